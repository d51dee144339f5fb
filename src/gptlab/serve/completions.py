"""POST /v1/completions as the official `openai` client calls it, on top of the Scheduler.

The request is mapped to a `gptlab.sampling.SamplingParams` here and nowhere else (OpenAI's
`max_tokens` is max_new_tokens, `n` is num_samples). Each prompt of a request becomes one
scheduler request with its `n` samples, so with a `seed` choice i*n+j equals sample j of
`gptlab.generate(model, [prompt_i], max_tokens, num_samples=n, seed=seed, eos_id=<|endoftext|>, ...)`.
gptlab's extras, accepted as extra body fields, with SamplingParams' off values as defaults:
top_k (0: off), min_p (0.0: off), repetition_penalty (1.0: off), ignore_eos (do not stop at
<|endoftext|>), return_token_ids (each choice also carries `token_ids`, and `prompt_token_ids`)
and prompt_lookup (speculative decoding by prompt lookup with n-grams of up to N tokens: the same
tokens when greedy, the same distribution when sampling; not with logprobs).
Each choice's text comes out of a `gptlab.generation.TextDecoder`, as `stream_text`'s does.

Logprobs are the model's own log-probabilities (log-softmax of its logits, before temperature,
penalties and filters), as OpenAI reports them; `top_logprobs` holds the `logprobs` most likely
tokens plus the chosen one.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gptlab.generation import TextDecoder
from gptlab.sampling import SamplingParams
from gptlab.serve.errors import APIError
from gptlab.serve.scheduler import GenerationRequest, QueueFull

MAX_LOGPROBS = 20
MAX_STOPS = 16  # OpenAI takes 4; lm-eval's client adds <|endoftext|> to a task's own (humaneval has 5)

Prompt = str | list[str] | list[int] | list[list[int]]
# null is their default: never None past validation (gptlab's switches too, as top_k's null is off)
EXTRAS_NULL_MEANS_DEFAULT = ("ignore_eos", "return_token_ids", "prompt_lookup")
NULL_MEANS_DEFAULT = ("prompt", "n", "stream", "echo", *EXTRAS_NULL_MEANS_DEFAULT)


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: only with `stream: true`."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = False  # null: False


class SamplingRequest(BaseModel):
    """What the bodies of /v1/completions and /v1/chat/completions share (OpenAI's fields, then
    gptlab's extras)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # the JSON types the schema states: no true for 1
    null_means_default: ClassVar[tuple[str, ...]] = ("n", "stream", *EXTRAS_NULL_MEANS_DEFAULT)

    model: str
    max_tokens: int | None = Field(16, ge=0)
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    n: int | None = Field(1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # gptlab's extras
    top_k: int | None = Field(SamplingParams.top_k, ge=0)  # 0 (or null): off
    min_p: float | None = Field(SamplingParams.min_p, ge=0, le=1)  # 0.0 (or null): off
    repetition_penalty: float | None = Field(SamplingParams.repetition_penalty, gt=0)  # 1.0 (or null): off
    ignore_eos: bool | None = False
    return_token_ids: bool | None = False
    prompt_lookup: int | None = Field(0, ge=0, le=16)  # 0: off

    @model_validator(mode="after")
    def _null_is_the_default(self):
        """OpenAI takes null for any optional field, meaning its default; past this, only the
        fields where null means "not set" (max_tokens, temperature, top_k, ...) hold None."""
        for name in self.null_means_default:
            if getattr(self, name) is None:
                setattr(self, name, type(self).model_fields[name].default)
        return self


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions."""

    null_means_default: ClassVar[tuple[str, ...]] = NULL_MEANS_DEFAULT

    prompt: Prompt | None = ""  # OpenAI's default, <|endoftext|>: an empty prompt is the end-of-text token
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChoiceText:
    """One choice as tokens arrive: its text from a TextDecoder (UTF-8 hold-back, stop strings:
    the first one found ends the choice), its token ids and its logprob entries."""

    def __init__(self, tokenizer, stops: list[str], logprobs: bool, offset: int = 0):
        self.tokenizer, self.want_logprobs = tokenizer, logprobs
        self.text = TextDecoder(tokenizer, stops)
        self.offset = offset  # characters before this choice's text (the echoed prompt)
        self.entries: list[tuple] = []  # (token text, logprob, top dict, text offset) not yet emitted
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None

    def add(self, token: int, logprob=None, top=None) -> tuple[str, list]:
        """Take one generated token; returns the (text, logprob entries) now safe to send."""
        self.token_ids.append(token)
        if self.want_logprobs:
            self.entries.append(self.entry(token, logprob, top, self.offset + len(self.text.text)))
        piece = self.text.add(token)
        if self.text.stopped:
            self.finish_reason = "stop"
        return self._take(piece)

    def end_of_text(self, token: int, logprob=None, top=None) -> tuple[str, list]:
        """Take <|endoftext|>: it ends the choice, is counted and has its logprob entry (as in
        OpenAI's completions), but adds no text."""
        self.token_ids.append(token)
        if self.want_logprobs:
            self.entries.append(self.entry(token, logprob, top, self.offset + len(self.text.text)))
        return self.finish("stop")

    def finish(self, reason: str) -> tuple[str, list]:
        """End the choice (if no stop string ended it first); returns what is left to send."""
        if self.finish_reason is not None:
            return self._take("")
        self.finish_reason = reason
        return self._take(self.text.finish())

    def entry(self, token: int, logprob, top, offset: int) -> tuple:
        """A logprob entry; tokens with the same text (bytes of split characters) keep the best score."""
        alternatives = None
        if top is not None:
            alternatives = {}
            for t, lp in [*top, (token, logprob)]:
                alternatives.setdefault(self.tokenizer.decode([t]), lp)
        return self.tokenizer.decode([token]), logprob, alternatives, offset

    def _take(self, piece: str) -> tuple[str, list]:
        entries, self.entries = self.entries, []
        return piece, entries


def logprobs_json(entries: list[tuple]) -> dict:
    """OpenAI's completion logprobs object from (token, logprob, top, offset) entries."""
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [e[2] for e in entries],
        "text_offset": [e[3] for e in entries],
    }


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise APIError(400, f"stop must be up to {MAX_STOPS} non-empty strings", param="stop", code="invalid_value")
    return stops


def _check_unsupported(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of < body.n:
        raise APIError(400, f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of", code="invalid_value")  # fmt: skip
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of", code="unsupported")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options", code="invalid_value")  # fmt: skip
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported; use repetition_penalty", param=name, code="unsupported")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")


class Completions:
    """The /v1/completions endpoint for one served model."""

    def __init__(self, state):
        self.state = state  # ServerState: model, tokenizer, scheduler, name
        self.router = APIRouter()
        self.router.add_api_route("/v1/completions", self.create, methods=["POST"])

    def prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The request's prompts as token id lists (an empty prompt is <|endoftext|>)."""
        tok, p = self.state.tokenizer, body.prompt
        vocab = tok.n_vocab  # a padded head's spare ids are no tokens (the app checked n_vocab <= vocab_size)
        if isinstance(p, str):
            p = [p]
        if not p:
            raise APIError(400, "prompt must not be an empty list", param="prompt", code="invalid_value")
        if isinstance(p[0], int):
            p = [p]
        ids = [tok.encode(x, allowed_special="all") if isinstance(x, str) else list(x) for x in p]
        for row in ids:
            if any(not 0 <= t < vocab for t in row):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        return [row or [tok.eot_token] for row in ids]

    def params(self, body: CompletionRequest, prompts: list[list[int]]) -> SamplingParams:
        """Validate the request against the model and server limits; its SamplingParams (the one
        place OpenAI's names and defaults meet gptlab's: max_tokens, n, null for "not set")."""
        _check_unsupported(body)
        block, max_batch = self.state.model.config.block_size, self.state.scheduler.max_batch
        if len(prompts) > self.state.scheduler.max_queue:
            raise APIError(400, f"at most {self.state.scheduler.max_queue} prompts per request", param="prompt", code="invalid_value")  # fmt: skip
        if body.n > max_batch:
            raise APIError(400, f"n must be at most {max_batch} (the batch size)", param="n", code="invalid_value")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        # What must fit the context is what the model is fed: the prompt and every new token but
        # the last (its logits come from the token before it), and a prompt only scored is fed
        # without its last token (only a target). So a full-context prompt still gets one new
        # token, as lm-eval's local-completions asks (echo, max_tokens 1: it drops that token's
        # logprob), and may be one token longer when only scored (echo, max_tokens 0).
        longest = max(len(p) for p in prompts)
        if longest > (block + 1 if body.echo and max_tokens == 0 else block):
            raise APIError(400, f"This model's maximum context length is {block} tokens, however your prompt has {longest} tokens", param="prompt", code="context_length_exceeded")  # fmt: skip
        if longest + max_tokens - 1 > block:
            raise APIError(400, f"This model's maximum context length is {block} tokens, however you requested {longest + max_tokens} tokens ({longest} in your prompt; {max_tokens} for the completion). Please reduce max_tokens to at most {block + 1 - longest}.", param="max_tokens", code="context_length_exceeded")  # fmt: skip
        if body.prompt_lookup and (body.logprobs is not None or max_tokens == 0):
            raise APIError(400, "prompt_lookup (speculative decoding) reports no logprobs and needs max_tokens >= 1", param="prompt_lookup", code="unsupported")  # fmt: skip
        if max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", param="max_tokens", code="invalid_value")  # fmt: skip
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
        given = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
        try:  # max_tokens 0 (echo: score the prompt only) is the scheduler request's prompt_only
            return SamplingParams(
                max_new_tokens=max(max_tokens, 1), num_samples=body.n, stop=_stops(body.stop), **given
            )
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split()[0], code="invalid_value") from e

    async def create(self, body: CompletionRequest, request: Request):
        check_model(self.state, body.model)
        prompts = self.prompts(body)
        params = self.params(body, prompts)
        return await respond(CompletionRun(self.state, body, prompts, params), request)


def check_model(state, model: str) -> None:
    """404 unless `model` is the served model's name."""
    if model != state.name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.name}`", param="model", code="model_not_found")  # fmt: skip


async def respond(run: CompletionRun, request: Request):
    """Submit the run; its whole response, or its server-sent events (stream). The client going
    away cancels it."""
    run.submit()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, run))
    if run.body.stream:
        return StreamingResponse(run.stream(watcher), media_type="text/event-stream")
    try:
        return JSONResponse(await run.collect())
    finally:
        watcher.cancel()
        run.cancel()


async def _cancel_on_disconnect(request: Request, run: CompletionRun) -> None:
    """Cancel the run's generation when the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            run.cancel()
            return


class CompletionRun:
    """One /v1/completions request in flight: its scheduler requests and its choices' text.
    The chat API's run (gptlab.serve.chat) is this one answering in chat's shapes."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "text_completion", "text_completion", "cmpl-"

    def __init__(self, state, body: CompletionRequest, prompts: list[list[int]], params: SamplingParams):
        self.state, self.body, self.prompts, self.params = state, body, prompts, params
        self.n = params.num_samples
        self.eos_id = None if body.ignore_eos else state.tokenizer.eot_token
        self.prompt_logprobs = body.echo and body.logprobs is not None
        self.id, self.created = f"{self.ID_PREFIX}{uuid.uuid4().hex}", int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        self.prompt_texts = [state.tokenizer.decode(p) for p in prompts]
        self.choices = []
        for text in self.prompt_texts:
            self.choices += [self.new_choice(len(text) if body.echo else 0) for _ in range(self.n)]
        loop = asyncio.get_running_loop()
        self.requests = [
            GenerationRequest(
                p,
                params,
                loop,
                self.events,
                index=i,
                eos_id=self.eos_id,
                logprobs=body.logprobs,
                prompt_logprobs=self.prompt_logprobs,
                prompt_only=body.max_tokens == 0,
                prompt_lookup=body.prompt_lookup,
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]
        self.prompt_entries: list[list | None] = [None] * len(prompts)
        self.done = 0

    def new_choice(self, offset: int) -> ChoiceText:
        return ChoiceText(self.state.tokenizer, self.params.stop, self.body.logprobs is not None, offset)

    def submit(self) -> None:
        try:
            for r in self.requests:
                self.state.scheduler.submit(r)
        except QueueFull as e:
            self.cancel()
            raise APIError(429, f"The server is busy: {e}. Retry later.", code="rate_limit_exceeded") from e
        except ValueError as e:
            self.cancel()
            raise APIError(400, str(e), code="invalid_value") from e

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()

    def _echo_piece(self, i: int) -> tuple[str, list]:
        """The prompt's text (and its logprob entries) that an echoing choice starts with."""
        entries = []
        if self.prompt_logprobs:
            prompt, scores, offset = self.prompts[i], self.prompt_entries[i] or [], 0
            choice = self.choices[i * self.n]
            # Offsets count characters of the echoed text: a token that ends inside a character
            # moves the offset only once the character is whole (as a generated token's offset).
            text = codecs.getincrementaldecoder("utf-8")(errors="replace")
            for token, (lp, top) in zip(prompt, scores, strict=False):
                entries.append(choice.entry(token, lp, top, offset))
                offset += len(text.decode(self.state.tokenizer.decode_bytes([token])))
        return self.prompt_texts[i], entries

    async def pieces(self) -> AsyncIterator[tuple[int, str, list, str | None]]:
        """(choice index, text, logprob entries, finish_reason) as generation goes."""
        n = self.n
        while self.done < len(self.requests):
            kind, i, payload = await self.events.get()
            if kind == "prompt":
                self.prompt_entries[i] = payload
            elif kind == "tokens":
                for j, row in enumerate(payload):
                    choice = self.choices[i * n + j]
                    if row is None or choice.finish_reason is not None:
                        continue
                    token, lp, top = row
                    if token == self.eos_id:  # counted in usage and logprobs, never shown as text
                        yield (i * n + j, *choice.end_of_text(token, lp, top), "stop")
                    else:
                        text, entries = choice.add(token, lp, top)
                        if choice.finish_reason is not None:
                            self.requests[i].stop_row(j)
                        if text or entries or choice.finish_reason:
                            yield i * n + j, text, entries, choice.finish_reason
            else:  # done
                self.done += 1
                if payload.startswith("error"):
                    raise APIError(500, f"generation failed: {payload}", code="internal_error")
                for j in range(n):
                    choice = self.choices[i * n + j]
                    if choice.finish_reason is None:
                        reason = "length" if payload in ("length", "cancelled") else "stop"
                        yield (i * n + j, *choice.finish(reason), reason)

    def usage(self) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _choice_extras(self, index: int) -> dict:
        if not self.body.return_token_ids:
            return {}
        ids = [t for t in self.choices[index].token_ids if t != self.eos_id]
        return {"token_ids": ids, "prompt_token_ids": self.prompts[index // self.n]}

    async def collect(self) -> dict:
        """The whole (non-streamed) response."""
        texts = [[] for _ in self.choices]
        entries = [[] for _ in self.choices]
        async for index, text, more, _ in self.pieces():
            texts[index].append(text)
            entries[index] += more
        choices = [self.choice_json(i, "".join(texts[i]), entries[i]) for i in range(len(self.choices))]
        return dict(id=self.id, object=self.OBJECT, created=self.created, model=self.state.name, choices=choices, usage=self.usage())  # fmt: skip

    def choice_json(self, index: int, text: str, entries: list) -> dict:
        """Choice `index` of the whole response, from its text and logprob entries."""
        if self.body.echo:
            echo_text, echo_entries = self._echo_piece(index // self.n)
            text, entries = echo_text + text, echo_entries + entries
        lp = logprobs_json(entries) if self.body.logprobs is not None else None
        return dict(index=index, text=text, logprobs=lp, finish_reason=self.choices[index].finish_reason, **self._choice_extras(index))  # fmt: skip

    def event(self, choices: list[dict], **extra) -> str:
        """One server-sent event: a chunk holding `choices`."""
        data = dict(id=self.id, object=self.CHUNK_OBJECT, created=self.created, model=self.state.name, choices=choices, **extra)  # fmt: skip
        return f"data: {json.dumps(data)}\n\n"

    def opening(self, **extra) -> list[str]:
        """Events sent before any text (none: a completion chunk carries only text)."""
        return []

    def _chunk(self, index: int, text: str, entries: list, finish: str | None, **extra) -> str:
        lp = logprobs_json(entries) if self.body.logprobs is not None else None
        choice = dict(index=index, text=text, logprobs=lp, finish_reason=finish)
        if finish is not None:
            choice.update(self._choice_extras(index))
        return self.event([choice], **extra)

    async def stream(self, watcher: asyncio.Task) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece of text, then [DONE]. With stream_options'
        include_usage, as OpenAI: every chunk has `usage: null` and a last chunk with no choices
        carries the request's usage (so a client that adds up usage counts it once)."""
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        extra = {"usage": None} if include_usage else {}
        try:
            for event in self.opening(**extra):
                yield event
            started: set[int] = set()
            async for index, text, entries, finish in self.pieces():
                if self.body.echo and index not in started:
                    started.add(index)
                    echo_text, echo_entries = self._echo_piece(index // self.n)
                    text, entries = echo_text + text, echo_entries + entries
                yield self._chunk(index, text, entries, finish, **extra)
            if include_usage:
                yield self.event([], usage=self.usage())
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            watcher.cancel()
            self.cancel()
        yield "data: [DONE]\n\n"
