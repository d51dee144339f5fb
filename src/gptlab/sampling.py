"""Sampling settings and the pure functions that turn logits (B, V) into next tokens.

`SamplingParams` is the one description of how to decode, validated once when it is made; the
Python API (`gptlab.generate`), the CLI, the server and speculative decoding all take it. Every
filter has one value that turns it off, and that value is its default: `top_k=0`, `top_p=1.0`,
`min_p=0.0`, `repetition_penalty=1.0`.

`probabilities(logits, params, seen)` is the exact distribution `sample_next` draws from
(repetition penalty, then temperature, then top-k, top-p and min-p, the order transformers uses);
temperature 0 makes it one-hot on the argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gptlab import ops

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode: the sampling filters, how many tokens and continuations, the seed, stop strings.

    temperature: 0 is greedy (argmax); top_k: keep the k most likely tokens (0: off); top_p: keep
    the smallest set of most likely tokens holding probability p (1.0: off); min_p: drop tokens
    less likely than min_p x the most likely one (0.0: off); repetition_penalty: CTRL's penalty on
    tokens already in the context (1.0: off); seed: makes sampling reproducible (None: torch's
    global generator); max_new_tokens: tokens to generate per row; num_samples: continuations per
    prompt; stop: strings that end a text continuation (text APIs and the server; a str or a
    sequence of str, kept as a tuple).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 200
    num_samples: int = 1
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (temperature=0 is greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (top_k=0 turns it off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (top_p=1.0 turns it off), got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (min_p=0.0 turns it off), got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be a number > 0 (repetition_penalty=1.0 turns it off), got {self.repetition_penalty!r}"
            )
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_int(self.num_samples) or self.num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {self.num_samples!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))  # frozen: the one normalisation, done once

    @property
    def greedy(self) -> bool:
        """Whether decoding is deterministic (temperature 0: the argmax)."""
        return self.temperature == 0

    def generator(self, device=None, *, fresh: bool = False) -> torch.Generator | None:
        """A torch.Generator on `device` seeded with `seed`. Without a seed: None (torch's global
        generator), or with fresh=True one seeded from the OS's entropy, for a server or a command
        whose global generator would start from the same seed on every run."""
        if self.seed is not None:
            return torch.Generator(device=device).manual_seed(self.seed)
        if fresh:
            generator = torch.Generator(device=device)
            generator.seed()
            return generator
        return None


# ---------------------------------------------------------------------------------------------
# Filters: pure functions over logits (B, V)


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept); the rest -> -inf."""
    if k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


# top_p_mask looks among the 512 most likely tokens first (torch.topk: 85 us over GPT-2's 50,257,
# 413 from 1,024 on, AMD EPYC Zen 5) and sorts them all only when those hold less than p.
TOP_P_FIRST = 512


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability sums to at least p; the rest -> -inf. The most likely token is always kept."""
    if p >= 1.0:
        return logits
    probs = F.softmax(logits.float(), dim=-1)  # (B, V)
    keep = ops.top_p_keep(probs, p)  # in C, where it runs: no sort
    if keep is not None:
        return logits.masked_fill(~keep, float("-inf"))
    k = min(probs.size(-1), TOP_P_FIRST)
    top, order = _in_vocabulary_order(*torch.topk(probs, k, dim=-1))  # (B, k), most likely first
    mass = top.cumsum(dim=-1)  # (B, k)
    keep_top = mass - top < p  # the mass of the more likely tokens is short of p (the first: always)
    last = top.masked_fill(~keep_top, float("inf")).amin(dim=-1)  # (B,) the least likely kept
    # A wider nucleus, or one that ends among probabilities equal to the k-th (topk took some of
    # them, in no set order): every token, ranked as gl_top_p_keep ranks them.
    if k < probs.size(-1) and not bool(((mass[..., -1] >= p) & (last > top[..., -1])).all()):
        order = _argsort_descending(probs)  # (B, V)
        top = probs.gather(-1, order)
        keep_top = top.cumsum(dim=-1) - top < p
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep_top)  # vocabulary order
    return logits.masked_fill(~keep, float("-inf"))


def _in_vocabulary_order(top: torch.Tensor, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """topk's (values, indices), most likely first, equal values in vocabulary order (topk leaves
    them in any order; gptlab's kernel keeps the earlier ids, and so must this path)."""
    by_id, perm = order.sort(dim=-1)  # (B, k)
    values = top.gather(-1, perm)
    rank = values.sort(dim=-1, descending=True, stable=True).indices
    return values.gather(-1, rank), by_id.gather(-1, rank)


def _argsort_descending(x: torch.Tensor) -> torch.Tensor:
    """Indices (B, V) that sort each row of x from largest to smallest, equal values in vocabulary
    order. On the CPU through NumPy: over GPT-2's 50,257 probabilities 0.50 ms where torch.sort
    takes 2.9 (AMD EPYC Zen 5)."""
    if x.device.type != "cpu":
        return torch.sort(x, dim=-1, descending=True, stable=True).indices
    return torch.from_numpy(np.argsort(-x.detach().numpy(), axis=-1, kind="stable"))


def min_p_mask(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """min-p (Nguyen et al. 2024): keep tokens whose probability is at least min_p times the top one."""
    if not min_p:
        return logits
    probs = F.softmax(logits.float(), dim=-1)  # (B, V)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def seen_tokens(token_ids, vocab_size: int, device=None) -> torch.Tensor:
    """(B, V) bool: which ids occur in each row of `token_ids` (a list of id lists, or (B, S)
    LongTensor in which negative ids are padding)."""
    if not isinstance(token_ids, torch.Tensor):
        width = max((len(r) for r in token_ids), default=0)
        token_ids = torch.tensor(
            [list(r) + [-1] * (width - len(r)) for r in token_ids], dtype=torch.long, device=device
        )
        token_ids = token_ids.view(len(token_ids) if len(token_ids) else 0, width)
    B = token_ids.size(0)
    seen = torch.zeros(B, vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    ids = token_ids.masked_fill(token_ids < 0, vocab_size)  # padding -> a spare column, dropped below
    seen.scatter_(1, ids, True)
    return seen[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019), as transformers applies it: for tokens already
    in the context, a positive logit is divided by `penalty`, a negative one multiplied by it.

    `seen` is a (B, V) bool mask (see `seen_tokens`) or a (B, S) LongTensor of context ids
    (negative ids are padding)."""
    if penalty == 1.0:
        return logits
    if seen.dtype != torch.bool:
        seen = seen_tokens(seen, logits.size(-1))
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    big = torch.finfo(logits.dtype).max  # an extreme penalty (1e-245) must not make inf, which softmax turns to NaN
    return torch.where(seen, penalised.clamp(-big, big), logits)


# ---------------------------------------------------------------------------------------------
# The distribution and the draw


def _penalised(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """logits (B, V) with the repetition penalty applied; `seen` (B, V) is needed when it is on."""
    if params.repetition_penalty == 1.0:
        return logits
    if seen is None:
        raise ValueError("repetition_penalty needs `seen`, the tokens already in each row's context")
    return apply_repetition_penalty(logits, seen, params.repetition_penalty)


def _warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 logits (B, V) after temperature (> 0) and the filters: what the softmax takes."""
    logits = logits.float()
    if params.temperature < 1.0:  # dividing enlarges: count down from the row's top logit (the same softmax), and
        logits = logits - logits.amax(
            dim=-1, keepdim=True
        )  # keep the divisor a float32 > 0, so 1e-300 gives no inf/NaN
    if params.temperature != 1.0:  # x / 1 is x: no operation (each costs ~50 us right after a decoding step)
        logits = logits / max(params.temperature, torch.finfo(torch.float32).tiny)  # (B, V)
    if params.top_k:
        logits = top_k_mask(logits, params.top_k)
    if params.top_p < 1.0:
        logits = top_p_mask(logits, params.top_p)
    if params.min_p:
        logits = min_p_mask(logits, params.min_p)
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution (B, V) float32 that `sample_next` draws from for logits (B, V): repetition
    penalty (over `seen`, (B, V) bool), temperature, top-k, top-p, min-p, softmax; one-hot on the
    argmax at temperature 0."""
    logits = _penalised(logits, params, seen)
    if params.greedy:
        return F.one_hot(ops.argmax(logits), logits.size(-1)).float()  # (B, V)
    return F.softmax(_warped(logits, params), dim=-1)


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    seen: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids (B,) drawn from `probabilities(logits, params, seen)` with `generator` (one
    kept across steps, e.g. `params.generator(device)`; None: torch's global one); the argmax at
    temperature 0, without building the one-hot."""
    logits = _penalised(logits, params, seen)
    if params.greedy:
        ids = ops.argmax(logits)  # (B,): the first NaN of a row that holds one
        if not _picks_are_numbers(logits, ids):  # NaN (or a row of -inf): was token 0, silently
            raise NonFiniteProbabilities(NOT_FINITE)
        return ids
    probs = F.softmax(_warped(logits, params), dim=-1)  # (B, V)
    return draw(probs, generator).to(logits.device)  # (B,)


def _picks_are_numbers(logits: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether every row's picked logit (logits (B, V), ids (B,)) is above -inf, so not NaN. On
    the CPU read through numpy, ~4 us a step where torch's gather and compare take ~15."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        rows = logits.detach().numpy()
        return all(rows[r, i] > -math.inf for r, i in enumerate(ids.tolist()))
    return bool((logits.gather(-1, ids.unsqueeze(-1)) > float("-inf")).all())


class NonFiniteProbabilities(ValueError):
    """A distribution to draw from holds inf or NaN, or sums to 0 (a diverged model's logits)."""


NOT_FINITE = ("the model's logits are not finite (NaN or inf): its activations overflowed (float16 holds at most "
              "65,504) or its weights hold NaN; run it in float32 or bfloat16")  # fmt: skip


def check_finite(logits: torch.Tensor) -> None:
    """NonFiniteProbabilities (a ValueError) where `logits` hold NaN or inf: they give no
    distribution to read probabilities, a table or an argmax from."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteProbabilities(NOT_FINITE)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One id per row of probs (B, V) (non-negative, each row's sum > 0; scaled to 1 here), drawn
    with `generator` by inverting the cumulative distribution at one uniform number per row.
    torch.multinomial draws an exponential number per vocabulary entry: 773 us a row of GPT-2's
    50,257 on an AMD EPYC Zen 5 where this takes 41; the draws differ, not their distribution."""
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    u = torch.rand(probs.size(0), 1, generator=generator, dtype=torch.float64, device=probs.device)  # (B, 1)
    ids = ops.draw(probs, u)  # in C where it runs, with the arithmetic below: the same ids
    if ids is not None:
        return ids
    cdf = probs.double().cumsum(dim=-1)  # (B, V); float64, so a token's share is its probability to ~1e-16
    total = cdf[:, -1:]  # (B, 1)
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise NonFiniteProbabilities(
            f"probabilities must be finite and non-negative with a positive sum in every row ({NOT_FINITE})"
        )
    ids = torch.searchsorted(cdf, u * total, right=True)  # the first entry whose cumulative mass exceeds it: never a 0
    return ids.clamp_(max=probs.size(-1) - 1).squeeze(-1)  # (B,)
