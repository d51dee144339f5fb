"""Hook points with TransformerLens's names on gptlab's GPT: caching and editing activations.

Every activation TransformerLens names on GPT-2 passes through a `HookPoint` (an identity module)
in gptlab's forward: `hook_embed`, `hook_pos_embed`, `blocks.{L}.hook_resid_pre`,
`blocks.{L}.ln1.hook_scale` / `hook_normalized`, `blocks.{L}.attn.hook_q` / `hook_k` / `hook_v`
(batch, pos, head, d_head), `hook_attn_scores` / `hook_pattern` (batch, head, query, key),
`hook_z` (batch, pos, head, d_head), `blocks.{L}.hook_attn_out`, `hook_resid_mid`, `ln2.*`,
`mlp.hook_pre` / `hook_post`, `hook_mlp_out`, `hook_resid_post`, `ln_final.hook_scale` /
`hook_normalized`. Variants add `attn.hook_rot_q` / `hook_rot_k` (after rotation) and, for
SwiGLU, `mlp.hook_pre_linear` (the up projection; `hook_pre` is the gate).

A HookPoint with no hook costs one dict check, and the decoding step stays in C until a hook is
registered (gptlab.fused_step then runs the modules). Attention scores and patterns exist only
when hooked: a hook on either makes that layer take the explicit attention path. Masked scores
are -inf (TransformerLens's HookedTransformer; its TransformerBridge writes the dtype's minimum).
Values are the model's own: no LayerNorm folding, no centring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import operator
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from gptlab.atomic import atomic_write

HookFn = Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]
# gptlab's module paths -> TransformerLens's names (applied in order)
_RENAMES = (("transformer.h.", "blocks."), (".ln_1.", ".ln1."), (".ln_2.", ".ln2."), ("transformer.ln_f.", "ln_final."))
# The points in the order a forward pass reaches them (a block's without its "blocks.L." prefix).
_FORWARD_ORDER = (
    "hook_embed", "hook_pos_embed", "hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q",
    "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_attn_scores", "attn.hook_pattern",
    "attn.hook_z", "hook_attn_out", "hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized", "mlp.hook_pre",
    "mlp.hook_pre_linear", "mlp.hook_post", "hook_mlp_out", "hook_resid_post", "ln_final.hook_scale",
    "ln_final.hook_normalized",
)  # fmt: skip


class HookPoint(nn.Module):
    """An identity on one activation, where hooks can read or replace it."""

    def __init__(self):
        super().__init__()
        self.name = ""  # TransformerLens's name, set by hook_points()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) if self._forward_hooks else x  # no hook: no module call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A hook may edit its activation in place (TransformerLens's ablation idiom). Under
        # autograd, editing a view from split/chunk (q, k, v; SwiGLU's gate and up) is an error:
        # such a view reaches the hooks as a copy.
        return x.clone() if x.requires_grad and x._is_view() else x

    @property
    def active(self) -> bool:
        return bool(self._forward_hooks)

    def add_hook(self, fn: HookFn, prepend: bool = False):
        """Call fn(activation, self) at each forward (before the hooks already there with
        `prepend`); a tensor it returns replaces the activation. Returns the handle (`.remove()`)."""

        def hook(module, args, output):
            out = fn(output, self)
            return output if out is None else out

        return self.register_forward_hook(hook, prepend=prepend)


def tl_name(path: str) -> str:
    """gptlab's module path of a hook point -> TransformerLens's name for it."""
    for old, new in _RENAMES:
        path = path.replace(old, new)
    return path


def _forward_position(name: str) -> tuple[int, int]:
    """(block, rank): where a forward pass reaches the point (embeddings first, ln_final last)."""
    parts = name.split(".", 2)
    block, point = (int(parts[1]), parts[2]) if parts[0] == "blocks" else (-1, name)
    if point.startswith("ln_final."):
        block = 1 << 30
    return block, _FORWARD_ORDER.index(point) if point in _FORWARD_ORDER else len(_FORWARD_ORDER)


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """{TransformerLens name: HookPoint} for every hook point of the model, in the order a
    forward pass reaches them (each point's `name` is set on the way)."""
    points = {}
    for path, module in model.named_modules():
        if isinstance(module, HookPoint):
            module.name = tl_name(path)
            points[module.name] = module
    return dict(sorted(points.items(), key=lambda item: _forward_position(item[0])))


def _unknown(name: str, points: dict[str, HookPoint]) -> str:
    """What to say of a name the model has no point for: the closest names, or the blocks it has."""
    close = difflib.get_close_matches(name, points, n=3, cutoff=0.8)
    blocks = {n.split(".")[1] for n in points if n.startswith("blocks.")}
    hint = f"did you mean {' or '.join(close)}?" if close else f"its points are e.g. {', '.join(list(points)[:4])}"
    return f"no hook point {name} (the model has blocks 0-{len(blocks) - 1}; {hint}; model.hook_points() lists all {len(points)})"  # fmt: skip


def _select(points: dict[str, HookPoint], names) -> list[HookPoint]:
    """names: None (all), a name, a list of names, or a predicate on names. A name listed twice
    is selected once (a cache streamed to a file wrote it twice and could not be read back; a
    hook ran twice)."""
    if names is None:
        return list(points.values())
    if callable(names):
        return [p for n, p in points.items() if names(n)]
    names = list(dict.fromkeys([names] if isinstance(names, str) else names))
    unknown = [n for n in names if n not in points]
    if unknown:
        raise ValueError(_unknown(unknown[0], points))
    return [points[n] for n in names]


@contextlib.contextmanager
def hooks(model: nn.Module, fwd_hooks: Iterable[tuple] = ()):
    """Register (name or predicate, fn) pairs for the duration of a `with` block. They fire only
    in the thread that entered it, so a server decoding in another thread is never touched."""
    points = hook_points(model)
    handles = []
    thread = threading.get_ident()

    def this_thread(fn):
        return lambda x, hook: fn(x, hook) if threading.get_ident() == thread else None

    try:
        for names, fn in fwd_hooks:
            handles += [p.add_hook(this_thread(fn)) for p in _select(points, names)]
        yield model
    finally:
        for h in handles:
            h.remove()


def _logits_only(forward_kwargs: dict) -> None:
    """These return logits alone: a loss asked for would be computed and dropped."""
    if forward_kwargs.get("targets") is not None:
        raise ValueError("targets: run_with_hooks and run_with_cache return logits only; for the loss, call model(idx, targets=...) inside `with model.hooks([...])`")  # fmt: skip


def run_with_hooks(model: nn.Module, idx: torch.Tensor, fwd_hooks: Iterable[tuple] = (),
                   stop_at_layer: int | None = None, **forward_kwargs):  # fmt: skip
    """The model's logits (B, T, V) with the hooks in place for this one forward; with
    stop_at_layer, the residual stream (B, T, C) where it stops (see run_with_cache)."""
    _logits_only(forward_kwargs)
    return _forward(model, idx, list(fwd_hooks), stop_at_layer, forward_kwargs, grad=True)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def cache_to_file(model: nn.Module, idx: torch.Tensor, path, names_filter=None, stop_at_layer: int | None = None,
                  **forward_kwargs) -> torch.Tensor:  # fmt: skip
    """Run the model and stream each selected activation to a safetensors file as it is
    computed, so only one is in memory at a time (for inputs whose whole cache would not fit);
    returns the logits (the residual stream with stop_at_layer, as run_with_cache). The file is
    written beside `path` (its directory made if need be) and renamed into place when complete;
    `safetensors.safe_open` reads one tensor at a time back."""
    path = os.fspath(path)
    header: dict[str, dict] = {}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory) as raw:

        def save(x, hook):
            data = x.detach().to("cpu").contiguous()
            start = raw.tell()
            raw.write(data.reshape(-1).view(torch.uint8).numpy().tobytes())
            header[hook.name] = {"dtype": _SAFETENSORS_DTYPES[data.dtype], "shape": list(data.shape),
                                 "data_offsets": [start, raw.tell()]}  # fmt: skip

        logits = _forward(model, idx, [(names_filter, save)], stop_at_layer, forward_kwargs)
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned

        def write(tmp):
            with open(tmp, "wb") as out:
                out.write(len(blob).to_bytes(8, "little") + blob)
                raw.seek(0)
                shutil.copyfileobj(raw, out, 16 << 20)

        atomic_write(path, write)
    return logits


@torch.no_grad()
def process_weights(
    model: nn.Module,
    *,
    fold_ln: bool = True,
    center_writing_weights: bool = True,
    center_unembed: bool = True,
    fold_value_biases: bool = True,
) -> nn.Module:
    """A copy of a GPT-2-style model (LayerNorm, learned positions, biases) with TransformerLens's
    weight processing, the same function (logits equal up to a constant per position when the
    unembedding is centred): LayerNorm gains and biases folded into the layers that read them
    (the norms keep only their normalization), the weights writing to the residual stream
    centred, the unembedding centred over the vocabulary, value biases folded into the output
    bias. The head becomes a separate matrix with a bias. Never applied unless asked for."""
    import copy

    c = model.config
    if scheme := getattr(model, "quantization", None):  # its layers hold integer codes, not weights to fold
        raise ValueError(f"process_weights folds float weights; this model is quantized ({scheme['mode']}): "
                         "process gptlab.quantize.dequantize_model(model)")  # fmt: skip
    if c.norm != "layernorm" or c.pos_embedding != "learned" or not c.bias or c.mlp == "swiglu":
        raise ValueError("process_weights handles GPT-2's architecture (LayerNorm, learned positions, biases, GELU)")
    m = copy.deepcopy(model)
    head = nn.Linear(c.n_embd, c.vocab_size, bias=True, device=m.lm_head.weight.device, dtype=m.lm_head.weight.dtype)
    head.weight.copy_(m.lm_head.weight)
    head.bias.zero_()
    m.lm_head, m.config = head, dataclasses.replace(c, tie_weights=False)

    def fold(norm, linear):  # linear(norm(x)) = linear'(normalized x)
        linear.bias.add_(linear.weight @ norm.bias)
        linear.weight.mul_(norm.weight[None, :])
        norm.weight.fill_(1.0)
        norm.bias.zero_()

    for block in m.transformer.h:
        if fold_ln:
            fold(block.ln_1, block.attn.c_attn)
            fold(block.ln_2, block.mlp.c_fc)
        if fold_value_biases:  # a pattern's rows sum to 1: the value bias adds W_O b_v at every position
            b_v = block.attn.c_attn.bias[2 * c.n_embd :]
            block.attn.c_proj.bias.add_(block.attn.c_proj.weight @ b_v)
            b_v.zero_()
        if center_writing_weights:  # every reader of the residual stream subtracts its mean first
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.sub_(proj.weight.mean(0, keepdim=True))
                proj.bias.sub_(proj.bias.mean())
    if fold_ln:
        fold(m.transformer.ln_f, m.lm_head)
    if center_writing_weights:
        for table in (m.transformer.wte, m.transformer.wpe):
            table.weight.sub_(table.weight.mean(-1, keepdim=True))
    if center_unembed:
        m.lm_head.weight.sub_(m.lm_head.weight.mean(0, keepdim=True))
        m.lm_head.bias.sub_(m.lm_head.bias.mean())
    return m


class _Stop(Exception):
    """Raised where stop_at_layer ends a forward, holding the residual stream there."""

    def __init__(self, residual: torch.Tensor):
        super().__init__()
        self.residual = residual


def _stop_point(model: nn.Module, stop_at_layer) -> tuple[str, bool]:
    """(hook point, first): where stop_at_layer=L ends the forward, as in TransformerLens: as
    block L starts, before any hook of that block (blocks.L.hook_resid_pre, stopped first); with
    L = n_layer after the last block and its hooks, before the final norm. A negative L counts
    from the end (-1: the last block is not run)."""
    n = model.config.n_layer
    try:
        layer = operator.index(stop_at_layer)
    except TypeError:
        layer = None
    if layer is None or not -n <= layer <= n:
        raise ValueError(f"stop_at_layer must be an integer in [-{n}, {n}] ({n} blocks), got {stop_at_layer!r}")
    layer += n if layer < 0 else 0
    return (f"blocks.{layer}.hook_resid_pre", True) if layer < n else (f"blocks.{n - 1}.hook_resid_post", False)


@contextlib.contextmanager
def _stopping(model: nn.Module, stop_at_layer: int | None):
    """While the `with` block runs, a forward in this thread raises _Stop where stop_at_layer
    says (_stop_point); nothing when it is None."""
    if stop_at_layer is None:
        yield
        return
    name, first = _stop_point(model, stop_at_layer)
    thread = threading.get_ident()

    def stop(x, hook):
        if threading.get_ident() == thread:
            raise _Stop(x)

    handle = hook_points(model)[name].add_hook(stop, prepend=first)
    try:
        yield
    finally:
        handle.remove()


def run_with_cache(model: nn.Module, idx: torch.Tensor, names_filter=None, stop_at_layer: int | None = None,
                   device=None, **forward_kwargs):  # fmt: skip
    """(logits, cache): cache[name] is the activation at each selected hook point (all by default;
    names_filter: a name, names or a predicate), detached, on `device` when given. With
    stop_at_layer=L the forward stops as block L starts and returns the residual stream there,
    (B, T, C), in place of the logits: blocks 0..L-1 run and are cached, block L's points are
    not. As in TransformerLens, L = n_layer runs every block but not the final norm and the head
    (the residual stream after the last block), and a negative L counts from the end."""
    _logits_only(forward_kwargs)
    cache: dict[str, torch.Tensor] = {}

    def save(x, hook):
        cache[hook.name] = x.detach() if device is None else x.detach().to(device)

    return _forward(model, idx, [(names_filter, save)], stop_at_layer, forward_kwargs), cache


def _forward(model: nn.Module, idx: torch.Tensor, fwd: list, stop_at_layer: int | None, forward_kwargs: dict,
             grad: bool = False):  # fmt: skip
    """The logits of one forward under the `fwd` hooks (without gradients unless `grad`), or the
    residual stream where stop_at_layer ends it."""
    try:
        with contextlib.nullcontext() if grad else torch.no_grad(), hooks(model, fwd), _stopping(model, stop_at_layer):
            return model(idx, **forward_kwargs)[0]
    except _Stop as stopped:
        return stopped.residual


_KEYED = ("hook_attn_scores", "hook_pattern")  # (B, nh, query, key): positions on dim 2, keys on dim 3


@contextlib.contextmanager
def recording(model: nn.Module, names):
    """{name: [activation of each forward]} filled while the `with` block runs (generate's cache_names)."""
    records: dict[str, list[torch.Tensor]] = {}

    def record(x, hook):
        records.setdefault(hook.name, []).append(x.detach())

    with hooks(model, [(names, record)]):
        yield records


def per_row(records: dict[str, list[torch.Tensor]], prompt_lengths: list[int], lengths: list[int]) -> list[dict]:
    """A batched generation's recorded activations (a left-padded prefill, then one step per
    token) as one {name: (length, ...)} per row, its padding removed; attention patterns and
    scores become (heads, length, length), the keys a step had not seen yet 0 (scores -inf)."""
    pad = [max(prompt_lengths) - n for n in prompt_lengths]
    rows: list[dict] = [{} for _ in prompt_lengths]
    for name, chunks in records.items():
        if name.endswith(_KEYED):
            fill = float("-inf") if name.endswith("hook_attn_scores") else 0.0
            S = chunks[0].size(2) + len(chunks) - 1  # every key
            chunks = [torch.nn.functional.pad(c, (0, S - c.size(3)), value=fill) for c in chunks]
            full = torch.cat(chunks, dim=2)  # (B, nh, S, S)
            for b, row in enumerate(rows):
                row[name] = full[b, :, pad[b] : pad[b] + lengths[b], pad[b] : pad[b] + lengths[b]]
        else:
            full = torch.cat(chunks, dim=1)  # (B, S, ...)
            for b, row in enumerate(rows):
                row[name] = full[b, pad[b] : pad[b] + lengths[b]]
    return rows
