"""The explorer's JSON endpoints: next-token candidates, per-token surprisal, attention maps, the
logit lens and activation patching.

All take {"prompt": str or [token ids], ...} by POST; an empty prompt means <|endoftext|> alone,
and <|endoftext|> in a text is that token (as /v1/completions reads it).
The page sends ids once a token was picked, so it continues from the token chosen (a piece of a
character, or a token that re-encoding the text would merge with the one before) and not from
its text. Each token comes with its `label` for display (`gptlab.inspect.token_label`: bytes of
a split character as \\xNN, control characters escaped), as the CLI shows them. The model runs
in FastAPI's thread pool (these are plain `def` routes), beside the scheduler's thread; each route
lets its thread's OpenMP helpers go when it returns (`kernels.release_threads`: while they live,
the scheduler's decoding runs at ~40% of its speed).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from gptlab.inspect import token_label
from gptlab.kernels import release_threads
from gptlab.sampling import check_finite
from gptlab.serve.errors import APIError


class PromptBody(BaseModel):
    model_config = ConfigDict(strict=True)  # the JSON types the OpenAPI document states: no true or "1" for 1

    prompt: str | list[int] = ""  # text, or token ids


class NextBody(PromptBody):
    top: int = Field(10, ge=1, le=100)


class AttentionBody(PromptBody):
    layer: int = 0
    head: int = 0


class LensBody(PromptBody):
    top: int = Field(1, ge=1, le=10)


class PatchBody(BaseModel):
    model_config = ConfigDict(strict=True)

    clean: str | list[int]  # text, or token ids
    corrupt: str | list[int]
    right: str  # the clean prompt's answer, one token
    wrong: str  # the corrupted prompt's answer, one token
    over: Literal["layer-pos", "layer-head"] = "layer-pos"


class PatchCellBody(PatchBody):
    layer: int
    unit: int  # a position (layer-pos) or a head (layer-head)
    top: int = Field(10, ge=1, le=100)


def computes(route):
    """The route, letting the OpenMP helpers of the pool thread it ran in go when it returns."""

    @functools.wraps(route)
    def run(*args, **kwargs):
        try:
            return route(*args, **kwargs)
        finally:
            release_threads()

    return run


class Explorer:
    """Routes under /api for one model and tokenizer."""

    def __init__(self, state):
        self.state = state
        self.router = APIRouter(prefix="/api")
        self.router.add_api_route("/info", self.info, methods=["GET"])
        self.router.add_api_route("/next", computes(self.next_tokens), methods=["POST"])
        self.router.add_api_route("/tokens", computes(self.tokens), methods=["POST"])
        self.router.add_api_route("/attention", computes(self.attention), methods=["POST"])
        self.router.add_api_route("/lens", computes(self.lens), methods=["POST"])
        self.router.add_api_route("/patch", computes(self.patch), methods=["POST"])
        self.router.add_api_route("/patch/cell", computes(self.patch_cell), methods=["POST"])

    def _ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """The token ids of a prompt given as text or as ids (`param` names its field in errors)."""
        tok, c = self.state.tokenizer, self.state.model.config
        # <|endoftext|> in text is the token, as in completions: a pick after an empty prompt (read
        # as <|endoftext|> alone) shows it, and the text must read back as the ids it shows
        ids = (tok.encode(prompt, allowed_special="all") if isinstance(prompt, str) else list(prompt)) or [
            tok.eot_token
        ]
        bad = next((t for t in ids if not 0 <= t < c.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary [0, {c.vocab_size})", param=param, code="invalid_value")  # fmt: skip
        if len(ids) > c.block_size:
            raise APIError(400, f"{param} has {len(ids)} tokens; the model's context is {c.block_size}", param=param, code="context_length_exceeded")  # fmt: skip
        return ids

    def _labels(self, ids: list[int]) -> list[str]:
        return [token_label(self.state.tokenizer, t) for t in ids]

    def _token(self, token_id: int, **fields) -> dict:
        """A token as the page gets it: id, text (as decoded) and label (for display)."""
        text, label = self.state.tokenizer.decode([token_id]), token_label(self.state.tokenizer, token_id)
        return dict(id=token_id, text=text, label=label, **fields)

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], device=self.state.model.transformer.wte.weight.device)  # (1, T)

    @torch.no_grad()
    def _logits(self, ids: list[int]) -> torch.Tensor:
        logits, _ = self.state.model(self._tensor(ids))  # (1, T, V)
        check_finite(logits)  # NaN was shown as a probability of null
        return logits[0].float()  # (T, V)

    def info(self) -> dict:
        """The model's name and shape (the page builds its layer and head pickers from it)."""
        c = self.state.model.config
        return dict(model=self.state.name, n_layer=c.n_layer, n_head=c.n_head, block_size=c.block_size, vocab_size=c.vocab_size)  # fmt: skip

    def next_tokens(self, body: NextBody) -> dict:
        """The `top` most likely next tokens after the prompt, with their probabilities."""
        ids = self._ids(body.prompt)
        return dict(prompt_tokens=self._labels(ids), candidates=self._candidates(self._logits(ids)[-1], body.top))

    def tokens(self, body: PromptBody) -> dict:
        """Each prompt token with the probability the model gave it and its surprisal in bits
        (-log2 p); the first token has no prefix to be predicted from (null). `text` is the whole
        prompt as its tokens decode (what the page shows once a token was picked by id)."""
        ids = self._ids(body.prompt)
        logp = torch.log_softmax(self._logits(ids)[:-1], dim=-1)  # (T-1, V)
        scores = (
            logp.gather(1, torch.tensor(ids[1:], device=logp.device)[:, None])[:, 0].tolist() if len(ids) > 1 else []
        )
        out = [self._token(ids[0], prob=None, surprisal=None)]
        out += [self._token(t, prob=math.exp(lp), surprisal=-lp / math.log(2)) for t, lp in zip(ids[1:], scores, strict=True)]  # fmt: skip
        return dict(tokens=out, text=self.state.tokenizer.decode(ids))

    def attention(self, body: AttentionBody) -> dict:
        """The (T, T) attention probabilities of one head: row i is what token i attends to."""
        c = self.state.model.config
        if not 0 <= body.layer < c.n_layer:
            raise APIError(400, f"layer must be in [0, {c.n_layer})", param="layer", code="invalid_value")
        if not 0 <= body.head < c.n_head:
            raise APIError(400, f"head must be in [0, {c.n_head})", param="head", code="invalid_value")
        ids = self._ids(body.prompt)
        weights = self.state.model.attention(self._tensor(ids), body.layer, body.head)[0]  # (T, T)
        return dict(tokens=self._labels(ids), layer=body.layer, head=body.head, weights=weights.float().tolist())

    def _candidates(self, logits: torch.Tensor, top: int) -> list[dict]:
        """The `top` most likely tokens for next-token logits (V,), with probabilities."""
        probs = torch.softmax(logits.float(), dim=-1)  # (V,)
        p, idx = torch.topk(probs, min(top, probs.numel()))
        return [self._token(i, prob=v, logprob=math.log(max(v, 1e-45))) for i, v in zip(idx.tolist(), p.tolist(), strict=True)]  # fmt: skip

    def lens(self, body: LensBody) -> dict:
        """The logit lens (gptlab.inspect.logit_lens): for the residual stream before block 0 and
        after each block, the top tokens the final norm and head read at each position."""
        from gptlab.inspect import logit_lens

        ids = self._ids(body.prompt)
        lens = logit_lens(self.state.model, self._tensor(ids), top=body.top)
        top = [[[self._token(i, prob=p) for i, p in zip(pos_ids, pos_probs, strict=True)]
                for pos_ids, pos_probs in zip(layer_ids, layer_probs, strict=True)]
               for layer_ids, layer_probs in zip(lens["top_ids"], lens["top_probs"], strict=True)]  # fmt: skip
        return dict(tokens=self._labels(ids), layers=lens["layers"], top=top)

    def _patch_inputs(self, body: PatchBody):
        clean, corrupt = self._ids(body.clean, "clean"), self._ids(body.corrupt, "corrupt")
        if len(clean) != len(corrupt):
            raise APIError(400, f"clean has {len(clean)} tokens, corrupt {len(corrupt)}: they must be as long", param="corrupt", code="invalid_value")  # fmt: skip
        answers = []
        for param in ("right", "wrong"):
            answer = self.state.tokenizer.encode(getattr(body, param), allowed_special="all")  # as the prompts
            if len(answer) != 1:
                raise APIError(400, f"{param} must be one token, got {len(answer)}", param=param, code="invalid_value")  # fmt: skip
            answers += answer
        if answers[0] == answers[1]:
            raise APIError(400, "right and wrong are the same token: their logit difference is always 0", param="wrong", code="invalid_value")  # fmt: skip
        return self._tensor(clean), self._tensor(corrupt), answers

    def patch(self, body: PatchBody) -> dict:
        """Activation patching of clean into corrupt (gptlab.patching): the grid as a share of the
        way from the corrupted logit difference (0) to the clean one (1)."""
        from gptlab.patching import activation_patching, logit_diff

        clean, corrupt, (right, wrong) = self._patch_inputs(body)
        result = activation_patching(self.state.model, clean, corrupt, logit_diff(right, wrong), over=body.over)
        if abs(result["clean"] - result["corrupt"]) <= 1e-9:  # the grid has no scale: zeros, read as results
            raise APIError(400, f"clean and corrupt give the same logit difference ({result['clean']:.4f}): there is nothing to patch; choose prompts whose answers differ", param="corrupt", code="invalid_value")  # fmt: skip
        columns = (self._labels(clean[0].tolist()) if body.over == "layer-pos"
                   else [f"head {h}" for h in range(self.state.model.config.n_head)])  # fmt: skip
        return dict(over=body.over, columns=columns, clean=result["clean"], corrupt=result["corrupt"],
                    grid=result["normalized"].tolist())  # fmt: skip

    def patch_cell(self, body: PatchCellBody) -> dict:
        """The next-token distribution of the corrupted prompt with one cell patched in, beside
        the clean and corrupted prompts' own."""
        from gptlab.patching import patched_logits

        clean, corrupt, _ = self._patch_inputs(body)
        try:
            logits = patched_logits(self.state.model, clean, corrupt, body.layer, body.unit, body.over)
        except ValueError as e:  # the cell is outside the grid: name the coordinate at fault
            param = "unit" if 0 <= body.layer < self.state.model.config.n_layer else "layer"
            raise APIError(400, str(e), param=param, code="invalid_value") from e
        with torch.no_grad():
            clean_logits, corrupt_logits = self._logits(clean[0].tolist()), self._logits(corrupt[0].tolist())
        return dict(layer=body.layer, unit=body.unit, patched=self._candidates(logits[0, -1], body.top),
                    clean=self._candidates(clean_logits[-1], body.top),
                    corrupt=self._candidates(corrupt_logits[-1], body.top))  # fmt: skip
