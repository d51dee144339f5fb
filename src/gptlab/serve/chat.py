"""POST /v1/chat/completions: a conversation rendered as `gptlab prepare` renders chat records for
fine-tuning (`gptlab.sft.Template`; `gptlab serve --template`), then completed as /v1/completions
completes a prompt: the same request fields, checks, scheduler, sampling and stop strings.

The prompt is `Template.chat_prompt(messages)` (the messages, then the assistant's head) encoded
part by part as `sft.encode_example` encodes a training example, so its tokens are the ones a
fine-tuned model was trained on before its reply. The reply ends at <|endoftext|>, where the model
starts a user turn (the user head, after the assistant tail or not) or at a request's stop string,
none of which is returned; nor is the assistant tail written before <|endoftext|> (the template's
text after {content}, "\\n\\n" by default), so a reply sent back in the next request renders as
in training. Logprobs come in chat's shape, `{"content": [{token, logprob, bytes, top_logprobs}]}`,
one entry per generated token (the turn's end too, as completions' logprobs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gptlab.serve.completions import (
    MAX_LOGPROBS,
    ChoiceText,
    CompletionRequest,
    CompletionRun,
    SamplingRequest,
    check_model,
    respond,
)
from gptlab.serve.errors import APIError
from gptlab.sft import encode_example

ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class TextPart(BaseModel):
    """A content part; text is the only kind taken."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message: `content` a string, or a list of text parts (joined by newlines, as vLLM does)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content):
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of text parts")
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError('content parts must be text parts, {"type": "text", "text": "..."}: no other kind is supported')  # fmt: skip
        return "\n".join(part["text"] for part in content)


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions. max_tokens (or max_completion_tokens, its newer
    name) defaults to what the context leaves."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None  # refused: no function calling
    response_format: dict | None = None  # only {"type": "text"}

    def completion(self, prompt: list[int], room: int) -> CompletionRequest:
        """This request as a completion of `prompt`, the rendered conversation; `room`: the new
        tokens the context leaves it."""
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) disagree; send one", param="max_completion_tokens", code="invalid_value")  # fmt: skip
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported", param="tools", code="unsupported")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format", code="unsupported")  # fmt: skip
        max_tokens = self.max_completion_tokens or self.max_tokens or max(room, 1)  # too long a prompt: its own 400
        shared = {name: getattr(self, name) for name in SamplingRequest.model_fields}
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return CompletionRequest(**{**shared, "max_tokens": max_tokens}, prompt=prompt, logprobs=logprobs)


class ChatChoice(ChoiceText):
    """A chat choice: logprob entries in chat's shape, and the assistant tail cut when the model
    ends its turn with <|endoftext|> (the stop at `tail + user head` holds the tail back until then)."""

    def __init__(self, tokenizer, stops: list[str], logprobs: bool, tail: str):
        super().__init__(tokenizer, stops, logprobs)
        self.tail = tail

    def end_of_text(self, token: int, logprob=None, top=None) -> tuple[str, list]:
        decoded = self.text  # a TextDecoder: .text decoded so far, its first .emitted characters sent
        if decoded.text.endswith(self.tail) and len(decoded.text) - decoded.emitted >= len(self.tail):
            decoded.text = decoded.text[: len(decoded.text) - len(self.tail)]
        return super().end_of_text(token, logprob, top)

    def entry(self, token: int, logprob, top, offset: int) -> dict:
        def one(t: int, lp: float) -> dict:
            return {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": list(self.tokenizer.decode_bytes([t]))}

        return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top or []]}


class ChatRun(CompletionRun):
    """A chat completion in flight: a CompletionRun answering with messages and deltas."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, state, body: CompletionRequest, prompts, params, tail: str):
        self.tail = tail
        super().__init__(state, body, prompts, params)

    def new_choice(self, offset: int) -> ChatChoice:
        return ChatChoice(self.state.tokenizer, self.params.stop, self.body.logprobs is not None, self.tail)

    def _logprobs(self, entries: list[dict]) -> dict | None:
        return {"content": entries} if self.body.logprobs is not None else None

    def choice_json(self, index: int, text: str, entries: list) -> dict:
        message = {"role": "assistant", "content": text}
        finish = self.choices[index].finish_reason
        return dict(index=index, message=message, logprobs=self._logprobs(entries), finish_reason=finish, **self._choice_extras(index))  # fmt: skip

    def opening(self, **extra) -> list[str]:
        """Each choice's first delta names the role, as OpenAI's stream does."""
        delta = {"role": "assistant", "content": ""}
        return [self.event([dict(index=i, delta=delta, logprobs=None, finish_reason=None)], **extra) for i in range(len(self.choices))]  # fmt: skip

    def _chunk(self, index: int, text: str, entries: list, finish: str | None, **extra) -> str:
        choice = dict(index=index, delta={"content": text} if text else {}, logprobs=self._logprobs(entries), finish_reason=finish)  # fmt: skip
        if finish is not None:
            choice.update(self._choice_extras(index))
        return self.event([choice], **extra)


class ChatCompletions:
    """The /v1/chat/completions endpoint: the state's template around `completions`' machinery."""

    def __init__(self, state, completions):
        self.state, self.completions = state, completions  # ServerState; the Completions endpoint
        self.tail = state.template.turn("assistant")[1]
        user = state.template.turn("user")[0].rstrip()  # the model starting a user turn: "### User:"
        self.stops = tuple(dict.fromkeys([self.tail + user, user])) if user else ()
        self.router = APIRouter()
        self.router.add_api_route("/v1/chat/completions", self.create, methods=["POST"])

    def prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation's token ids, as a fine-tuning example's up to the assistant's reply."""
        messages = [{"role": ALIASES.get(m.role, m.role), "content": m.content} for m in body.messages]
        ids, _ = encode_example(self.state.tokenizer, self.state.template.chat_prompt(messages), end=False)
        return ids

    async def create(self, body: ChatCompletionRequest, request: Request):
        check_model(self.state, body.model)
        ids = self.prompt(body)
        completion = body.completion(ids, room=self.state.model.config.block_size + 1 - len(ids))
        try:
            prompts = self.completions.prompts(completion)
            params = self.completions.params(completion, prompts)
        except APIError as e:  # name the fields this request sent: its messages, its max_*tokens
            sent = "max_completion_tokens" if body.max_tokens is None else "max_tokens"
            e.param = {"prompt": "messages", "max_tokens": sent}.get(e.param, e.param)
            e.message = e.message.replace("reduce max_tokens", f"reduce {sent}")
            raise
        params = replace(params, stop=(*params.stop, *self.stops))
        return await respond(ChatRun(self.state, completion, prompts, params, self.tail), request)
