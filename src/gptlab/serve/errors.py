"""Errors in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}, for every failure:
our own checks, FastAPI's validation (always 400, as OpenAI answers), unknown routes, and a
request body over the size limit (413, enforced while the body streams in)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error the client caused or must handle, answered as OpenAI does."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, type=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class BodyTooLarge(StarletteHTTPException):
    """Raised from inside `receive` when a streamed body passes the limit; FastAPI re-raises
    HTTPExceptions from body parsing untouched, so the handler below answers 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodyLimit:
    """ASGI middleware: 413 for a body whose Content-Length, or whose bytes so far, pass `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = APIError(413, str(BodyTooLarge(self.max_bytes).detail), code="request_too_large")
            return await error.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON in the request body: {first.get('msg', '')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    message = first.get("msg", "invalid request")
    if param:
        message = f"{'.'.join(loc)}: {message}" + (
            f" (got {json.dumps(first.get('input'), default=str)[:200]})" if "input" in first else ""
        )
    return APIError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
