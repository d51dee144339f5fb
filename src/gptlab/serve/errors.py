"""Errors in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}, for every failure:
our own checks, FastAPI's validation (always 400, as OpenAI answers), unknown routes, a method a
route does not take (405, with `Allow`), and a request body over the size limit (413, enforced
while the body streams in).

`declare_errors` makes the OpenAPI document say so: each operation lists the error statuses it
can answer, with the error body's schema, and not FastAPI's 422, which this server never sends.
"""

from __future__ import annotations

import json
import logging
import types

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from gptlab.sampling import NonFiniteProbabilities

log = logging.getLogger(__name__)

TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ErrorDetail(BaseModel):
    """What went wrong: `param` names the request field at fault, `code` is machine-readable."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error response's body, as OpenAI's API sends it."""

    error: ErrorDetail


# What each status means here, for the OpenAPI document.
DESCRIPTIONS = {
    400: "Invalid request: a malformed body, a missing or out-of-range field, an unsupported option",
    404: "No such model",
    413: "Request body over the server's limit",
    429: "The server's queue is full; retry later",
    500: "Internal error",
}
EVERY_OPERATION = (413, 500)  # the body limit (middleware) and the last-resort handler apply to every route


class APIError(Exception):
    """An error the client caused or must handle, answered as OpenAI does."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, type=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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


def _required_fields(request: Request) -> list[str]:
    """The required fields of the route's JSON body, in declaration order ([] when it has none)."""
    model = _body_model(request)
    return [name for name, field in model.model_fields.items() if field.is_required()] if model else []


def _body_model(request: Request) -> type[BaseModel] | None:
    route = request.scope.get("route")
    body = getattr(route, "body_field", None)
    model = getattr(getattr(body, "field_info", None), "annotation", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _union_error(errors: list[dict], request: Request) -> APIError | None:
    """One message for a field of several types (`str | list[int]`) that matched none: pydantic
    reports each type's failure, and the first alone ("prompt.str: Input should be a valid
    string" for [1.5]) reads as if only text were taken."""
    model, loc = _body_model(request), tuple(errors[0].get("loc", ()))
    if model is None or len(loc) < 3 or loc[0] != "body" or loc[1] not in model.model_fields:
        return None
    annotation = model.model_fields[loc[1]].annotation
    if not isinstance(annotation, types.UnionType) or len([t for t in annotation.__args__ if t is not type(None)]) < 2:
        return None  # one type (or `X | None`: loc[2] is then a field of X, not a type's name)
    kinds = list(dict.fromkeys(str(e["loc"][2]) for e in errors if tuple(e["loc"][:2]) == loc[:2] and len(e["loc"]) > 2))  # fmt: skip
    got = json.dumps(errors[0].get("input"), default=str)[:200]
    return APIError(400, f"{loc[1]}: must be {' or '.join(kinds)} (got {got})", param=str(loc[1]), code="invalid_value")  # fmt: skip


def _validation_error(exc: RequestValidationError, request: Request) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    content_type = request.headers.get("content-type", "")
    if tuple(first.get("loc", ())) == ("body",) and content_type and "json" not in content_type:
        # FastAPI reads a form or text body as a string: say what the body must be
        return APIError(400, f"the request body must be JSON (Content-Type: application/json), got {content_type}", param="body", code="invalid_content_type")  # fmt: skip
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON in the request body: {first.get('msg', '')}", code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        required = _required_fields(request)
        needs = f" with {', '.join(required)}" if required else " (an empty one is {})"
        message = f"the request body is missing: send a JSON object{needs}"
        return APIError(400, message, param=required[0] if required else "body", code="missing_body")
    union = _union_error(errors, request) if errors else None
    if union is not None:
        return union
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    message = first.get("msg", "invalid request")
    if param:
        message = f"{'.'.join(loc)}: {message}" + (
            f" (got {json.dumps(first.get('input'), default=str)[:200]})" if "input" in first else ""
        )
    else:
        message = f"request body: {message}"
    return APIError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc, request).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's "There was an error parsing the body", for a body that is not UTF-8
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
            return APIError(400, f"the request body is not UTF-8 JSON: {exc.__cause__}", code="invalid_json").response()  # fmt: skip
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response(headers=exc.headers)  # 405: Allow

    @app.exception_handler(NonFiniteProbabilities)
    async def not_finite(request: Request, exc: NonFiniteProbabilities):  # the model's, not the request's
        return APIError(500, str(exc), code="non_finite_logits").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()


def _error_schemas() -> dict:
    """ErrorBody and ErrorDetail as OpenAPI component schemas."""
    schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    return {**schema.pop("$defs", {}), "ErrorBody": schema}


def declare_errors(app: FastAPI, statuses: dict[str, tuple[int, ...]]) -> None:
    """Declare in `app`'s OpenAPI document the error statuses each operation answers, each with
    the error body's schema: `statuses` maps a route's path to its own (e.g. 404 for an unknown
    model), and every operation can answer 413 and 500. FastAPI's automatic 422 is dropped:
    validation errors are answered with 400."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            components.update(_error_schemas())
            body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
            for path, operations in schema.get("paths", {}).items():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    for status in sorted({*statuses.get(path, ()), *EVERY_OPERATION}):
                        responses[str(status)] = {"description": DESCRIPTIONS[status], "content": body}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
