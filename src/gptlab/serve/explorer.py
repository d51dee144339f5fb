"""The explorer's JSON endpoints: next-token candidates, per-token surprisal, attention maps.

All take {"prompt": str, ...} by POST; an empty prompt means <|endoftext|> alone. The model runs
in FastAPI's thread pool (these are plain `def` routes), beside the scheduler's thread.
"""

from __future__ import annotations

import math

import torch
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gptlab.serve.errors import APIError


class PromptBody(BaseModel):
    model_config = ConfigDict(strict=True)  # the JSON types the OpenAPI document states: no true or "1" for 1

    prompt: str = ""


class NextBody(PromptBody):
    top: int = Field(10, ge=1, le=100)


class AttentionBody(PromptBody):
    layer: int = 0
    head: int = 0


class Explorer:
    """Routes under /api for one model and tokenizer."""

    def __init__(self, state):
        self.state = state
        self.router = APIRouter(prefix="/api")
        self.router.add_api_route("/info", self.info, methods=["GET"])
        self.router.add_api_route("/next", self.next_tokens, methods=["POST"])
        self.router.add_api_route("/tokens", self.tokens, methods=["POST"])
        self.router.add_api_route("/attention", self.attention, methods=["POST"])

    def _ids(self, prompt: str) -> list[int]:
        tok, block = self.state.tokenizer, self.state.model.config.block_size
        ids = tok.encode(prompt) or [tok.eot_token]
        if len(ids) > block:
            raise APIError(400, f"prompt has {len(ids)} tokens; the model's context is {block}", param="prompt", code="context_length_exceeded")  # fmt: skip
        return ids

    def _texts(self, ids: list[int]) -> list[str]:
        return [self.state.tokenizer.decode([t]) for t in ids]

    @torch.no_grad()
    def _logits(self, ids: list[int]) -> torch.Tensor:
        device = self.state.model.transformer.wte.weight.device
        logits, _ = self.state.model(torch.tensor([ids], device=device))  # (1, T, V)
        return logits[0].float()  # (T, V)

    def info(self) -> dict:
        """The model's name and shape (the page builds its layer and head pickers from it)."""
        c = self.state.model.config
        return dict(model=self.state.name, n_layer=c.n_layer, n_head=c.n_head, block_size=c.block_size, vocab_size=c.vocab_size)  # fmt: skip

    def next_tokens(self, body: NextBody) -> dict:
        """The `top` most likely next tokens after the prompt, with their probabilities."""
        ids = self._ids(body.prompt)
        probs = torch.softmax(self._logits(ids)[-1], dim=-1)  # (V,)
        p, idx = torch.topk(probs, min(body.top, probs.numel()))
        candidates = [
            dict(id=i, text=self.state.tokenizer.decode([i]), prob=v, logprob=math.log(max(v, 1e-45)))
            for i, v in zip(idx.tolist(), p.tolist(), strict=True)
        ]
        return dict(prompt_tokens=self._texts(ids), candidates=candidates)

    def tokens(self, body: PromptBody) -> dict:
        """Each prompt token with the probability the model gave it and its surprisal in bits
        (-log2 p); the first token has no prefix to be predicted from (null)."""
        ids = self._ids(body.prompt)
        logp = torch.log_softmax(self._logits(ids)[:-1], dim=-1)  # (T-1, V)
        scores = (
            logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].tolist() if len(ids) > 1 else []
        )
        out = [dict(id=ids[0], text=self._texts(ids[:1])[0], prob=None, surprisal=None)]
        for t, lp in zip(ids[1:], scores, strict=True):
            out.append(
                dict(id=t, text=self.state.tokenizer.decode([t]), prob=math.exp(lp), surprisal=-lp / math.log(2))
            )
        return dict(tokens=out)

    def attention(self, body: AttentionBody) -> dict:
        """The (T, T) attention probabilities of one head: row i is what token i attends to."""
        c = self.state.model.config
        if not 0 <= body.layer < c.n_layer:
            raise APIError(400, f"layer must be in [0, {c.n_layer})", param="layer", code="invalid_value")
        if not 0 <= body.head < c.n_head:
            raise APIError(400, f"head must be in [0, {c.n_head})", param="head", code="invalid_value")
        ids = self._ids(body.prompt)
        device = self.state.model.transformer.wte.weight.device
        weights = self.state.model.attention(torch.tensor([ids], device=device), body.layer, body.head)[0]  # (T, T)
        return dict(tokens=self._texts(ids), layer=body.layer, head=body.head, weights=weights.float().tolist())
