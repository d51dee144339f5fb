"""gptlab's C kernels as functions on tensors: each says when it applies, and runs the kernel.

gptlab.kernels chooses and loads the library for this CPU; this module calls into it:
- the float kernel and the int8/int4 decoders: y = x W^T + b for a few rows of x, each weight row
  read once for all of them (the model's layers choose them in gptlab.linear and gptlab.quantize);
- attention: one decoding step over the KV cache, and a prompt's causal attention;
- the training loss's softmax and cross-entropy, for gptlab.chunked_loss;
- argmax, top-p's nucleus and sampling's draws, for gptlab.sampling;
- the GELU, and an int4 layer dequantized.
Each `..._applies` (or a None result) sends the caller to PyTorch's own kernels otherwise.
"""

from __future__ import annotations

import ctypes
import sys

import torch
import torch.nn.functional as F

from gptlab import kernel_build, kernels
from gptlab.data import IGNORE
from gptlab.kernels import MAX_HEAD_SIZE, MAX_ROWS, check, ptr, stream


def _f32(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias in fp32 (bf16 biases add in fp32, as torch's bf16 linear does); keep it alive over the call."""
    return bias if bias is None or bias.dtype == torch.float32 else bias.float()


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) W (N, K)^T + b through the C kernel, in x's dtype; the caller checked linear.kernel_applies.
    (Every microsecond here is paid ~50 times per token: no reshapes, one allocation.)"""
    N, K = weight.shape
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    lib = kernels.library()
    fn = lib.gl_linear_f32 if x.dtype is torch.float32 else lib.gl_linear_bf16
    b = _f32(bias)
    status = fn(x.data_ptr(), stream(weight), ptr(b), y.data_ptr(), x.numel() // K, N, K,
                torch.get_num_threads())  # fmt: skip
    check(status)
    return y


# Up to this many rows, the int4 kernel beats dequantizing the layer and running the fp32 GEMM:
# measured on an Intel Xeon (avx512), 3072x768 layer, 0.34 vs 1.69 ms at 16 rows, 1.35 vs 2.55 at
# 64, 9.9 vs 6.4 at 256, before prompts put rows of x in the lanes (linear_i4_lanes in
# csrc/quantized_i4.c). The x86 SIMD variants' lanes kernel beats it at any size since (INT4_KERNEL_ROWS_X86);
# this crossover stays for the portable variant (400 ms for 512 rows of GPT-2's four block layers on a
# Zen 5 EPYC, against 37 dequantized) and the NEON ones (not measured).
INT4_KERNEL_ROWS = 128
# GPT-2's four block layers at 512 rows, kernel against dequantize + fp32 GEMM: AMD EPYC Zen 4
# 14.8 ms (avx512-256) and 21.4 (avx2) against ~28; AMD EPYC Zen 5 11.7 ms (avx512) against 39.4.
INT4_KERNEL_ROWS_X86 = sys.maxsize


def int4_kernel_rows() -> int:
    """Up to how many rows of x an int4 layer runs gptlab's kernel (more: dequantize for the GEMM)."""
    x86_simd = kernel_build.VARIANTS.get(kernels.variant() or "", ("",))[0] in ("GL_AVX2", "GL_AVX512")
    return INT4_KERNEL_ROWS_X86 if x86_simd else INT4_KERNEL_ROWS


def fbgemm_int8_is_exact() -> bool:
    """Whether PyTorch's fbgemm int8 x int8 GEMM keeps full precision here: with AVX-512 VNNI it
    sums in 32 bits; without, vpmaddubsw's 16-bit pair sums saturate (measured on an AMD EPYC:
    logits cosine 0.9953 and perplexity +1.08%, against 0.9999 and +0.2% through gptlab's kernel)."""
    return "avx512vnni" in kernels.cpu_features()


def int_kernels_apply(x: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether the int8/int4 kernels take x (..., K): CPU, 1 to max_rows rows (none: the caller's
    F.linear gives the empty result, where C would segfault or report a failure), no autograd."""
    return 0 < x.numel() <= max_rows * x.size(-1) and kernels.inference_on_cpu(x) and kernels.library() is not None


def _decoder(name: str, weight: torch.Tensor, buffers: list[torch.Tensor], bias, N: int, K: int, extra: tuple):
    """x (..., K) float -> fp32 (..., N) through kernel `name`, this layer's buffers bound once
    (pointers taken now: build a new one whenever the buffers change, as prepare() does).
    `run.layer` describes the layer to gl_decode_step (gptlab.fused_step): (kind, N, K, group
    size, (weight, scales, zeros or row sums, fp32 bias or None))."""
    b = _f32(bias)
    static = [ctypes.c_void_p(stream(weight))] + [ctypes.c_void_p(t.data_ptr()) for t in buffers]
    static.append(None if b is None else ctypes.c_void_p(b.data_ptr()))

    def run(x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype is torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = torch.empty(*x.shape[:-1], N)
        fn = getattr(kernels.library(), name)  # the active variant's (use_variant)
        check(fn(x.data_ptr(), *static, y.data_ptr(), x.numel() // K, N, K, *extra, torch.get_num_threads()))
        return y

    run.layer = (name.rsplit("_", 1)[1], N, K, extra[0] if extra else 0, (weight, *buffers, b))
    return run


def int8_decoder(weight, scales, weight_sums, bias):
    """The int8 kernel for one layer: int8 weight (N, K), bf16 row scales (N,), int32 row sums (N,),
    fp32 bias (N,) or None; x is quantized per row to int8 in C."""
    N, K = weight.shape
    return _decoder("gl_linear_i8", weight, [scales, weight_sums], bias, N, K, ())


def quantize_rows_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) quantized per row, as gptlab's int8 kernel quantizes it, stored unsigned: xq (M, K)
    uint8 = round(x / s) + 128 and s (M,) fp32 = max|x| / 127 (0 for a row of zeros)."""
    x = x if x.dtype is torch.float32 and x.is_contiguous() else x.float().contiguous()
    M, K = x.shape
    xq, s = torch.empty(M, K, dtype=torch.uint8), torch.empty(M)
    check(
        kernels.library().gl_quantize_rows_u8(x.data_ptr(), xq.data_ptr(), s.data_ptr(), M, K, torch.get_num_threads())
    )
    return xq, s


def int4_fits(in_features: int, group_size: int) -> bool:
    """Whether gl_linear_i4 takes this shape: inputs in whole chunks of 128, groups of >= 32."""
    return in_features % 128 == 0 and group_size % 32 == 0


def int4_decoder(weight, scales, zeros, group_size: int, bias):
    """The int4 kernel for one layer: weight as nibbles (N, K/2), bf16 scales and zeros (N, K/g),
    fp32 bias (N,) or None; x is quantized per row to int8 in C."""
    N, K = weight.size(0), weight.size(1) * 2
    return _decoder("gl_linear_i4", weight, [scales, zeros], bias, N, K, (group_size,))


def decode_attention_applies(qkv: torch.Tensor, kv, cache_pos) -> bool:
    """Whether decode_attention takes this step: one new token per row, an int cache position,
    CPU, fp32 or bf16 caches in the activations' dtype (or bf16 caches of fp32 activations), no
    autograd."""
    return (
        qkv.size(1) == 1
        and isinstance(cache_pos, int)
        and qkv.dtype in (torch.float32, torch.bfloat16)
        and kv[0].dtype in (qkv.dtype, torch.bfloat16)
        and kv[1].dtype is kv[0].dtype
        and kv[0].size(-1) <= MAX_HEAD_SIZE
        and kernels.inference_on_cpu(qkv)
        and kernels.library() is not None
    )


def prompt_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float) -> bool:
    """Whether prompt_attention takes this causal attention: plain causal (no mask), no dropout,
    several queries, fp32 or bf16 on CPU without autograd, each head's values adjacent, where the
    kernels have SIMD."""
    return (
        mask is None
        and dropout_p == 0.0
        and q.size(2) > 1
        and q.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype is q.dtype and t.stride(-1) == 1 for t in (q, k, v))
        and q.size(-1) <= MAX_HEAD_SIZE
        and kernels.inference_on_cpu(q)
        and kernels.has_simd()
        and kernels.library() is not None
    )


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hs) over k, v (B, nh, S, hs), S >= T, query t seeing keys
    0..S-T+t, as F.scaled_dot_product_attention(is_causal=True) for S == T, in C (gl_attend_prompt,
    fp32 sums; bf16 q, k, v widened as C reads them, the output rounded once as it writes it):
    returns it as SDPA does, (B, nh, T, hs), a view of (B, T, nh, hs) memory (the heads side by
    side, as c_proj takes them). A 512-token GPT-2 prompt's 12 layers took PyTorch's flash
    attention 55 ms on an AMD EPYC Zen 5 held to AVX2, and this 35 ms."""
    B, nh, T, hs = q.shape
    S = k.size(2)
    out = torch.empty(B, T, nh, hs, dtype=q.dtype)
    strides = [torch.tensor(t.stride()[:3], dtype=torch.long) for t in (q, k, v)]  # (batch, head, row)
    check(
        kernels.library().gl_attend_prompt(
            q.data_ptr(), strides[0].data_ptr(), k.data_ptr(), strides[1].data_ptr(), v.data_ptr(),
            strides[2].data_ptr(), out.data_ptr(), B, nh, T, S, hs, int(q.dtype is torch.bfloat16),
            torch.get_num_threads(),
        )
    )  # fmt: skip
    return out.transpose(1, 2)


def decode_attention(qkv: torch.Tensor, kv, cache_pos: int, mask: torch.Tensor | None, n_head: int) -> torch.Tensor:
    """One decoding step of causal self-attention for one layer, in C: writes the new key and
    value from qkv (B, 1, 3C) into the layer's cache (k, v), each (B, nh, max_len, hs), at slot
    cache_pos, and returns softmax(q k^T / sqrt(hs)) v over slots 0..cache_pos as (B, 1, C).
    mask: bool (B, 1, 1, cache_pos + 1), False at keys to skip (padding), or None. A bf16 cache of
    fp32 activations gets the new key and value rounded to bf16; the query and the sums stay fp32."""
    k_cache, v_cache = kv
    B, _, C3 = qkv.shape
    hs, max_len = k_cache.size(-1), k_cache.size(2)
    qkv = qkv.contiguous()
    out = torch.empty(B, 1, C3 // 3, dtype=qkv.dtype)
    m = None if mask is None else mask.reshape(B, cache_pos + 1).contiguous()
    status = kernels.library().gl_attend_one(
        qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_pos, ptr(m), out.data_ptr(),
        B, n_head, hs, max_len, int(qkv.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )  # fmt: skip
    check(status)
    return out


def softmax_exp_(
    logits_t: torch.Tensor, targets: torch.Tensor, peak: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Training's softmax cross-entropy over n rows of logits stored transposed, logits_t (V, n)
    fp32 (row r's logits in column r; each of the V rows contiguous, their stride n or more), in
    place: they become exp(logits - max) per column; returns (the rows' losses (n,), inv (n,)) with
    inv = 1 / sum of the column's exps, 0 where the target is IGNORE (-100, as in the C kernel; loss 0 there).
    d(sum of losses)/d(logits) is then inv * logits_t - onehot: gptlab.chunked_loss folds inv and
    the one-hot into the products after it, so the logits take two passes (max; exp and sum) and
    are written once; one pass when peak (n,), each column's largest logit (gemm.mm_colmax's), is
    given. None where the kernel does not run (not built, off, not CPU fp32): the caller computes
    it with PyTorch. Raises ValueError for a target outside [0, V)."""
    out = _softmax_xent(logits_t, targets, grad=True, peak=peak)
    return None if out is None else (out[0], out[2])


def softmax_xent_(logits_t: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """softmax_exp_ finished in place: logits_t (V, n) becomes softmax - onehot itself (zero columns
    where the target is IGNORE); returns the rows' losses (n,), or None as softmax_exp_."""
    out = softmax_exp_(logits_t, targets)
    if out is None:
        return None
    loss, inv = out
    logits_t.mul_(inv)  # (V, n) softmax, 0 in ignored columns
    rows = (targets != IGNORE).nonzero().squeeze(1)  # (k,)
    logits_t[targets[rows], rows] -= 1.0
    return loss


def cross_entropy_t(logits_t: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Scoring's cross-entropy over logits stored transposed, logits_t (V, n) fp32, read only:
    (the rows' losses (n,), their largest logits (n,)), or None where the kernel does not run.
    Two passes over the logits where PyTorch's log_softmax and max over dim 0 take five."""
    out = _softmax_xent(logits_t, targets, grad=False)
    return None if out is None else out[:2]


def _rows_dense(m: torch.Tensor) -> bool:
    """Whether matrix m's rows are each contiguous, and apart by at least a row (the padded
    workspaces of gptlab.chunked_loss)."""
    return m.dim() == 2 and m.stride(1) == 1 and m.stride(0) >= m.size(1)


def _softmax_xent(logits_t: torch.Tensor, targets: torch.Tensor, grad: bool, peak: torch.Tensor | None = None):
    """(losses, peaks, inv) from gl_softmax_xent, or None where it does not run."""
    if not (
        kernels.enabled()
        and logits_t.device.type == "cpu"
        and logits_t.dtype == torch.float32
        and _rows_dense(logits_t)
    ):
        return None
    if torch.compiler.is_compiling() or kernels.library() is None:  # compiled graphs cannot trace ctypes
        return None
    V, n = logits_t.shape
    t = targets.to(torch.int64).contiguous()
    given = None if peak is None else peak.to(torch.float32).contiguous()  # (n,)
    loss, peak, inv = torch.empty(n), torch.empty(n), torch.empty(n)
    status = kernels.library().gl_softmax_xent(
        logits_t.data_ptr(), logits_t.stride(0), t.data_ptr(), loss.data_ptr(), peak.data_ptr(), inv.data_ptr(), n, V,
        int(grad), None if given is None else given.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == -3:
        bad = t[(t != IGNORE) & ((t < 0) | (t >= V))]
        raise ValueError(f"target {int(bad[0])} outside the vocabulary [0, {V}) (and not the ignore index {IGNORE})")
    check(status)
    return loss, peak, inv


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) indices of the largest value per row, as torch.argmax: the first on
    ties, the first NaN where there is one. In C for CPU fp32: over GPT-2's 50,257 logits 6.6 us
    where torch's takes 27 (AMD EPYC Zen 5, avx512; avx2 7.8, portable 14.8). bf16 logits are
    widened first, which is exact: 16 us in all where torch's bf16 argmax takes 160."""
    lib = _sampling_library(logits, (torch.float32, torch.bfloat16))
    if lib is None or logits.dim() != 2:
        return logits.argmax(dim=-1)
    x = logits if logits.dtype is torch.float32 and logits.is_contiguous() else logits.float().contiguous()
    out = torch.empty(x.size(0), dtype=torch.long)
    lib.gl_argmax_f32(x.data_ptr(), out.data_ptr(), x.size(0), x.size(1))
    return out


def _sampling_library(t: torch.Tensor, dtypes=(torch.float32,)):
    """The active variant's ctypes library where sampling's kernels may read t (argmax, top-p, the
    draw: kernels on, a CPU tensor of one of `dtypes`, the library built), else None; one lookup
    of the variant, as these run at every decoding step."""
    if not (kernels.enabled() and t.device.type == "cpu" and t.dtype in dtypes):
        return None
    return kernels.library()


def top_p_keep(probs: torch.Tensor, p: float) -> torch.Tensor | None:
    """Which tokens are in the top-p nucleus of probs (..., V) (gptlab.sampling.top_p_mask's
    rule, most likely first, equal probabilities in vocabulary order), a bool tensor like probs,
    computed in C without sorting the vocabulary: over GPT-2's 50,257 a flat row took ~2.9 ms
    through NumPy's sort. None where the kernels cannot run it (then sort)."""
    lib = _sampling_library(probs)
    if lib is None or probs.size(-1) == 0:
        return None
    x = probs.detach().reshape(-1, probs.size(-1)).contiguous()  # (M, V)
    keep = torch.empty(x.shape, dtype=torch.bool)
    check(lib.gl_top_p_keep(x.data_ptr(), keep.data_ptr(), x.size(0), x.size(1), float(p)))
    return keep.view(probs.shape)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Ids (M,) drawn from probs (M, V) fp32 at uniform numbers u (M, 1) float64, in C with
    gptlab.sampling.draw's arithmetic (the same ids); None where the kernels cannot run it, or a
    row's sum is not finite and positive (the caller's own path says so)."""
    lib = _sampling_library(probs)
    if lib is None or probs.dim() != 2:
        return None
    x = probs if probs.is_contiguous() else probs.contiguous()
    ids = torch.empty(x.size(0), dtype=torch.long)
    status = lib.gl_draw(x.detach().data_ptr(), u.data_ptr(), ids.data_ptr(), x.size(0), x.size(1))
    return ids if status == 0 else None


def gelu(x: torch.Tensor, approximate: str = "none", inplace: bool = False) -> torch.Tensor:
    """F.gelu(x, approximate=approximate), into x itself when inplace (in inference, where the C
    kernel runs). GPT-2's tanh form runs in C on CPU where the kernels have SIMD: in inference in
    fp32 or bf16 (computed in fp32, rounded once, as PyTorch does), and under autograd in fp32,
    its backward too. A 512-token GPT-2 prefill's GELUs took PyTorch 24 ms of ~500 on an AMD EPYC
    Zen 5 held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`), gl_gelu_tanh 6 in place and 15 into fresh
    tensors (their page faults)."""
    if not (approximate == "tanh" and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()):
        return F.gelu(x, approximate=approximate)
    if not (kernels.enabled() and x.device.type == "cpu" and not torch.compiler.is_compiling()):
        return F.gelu(x, approximate=approximate)
    if not (kernels.has_simd() and kernels.library() is not None):
        return F.gelu(x, approximate=approximate)  # portable C: ~4x slower than PyTorch's
    if torch.is_grad_enabled() and x.requires_grad:
        return _GeluTanh.apply(x) if x.dtype is torch.float32 else F.gelu(x, approximate=approximate)
    return _gelu_tanh(x, x if inplace else torch.empty_like(x))


def _gelu_tanh(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y = gelu_tanh(x) in gl_gelu_tanh; x and y contiguous, of x's dtype (fp32 or bf16)."""
    bf16 = x.dtype is torch.bfloat16
    check(kernels.library().gl_gelu_tanh(x.data_ptr(), y.data_ptr(), x.numel(), int(bf16), torch.get_num_threads()))
    return y


class _GeluTanh(torch.autograd.Function):
    """The training MLP's tanh GELU, fp32, forward and backward in C (PyTorch's took ~5 ms of a
    ~250 ms demo step on the AMD EPYC Zen 5 held to AVX2)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _gelu_tanh(x, torch.empty_like(x))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy, dx = dy.contiguous(), torch.empty_like(x)
        check(kernels.library().gl_gelu_tanh_backward(x.data_ptr(), dy.data_ptr(), dx.data_ptr(), x.numel(),
                                                   torch.get_num_threads()))  # fmt: skip
        return dx


def dequantize_int4(
    weight, scales, zeros, group_size: int, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The (N, K) matrix of an int4 layer (as gptlab.quantize.dequantize_int4), in C, in fp32 or
    rounded to bf16 (dtype), into `out` (N * K contiguous of dtype) when given."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_int4: dtype must be torch.float32 or torch.bfloat16, not {dtype}")
    N, K = weight.size(0), weight.size(1) * 2
    out = torch.empty(N, K, dtype=dtype) if out is None else out.view(N, K)
    if out.dtype is not dtype or not out.is_contiguous():
        raise ValueError(f"dequantize_int4: out must be contiguous {dtype}, not {out.dtype}")
    kernels.library().gl_dequantize_i4(weight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), out.data_ptr(),
                                    N, K, group_size, int(dtype is torch.bfloat16), torch.get_num_threads())  # fmt: skip
    return out
