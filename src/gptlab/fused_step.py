"""One decoding step of a whole GPT in one C call (gl_decode_step in csrc/kernels.c).

With gptlab's kernels, the matrix products of a decoding step are fast enough that PyTorch's
other ~400 small operations and Python module calls per token cost as much as they do (1.7 of
4.3 ms per token for an int4 GPT-2 on a 2-core Xeon). `GPT.forward` therefore hands a forward over
the KV cache of up to `kernels.MAX_ROWS` new tokens in all (a decoding step of up to 8 rows, a
speculative verification, a short prompt; an int4 model's decoding steps of up to `INT_STEP_ROWS`
rows, an int8 one's too without AVX-512 VNNI, an fp32 or bf16 one's of up to `FLOAT_STEP_ROWS`;
inference, CPU) to `step`, which runs the blocks, the final norm and the head in C, computing what
the modules compute op by op, with the same linear kernels, for every variant (learned or rotary
positions, LayerNorm/RMSNorm, GELU/SwiGLU, biases or not). Whatever it does not cover runs the
modules as before: forward hooks on any module, autograd, training with dropout, torch.compile,
fp16, heads wider than 256, a layer without a C kernel, `kernels.use_kernels(False)`.

The model is described to C once (`Plan`: pointers to the model's own tensors, no copies, a few
KiB) and described again whenever a module, parameter or buffer it read was replaced; updates in
place (training between two generations) are read as they happen. That check runs at every
forward of several tokens (a prompt, rows joining a batch) and at slot 0; the one-token steps
after it over the same cache trust it (it costs ~0.4 ms per step of an int4 GPT-2, right after
the C step has streamed the weights through the caches: ~4% of it), checking only for hooks. So
a module swapped in the middle of a generation is seen from the next prompt on; the plan keeps
what it points at alive meanwhile. Those steps need not pass through the model's forward at all:
`decode` (gptlab.generation.decode_step's first try) hands them to C directly. The KV cache's
pointers are passed with each call, looked up again whenever the cache's (k, v) pairs change, so
threads may decode with one model and their own caches at once.
"""

from __future__ import annotations

import ctypes
import operator
import weakref

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from gptlab import gemm, kernels, linear, ops

_P, _I = ctypes.c_void_p, ctypes.c_int
F32, BF16, I8, I4 = 0, 1, 2, 3  # gl_linear_t.kind
_NORMS = {"layernorm": 0, "rmsnorm": 1}
_MLPS = {"gelu": 0, "gelu_erf": 1, "swiglu": 2}


class _Linear(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("kind", "N", "K", "g", "bias_bf16")),
        *((name, _P) for name in "wab"),
        ("bias", _P),
    ]


class _Block(ctypes.Structure):
    _fields_ = [
        *((name, _P) for name in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")),
        *((name, _Linear) for name in ("attn", "attn_proj", "fc", "mlp_proj")),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _I) for name in ("n_layer", "n_embd", "n_head", "hidden", "norm", "mlp", "bf16")),
        ("eps", ctypes.c_float),
        ("blocks", ctypes.POINTER(_Block)),
        ("lnf_w", _P),
        ("lnf_b", _P),
        ("head", _Linear),
        ("wte", _Linear),
        ("wpe", _P),
        ("n_pos", _I),
    ]


class Unsupported(Exception):
    """The model has something gl_decode_step does not run (the modules run it instead)."""


class Plan:
    """A model described to gl_decode_step: C structs pointing at the model's own tensors (no
    copies, so updates in place are read as they happen) and what the description read, so
    `current` can tell whether it still holds.

    Every module, parameter and buffer the plan read is recorded as (the dict it was found in,
    its name, the object): a swapped module or a reassigned parameter shows as another object
    there; every tensor read with its data pointer: `.data` reassigned shows as another pointer.
    Checking all of it costs ~50 us for GPT-2 small, ~0.4 ms with cold caches."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        config = model.config
        if dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported(f"{dtype} activations (the C step runs fp32 and bf16)")
        if config.head_size > kernels.MAX_HEAD_SIZE:
            raise Unsupported(f"head size {config.head_size} > {kernels.MAX_HEAD_SIZE}")
        self.dtype, self.slots, self.tensors = dtype, [], []
        # Hooks on any module would not run here: every module's hook dicts, checked at each step.
        self.hooks = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.hooks += [nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks]
        self.no_hooks_at = None  # torch's count of hook registrations when `hooked` last found none
        t = self._get(model, "transformer")
        C, H = config.n_embd, config.mlp_hidden
        fc_out = 2 * H if config.mlp == "swiglu" else H
        self.blocks = (_Block * config.n_layer)()
        for i, b in enumerate(self.blocks):
            block = self._get(self._get(t, "h"), str(i))
            attn, mlp = self._get(block, "attn"), self._get(block, "mlp")
            b.ln1_w, b.ln1_b = self._norm(self._get(block, "ln_1"))
            b.ln2_w, b.ln2_b = self._norm(self._get(block, "ln_2"))
            b.attn, b.attn_proj = self._linear(self._get(attn, "c_attn")), self._linear(self._get(attn, "c_proj"))
            b.fc, b.mlp_proj = self._linear(self._get(mlp, "c_fc")), self._linear(self._get(mlp, "c_proj"))
            shapes = [(b.attn, 3 * C, C), (b.attn_proj, C, C), (b.fc, fc_out, C), (b.mlp_proj, C, H)]
            if any((layer.N, layer.K) != (n, k) for layer, n, k in shapes):
                raise Unsupported("linear layers whose shapes are not the config's")  # C sizes its buffers by it
        lnf_w, lnf_b = self._norm(self._get(t, "ln_f"))
        self.struct = _Model(
            n_layer=config.n_layer, n_embd=config.n_embd, n_head=config.n_head, hidden=config.mlp_hidden,
            norm=_NORMS[config.norm], mlp=_MLPS[config.mlp], bf16=int(dtype is torch.bfloat16),
            eps=config.layer_norm_eps, blocks=self.blocks, lnf_w=lnf_w, lnf_b=lnf_b,
            head=self._linear(self._get(model, "lm_head")), wte=self._embedding(self._get(t, "wte"), config),
            wpe=self._positions(self._get(t, "wpe"), config), n_pos=config.block_size,
        )  # fmt: skip
        self.key = self._key()
        self.slot_columns = tuple(zip(*self.slots, strict=True))  # (dicts, names, objects): `current` maps over them

    def _get(self, module: nn.Module, name: str):
        """module's parameter, buffer, submodule or attribute `name`, recorded as read."""
        for where in (module._parameters, module._buffers, module._modules, module.__dict__):
            if name in where:
                value = where[name]
                self.slots.append((where, name, value))
                if isinstance(value, torch.Tensor):
                    self.tensors.append(value)
                return value
        self.slots.append((module.__dict__, name, None))
        return None

    def _key(self) -> list[int]:
        return list(map(torch.Tensor.data_ptr, self.tensors))

    def hooked(self) -> bool:
        """Whether a forward hook is registered on any of the model's modules (or globally). Every
        registration through torch's API takes a number from RemovableHandle.next_id, so while that
        count stands where a check found none, none was added and the ~150 dicts are not read again
        (~20 us a step, right after the C step has streamed the weights through the caches)."""
        registered = getattr(RemovableHandle, "next_id", None)
        if registered is not None and registered == self.no_hooks_at:
            return False
        hooked = any(self.hooks)
        self.no_hooks_at = None if hooked else registered
        return hooked

    def current(self) -> bool:
        """Whether everything the plan read is still what it read (see the class docstring)."""
        wheres, names, values = self.slot_columns
        return all(map(operator.is_, map(dict.get, wheres, names), values)) and self._key() == self.key

    def _pointer(self, t: torch.Tensor | None, dtype: torch.dtype) -> int | None:
        """t's data pointer (None for None); t must be contiguous and of `dtype`."""
        if t is None:
            return None
        if t.dtype is not dtype or not t.is_contiguous():
            raise Unsupported(f"a {t.dtype} parameter in a {self.dtype} model")
        return t.data_ptr()

    def _norm(self, norm: nn.Module) -> tuple[int, int | None]:
        plain = type(norm) in (nn.LayerNorm, nn.RMSNorm) or getattr(norm, "plain_when_unhooked", False)
        if not (plain and isinstance(norm, (nn.LayerNorm, nn.RMSNorm))):  # the model's own: unhooked here
            raise Unsupported(f"norm {type(norm).__name__}")
        weight = self._get(norm, "weight")
        if weight is None:
            raise Unsupported("a norm without a gain")
        bias = self._get(norm, "bias") if isinstance(norm, nn.LayerNorm) else None
        return self._pointer(weight, self.dtype), self._pointer(bias, self.dtype)

    def _linear(self, layer: nn.Module) -> _Linear:
        if isinstance(layer, nn.Linear):
            w = self._get(layer, "weight")
            if w.dtype is not self.dtype or not w.is_contiguous():
                raise Unsupported(f"a {w.dtype} linear layer in a {self.dtype} model")
            bf16 = int(w.dtype is torch.bfloat16)
            bias = self._pointer(self._get(layer, "bias"), w.dtype)
            return _Linear(BF16 if bf16 else F32, w.size(0), w.size(1), 0, bf16, kernels.stream(w), None, None, bias)
        decode = self._get(layer, "_decode")
        if decode is None or self._get(layer, "use_kernel") is not True:
            raise Unsupported(f"{type(layer).__name__} without gptlab's decoding kernel")
        kind, N, K, g, tensors = decode.layer  # see ops.int8_decoder / int4_decoder
        w, a, b, bias = tensors
        self.tensors += [t for t in tensors if t is not None]  # kept alive and checked, as the rest
        ptrs = kernels.stream(w), a.data_ptr(), b.data_ptr(), kernels.ptr(bias)
        return _Linear({"i8": I8, "i4": I4}[kind], N, K, g, 0, *ptrs)  # an fp32 bias (ops._decoder)

    def _embedding(self, wte: nn.Module, config) -> _Linear:
        """The token embedding as C reads it: an nn.Embedding's table, or the quantized head a
        QuantizedEmbedding reads its rows from (gptlab.quantize), described as a layer (V, C)."""
        if type(wte) is nn.Embedding and wte.max_norm is None:
            w = self._get(wte, "weight")
            table = _Linear(BF16 if self.dtype is torch.bfloat16 else F32, *w.shape, 0, 0, self._pointer(w, self.dtype))
        elif (head := self._get(wte, "head")) is not None and self._get(wte, "dtype") is self.dtype:
            table = self._linear(head)
        else:
            raise Unsupported(f"token embedding {type(wte).__name__}")
        if (table.N, table.K) != (config.vocab_size, config.n_embd):
            raise Unsupported("a token embedding whose shape is not the config's")
        return table

    def _positions(self, wpe: nn.Module | None, config) -> int | None:
        """The learned position table's pointer (None for rotary positions)."""
        if config.pos_embedding != "learned":
            return None
        if type(wpe) is not nn.Embedding or wpe.max_norm is not None:
            raise Unsupported(f"position embedding {type(wpe).__name__}")
        w = self._get(wpe, "weight")
        if tuple(w.shape) != (config.block_size, config.n_embd):
            raise Unsupported("a position embedding whose shape is not the config's")
        return self._pointer(w, self.dtype)

    def cache_pointers(self, cache):
        """(pointers, kv_bf16): layer l's key and value caches' data pointers at 2l and 2l + 1, for
        this cache only (so threads decoding with one model and their own caches never share them),
        and whether the caches are bf16 (a bf16 model's, or a quantized fp32 model's); None when a
        cache tensor is not contiguous, or neither in the activations' dtype nor bf16. Remembered
        on the cache while its `layers` hold the same (k, v) pairs, whose tensors keep their storage
        (checking each costs ~20 us a step with cold caches)."""
        layers = cache.layers
        known = getattr(cache, "c_pointers", None)  # (dtype, the (k, v) pairs, (pointers, kv_bf16))
        if known is not None and known[0] is self.dtype and len(known[1]) == len(layers):
            if all(map(operator.is_, known[1], layers)):
                return known[2]
        tensors = [t for kv in layers for t in kv]
        kv_dtype = tensors[0].dtype if tensors else self.dtype
        if kv_dtype not in (self.dtype, torch.bfloat16):
            return None
        if any(t.dtype is not kv_dtype or not t.is_contiguous() for t in tensors):
            return None
        pointers = (_P * len(tensors))(*map(torch.Tensor.data_ptr, tensors))
        found = pointers, int(kv_dtype is torch.bfloat16)
        cache.c_pointers = (self.dtype, tuple(layers), found)
        return found


class NoPlan:
    """Why a model has no plan, remembered while its modules stay the same (checking costs ~100 us,
    little next to the module path's step)."""

    def __init__(self, model, dtype, why: str):
        self.dtype, self.why, self.key = dtype, why, _module_ids(model)

    def current(self, model) -> bool:
        return _module_ids(model) == self.key


def _module_ids(model) -> tuple:
    return tuple(id(m) for m in model.modules())


_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Plan | NoPlan (no reference back)


def plan(model, dtype: torch.dtype) -> Plan | NoPlan:
    """The model's plan for activations of `dtype`, built again when what it read has changed."""
    cached = _plans.get(model)
    if isinstance(cached, Plan) and cached.dtype is dtype and cached.current():
        return cached
    if isinstance(cached, NoPlan) and cached.dtype is dtype and cached.current(model):
        return cached
    try:
        cached = Plan(model, dtype)
    except Unsupported as e:
        cached = NoPlan(model, dtype, str(e))
    _plans[model] = cached
    return cached


# An int4 model's one-token decoding steps run in C up to this many rows, not MAX_ROWS: its kernel
# takes any number of rows (quantized_i4.c), as in the modules, so C saves their Python and PyTorch
# overhead at every batch size. GPT-2 int4 batches decoding 16 tokens, fused against the modules
# alternating (AMD EPYC Zen 4, 2 threads, 2026-12-05, medians of 4): avx512-256 at 9 / 16 / 24 /
# 32 / 64 rows 1.21 / 1.15 / 1.09 / 1.08 / 1.03x, avx2 1.20 / 1.13 / 1.02 (32) / 1.03 (64),
# avx512 1.21 / 1.09 / 1.07 (32). An int8 model's steps too, where its modules run gptlab's int8
# kernel at every row count (a CPU without AVX-512 VNNI, where fbgemm's would saturate: the Zen 3):
# GPT-2 int8 so (fbgemm_int8_is_exact patched false, avx2, same machine, 32 tokens, medians of 5)
# at 9 / 16 / 32 / 64 rows 1.20 / 1.09 / 1.07 / 1.03x. With VNNI, an int8 model keeps MAX_ROWS: from
# 12 rows its modules multiply in fbgemm, faster than gl_linear_i8 (fused 0.96x at 12 rows, 0.83x
# at 16, 0.77x at 32).
INT_STEP_ROWS = 64

# An fp32 or bf16 model's one-token decoding steps run in C up to this many rows where the modules
# would multiply those rows with gptlab's own kernels too (gemm.prompt_gemm_choice() gives
# gptlab: the float kernel, then gl_sgemm_nt for fp32, from the same row counts in C's linear.c),
# so C computes what they do without their Python and PyTorch overhead. bf16 stops where the
# modules' bf16 layers leave the float kernel. GPT-2 batches decoding 32 tokens, fused against the
# modules (AMD EPYC Zen 4, 2 threads, 2026-12-05, medians of 5 alternating rounds), 9 / 12 / 16
# rows: avx512-256 fp32 1.19 / 1.15 / 1.24x, bf16 1.16 / 1.12 / 1.13x; avx2 fp32 1.21 / - / 1.18x;
# avx512 fp32 1.11 / - / 1.17x, bf16 1.15 / - / 1.16x; fp32 at 24 / 32 / 64 rows: avx512-256 1.12 /
# 1.14 / 1.05x, avx2 1.12 / - / 1.06x, avx512 1.10 / 1.05 / 1.05x (17 rows 1.10x). Where MKL won an
# Intel CPU's probe, the modules keep those rows.
FLOAT_STEP_ROWS = {torch.float32: INT_STEP_ROWS, torch.bfloat16: linear.KERNEL_ROWS_GPTLAB}


def _rows_fit(model, idx: torch.Tensor) -> bool:
    rows = idx.numel()
    if rows <= kernels.MAX_ROWS:
        return True
    if idx.dim() == 2 and idx.size(-1) != 1:  # a prompt: the modules (their last layer runs its last position only)
        return False
    mode = (getattr(model, "quantization", None) or {}).get("mode")
    if mode == "int4" or (mode == "int8" and not ops.fbgemm_int8_is_exact()):
        return rows <= INT_STEP_ROWS
    return (
        mode is None
        and rows <= FLOAT_STEP_ROWS.get(model.transformer.wte.weight.dtype, 0)
        and gemm.prompt_gemm_choice(rows) == "gptlab"
    )


def applies(model, idx: torch.Tensor, cache) -> bool:
    """Whether `step` may take this forward: up to MAX_ROWS new tokens in all (one decoding step
    of a batch, a speculative verification, a short prompt), or a decoding step of up to
    INT_STEP_ROWS rows of an int4 model (or an int8 one without VNNI), FLOAT_STEP_ROWS of an fp32
    or bf16 one where gptlab's GEMM runs prompts, over a KV cache at an int position, inference on
    the CPU with gptlab's kernels, no dropout in play."""
    return (
        _rows_fit(model, idx)
        and isinstance(cache.pos, int)
        and idx.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not (model.training and model.config.dropout > 0)
        and kernels.available()[0]
    )


def decode(model, tokens: torch.Tensor, positions, cache, key_mask) -> torch.Tensor | None:
    """Logits (B, V) of a decoding step, tokens (B,) at slot cache.pos (not advanced), taken before
    the model's forward would check and prepare it; None where the modules or `step` must run it,
    or an id or position is out of range (C checks them; the model's forward then raises).

    After the C step has streamed the weights through the caches, the first PyTorch operation of
    each kind, and Python code too, runs from memory: 17-73 us an operation (AMD EPYC Zen 4, 2
    threads; 2-6 us warm). A step through the model's forward so spent ~10% of an int4 GPT-2's
    token around the C call. Taken: the steps after one that `step` ran over this cache (its plan,
    trusted as there), int64 ids (B,), learned positions (B,) int64 or None (the slots'), a bool
    key_mask (B, S > slot) or None, room in the cache, and what `applies` asks."""
    p, pos = getattr(cache, "checked_plan", None), cache.pos
    if not (type(pos) is int and 0 < pos < cache.max_len and isinstance(p, Plan) and _plans.get(model) is p):
        return None  # (compiled decoding's position is a 0-dim tensor)
    if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 1 and tokens.dtype is torch.int64):
        return None
    B = tokens.size(0)
    if not (
        model.config.pos_embedding == "learned"
        and (positions is None or (positions.dtype is torch.int64 and positions.shape == tokens.shape))
        and (key_mask is None or (key_mask.dtype is torch.bool and key_mask.shape[0] == B and key_mask.size(1) > pos))
        and applies(model, tokens, cache)
        and not p.hooked()
    ):
        return None
    return _run(p, cache, tokens, positions, B, 1, key_mask, None, torch.empty(B, p.struct.head.N), False)


def step(model, idx: torch.Tensor, positions, dtype: torch.dtype, rope, cache, key_mask, last_only: bool):
    """Logits (B, T, V), or (B, 1, V) when last_only, for new tokens idx (B, T) at `positions`
    (B, T) in activations of `dtype` (rotary models: their angles in rope, (cos, sin), each
    (B, 1, T, hs/2), as the model computes them; ids and positions checked by the model), their
    keys and values written to slots cache.pos... (not advanced); key_mask (B, S) False at slots a
    row may not see, or None. None when the modules must run it."""
    (B, T), pos = idx.shape, cache.pos
    p = getattr(cache, "checked_plan", None)  # checked at this cache's last prompt (see the module's docstring)
    if not (T == 1 and pos > 0 and p is not None and p.dtype is dtype and _plans.get(model) is p):
        p = cache.checked_plan = plan(model, dtype)
    if isinstance(p, NoPlan) or p.hooked():
        return None
    angles = None if rope is None else torch.cat(rope, dim=-1).float().contiguous()  # (B, 1, T, hs): cos, sin
    logits = torch.empty(B, 1 if last_only else T, model.lm_head.out_features)  # (B, T|1, V)
    return _run(p, cache, idx, positions, B, T, key_mask, angles, logits, not last_only)


def _run(p: Plan, cache, idx, positions, B: int, T: int, key_mask, angles, logits: torch.Tensor, all_logits: bool):
    """gl_decode_step for `step` and `decode`: logits as allocated, fp32 (B, T, V) with
    all_logits, else one row per sequence, filled and returned in the plan's dtype; None where C
    cannot run it (a cache it cannot read, a layer it does not know, an id or position out of range)."""
    found = p.cache_pointers(cache)
    if found is None:
        return None
    kv, kv_bf16 = found
    pos = cache.pos
    tokens, positions = _int64(idx), None if positions is None else _int64(positions)  # (B, T)
    mask = None if key_mask is None else key_mask[:, : pos + T].contiguous()  # (B, pos + T)
    status = kernels.library().gl_decode_step(
        ctypes.byref(p.struct), kv, kv_bf16, tokens.data_ptr(), kernels.ptr(positions), B, T, pos,
        cache.layers[0][0].size(2), kernels.ptr(mask), kernels.ptr(angles), logits.data_ptr(), int(all_logits),
        torch.get_num_threads(),
    )  # fmt: skip
    if status in (-2, -3):  # a layer C does not know; an id or position out of range
        return None
    kernels.check(status)
    return logits if p.dtype is torch.float32 else logits.to(p.dtype)


def _int64(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int64, without an operation where it is already (see `decode`)."""
    return t if t.dtype is torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
