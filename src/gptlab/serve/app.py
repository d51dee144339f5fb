"""The FastAPI application: OpenAI-compatible completions and chat completions, /tokenize and
/detokenize, the explorer page and its JSON API.

`create_app(model, tokenizer, name=...)` builds it; the scheduler's worker thread starts and stops
with the app's lifespan. `gptlab serve` runs it under uvicorn.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from gptlab.kernels import release_threads
from gptlab.serve.chat import ChatCompletions
from gptlab.serve.completions import Completions
from gptlab.serve.errors import APIError, BodyLimit, declare_errors, install_error_handlers
from gptlab.serve.explorer import Explorer
from gptlab.serve.scheduler import Scheduler
from gptlab.serve.tokenize import Tokenization
from gptlab.sft import Template

MAX_BODY_BYTES = 1 << 20
# The error statuses each operation answers besides 413 and 500 (which any can), for the OpenAPI
# document; tests/test_openapi.py checks the server against it.
ERRORS = {
    "/v1/completions": (400, 404, 429),
    "/v1/chat/completions": (400, 404, 429),
    "/v1/models/{model_id}": (404,),  # the OpenAPI path (the route takes a "/" in it)
    "/api/next": (400,),
    "/api/tokens": (400,),
    "/api/attention": (400,),
    "/api/lens": (400,),
    "/api/patch": (400,),
    "/api/patch/cell": (400,),
    "/tokenize": (400, 404),
    "/detokenize": (400, 404),
}


@dataclass
class ServerState:
    """What every route needs: the model, its tokenizer, its public name and the scheduler (and
    the chat template, for /v1/chat/completions)."""

    model: object
    tokenizer: object
    name: str
    scheduler: Scheduler
    created: int
    template: Template = field(default_factory=Template)


def static_dir() -> str:
    return str(resources.files("gptlab.serve") / "static")


def create_app(
    model,
    tokenizer,
    *,
    name: str = "gptlab",
    max_batch: int = 16,
    max_queue: int = 64,
    max_body_bytes: int = MAX_BODY_BYTES,
    cache_len: int | None = None,
    draft_model=None,
    template: Template | None = None,
) -> FastAPI:
    """The server for one model. max_batch: rows decoded together; max_queue: requests waiting
    beyond that before answering 429; max_body_bytes: larger request bodies get 413; draft_model:
    decode requests speculatively with this model proposing (gptlab.speculative); template: how
    chat messages are rendered, as the model was fine-tuned on them (default: gptlab.sft's)."""
    if tokenizer.n_vocab > model.config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name} has {tokenizer.n_vocab} tokens, the model only {model.config.vocab_size}")  # fmt: skip
    model.eval()
    scheduler = Scheduler(model, max_batch=max_batch, max_queue=max_queue, cache_len=cache_len, draft_model=draft_model,
                          n_vocab=tokenizer.n_vocab)  # fmt: skip
    state = ServerState(model, tokenizer, name, scheduler, int(time.time()), template or Template())

    @asynccontextmanager
    async def lifespan(app):
        release_threads()  # this thread loaded the model and computes no more: the scheduler's decodes
        scheduler.start()
        try:
            yield
        finally:
            scheduler.close()

    app = FastAPI(title="gptlab", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.gptlab = state
    install_error_handlers(app)
    completions = Completions(state)
    app.include_router(completions.router)
    app.include_router(ChatCompletions(state, completions).router)
    app.include_router(Explorer(state).router)
    app.include_router(Tokenization(state).router)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [dict(id=name, object="model", created=state.created, owned_by="gptlab")]}

    @app.get("/v1/models/{model_id:path}")  # hub-style names hold a "/"
    async def model_card(model_id: str):
        if model_id != name:
            raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
        return dict(id=name, object="model", created=state.created, owned_by="gptlab")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, **scheduler.load()}

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(f"{static_dir()}/index.html")

    app.mount("/static", StaticFiles(directory=static_dir()), name="static")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    declare_errors(app, ERRORS)
    return app
