"""The GPT-2 model, read top to bottom in the order data flows:
norm -> rotary helpers -> attention -> MLP -> block -> GPT.

Module and parameter names follow OpenAI's GPT-2 (transformer.wte/wpe/h/ln_f, attn.c_attn/c_proj,
mlp.c_fc/c_proj, lm_head), so Hugging Face conversion is a name table plus transposes (hf.py).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab import fused_step, hooks, ops
from gptlab.chunked_loss import linear_cross_entropy
from gptlab.config import GPTConfig
from gptlab.data import IGNORE
from gptlab.hooks import HookPoint
from gptlab.kv_cache import write_kv
from gptlab.linear import Linear
from gptlab.meta import meta_device


class _HookedNorm:
    """A norm with TransformerLens's hook points: hook_scale (B, T, 1), the divisor, and
    hook_normalized (B, T, C), before the gain. Unhooked, it is the torch norm it extends (so
    gptlab.fused_step may run it in C); hooked, it is computed step by step (`_stepwise`)."""

    plain_when_unhooked = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hook_scale, self.hook_normalized = HookPoint(), HookPoint()

    @property
    def hooked(self) -> bool:
        return self.hook_scale.active or self.hook_normalized.active

    def forward(self, x):
        return self._stepwise(x) if self.hooked else super().forward(x)


class LayerNorm(_HookedNorm, nn.LayerNorm):
    def _stepwise(self, x):
        centred = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # (B, T, 1)
        x = self.hook_normalized(centred / scale)  # (B, T, C)
        return x * self.weight + self.bias if self.bias is not None else x * self.weight


class RMSNorm(_HookedNorm, nn.RMSNorm):
    def _stepwise(self, x):
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # (B, T, 1): the RMS
        return self.hook_normalized(x / scale) * self.weight


def make_norm(config: GPTConfig) -> nn.Module:
    """LayerNorm (GPT-2) or RMSNorm (Zhang & Sennrich 2019), as the config asks."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, eps=config.layer_norm_eps)
    return LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)


def rope_cos_sin(positions: torch.Tensor, head_size: int, theta: float, dtype: torch.dtype):
    """Rotary angles for integer positions (B, T) -> cos, sin each (B, 1, T, head_size/2)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size
    )  # (hs/2,)
    angles = positions.float()[:, None, :, None] * inv_freq  # (B, 1, T, hs/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+hs/2}) of x (B, nh, T, hs) by the angles (GPT-NeoX/Llama layout)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def explicit_attention(q, k, v, mask, hook_scores=None, hook_pattern=None):
    """softmax(q k^T / sqrt(hs) + mask) v, spelled out; also returns the probabilities.

    q (B, nh, T, hs), k and v (B, nh, S, hs), mask bool broadcastable to (B, nh, T, S). The
    masked scores and the probabilities pass through the hook points when given.
    """
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, T, S)
    att = att.masked_fill(~mask, float("-inf"))
    if hook_scores is not None:
        att = hook_scores(att)
    probs = F.softmax(att, dim=-1)
    if hook_pattern is not None:
        probs = hook_pattern(probs)
    return probs @ v, probs  # (B, nh, T, hs), (B, nh, T, S)


def attention(q, k, v, mask, dropout_p: float) -> torch.Tensor:
    """F.scaled_dot_product_attention over q (B, nh, T, hs), k and v (B, nh, S, hs): causal when mask
    is None (and T > 1), else the bool mask (B|1, 1, T, S). Where it trains in bf16 on a CPU it runs
    in fp32 (the bf16 inputs convert exactly, the output is rounded back): PyTorch's CPU flash
    attention computes its bf16 backward 2.3x slower than fp32's (AMD EPYC Zen 4, the demo's
    B8 x T128 x 4 heads of 32: 6.0 against 2.6 ms). CPU autocast would cast fp32 inputs back to
    bf16, so it is off for the call."""
    dtype = q.dtype
    upcast = dtype == torch.bfloat16 and q.device.type == "cpu" and q.requires_grad
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    with torch.autocast("cpu", enabled=False) if upcast else nullcontext():
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and q.size(2) > 1, dropout_p=dropout_p
        )  # (B, nh, T, hs)
    return y.to(dtype)


def single_query_attention(q, k, v, mask):
    """Attention for one query per row (decoding) by elementwise products and sums.

    q (B, nh, 1, hs), k and v (B, nh, S, hs), mask bool (B|1, 1, 1, S) or None. The scores and
    softmax are fp32. Decoding in bf16 on CPU goes this way: SDPA's flash kernel takes ~45 us per
    layer at 64 keys but ~550 at 900 here (GPT-2 small's 12 heads), where this path takes ~150,
    so bf16 decoding at a 900-token context runs at 92 instead of 70 tok/s.
    """
    scores = (k * q).sum(-1, dtype=torch.float32) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, S)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, 0], float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)  # (B, nh, S)
    return (probs.unsqueeze(-1) * v).sum(-2, keepdim=True)  # (B, nh, 1, hs)


def causal_mask(T: int, S: int, device) -> torch.Tensor:
    """(T, S) bool: query i, at absolute position S - T + i, sees keys 0..S - T + i."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


def _segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) ids of packed examples -> (B, T) bool, True where a run of equal ids (an example) begins."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return starts


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) ids of packed examples -> each token's position inside its example, (B, T)."""
    T = segments.size(1)
    t = torch.arange(T, device=segments.device).expand_as(segments)  # (B, T)
    return t - torch.cummax(torch.where(_segment_starts(segments), t, 0), dim=1).values


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) ids of packed examples -> (B, 1, T, T) bool: causal, and only within the query's own
    run of equal ids (a later run that reuses an id is another example)."""
    runs = _segment_starts(segments).cumsum(dim=1)  # (B, T) each token's run number
    T = segments.size(1)
    return causal_mask(T, T, segments.device) & (runs[:, None, :, None] == runs[:, None, None, :])


def _extremes(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of an integer tensor's values: a decoding step's few ids through one tolist (a
    min and a max cost two reductions and two syncs, ~20 us a step right after the C step has
    streamed the weights through the caches)."""
    if 0 < t.numel() <= 64:
        values = t.reshape(-1).tolist()
        return min(values), max(values)
    return int(t.min()), int(t.max())


def _batch_positions(positions: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """positions (B, T), or one row (1, T) or (T,) for every row, as (B, T); else a ValueError (the
    C step reads B*T of them)."""
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype is torch.bool:
        raise ValueError(f"positions must be integer position ids, got {_describe(positions)}")
    if tuple(positions.shape) not in ((B, T), (1, T), (T,)):
        raise ValueError(f"positions must be (B, T) = {(B, T)} or one row (1, T), got {tuple(positions.shape)}")
    return positions.expand(B, T)


def _batch_key_mask(key_mask: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """key_mask (B, S') or one row (1, S') for every row, S' >= S slots, as (B, S'); else a
    ValueError (the C step reads B rows of S bools)."""
    if not (
        isinstance(key_mask, torch.Tensor)
        and key_mask.dtype is torch.bool
        and key_mask.dim() == 2
        and key_mask.size(0) in (1, B)
        and key_mask.size(1) >= S
    ):
        shape = tuple(key_mask.shape) if isinstance(key_mask, torch.Tensor) else ""
        raise ValueError(
            f"key_mask must be a bool (B, S) tensor with S >= {S} (B = {B}, or 1 for every row), "
            f"got {_describe(key_mask)} {shape}"
        )
    return key_mask.expand(B, -1)


def _rows_dtype(wte: nn.Module) -> torch.dtype:
    """The dtype of the rows a token embedding gives: an nn.Embedding's weight's, or the `dtype`
    of one that reads its rows elsewhere (gptlab.quantize.QuantizedEmbedding)."""
    if type(wte) is nn.Embedding:
        return wte.weight.dtype
    return getattr(wte, "dtype", None) or wte.weight.dtype


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # fused q, k, v
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        rotary = ("rot_q", "rot_k") if config.pos_embedding == "rope" else ()  # only points that run
        for name in ("q", "k", "v", *rotary, "attn_scores", "pattern", "z"):
            setattr(self, f"hook_{name}", HookPoint())  # gptlab.hooks: TransformerLens's names

    def hooked(self) -> bool:
        """Whether a hook is registered on one of this layer's hook points (gptlab.hooks)."""
        return any(m._forward_hooks for m in self.children() if isinstance(m, HookPoint))

    def forward(self, x, rope=None, kv=None, cache_pos=0, mask=None, probs_out=None, last_only=False):
        """x (B, T, C) -> (B, T, C), or (B, 1, C) for the last query only when last_only (every
        position's keys and values still reach the cache).

        rope: (cos, sin) or None; kv: this layer's (k, v) cache buffers or None; mask: bool
        (B|1, 1, T, S) or None for plain causal attention; probs_out: a list to append the
        attention probabilities to, which selects the explicit path.
        """
        B, T, C = x.size()
        qkv = self.c_attn(x)  # (B, T, 3C)
        one_step = rope is None and kv is not None and probs_out is None and not self.hooked()
        if one_step and ops.decode_attention_applies(qkv, kv, cache_pos):
            y = ops.decode_attention(qkv, kv, cache_pos, mask, self.n_head)  # (B, 1, C): one step, in C
            return self.resid_dropout(self.c_proj(y))
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs) for t in qkv.split(self.n_embd, dim=2))  # (B, T, nh, hs)
        q, k, v = self.hook_q(q).transpose(1, 2), self.hook_k(k).transpose(1, 2), self.hook_v(v).transpose(1, 2)
        if rope is not None:  # (B, nh, T, hs); the rotated ones hooked as (B, T, nh, hs)
            q = self.hook_rot_q(apply_rope(q, *rope).transpose(1, 2)).transpose(1, 2)
            k = self.hook_rot_k(apply_rope(k, *rope).transpose(1, 2)).transpose(1, 2)
        if kv is not None:
            k, v = write_kv(kv, cache_pos, k, v)  # (B, nh, S, hs)
        if last_only:  # the last query sees every key: no causal mask left to apply
            q, T = q[:, :, -1:], 1  # (B, nh, 1, hs)
            mask = None if mask is None else mask[:, :, -1:]  # (B|1, 1, 1, S)
        if probs_out is not None or self.hook_attn_scores.active or self.hook_pattern.active:
            if mask is None:
                mask = causal_mask(T, k.size(2), x.device)
            y, probs = explicit_attention(q, k, v, mask, self.hook_attn_scores, self.hook_pattern)
            if probs_out is not None:
                probs_out.append(probs)
        elif T == 1 and q.dtype != torch.float32 and q.device.type == "cpu":
            y = single_query_attention(q, k, v, mask)  # (B, nh, 1, hs)
        elif ops.prompt_attention_applies(q, k, v, mask, self.dropout if self.training else 0.0):
            y = ops.prompt_attention(q, k, v)  # (B, nh, T, hs): a prompt's causal attention in C
        else:
            y = attention(q, k, v, mask, self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = self.hook_z(y.transpose(1, 2)).contiguous().view(B, T, C)  # (B, T, nh, hs): heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GELU MLP (GPT-2's tanh approximation, or the exact erf GELU for mlp="gelu_erf", as nanoGPT's
    nn.GELU()), or SwiGLU with the gate and up projections fused in c_fc."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        self.gelu_approximate = "none" if config.mlp == "gelu_erf" else "tanh"
        hidden = config.mlp_hidden
        self.c_fc = Linear(config.n_embd, (2 if self.swiglu else 1) * hidden, bias=config.bias)
        self.c_proj = Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()  # (B, T, hidden) before/after the activation
        if self.swiglu:
            self.hook_pre_linear = HookPoint()  # SwiGLU's up projection (hook_pre is its gate)

    def forward(self, x):
        h = self.c_fc(x)  # (B, T, hidden) or (B, T, 2*hidden)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(self.hook_pre(gate)) * self.hook_pre_linear(up)
        else:
            h = self.hook_pre(h)  # c_fc's fresh output: the GELU may overwrite it unless a hook sees it
            h = ops.gelu(h, approximate=self.gelu_approximate, inplace=not self._c_fc_output_seen())
        return self.dropout(self.c_proj(self.hook_post(h)))  # (B, T, C)

    def _c_fc_output_seen(self) -> bool:
        """Whether a hook may hold c_fc's output: hook_pre, or a plain PyTorch forward hook on c_fc
        (or a layer inside it, or every module's), which an in-place GELU would overwrite."""
        if self.hook_pre.active or nn.modules.module._global_forward_hooks:
            return True
        return any(m._forward_hooks for m in self.c_fc.modules())


class Block(nn.Module):
    """Pre-LN Transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)
        for name in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"):
            setattr(self, f"hook_{name}", HookPoint())  # (B, T, C) each

    def forward(self, x, rope=None, kv=None, cache_pos=0, mask=None, probs_out=None, last_only=False):
        """x (B, T, C) -> (B, T, C); last_only: (B, 1, C), the last position's output, the keys and
        values of all T written to kv. The caller checks that no hook would miss a position."""
        x = self.hook_resid_pre(x)
        y = self.attn(self.ln_1(x), rope, kv, cache_pos, mask, probs_out, last_only)  # (B, T|1, C)
        x = self.hook_resid_mid((x[:, -1:] if last_only else x) + self.hook_attn_out(y))
        return self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln_2(x))))

    def hooked(self) -> bool:
        """Whether any forward hook (a HookPoint's or a plain PyTorch one) is set in this block."""
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules())


class GPT(nn.Module):
    """A GPT-2-style decoder-only language model."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.kv_cache_dtype = None  # the KV caches' dtype; None: gptlab.kv_cache.cache_dtype's choice
        modules = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if config.pos_embedding == "learned":
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        modules["drop"] = nn.Dropout(config.dropout)
        modules["h"] = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        modules["ln_f"] = make_norm(config)
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.hook_embed = HookPoint()  # (B, T, C)
        if config.pos_embedding == "learned":  # rotary models add no position embedding
            self.hook_pos_embed = HookPoint()  # (B, T, C)
        self.tie_weights()
        self.apply(self._init_weights)
        # GPT-2 paper: scale the residual projections' init by 1/sqrt(N) for N residual additions.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, device=None, dtype=None) -> GPT:
        """Load GPT-2 weights in the Hugging Face format: a Hub id or a local directory."""
        from gptlab.hf import load_pretrained

        return load_pretrained(name_or_path, device=device, dtype=dtype)

    def save_pretrained(self, directory) -> None:
        """Write the Hugging Face GPT2LMHeadModel layout (config, safetensors, tokenizer files)."""
        from gptlab.hf import save_pretrained

        save_pretrained(self, directory)

    def hook_points(self):
        """{TransformerLens name: HookPoint} (gptlab.hooks)."""
        return hooks.hook_points(self)

    def run_with_cache(self, idx, names_filter=None, stop_at_layer=None, device=None, **forward_kwargs):
        """(logits, {hook name: activation}), as TransformerLens's (gptlab.hooks.run_with_cache)."""
        return hooks.run_with_cache(self, idx, names_filter, stop_at_layer, device, **forward_kwargs)

    def cache_to_file(self, idx, path, names_filter=None, stop_at_layer=None, **forward_kwargs):
        """Logits, with the selected activations streamed to a safetensors file (gptlab.hooks)."""
        return hooks.cache_to_file(self, idx, path, names_filter, stop_at_layer, **forward_kwargs)

    def run_with_hooks(self, idx, fwd_hooks=(), stop_at_layer=None, **forward_kwargs):
        """Logits with (name or predicate, fn(tensor, hook)) hooks for one forward (gptlab.hooks)."""
        return hooks.run_with_hooks(self, idx, fwd_hooks, stop_at_layer, **forward_kwargs)

    def hooks(self, fwd_hooks=()):
        """A context manager holding (name or predicate, fn) hooks (gptlab.hooks.hooks)."""
        return hooks.hooks(self, fwd_hooks)

    def tie_weights(self) -> None:
        """Share lm_head's matrix with the token embedding when the config ties them."""
        if self.config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        idx,
        targets=None,
        *,
        positions=None,
        kv_cache=None,
        key_mask=None,
        segments=None,
        attn_probs=None,
        last_only=False,
        return_logits=True,
        head=True,
    ):
        """Next-token logits (B, T, vocab_size) and, given targets (B, T), the mean cross-entropy.

        Generation passes `kv_cache` (a KVCache; new keys go to slots kv_cache.pos...), per-row
        `positions` (B, T) and `key_mask` (B, S_max) bool, False at padding slots (either may be one
        row, (1, ...), for every row; positions (T,) too; another shape is a ValueError). `segments`
        (B, T) int marks packed examples (gptlab.sft): attention stays inside each run of equal
        ids and positions restart at each run, as if every example had its own row. `attn_probs`,
        a list, collects each layer's attention probabilities through the explicit path.
        `last_only` computes logits for the last position only, (B, 1, vocab_size): the head is a
        third of GPT-2 small's weights, so decoding should not run it for the prompt.
        `return_logits=False` with targets returns (None, loss), computing the head and the loss
        chunk by chunk (faster training, far less memory); the loss is the same.
        `head=False` returns what the head would read instead of logits: the final norm's output
        (B, T, n_embd) (scoring runs the head on the positions it needs, gptlab.chunked_loss).
        """
        self._check_input(idx, targets, kv_cache)
        B, T = idx.shape
        start = kv_cache.pos if kv_cache is not None else 0  # int, or a 0-dim tensor (compiled decoding)
        if segments is not None:
            if kv_cache is not None or positions is not None or segments.shape != idx.shape:
                raise ValueError("segments (B, T) packs examples for a full pass: no kv_cache, no positions")
            positions = segment_positions(segments)  # (B, T)
        elif positions is not None:
            positions = _batch_positions(positions, B, T)  # (B, T)
        if key_mask is not None:
            key_mask = _batch_key_mask(key_mask, B, kv_cache.max_len if isinstance(start, torch.Tensor) else start + T)
        if positions is None:
            positions = (start + torch.arange(T, device=idx.device)).expand(B, T)  # (B, T)
        learned = self.config.pos_embedding == "learned"
        dtype = _rows_dtype(self.transformer.wte)
        rope = None if learned else rope_cos_sin(positions, self.config.head_size, self.config.rope_theta, dtype)
        if learned and not torch.compiler.is_compiling():
            lo, top = _extremes(positions)
            if lo < 0:
                raise ValueError(f"position {lo} is negative")
            if top >= self.config.block_size:
                raise ValueError(f"position {top} exceeds block_size {self.config.block_size}")
        if targets is not None and not head:
            raise ValueError("head=False returns hidden states, not a loss: pass no targets")
        if targets is not None and last_only:
            raise ValueError("last_only computes the last position only: pass no targets")
        fused = head and kv_cache is not None and targets is None and attn_probs is None
        if fused and fused_step.applies(self, idx, kv_cache):
            # (B, T|1, V), embedding included: one C call
            logits = fused_step.step(self, idx, positions, dtype, rope, kv_cache, key_mask, last_only)
            if logits is not None:
                return logits, None
        x = self.hook_embed(self.transformer.wte(idx))  # (B, T, C)
        if learned:
            x = x + self.hook_pos_embed(self.transformer.wpe(positions))  # (B, T, C)
        x = self.transformer.drop(x)
        mask = self._attention_mask(T, start, kv_cache, key_mask, idx.device)
        if segments is not None:  # (B, 1, T, T): causal, and only within the query's own example
            mask = segment_mask(segments)
        last = len(self.transformer.h) - 1
        ln_f = self.transformer.ln_f
        every_position = getattr(ln_f, "hooked", False)  # a hooked final norm sees every position
        for i, block in enumerate(self.transformer.h):
            kv = kv_cache.layers[i] if kv_cache is not None else None
            # A prompt's last layer needs every position's keys and values, but only the last
            # position's output: as llama.cpp's graphs, skip the rest (~6% of GPT-2 small's prefill).
            trim = last_only and i == last and T > 1 and attn_probs is None and not (block.hooked() or every_position)
            x = block(x, rope, kv, start, mask, attn_probs, trim)  # (B, T, C), or (B, 1, C) when trimmed
        if last_only and not every_position:
            x = x[:, -1:]  # (B, 1, C)
        x = ln_f(x)[:, -1:] if last_only else ln_f(x)
        if not head:
            return x, None
        if targets is not None and not return_logits and isinstance(self.lm_head, nn.Linear):
            # Training: head and loss in row chunks, never holding all (B*T, V) logits (chunked_loss.py).
            return None, linear_cross_entropy(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE)
        return logits, loss

    @staticmethod
    def _attention_mask(T, start, kv_cache, key_mask, device):
        """None when plain causal attention (or, for one query, none) is right, else bool (B|1, 1, T, S)."""
        tensor_start = isinstance(start, torch.Tensor)
        if key_mask is None and not tensor_start and (start == 0 or T == 1):
            return None
        S = kv_cache.max_len if tensor_start else start + T
        q_slots = start + torch.arange(T, device=device)  # (T,) the queries' own cache slots
        k_slots = torch.arange(S, device=device)  # (S,)
        mask = (k_slots[None, :] <= q_slots[:, None])[None, None]  # (1, 1, T, S)
        if key_mask is not None:
            mask = mask & key_mask[:, None, None, :S]  # (B, 1, T, S)
            # A padding query sees nothing else; let it see its own slot so softmax stays finite.
            mask = mask | (k_slots[None, :] == q_slots[:, None])
        return mask

    def _check_input(self, idx, targets, kv_cache) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an integer tensor of token ids (B, T), got {_describe(idx)}")
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"idx must have shape (B, T) with T >= 1, got {tuple(idx.shape)}")
        if idx.size(0) == 0:
            raise ValueError(f"idx is an empty batch, shape {tuple(idx.shape)}: give at least one sequence (B >= 1)")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        if torch.compiler.is_compiling():  # value checks need a sync; compiled decoding checks before
            return
        limit = kv_cache.max_len if kv_cache is not None else self.config.block_size
        end = idx.size(1) + (int(kv_cache.pos) if kv_cache is not None else 0)
        if end > limit:
            raise ValueError(f"sequence length {end} exceeds the context length {limit} (block_size)")
        lo, hi = _extremes(idx)
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {self.config.vocab_size})")

    @torch.no_grad()
    def attention(self, idx, layer: int | None = None, head: int | None = None) -> torch.Tensor:
        """Attention probabilities, recomputed through the explicit path.

        Returns (n_layer, B, nh, T, T); with `layer`, (B, nh, T, T); with `head` too, (B, T, T).
        """
        if layer is not None and not -self.config.n_layer <= layer < self.config.n_layer:
            raise ValueError(f"layer {layer} out of range: the model has {self.config.n_layer} layers")
        if head is not None and not -self.config.n_head <= head < self.config.n_head:
            raise ValueError(f"head {head} out of range: the model has {self.config.n_head} heads")
        if head is not None and layer is None:
            raise ValueError("head needs a layer")
        probs: list[torch.Tensor] = []
        self(idx, attn_probs=probs)
        out = torch.stack(probs)  # (L, B, nh, T, T)
        if layer is not None:
            out = out[layer]
            if head is not None:
                out = out[:, head]
        return out

    def _as_built(self) -> GPT:
        """This model, or, when quantized layers stand in for nn.Linear (their weights
        are not parameters), the same architecture built on the meta device, for counting."""
        if not any(hasattr(m, "in_features") and not isinstance(m, nn.Linear) for m in self.modules()):
            return self
        with meta_device():
            return type(self)(self.config)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count, tied weights once; non_embedding drops the position table (nanoGPT).
        Quantized layers count as the nn.Linear they stand for."""
        model = self._as_built()
        n = sum(p.numel() for p in model.parameters())
        if non_embedding and "wpe" in model.transformer:
            n -= model.transformer.wpe.weight.numel()
        return n

    def param_breakdown(self) -> list[dict]:
        """Parameters per component; a tied head counts 0 and says so. Rows sum to num_params()."""
        model = self._as_built()
        if model is not self:
            return model.param_breakdown()
        t = self.transformer

        def count(modules):
            return sum(p.numel() for m in modules for p in m.parameters())

        rows = [dict(component="token embedding (wte)", params=t.wte.weight.numel(), note="")]
        if "wpe" in t:
            rows.append(dict(component="position embedding (wpe)", params=t.wpe.weight.numel(), note=""))
        rows += [
            dict(component="attention (all blocks)", params=count(b.attn for b in t.h), note=""),
            dict(component="MLP (all blocks)", params=count(b.mlp for b in t.h), note=""),
            dict(component="norms in blocks", params=count([*(b.ln_1 for b in t.h), *(b.ln_2 for b in t.h)]), note=""),
            dict(component="final norm (ln_f)", params=count([t.ln_f]), note=""),
        ]
        rows.append(self._head_row())
        return rows

    def _head_row(self) -> dict:
        tied = self.lm_head.weight is self.transformer.wte.weight
        return dict(component="head (lm_head)", params=0 if tied else self.lm_head.weight.numel(),
                    note="tied to wte, counted once" if tied else "")  # fmt: skip


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {x.dtype}"
    return type(x).__name__
