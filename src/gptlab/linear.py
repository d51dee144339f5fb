"""The model's linear layer: y = x W^T + b through the fastest product this CPU has for the case.

`Linear` is an nn.Linear (same parameters, same state dict, training unchanged) whose forward
without autograd on the CPU goes through `linear`, which picks by the number of rows of x:
- a few rows (decoding: up to float_kernel_rows): gptlab's matrix-vector kernel, each weight row
  read once for all of them (ops.float_linear);
- more (a prompt), where gemm.prompt_gemm_choice() gives gptlab: gptlab's GEMM, the weights read
  in place up to gemm.NT_ROWS rows (gemm.sgemm_linear);
- a bf16 layer on a CPU whose bf16 GEMM is emulated (bf16_matmul_is_fast): computed in fp32 and
  rounded once (bf16_linear_in_fp32);
- everything else, and anything with autograd: F.linear.
A decoding step usually runs the whole model in C instead (gptlab.fused_step), with the same
kernels. int4 layers' prompts on a CPU with AMX run as bf16 (int4_bf16_linear, for
gptlab.quantize).
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlab import cpu, gemm, kernels, ops
from gptlab.kernels import MAX_ROWS

log = logging.getLogger(__name__)


# Rows up to which the float kernel (each weight row read once for all rows of x) takes a bf16
# inference forward where gemm.prompt_gemm_choice() gives gptlab (x86 CPUs not made by Intel, and Intel
# ones where it was measured faster than MKL); elsewhere MAX_ROWS. AMD EPYC Zen 5, 2
# threads, 2026-12-05, GPT-2's whole forward with all logits, the kernel against oneDNN's bf16 GEMM
# natively and gl_sgemm widening bf16 held to AVX2, medians of 5, best of 2 alternations: avx512
# 9 rows 1.17x, 16 1.14x, 0.69x at 32; held to AVX2 1.81x, 1.44x, 1.19x. fp32 forwards: float_kernel_rows.
# More rows lose, though the four block layers alone favour the kernel further (to ~20 rows on
# avx2 and avx512-256, ~40 on avx512, against gl_sgemm_nt; their bf16 weights fit L3): the AMD EPYC
# Zen 4, 2026-12-05, the whole bf16 forward with the kernel up to 24 rows (40 on avx512) against 16,
# medians of 11 alternating rounds, 17-24 tokens 0.81-0.92x, 32-40 tokens on avx512 0.77-0.82x.
KERNEL_ROWS_GPTLAB = 16


def float_kernel_rows(dtype: torch.dtype) -> int:
    """Up to how many rows of x the float kernel takes an inference forward of `dtype`: MAX_ROWS,
    or where gemm.prompt_gemm_choice() gives gptlab, KERNEL_ROWS_GPTLAB for bf16 and for fp32 half the columns
    of gl_sgemm_nt's tile (its lanes hold rows of x, so fewer leave most of them idle). GPT-2's four
    block layers, the float kernel against gl_sgemm_nt, AMD EPYC Zen 4, 2 threads, medians of 9
    alternating rounds: 16 columns (avx2, avx512-256) 8 rows 0.97 / 1.06x, 9 1.10 / 1.15x, 16 1.70 /
    1.71x; 32 columns (avx512) 0.55x at 9 rows, 0.78x at 16."""
    if gemm.prompt_gemm_choice(PROMPT_GEMM_ROWS) != "gptlab":
        return MAX_ROWS
    if dtype is torch.bfloat16:
        return KERNEL_ROWS_GPTLAB
    return max(MAX_ROWS, kernels.gemm_columns() // 2)


def kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the float kernel takes y = x W^T: CPU, fp32 or bf16, a few rows (float_kernel_rows)
    but at least one (an empty x is F.linear's: C would divide by K, or read what is not there), no
    autograd."""
    rows = x.numel() // max(x.size(-1), 1)
    return (
        x.numel() > 0
        and x.dtype is weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and (rows <= MAX_ROWS or rows <= float_kernel_rows(x.dtype))  # decoding's rows skip asking prompt_gemm_choice
        and kernels.inference_on_cpu(x)
        and not (torch.is_grad_enabled() and weight.requires_grad)
        and weight.is_contiguous()
        and kernels.library() is not None
    )


# From this many rows on, an fp32 inference forward (a prompt longer than MAX_ROWS; the float
# kernel takes up to KERNEL_ROWS_GPTLAB first) runs in gptlab's GEMM where gemm.prompt_gemm_choice() gives gptlab.
# It was 256 while each thread packed all of B (12-04: GPT-2's block layers at 16 rows 8.9 ms
# against MKL's 3.4); since the threads split B's columns, gl_sgemm beats MKL at every row count.
# AMD EPYC Zen 5, 2 threads, 2026-12-05, GPT-2's whole forward with all logits / the last only,
# 256 against 9 here (medians of 5, best of 2 alternations): avx512 9 rows 1.58 / 1.43x, 16 1.60 /
# 1.38, 64 1.73, 128 1.95 / 2.12; avx512-256 1.80 / 1.45, 1.48 / 1.30, 1.20 / 1.21, 1.29 / 1.17;
# held to AVX2 (MKL too) 1.79 / 1.50, 1.48 / 1.38, 1.26 / 1.22, 1.26 / 1.19, and a bf16 model there
# (bf16_linear_in_fp32) 1.46 / 1.46 at 9 rows, 1.25 / 1.19 at 128.
PROMPT_GEMM_ROWS = MAX_ROWS + 1


def prompt_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether an fp32 inference forward of at least PROMPT_GEMM_ROWS rows runs in gptlab's GEMM
    (gemm.sgemm_linear): where gemm.prompt_gemm_choice() gives gptlab."""
    return (
        x.numel() >= max(PROMPT_GEMM_ROWS * x.size(-1), 1)  # no inputs (K = 0): F.linear's
        and x.dtype is torch.float32
        and weight.dtype is torch.float32
        and kernels.inference_on_cpu(x)
        and not (torch.is_grad_enabled() and weight.requires_grad)
        and kernels.library() is not None
        and gemm.prompt_gemm_choice(x.numel() // x.size(-1)) == "gptlab"
    )


@functools.cache
def bf16_matmul_is_fast() -> bool:
    """Whether a bf16 GEMM beats converting to fp32 and running the fp32 one: False unmeasured on
    an x86 CPU without bf16 instructions (cpu.may_have_native_bf16), else measured once.

    CPUs with native bf16 (AVX-512 BF16, AMX) run bf16 GEMMs 2-3x faster than fp32; without
    them PyTorch's bf16 GEMM is emulated and ~5x slower than fp32 (e.g. 63 vs 337 GFLOP/s on
    an Intel Xeon without AVX512_BF16), so bf16 weights are then better multiplied in fp32. The
    measurement waits for the huge-page thread first: timed while Linux copied a model's pages, the
    fp32 product took 40 ms instead of 5 and the emulated bf16 one 24, so a bf16 model's prompts
    ran PyTorch's emulated GEMM, 4x slower (AMD EPYC Zen 4 held to AVX2, 2026-12-05: 512-token
    bf16 prefill 225-239 tok/s against 860-992 in fp32).
    """
    if not cpu.may_have_native_bf16():
        log.info("no bf16 instructions on this CPU: multiplying bf16 weights in fp32")
        return False
    kernels.wait_for_huge_pages()
    x = torch.randn(128, 768)
    w = torch.randn(2304, 768)
    xb, wb = x.bfloat16(), w.bfloat16()
    candidates = {"native": lambda: F.linear(xb, wb), "via_fp32": lambda: F.linear(xb.float(), wb.float()).bfloat16()}
    times = {name: [] for name in candidates}
    for _ in range(4):  # the first round warms up; alternating, a slow moment is less likely to favour one
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    native, via_fp32 = (min(times[name][1:]) for name in candidates)
    fast = native <= via_fp32
    log.info(
        "bf16 GEMM %.2f ms vs fp32 conversion %.2f ms: multiplying bf16 weights in %s",
        native * 1e3, via_fp32 * 1e3, "bf16" if fast else "fp32",
    )  # fmt: skip
    return fast


SLAB_BYTES = 4 << 20  # fp32 weight rows converted at a time (bf16_linear_in_fp32)
WHOLE_BYTES = 16 << 20  # a weight whose fp32 copy fits this is converted whole, into the same buffer
_slabs = threading.local()  # each thread's reused buffers, one per dtype


def _buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This thread's reused buffer of `dtype`, at least `numel` long (grown, never shrunk): no
    fresh tensor, and its page faults, per call."""
    buffers = _slabs.__dict__.setdefault("by_dtype", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buf


def bf16_linear_in_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear of bf16 x (..., K) and weight (N, K) computed in fp32, rounded to bf16 once, for
    CPUs whose bf16 GEMM is emulated. The weight is converted into one reused buffer (no fresh
    fp32 copy per call: page faults included, 154 MB for GPT-2's head): whole when its fp32 copy
    fits WHOLE_BYTES, and multiplied as F.linear; else a slab of rows at a time (SLAB_BYTES, so it
    stays in cache), multiplied transposed, W x^T, as MKL runs that faster. AMD EPYC, 512 rows,
    2026-12-02: the 50,257-row head (scoring) 720 -> 472 ms in slabs; GPT-2's block layers
    together 79.3 ms in slabs, 70.5 converted whole, 66.7 for fp32 weights. From PROMPT_GEMM_ROWS
    rows, where gemm.bf16_prompt_gemm_choice() gives gptlab, gptlab's GEMM multiplies the bf16 weight
    itself, widening it as it reads it (gemm.sgemm_linear; no fp32 copy: a 512-token bf16 GPT-2 prefill
    457 -> 440 ms on the Zen 5 held to AVX2), and x too (gl_sgemm_bf16_ab: no fp32 copy of the
    activations, 461 -> 455 ms, medians of 7 alternating runs, where fp32's took 460), and up to
    NT_ROWS rows gl_sgemm_nt rounds y to bf16 as it writes it (no fp32 y to round afterwards: on
    the Intel Xeon 6/207 held to AVX-512 VNNI 260.0-264.2 -> 252.9-253.8 ms, held to AVX2
    443.5-447.3 -> 435.3-436.5)."""
    K, N = weight.size(1), weight.size(0)
    if (
        x.numel() >= PROMPT_GEMM_ROWS * K
        and gemm.bf16_prompt_gemm_choice() == "gptlab"
        and kernels.library() is not None
    ):
        return gemm.sgemm_linear(x, weight, bias, torch.bfloat16)  # (..., N): widened as read, rounded once
    xf = x.reshape(-1, K).float()  # (M, K)
    if N * K * 4 <= WHOLE_BYTES:
        w = _buffer(N * K)[: N * K].view(N, K)
        w.copy_(weight)  # bf16 -> fp32, exact
        y = F.linear(xf, w, None if bias is None else bias.float())  # (M, N)
        return y.to(torch.bfloat16).view(*x.shape[:-1], N)  # rounded once
    rows = max(16, SLAB_BYTES // (4 * K))
    slab = _buffer(rows * K)
    yt = torch.empty(N, xf.size(0))  # y^T (N, M)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        w = slab[: (n1 - n0) * K].view(n1 - n0, K)
        w.copy_(weight[n0:n1])  # bf16 -> fp32, exact
        if bias is None:
            torch.mm(w, xf.t(), out=yt[n0:n1])
        else:
            torch.addmm(bias[n0:n1, None].float(), w, xf.t(), out=yt[n0:n1])
    y = torch.empty(xf.size(0), N, dtype=torch.bfloat16).copy_(yt.t())  # row-major, rounded once
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the fastest kernel this CPU has for the case (see the module docstring)."""
    if kernel_applies(x, weight):
        return ops.float_linear(x, weight, bias)
    if prompt_gemm_applies(x, weight):
        return gemm.sgemm_linear(x, weight, bias)
    if (
        x.dtype is torch.bfloat16
        and kernels.inference_on_cpu(x)
        and not (torch.is_grad_enabled() and weight.requires_grad)
        and not bf16_matmul_is_fast()
    ):
        return bf16_linear_in_fp32(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose inference forward on CPU runs gptlab's kernels (see `linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# From this many rows, on a CPU with AMX whose bf16 GEMM PyTorch runs fast (bf16_matmul_is_fast), an
# int4 layer multiplies a prompt as bf16: dequantized to bf16 (int4_bf16_linear) and multiplied by
# oneDNN on AMX, instead of gptlab's int4 lanes kernel. Intel Xeon 6/207, 2026-12-06, GPT-2's four
# block layers (g64), lanes kernel against the bf16 product, medians of 15, two runs: 128 rows
# 0.74-0.75x, 256 rows 1.13-1.25x, 384 1.32-1.33x, 512 1.48-1.52x, 1024 1.52-2.08x. Without AMX
# (AVX512-BF16 only: AMD Zen 4 and 5) the lanes kernel ran 3.4x faster than the fp32 GEMM at 512
# rows (Zen 5), where a bf16 GEMM is ~2x fp32: not taken. Since the weight is dequantized straight to
# bf16 (gl_dequantize_i4's bf16 output; before, to fp32 then rounded by torch), the bf16 path runs
# those layers 10-15% faster: 4.0 -> 3.6 ms at 256 rows (1.18-1.21x the lanes kernel), 192 rows
# 0.98-1.04x, 160 0.93-0.94x, 128 0.81-0.82x (medians of 14, alternating): 256 stays the threshold.
INT4_BF16_ROWS = 256
# Up to this many weights: the reused buffer int4_bf16_linear dequantizes into stays alive with
# its thread (2 bytes a weight: 32 MB here), so a larger layer (GPT-2's 38.6M-weight head, for a
# whole prompt's logits) keeps the lanes kernel. Every block layer of GPT-2 xl (1600 wide) fits.
INT4_BF16_MAX_WEIGHTS = 16 << 20


def int4_prompts_in_bf16(rows: int, weights: int) -> bool:
    """Whether an int4 layer of `weights` weights multiplies `rows` rows of x as bf16
    (int4_bf16_linear): from INT4_BF16_ROWS rows, up to INT4_BF16_MAX_WEIGHTS weights, on a CPU with
    AMX-BF16 whose bf16 GEMM is fast."""
    return (
        rows >= INT4_BF16_ROWS
        and weights <= INT4_BF16_MAX_WEIGHTS
        and "amxbf16" in kernels.cpu_features()  # cpuid's: an emulator's CPU (qemu-user) shows the host's /proc/cpuinfo
        and bf16_matmul_is_fast()
    )


def int4_bf16_linear(x: torch.Tensor, weight, scales, zeros, group_size: int, bias) -> torch.Tensor:
    """x (M, K) through an int4 layer in bf16: the weight dequantized and rounded to bf16 (in C,
    into this thread's reused buffer), x rounded to bf16, multiplied by PyTorch's bf16 GEMM (oneDNN:
    AMX), the bf16 result widened to fp32 (M, N) and the fp32 bias (N,) or None added."""
    N, K = weight.size(0), weight.size(1) * 2
    buffer = _buffer(N * K, torch.bfloat16)[: N * K]
    w16 = ops.dequantize_int4(weight, scales, zeros, group_size, buffer, torch.bfloat16)  # (N, K)
    y = F.linear(x.to(torch.bfloat16), w16).float()  # (M, N); w16 (N, K)
    return y if bias is None else y.add_(bias)
