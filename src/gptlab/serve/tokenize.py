"""POST /tokenize and POST /detokenize, as llama.cpp's and vLLM's servers answer them.

Text is tokenized exactly as /v1/completions tokenizes a prompt string (special tokens such as
<|endoftext|> in the text are the special token), so a client can count a prompt's tokens or
split it before sending it. Either server's spelling works:

- /tokenize takes the text as `prompt` (vLLM) or `content` (llama.cpp), and an optional `model`,
  which must be this server's. It answers {"tokens": [...], "count": n, "max_model_len":
  block_size}. `with_pieces` (llama.cpp) makes each token {"id": id, "piece": text}, the piece a
  list of byte values where the token is not whole UTF-8 on its own.
- /detokenize takes {"tokens": [...]} and answers the text both ways: {"prompt": text,
  "content": text}.

GPT-2 adds no beginning-of-text token, so llama.cpp's `add_special` and vLLM's
`add_special_tokens` have nothing to add here; they are refused when true rather than ignored.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gptlab.serve.errors import APIError


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None  # vLLM's name
    content: str | None = None  # llama.cpp's name
    with_pieces: bool = False
    add_special: bool = False
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class Tokenization:
    """The two routes for one server's tokenizer."""

    def __init__(self, state):
        self.state = state
        self.router = APIRouter()
        self.router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        self.router.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.state.name:
            raise APIError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")

    def tokenize(self, body: TokenizeRequest) -> dict:
        """The text's token ids (and pieces), as /v1/completions would read it."""
        self._check_model(body.model)
        if (body.prompt is None) == (body.content is None):
            raise APIError(400, "give the text as exactly one of `prompt` or `content`", param="prompt", code="invalid_value")  # fmt: skip
        for flag in ("add_special", "add_special_tokens"):
            if getattr(body, flag):
                raise APIError(400, f"`{flag}`: GPT-2 has no beginning-of-text token to add", param=flag, code="invalid_value")  # fmt: skip
        tok = self.state.tokenizer
        ids = tok.encode(body.prompt if body.prompt is not None else body.content, allowed_special="all")
        tokens = [dict(id=t, piece=self._piece(t)) for t in ids] if body.with_pieces else ids
        return dict(tokens=tokens, count=len(ids), max_model_len=self.state.model.config.block_size)

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """The text of the token ids (invalid UTF-8 replaced by U+FFFD, as the completions' text is)."""
        self._check_model(body.model)
        n_vocab = self.state.tokenizer.n_vocab
        bad = next((t for t in body.tokens if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} outside the vocabulary [0, {n_vocab})", param="tokens", code="invalid_value")  # fmt: skip
        text = self.state.tokenizer.decode(body.tokens)
        return dict(prompt=text, content=text)

    def _piece(self, token: int) -> str | list[int]:
        raw = self.state.tokenizer.decode_bytes([token])
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)
