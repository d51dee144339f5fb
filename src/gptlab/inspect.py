"""Looking inside a model: what its parameters, FLOPs and memory are made of, a step-by-step trace
of one forward pass, attention maps, the logit lens, and the next-token distribution.

Everything here returns data; the `gptlab info/trace/attention/lens/next` commands print it.
Residual streams are read with forward hooks on the model's modules, so the model's own forward
pass (and its fast attention kernels) stays untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from gptlab.config import GPTConfig
from gptlab.model import GPT
from gptlab.sampling import check_finite
from gptlab.tokenizer import Tokenizer

# ----------------------------------------------------------------------------- tokens


def token_label(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text for display, a label no other text has: a backslash doubled (\\\\),
    non-printable characters escaped (\\n, \\x1b, \\u00a0), and a piece of a multi-byte UTF-8
    character shown as its bytes (\\xe4)."""
    raw = tokenizer.decode_bytes([token_id])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"\\x{b:02x}" for b in raw)
    return "".join(_escape(c) for c in text)


def _escape(c: str) -> str:
    """One character of a label. A backslash is doubled, or the tokens `\\` and `n` would read as a
    newline; U+0080..U+00FF are written \\u00XX, as \\xXX there is a byte of a split character
    (GPT-2's U+00A0, token 1849, read as its lone byte 0xa0, token 254)."""
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    if "\x80" <= c <= "\xff":
        return f"\\u{ord(c):04x}"
    return c.encode("unicode_escape").decode("ascii")


def encode_prompt(tokenizer: Tokenizer, prompt: str, block_size: int, flag: str = "--prompt") -> list[int]:
    """Token ids of a prompt; an empty prompt or one longer than the context is a ValueError
    (naming the command's `flag` for it). `<|endoftext|>` in the text is that token, as in the
    explorer's and the completions API's prompts."""
    if not prompt:
        raise ValueError(f"the prompt is empty: give some text with {flag}")
    ids = tokenizer.encode(prompt, allowed_special="all")
    if len(ids) > block_size:
        raise ValueError(f"{flag} is {len(ids)} tokens, longer than the model's context of {block_size}")
    return ids


# ----------------------------------------------------------------------------- breakdown


def matrices(config: GPTConfig) -> list[tuple[str, int, int, int]]:
    """Every weight matrix a token is multiplied by, as (name, count, out_features, in_features).

    The head is listed even when tied to the token embedding: the lookup is free, the head matmul
    is not. A classifier's head is its `score` (num_labels, n_embd): it has no lm_head.
    """
    C, hidden = config.n_embd, config.mlp_hidden
    fc_out = 2 * hidden if config.mlp == "swiglu" else hidden
    L = config.n_layer
    head = ("score", 1, config.num_labels, C) if config.num_labels else ("lm_head", 1, config.vocab_size, C)
    return [
        ("attn.c_attn", L, 3 * C, C),
        ("attn.c_proj", L, C, C),
        ("mlp.c_fc", L, fc_out, C),
        ("mlp.c_proj", L, C, hidden),
        head,
    ]


def matmul_params(config: GPTConfig) -> int:
    """Weights that take part in matrix multiplies per token (blocks' Linear layers plus the head)."""
    return sum(n * out * inp for _, n, out, inp in matrices(config))


def flops_per_token(config: GPTConfig, context: int | None = None) -> dict:
    """Model FLOPs per token at a context length, counted as in the PaLM paper's appendix B.

    Forward: 2 FLOPs per matmul weight (N = matmul_params) plus attention's two T-long products
    per layer (q k^T and probs v: 2 * 2 * T * n_embd per layer), over the full context, with no
    causal discount. Training (forward + backward) is 3x forward: 6N + 12 * L * T * n_embd.
    Biases, norms, softmax and embedding lookups are left out (under 1% at GPT-2 sizes).
    """
    T = context or config.block_size
    n = matmul_params(config)
    attention = 4 * config.n_layer * T * config.n_embd
    return {
        "context": T,
        "matmul_params": n,
        "attention": attention,
        "forward": 2 * n + attention,
        "train": 3 * (2 * n + attention),
    }


def kv_cache_bytes(config: GPTConfig, bytes_per_value: int, context: int | None = None) -> dict:
    """KV-cache size: a key and a value vector of n_embd per layer per token."""
    per_token = 2 * config.n_layer * config.n_embd * bytes_per_value
    T = context or config.block_size
    return {"per_token": per_token, "context": T, "full_context": per_token * T}


def weight_memory(model: GPT, group_size: int = 64) -> dict[str, int]:
    """Bytes of weights stored as fp32, bf16, int8 and int4.

    int8 and int4 (the gptlab quantize schemes) quantize every matrix in matrices(), the head
    included (once when tied), with a bf16 scale per output channel (int8) or a bf16 scale and zero
    point per group of `group_size` inputs (int4); every other parameter (embedding tables not
    shared with the head, position table, biases, norms) is counted at fp32, as quantize keeps
    them from an fp32 model (they were counted at bf16: an untied model's file was 1.8x that).
    """
    total = model.num_params()
    mats = matrices(model.config)
    n_mat = matmul_params(model.config)
    rows = sum(n * out for _, n, out, _ in mats)
    groups = sum(n * out * math.ceil(inp / group_size) for _, n, out, inp in mats)
    rest = total - n_mat
    return {
        "fp32": 4 * total,
        "bf16": 2 * total,
        "int8": n_mat + 2 * rows + 4 * rest,
        "int4": (n_mat + 1) // 2 + 4 * groups + 4 * rest,
    }


def model_info(model: GPT, context: int | None = None, group_size: int = 64) -> dict:
    """Everything `gptlab info` shows: parameters per component, FLOPs, KV cache, weight memory
    (int4's with `group_size`), at `context` tokens (default and at most block_size: the model
    never holds more)."""
    block = model.config.block_size
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= block):
        raise ValueError(f"context must be in [1, {block}] (the model's block_size), got {context!r}")
    total = model.num_params()
    components = [dict(r, share=r["params"] / total) for r in model.param_breakdown()]
    return {
        "config": model.config.to_dict(),
        "components": components,
        "total": total,
        "non_embedding": model.num_params(non_embedding=True),
        "flops": flops_per_token(model.config, context),
        "kv_cache": {name: kv_cache_bytes(model.config, size, context) for name, size in (("fp32", 4), ("bf16", 2))},
        "weights": weight_memory(model, group_size),
    }


# ----------------------------------------------------------------------------- hooks


@contextmanager
def capture_outputs(modules: dict[str, nn.Module]) -> Iterator[dict[str, torch.Tensor]]:
    """Record each named module's output during the forward passes run inside the block."""
    outputs: dict[str, torch.Tensor] = {}

    def hook(name):
        return lambda module, args, output: outputs.__setitem__(name, output.detach())

    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


def _check_idx(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    if idx.dim() == 1:
        idx = idx[None]  # (1, T)
    if idx.size(1) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    return idx


def _one_sequence(model: GPT, idx: torch.Tensor, top: int) -> torch.Tensor:
    """idx as (1, T) for the functions that read one sequence's top tokens; ValueError for a batch
    (its other rows were ignored) or a top below 1."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be at least 1, got {top!r}")
    idx = _check_idx(model, idx)
    if idx.size(0) != 1:
        raise ValueError(f"one sequence at a time: idx has {idx.size(0)} rows")
    return idx


@torch.no_grad()
def residual_streams(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and the residual stream entering block 0 and leaving each block: n_layer + 1 tensors (B, T, C)."""
    idx = _check_idx(model, idx)
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(model.config.n_layer)]
    logits, cache = model.run_with_cache(idx, names_filter=names)  # hooks of this thread only (gptlab.hooks)
    return logits, [cache[name] for name in names]


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest probabilities and their ids; ValueError for NaN or infinite logits, which
    have no distribution (they were printed as NaN, written to JSON as NaN, or crashed a table)."""
    check_finite(logits)
    probs = torch.softmax(logits.float(), dim=-1)
    return probs.topk(min(k, probs.size(-1)), dim=-1)  # values, indices


@torch.no_grad()
def next_tokens(model: GPT, tokenizer: Tokenizer, idx: torch.Tensor, top: int = 10) -> list[dict]:
    """The `top` most likely next tokens after the sequence, with probabilities and logits."""
    idx = _one_sequence(model, idx, top)
    logits, _ = model(idx)
    last = logits[0, -1].float()  # (V,)
    probs, ids = _top(last, top)
    return [
        {"id": int(i), "token": token_label(tokenizer, int(i)), "prob": float(p), "logit": float(last[i])}
        for p, i in zip(probs, ids, strict=True)
    ]


@torch.no_grad()
def logit_lens(model: GPT, idx: torch.Tensor, top: int = 5) -> dict:
    """For the residual stream before block 0 and after each block, the top tokens that the final
    norm and head read from it (nostalgebraist's logit lens). The last row is the model's output.

    Returns layer names, top_ids and top_probs as nested lists (layers, T, top).
    """
    idx = _one_sequence(model, idx, top)
    _, streams = residual_streams(model, idx)
    top_ids, top_probs = [], []
    for x in streams:
        probs, ids = _top(model.lm_head(model.transformer.ln_f(x))[0], top)  # (T, top) each
        top_ids.append(ids.tolist())
        top_probs.append(probs.tolist())
    names = ["embed"] + [f"block {i}" for i in range(model.config.n_layer)]
    return {"layers": names, "input_ids": idx[0].tolist(), "top_ids": top_ids, "top_probs": top_probs}


# ----------------------------------------------------------------------------- trace


def _norm(x: torch.Tensor) -> float:
    """Mean over positions of the L2 norm along the embedding, for the first sequence."""
    return x[0].float().norm(dim=-1).mean().item()


def _watch_for_trace(model: GPT) -> dict[str, nn.Module]:
    t = model.transformer
    watch = {"wte": t.wte, "embed": t.drop, "ln_f": t.ln_f}
    if "wpe" in t:
        watch["wpe"] = t.wpe
    for i, b in enumerate(t.h):
        watch |= {f"{i}.ln_1": b.ln_1, f"{i}.c_attn": b.attn.c_attn, f"{i}.attn": b.attn}
        watch |= {f"{i}.ln_2": b.ln_2, f"{i}.c_fc": b.mlp.c_fc, f"{i}.mlp": b.mlp, f"{i}.out": b}
    return watch


def _trace_stages(cfg: GPTConfig, out: dict[str, torch.Tensor], logits: torch.Tensor) -> list[dict]:
    """Each stage's output shape, block 0 in detail (the rest repeat it)."""
    B, T = out["wte"].shape[:2]
    shape = lambda name: list(out[name].shape)
    stage = lambda name, shp, detail="": dict(stage=name, shape=shp, detail=detail)
    stages = [
        stage("token ids", [B, T], "input"),
        stage("token embedding wte[ids]", shape("wte"), f"{cfg.vocab_size} x {cfg.n_embd} table"),
        stage("position embedding wpe[0..T-1]", shape("wpe"), "learned positions")
        if "wpe" in out
        else stage("rotary angles", [B, 1, T, cfg.head_size // 2], "rotate q, k in every block"),
        stage("x = embeddings (residual stream)", shape("embed")),
        stage("block 0: ln_1(x)", shape("0.ln_1"), cfg.norm),
        stage("block 0: c_attn -> q, k, v fused", shape("0.c_attn"), "3 x n_embd"),
        stage(
            "block 0: q, k, v split into heads",
            [B, cfg.n_head, T, cfg.head_size],
            f"{cfg.n_head} heads x {cfg.head_size}",
        ),
        stage("block 0: softmax(q k^T / sqrt(hs)), causal", [B, cfg.n_head, T, T], "attention probabilities"),
        stage("block 0: heads merged, c_proj", shape("0.attn"), "x += this"),
        stage("block 0: ln_2(x)", shape("0.ln_2"), cfg.norm),
        stage("block 0: mlp c_fc", shape("0.c_fc"), cfg.mlp),
        stage("block 0: mlp c_proj", shape("0.mlp"), "x += this"),
    ]
    stages += [stage(f"block {i} output", shape(f"{i}.out")) for i in range(cfg.n_layer)]
    stages.append(stage("final norm ln_f", shape("ln_f"), cfg.norm))
    stages.append(stage("lm_head -> logits", list(logits.shape), "tied to wte" if cfg.tie_weights else "untied"))
    return stages


def _block_changes(n_layer: int, out: dict[str, torch.Tensor]) -> list[dict]:
    """Per block: residual norm in and out, the attention and MLP contributions, and the change."""
    rows, x_in = [], out["embed"]
    for i in range(n_layer):
        x_out = out[f"{i}.out"]
        rows.append(
            dict(
                layer=i,
                resid_in=_norm(x_in),
                attn=_norm(out[f"{i}.attn"]),
                mlp=_norm(out[f"{i}.mlp"]),
                change=_norm(x_out - x_in),
                resid_out=_norm(x_out),
            )
        )
        x_in = x_out
    return rows


@torch.no_grad()
def trace(model: GPT, tokenizer: Tokenizer, idx: torch.Tensor, top: int = 5) -> dict:
    """A forward pass step by step: tokens, each stage's output shape, how much each block changes
    the residual stream (norms averaged over positions), the logits' shape and the top next tokens.
    """
    idx = _one_sequence(model, idx, top)
    with capture_outputs(_watch_for_trace(model)) as out:
        logits, _ = model(idx)
    probs, ids = _top(logits[0, -1], top)
    return {
        "tokens": [dict(id=int(i), text=token_label(tokenizer, int(i))) for i in idx[0]],
        "stages": _trace_stages(model.config, out, logits),
        "blocks": _block_changes(model.config.n_layer, out),
        "logits_shape": list(logits.shape),
        "next": [
            dict(id=int(i), token=token_label(tokenizer, int(i)), prob=float(p))
            for p, i in zip(probs, ids, strict=True)
        ],
    }


# ----------------------------------------------------------------------------- plots


def _save_figure(fig, path) -> None:
    from gptlab.atomic import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


# Text drawn as it reads: matplotlib would take a string with two `$` (a token such as "$$", a
# prompt of prices) as mathtext, and fail to parse it or draw it as maths.
PLAIN = dict(parse_math=False)


# However long the prompt, a figure stays within these sizes (inches, at 120 dpi). An attention
# grid grows as T x T: GPT-2's 12 heads over 300 tokens asked for a 36,600-pixel square (~5 GB to
# draw) and longer prompts were killed for memory; a lens or patching grid grows as T and passed
# matplotlib's 65,536-pixel limit at ~550 tokens. Labels are then thinned to what fits.
MAX_SQUARE_INCHES = 40.0  # an attention figure's width and height: 4,800 pixels
MAX_WIDE_INCHES = 160.0  # a lens or patching figure's width: 19,200 pixels


def _every(n: int, inches: float, points: float) -> int:
    """Label every k-th of n cells spread over `inches` so that labels `points` high do not
    overlap (k = 1 while every label fits)."""
    return max(1, math.ceil(n * points * 1.3 / 72 / max(inches, 1e-6)))


def _ticks(set_ticks, labels: list[str], step: int, **kwargs) -> None:
    """Tick every `step`-th cell with its own label (set_ticks: an axis's set_xticks/set_yticks)."""
    set_ticks(range(0, len(labels), step), labels[::step], **PLAIN, **kwargs)


def _visible(label: str) -> str:
    """A blank token label drawn as open boxes, so a plot shows that a space is there."""
    return label if label.strip() else label.replace(" ", "\u2423")


def _label_axes(ax, labels: list[str], fontsize: float, step: int, *, xlabel: bool, ylabel: bool) -> None:
    _ticks(ax.set_xticks, labels, step, rotation=90, fontsize=fontsize)
    _ticks(ax.set_yticks, labels, step, fontsize=fontsize)
    if xlabel:
        ax.set_xlabel("key (attended to)", fontsize=fontsize + 1)
    if ylabel:
        ax.set_ylabel("query", fontsize=fontsize + 1)


def plot_attention(probs: torch.Tensor, labels: list[str], path, *, title: str, heads: list[int] | None = None) -> None:
    """Write a PNG heatmap of attention probabilities: (T, T) for one head, or (nh, T, T) as a grid.

    Token strings label both axes (rows: queries, columns: keys); `heads` names the grid's panels.
    """
    plt = _pyplot()
    probs = probs.float().cpu()
    grid = probs if probs.dim() == 3 else probs[None]  # (n, T, T)
    n, T = grid.size(0), grid.size(-1)
    heads = heads if heads is not None else list(range(n))
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    side = min(max(3.0, 0.25 * T + 1.2), (MAX_SQUARE_INCHES - 1.5) / cols)  # a panel's
    fig, axes = plt.subplots(
        rows, cols, figsize=(cols * side + 1.5, rows * side + 0.6), squeeze=False, layout="constrained"
    )
    labels = [_visible(label) for label in labels]
    fontsize = max(5.0, min(10.0, 200 / max(T, 1)))
    step = _every(T, side - 1.2, fontsize)
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        image = ax.imshow(grid[k].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        _label_axes(ax, labels, fontsize, step, xlabel=k // cols == rows - 1 or k + cols >= n, ylabel=k % cols == 0)
        if n > 1:
            ax.set_title(f"head {heads[k]}", fontsize=fontsize + 2)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="attention probability")
    fig.suptitle(title, **PLAIN)
    _save_figure(fig, path)
    plt.close(fig)


def plot_logit_lens(lens: dict, tokenizer: Tokenizer, path, *, title: str) -> None:
    """Write a PNG of the logit lens: layers by positions, colour = top-1 probability, text = top-1 token."""
    plt = _pyplot()
    probs = torch.tensor(lens["top_probs"])[..., 0]  # (layers, T)
    ids = [[row[0] for row in layer] for layer in lens["top_ids"]]
    L, T = probs.shape
    width = min(max(4.0, 0.9 * T + 2), MAX_WIDE_INCHES)
    fig, ax = plt.subplots(figsize=(width, max(3.0, 0.4 * L + 1.5)), layout="constrained")
    image = ax.imshow(probs.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    cell_text = (width - 2) / T >= 0.5  # room for a token in each cell (past ~300 positions, colour alone)
    for layer in range(L if cell_text else 0):
        for pos in range(T):
            color = "white" if probs[layer, pos] > 0.6 else "black"
            ax.text(
                pos,
                layer,
                token_label(tokenizer, ids[layer][pos])[:10],
                ha="center",
                va="center",
                fontsize=7,
                color=color,
                **PLAIN,
            )
    inputs = [_visible(token_label(tokenizer, i)) for i in lens["input_ids"]]
    _ticks(ax.set_xticks, inputs, _every(T, width - 2, 8), rotation=90, fontsize=8)
    ax.set_yticks(range(L), lens["layers"], fontsize=8)
    ax.set_xlabel("input token (prediction is for the next position)")
    fig.colorbar(image, ax=ax, label="top-1 probability")
    ax.set_title(title, **PLAIN)
    _save_figure(fig, path)
    plt.close(fig)


def plot_patching(patched: torch.Tensor, attribution: torch.Tensor, columns: list[str], path, *, title: str) -> None:
    """Write a PNG of two grids side by side, (layers, columns) each: activation patching and
    attribution patching's estimate of it, on one colour scale (0 corrupted, 1 clean)."""
    plt = _pyplot()
    L, U = patched.shape
    width = min(max(4.0, 0.6 * U + 2), MAX_WIDE_INCHES / 2)  # each grid's
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, max(3.0, 0.4 * L + 1.5)), layout="constrained")
    limit = max(float(patched.abs().max()), float(attribution.abs().max()), 1e-6)
    for ax, grid, name in zip(
        axes, (patched, attribution), ("activation patching", "attribution patching"), strict=True
    ):
        image = ax.imshow(
            grid.float().cpu().numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto", origin="lower"
        )
        _ticks(ax.set_xticks, [_visible(c) for c in columns], _every(U, width - 2, 8), rotation=90, fontsize=8)
        ax.set_yticks(range(L), [str(i) for i in range(L)], fontsize=8)
        ax.set_ylabel("layer")
        ax.set_title(name)
    fig.colorbar(image, ax=list(axes), label="share of the clean-corrupted difference restored")
    fig.suptitle(title, **PLAIN)
    _save_figure(fig, path)
    plt.close(fig)
