"""Activation patching, ablation and attribution patching over gptlab's hook points (gptlab.hooks).

Activation patching (Meng et al. 2022; Wang et al. 2022's indirect-object identification): run
the corrupted prompt with one activation taken from the clean run, and see how far the metric
moves back towards the clean value. Grids:
- "layer-pos": blocks.L.hook_resid_pre at one position, for every layer L and position;
- "layer-head": blocks.L.attn.hook_z of one head at every position, for every layer and head.

All patched runs of one layer go in one batch (a row per position or head), so a grid costs
n_layer forwards, not n_layer x T. Attribution patching (Nanda 2023) approximates the same grid
from one forward and one backward on the corrupted prompt: the metric's gradient at each
activation times (clean - corrupted) activation, summed over the patched dimensions.

Clean and corrupted prompts must have the same number of tokens. Metrics take the logits (B, T, V)
and return one value per row, (B,); `logit_diff` is the usual one. Every run is in eval mode (no
dropout), whatever mode the model is in; its mode is given back after.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch

from gptlab.generation import evaluating

Metric = Callable[[torch.Tensor], torch.Tensor]
OVER = {"layer-pos": "hook_resid_pre", "layer-head": "attn.hook_z"}


def _in_eval_mode(fn):
    """fn(model, ...) with the model in eval mode meanwhile: a model in training (a loop's, a fresh
    GPT with dropout) would patch and ablate through dropout, another grid on every call."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with evaluating(model):
            return fn(model, *args, **kwargs)

    return wrapper


def logit_diff(right: int, wrong: int) -> Metric:
    """logit(right) - logit(wrong) at the last position, per row."""
    return lambda logits: logits[:, -1, right] - logits[:, -1, wrong]


def _per_row(metric: Metric, logits: torch.Tensor) -> torch.Tensor:
    """metric(logits (B, T, V)) -> (B,), or a ValueError naming what it returned instead (a scalar
    such as .mean() gives no value per patched run)."""
    value = metric(logits)
    if not isinstance(value, torch.Tensor) or value.shape != logits.shape[:1]:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"the metric must return one value per row, shape ({logits.size(0)},), got {got}: e.g. logits[:, -1, right] - logits[:, -1, wrong], without .mean()")  # fmt: skip
    if not torch.isfinite(value).all():  # else a NaN span read as "no difference" and the grid as zeros
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(f"the metric is NaN or inf in {bad} of {value.numel()} rows: the model's activations overflowed (float16 holds at most 65,504) or its weights hold NaN; run it in float32 or bfloat16")  # fmt: skip
    return value


def _check(model, clean: torch.Tensor, corrupt: torch.Tensor, over: str) -> None:
    if over not in OVER:
        raise ValueError(f"over must be one of {', '.join(OVER)}, got {over!r}")
    if clean.shape != corrupt.shape or clean.dim() != 2 or clean.size(0) != 1:
        raise ValueError(
            f"clean and corrupted prompts must be one row each of the same length, got {tuple(clean.shape)} and "
            f"{tuple(corrupt.shape)} tokens"
        )


def _units(model, T: int, over: str) -> int:
    return T if over == "layer-pos" else model.config.n_head


def _patch_one(over: str, unit: int, source: torch.Tensor) -> Callable:
    """A hook that writes source's values at one position (layer-pos) or head (layer-head) into row 0."""

    def hook(x, _):
        x = x.clone()
        if over == "layer-pos":
            x[:, unit] = source[:, unit]  # x (B, T, C)
        else:
            x[:, :, unit] = source[:, :, unit]  # x (B, T, nh, hs)
        return x

    return hook


def _patch_rows(over: str, source: torch.Tensor) -> Callable:
    """A hook that writes, into row u of a batch, source's values at position or head u."""

    def hook(x, _):
        x, src = x.clone(), source.expand_as(x)
        units = torch.arange(x.size(0), device=x.device)
        if over == "layer-pos":
            x[units, units] = src[units, units]  # x (U, T, C): row u patched at position u
        else:
            x[units, :, units] = src[units, :, units]  # x (U, T, nh, hs): row u patched at head u
        return x

    return hook


@_in_eval_mode
@torch.no_grad()
def activation_patching(model, clean: torch.Tensor, corrupt: torch.Tensor, metric: Metric, over: str = "layer-pos"):
    """{"grid": (n_layer, T or n_head) metric of each patched run, "clean": float, "corrupt": float,
    "normalized": the grid as a share of the way from corrupt (0) to clean (1), zeros when the two
    are equal}.

    clean, corrupt: (1, T) token ids. One batched forward per layer."""
    _check(model, clean, corrupt, over)
    names = [f"blocks.{layer}.{OVER[over]}" for layer in range(model.config.n_layer)]
    clean_logits, cache = model.run_with_cache(clean, names_filter=names)
    clean_value, corrupt_value = float(_per_row(metric, clean_logits)[0]), float(_per_row(metric, model(corrupt)[0])[0])
    U = _units(model, clean.size(1), over)
    rows = corrupt.expand(U, -1)  # (U, T): one corrupted run per position or head
    grid = torch.stack([
        _per_row(metric, model.run_with_hooks(rows, fwd_hooks=[(name, _patch_rows(over, cache[name]))])) for name in names
    ])  # fmt: skip
    span = clean_value - corrupt_value
    normalized = (grid - corrupt_value) / span if abs(span) > 1e-9 else torch.zeros_like(grid)
    return {"grid": grid, "clean": clean_value, "corrupt": corrupt_value, "normalized": normalized}


@_in_eval_mode
@torch.no_grad()
def patched_logits(model, clean, corrupt, layer: int, unit: int, over: str = "layer-pos") -> torch.Tensor:
    """The corrupted run's logits (1, T, V) with one cell of the grid patched in from the clean run."""
    _check(model, clean, corrupt, over)
    units = _units(model, clean.size(1), over)
    if not (0 <= layer < model.config.n_layer and 0 <= unit < units):
        raise ValueError(f"cell ({layer}, {unit}) outside the {model.config.n_layer} x {units} grid")
    name = f"blocks.{layer}.{OVER[over]}"
    _, cache = model.run_with_cache(clean, names_filter=name)
    return model.run_with_hooks(corrupt, fwd_hooks=[(name, _patch_one(over, unit, cache[name]))])


def activation_patching_loop(model, clean, corrupt, metric: Metric, over: str = "layer-pos") -> torch.Tensor:
    """The same grid as activation_patching, one forward per cell (the reference it is tested against)."""
    grid = torch.empty(model.config.n_layer, _units(model, clean.size(1), over))
    for layer, unit in itertools.product(range(grid.size(0)), range(grid.size(1))):
        grid[layer, unit] = _per_row(metric, patched_logits(model, clean, corrupt, layer, unit, over))[0]
    return grid


@_in_eval_mode
def attribution_patching(model, clean: torch.Tensor, corrupt: torch.Tensor, metric: Metric, over: str = "layer-pos"):
    """The gradient estimate of activation_patching's grid minus its corrupted baseline:
    (n_layer, T or n_head) = sum over the patched dimensions of d metric / d activation (at the
    corrupted run) x (clean - corrupted activation). One forward and one backward."""
    _check(model, clean, corrupt, over)
    names = [f"blocks.{layer}.{OVER[over]}" for layer in range(model.config.n_layer)]
    _, clean_cache = model.run_with_cache(clean, names_filter=names)
    acts = {}

    def keep(x, hook):
        x.retain_grad()
        acts[hook.name] = x

    def embed(e, hook):  # the graph starts at the embeddings: no weight needs a gradient
        return e.detach().requires_grad_(True)

    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        with torch.enable_grad(), model.hooks([("hook_embed", embed), (names, keep)]):
            metric(model(corrupt)[0]).sum().backward()
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    dims = (-1,) if over == "layer-pos" else (-1, 1)  # sum over d_model, or over d_head and positions
    return torch.stack([
        (acts[n].grad * (clean_cache[n] - acts[n].detach())).sum(dims)[0] for n in names
    ])  # fmt: skip


@_in_eval_mode
@torch.no_grad()
def ablate(model, idx: torch.Tensor, name: str, *, head: int | None = None, how: str = "zero", mean_over=None):
    """Logits with the activation at hook point `name` replaced by zeros, or by its mean over
    `mean_over` (token ids, default idx) for how="mean": over the batch and positions, or for an
    attention point (hook_pattern, hook_attn_scores: (B, nh, T, T)) over the batch alone, each
    head and query/key position its own (so `mean_over` has idx's length). With `head`, only that
    head's part: of a (B, T, nh, hs) point such as hook_z, or of an attention point."""
    if how not in ("zero", "mean"):
        raise ValueError(f"how must be zero or mean, got {how!r}")
    if head is not None and not -model.config.n_head <= head < model.config.n_head:
        raise ValueError(f"head must be in [0, {model.config.n_head}) (or counted from the end), got {head}")
    attention = name.endswith(("hook_pattern", "hook_attn_scores"))  # (B, nh, T, T); else (B, T, ...)
    mean = None
    if how == "mean":
        source = idx if mean_over is None else mean_over
        if attention and source.size(-1) != idx.size(-1):
            raise ValueError(f"mean_over has {source.size(-1)} tokens and idx {idx.size(-1)}: {name}'s mean is per query and key position, so they must be as long")  # fmt: skip
        _, cache = model.run_with_cache(source, names_filter=name)
        mean = cache[name].mean(dim=0 if attention else (0, 1), keepdim=True)  # (1, nh, T, T) or (1, 1, ...)

    def hook(x, _):
        if head is not None and x.dim() != 4:  # else `head` would pick a channel of a (B, T, C) point
            raise ValueError(f"{name} has no head axis: head= takes a (B, T, n_head, head_size) point, e.g. hook_z")
        x = x.clone()
        axis = 1 if attention else 2  # the head axis: (B, nh, T, T) or (B, T, nh, hs)
        part = (slice(None),) * axis + (head,) if head is not None else (Ellipsis,)
        x[part] = 0.0 if mean is None else mean.expand_as(x)[part]
        return x

    return model.run_with_hooks(idx, fwd_hooks=[(name, hook)])
