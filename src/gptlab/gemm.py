"""Whose GEMM multiplies prompts' layers and the training head: gptlab's (csrc/gemm.c) or PyTorch's.

A prompt's layer of more than kernels.MAX_ROWS rows, and the training head's three products, are
general matrix products, where decoding's kernels (gptlab.kernels) are matrix-vector ones.
PyTorch's x86 builds multiply with Intel's MKL, which runs slowly on AMD CPUs, so gptlab has a
GEMM of its own in every SIMD variant: `gemm_choice` and `prompt_gemm_choice` say which one runs
(by vendor, or on an Intel CPU measured once per machine by gptlab.gemm_probe; GPTLAB_GEMM=
auto|gptlab|torch forces one), `mm` and `mm_colmax` run the head's products, and `sgemm_linear`
a layer's y = b + x W^T, reading the weights in place up to NT_ROWS rows.
"""

from __future__ import annotations

import logging
import os

import torch

from gptlab import cpu, gemm_probe, kernel_build, kernels
from gptlab.kernels import check, ptr
from gptlab.machine_cache import machine_key

log = logging.getLogger(__name__)

GEMM_CHOICES = ("auto", "gptlab", "torch")


def gemm_choice() -> str:
    """Whose fp32 GEMM runs `mm` (the training head's three products): "gptlab" (gl_sgemm) or
    "torch" (PyTorch's BLAS). GPTLAB_GEMM=gptlab|torch forces one (and prompt_gemm_choice's); auto
    (the default) takes gptlab's on an x86 CPU not made by Intel whose kernel variant has SIMD,
    whichever ran the head faster on an Intel one (measured once per machine, gptlab.gemm_probe),
    and PyTorch's elsewhere. PyTorch's x86 builds multiply with Intel's MKL, which on an AMD EPYC
    (Zen 3, 2 threads) ran the demo head's products at 75-110 GFLOP/s where gl_sgemm runs them at
    135-175 (`gptlab bench gemm`); on other architectures PyTorch's BLAS beats plain C."""
    return _gemm_choice("head")


def prompt_gemm_choice(rows: int) -> str:
    """As gemm_choice, for prompts' layers of `rows` rows of x (more than MAX_ROWS, without
    autograd: sgemm_linear against F.linear): on an Intel CPU, whichever ran the probe's row count
    nearest `rows` faster there (gemm_probe.prompt_work)."""
    return _gemm_choice(gemm_probe.prompt_work(rows))


_measured_gemm: dict[tuple[int, str], dict[str, str]] = {}  # (threads, variant) -> this process's choice per work


def bf16_prompt_gemm_choice() -> str:
    """Who multiplies a bf16 model's prompts (more than MAX_ROWS rows) on a CPU whose bf16 GEMM is
    emulated (linear.bf16_linear_in_fp32): "gptlab", wherever its GEMM runs at all (x86 with SIMD), or
    "torch" (the weight widened into a reused fp32 buffer for PyTorch's BLAS); GPTLAB_GEMM forces
    either. Not the probe's choice: that times fp32 operands, and here PyTorch's side would also
    pay for widening the weight and converting x and y, where gptlab's GEMM widens them as it reads
    them and rounds y as it writes it. Intel Xeon 6/207, 512-token GPT-2 prefill against fp32's
    (MKL's there), medians of 8 interleaved rounds, 2 runs each: held to the first Xeon's AVX-512
    VNNI 0.993 / 0.996x (0.963 / 0.968x through MKL), held to AVX2 1.001 / 1.008x (0.966 / 0.973x);
    256 tokens 1.09x (0.94x); 1,024 tokens, past NT_ROWS, level with MKL's route (1.09x both)."""
    want = _gemm_env()
    if want != "auto":
        return want
    return "gptlab" if kernels.has_simd() and kernel_build.is_x86() and not torch.compiler.is_compiling() else "torch"


def _gemm_env() -> str:
    """GPTLAB_GEMM's choice, one of GEMM_CHOICES; ValueError for another value. gptlab where
    gptlab's kernels do not run (GPTLAB_KERNELS=0, no C compiler) is torch, with a warning once:
    its GEMM is in them (it was ignored unsaid, and `python -m gptlab.kernels` named gptlab's)."""
    want = os.environ.get("GPTLAB_GEMM", "auto").strip().lower() or "auto"
    if want not in GEMM_CHOICES:
        raise ValueError(f"GPTLAB_GEMM={want!r}: expected one of {', '.join(GEMM_CHOICES)}")
    if want == "gptlab" and kernels.library() is None:
        kernels.warn_once(log, f"GPTLAB_GEMM=gptlab is ignored: gptlab's kernels are not running ({kernels.available()[2]}); "
                   "PyTorch's GEMM runs")  # fmt: skip
        return "torch"
    return want


def _gemm_choice(work: str) -> str:
    want = _gemm_env()
    if want != "auto":
        return want
    if not (kernels.has_simd() and kernel_build.is_x86()):
        return "torch"
    if cpu.vendor() != "GenuineIntel":
        return "gptlab"
    if torch.compiler.is_compiling():  # nothing is timed inside a traced graph, which runs PyTorch's GEMM anyway
        return "torch"
    at = (torch.get_num_threads(), kernels.variant())  # asked on every prompt's layer: a dict lookup
    if at not in _measured_gemm:  # every choice from one reading of the timings (logged once)
        timings = gemm_probe.timings(machine_key(kernels.cpu_description(), f"kernels {at[1]}"), measure_gemms)
        _measured_gemm[at] = {w: gemm_probe.choice(w, timings) for w in gemm_probe.WORK}
    return _measured_gemm[at][work]


def measure_gemms() -> dict:
    """gemm_probe's timings of gptlab's GEMM against PyTorch's on this CPU, measured now."""
    kernels.wait_for_huge_pages()  # a timing taken while Linux copies a model's pages runs slow, and this one is cached
    lib = kernels.library()
    return gemm_probe.measure(sgemm_linear, lambda a, b, out: run_gemm(lib.gl_sgemm, a, b, out))


def mm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool = False,
    bf16: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = a @ b (+ bias), or out += a @ b (+ bias) when accumulate; a (M, K), b (K, N) and out
    (M, N) 2-D with any strides (out's rows contiguous), bias (N,) fp32 contiguous or None, no
    autograd. On CPU fp32 in gl_sgemm where gemm_choice() says gptlab (whatever the thread count,
    each element sums in the same order), else torch.mm/addmm_. b may be bf16 (a bf16 layer's
    weight), and then a too (its activations): widened exactly as gl_sgemm_bf16_b and
    gl_sgemm_bf16_ab pack them, the same product as of a.float() and b.float().

    bf16: a and b fp32, each rounded to bf16 before it is multiplied, the sums in fp32 (bf16
    autocast's product, without its bf16 result): in gl_gemm_bf16 where gemm_bf16_runs(), else
    through torch's bf16 product."""
    if bias is not None and not (bias.dtype is torch.float32 and bias.shape == out.shape[1:] and bias.is_contiguous()):
        raise ValueError(f"mm: bias must be a contiguous fp32 ({out.size(1)},), not {bias.dtype} {tuple(bias.shape)}")
    if bf16:
        return _mm_bf16(a, b, out, accumulate, bias)
    if _sgemm_runs(a, b, out):
        run_gemm(getattr(kernels.library(), _SGEMMS[a.dtype, b.dtype]), a, b, out, accumulate, bias)
        return out
    a, b = (t.float() if t.dtype is torch.bfloat16 else t for t in (a, b))  # bf16 widens exactly
    out = out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    return out if bias is None else out.add_(bias)


def run_gemm(fn, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False, bias=None) -> None:
    """out (+)= a @ b (+ bias) through the C GEMM `fn` (gl_sgemm's arguments), unchecked: mm's."""
    (M, K), N = a.shape, b.size(1)
    status = fn(
        M, N, K, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1),
        out.data_ptr(), out.stride(0), None if bias is None else bias.data_ptr(), int(accumulate),
        torch.get_num_threads(),
    )  # fmt: skip
    check(status)


def mm_colmax(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bf16: bool = False) -> torch.Tensor | None:
    """out = a @ b as mm(a, b, out, bf16=bf16), and the largest value of each of out's columns
    (N,), found as gptlab's GEMM writes out's tiles (the training head's W x^T: ops.softmax_exp_ then
    reads the logits once instead of twice). None, with out untouched, where gptlab's GEMM does
    not run the product."""
    runs = gemm_bf16_runs(out.device) if bf16 else b.dtype is torch.float32
    if not (runs and _sgemm_runs(a, b, out)):
        return None
    (M, K), N = a.shape, b.size(1)
    top = torch.empty(N)  # (N,)
    status = kernels.library().gl_sgemm_colmax(
        M, N, K, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(), b.stride(0), b.stride(1),
        out.data_ptr(), out.stride(0), top.data_ptr(), int(bf16), torch.get_num_threads(),
    )  # fmt: skip
    check(status)
    return top


def _mm_bf16(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool, bias) -> torch.Tensor:
    if not all(t.dtype == torch.float32 for t in (a, b, out)):
        raise ValueError(f"mm(bf16=True) takes fp32 operands, not {a.dtype}, {b.dtype} -> {out.dtype}")
    if gemm_bf16_runs(out.device) and _sgemm_runs(a, b, out):
        run_gemm(kernels.library().gl_gemm_bf16, a, b, out, accumulate, bias)
        return out
    product = (a.bfloat16() @ b.bfloat16()).float()  # (M, N)
    out = out.add_(product) if accumulate else out.copy_(product)
    return out if bias is None else out.add_(bias)


def gemm_bf16_choice() -> str:
    """Who runs mm(bf16=True) here: "gl_gemm_bf16" or "torch" (see gemm_bf16_runs)."""
    return "gl_gemm_bf16" if gemm_bf16_runs() else "torch"


def head_gemm() -> str:
    """Who multiplies the training head, for logs and benchmarks: gemm_choice(), and where bf16
    autocast's products run ("gptlab, bf16 in gl_gemm_bf16")."""
    return f"{gemm_choice()}, bf16 in {gemm_bf16_choice()}"


# (a's dtype, b's) -> the fp32 GEMM that widens what is bf16 as it packs it
_SGEMMS = {
    (torch.float32, torch.float32): "gl_sgemm",
    (torch.float32, torch.bfloat16): "gl_sgemm_bf16_b",
    (torch.bfloat16, torch.bfloat16): "gl_sgemm_bf16_ab",
}


def _sgemm_runs(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    if not (kernels.enabled() and all(t.device.type == "cpu" for t in (a, b, out))):
        return False
    if not (out.dtype is torch.float32 and (a.dtype, b.dtype) in _SGEMMS):
        return False
    if out.dim() != 2 or out.stride(1) != 1 or a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        return False
    if torch.compiler.is_compiling() or kernels.library() is None:
        return False
    return gemm_choice() == "gptlab"


def gemm_bf16_runs(device: torch.device | str = "cpu") -> bool:
    """Whether mm(bf16=True) runs in gl_gemm_bf16 on `device`: a CPU with AVX512-BF16 (vdpbf16ps),
    a variant with AVX-512, and gptlab's GEMM chosen (gemm_choice). On an AMD EPYC Zen 4 (2
    threads) it runs the demo head's three products at 284-312 GFLOP/s against gl_sgemm's 147-196.
    On Intel CPUs only with GPTLAB_GEMM=gptlab: their probe (gptlab.gemm_probe) times fp32, and
    Intel's bf16 CPUs have oneDNN's native bf16 products (AMX on the newer), never timed against it."""
    if not (kernels.enabled() and torch.device(device).type == "cpu" and kernel_build.is_x86()):
        return False
    if cpu.vendor() == "GenuineIntel" and _gemm_env() != "gptlab":  # before gemm_choice: no probe for nothing
        return False
    if torch.compiler.is_compiling() or gemm_choice() != "gptlab" or kernels.library() is None:
        return False
    return bool(kernels.library().gl_has_gemm_bf16())


# Up to this many rows, an fp32 prompt's layer runs gl_sgemm_nt, which reads the weights in place,
# instead of gl_sgemm, which packs them (a transpose of every weight on every call: 20% of a
# 64-token GPT-2 forward's samples). GPT-2's four block layers, gl_sgemm against gl_sgemm_nt, AMD
# EPYC Zen 4, 2 threads, medians of 7-9 alternating rounds, avx512-256 / avx2 / avx512: 32 rows
# 1.60 / 1.45 / 1.61x, 64 1.29 / 1.28 / 1.41x, 128 1.21 / 1.16 / 1.21x, 256 1.06 / 1.07 / 1.10x,
# 512 1.00-1.02 / 1.00-1.03 / 1.08x, 640 1.00 / 0.98 / 1.06x, 768 0.96 / 0.97 / 0.97x; GPT-2's head
# (all logits) avx512-256 / avx2 16 rows 1.98 / 1.86x, 64 1.50 / 1.42x, 512 1.20 / 1.18x.
# bf16 weights (and activations: a bf16 model on a CPU without bf16 instructions) take the same
# bound: gl_sgemm_nt widens each block of W's rows once, then reads them as fp32 ones. Against
# gl_sgemm_bf16_ab (W widened and transposed as it is packed), GPT-2's four block layers,
# avx2 / avx512 / avx512-256, medians of 5 alternating rounds: 32 rows 1.23 / 1.26 / 1.22x, 128
# 1.09 / 1.05 / 1.12x, 256 1.05 / 1.03 / 1.04x, 512 1.02 / 0.99 / 1.00x, 768 0.98x. At 17-24 rows,
# since x^T's last narrow panel takes half a tile (medians of 7, avx2 / avx512-256): 17 rows 1.01 /
# 1.00x (0.75-0.85x before), 20 1.26 / 1.24x, 24 1.25 / 1.19x.
NT_ROWS = 512


def sgemm_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """F.linear of x (..., K) and weight (N, K) in gptlab's GEMM, y = b + x W^T in fp32: both fp32,
    or the weight bf16 and x fp32 or bf16, widened as they are read. Up to NT_ROWS rows of x,
    gl_sgemm_nt reads the weight where it is (a bf16 one widened a block of rows at a time); more
    run gl_sgemm (_bf16_b, _bf16_ab), which packs it. y is fp32, or rounded once to `dtype` bf16
    (by gl_sgemm_nt as it writes y: no fp32 y to convert afterwards)."""
    N, K = weight.shape
    x2 = x.reshape(-1, K)  # (M, K)
    b = None if bias is None else bias.detach().float().contiguous()
    in_place = not (x.dtype is torch.bfloat16 and weight.dtype is torch.float32)  # no such gl_sgemm_nt
    if in_place and x2.size(0) <= NT_ROWS and weight.is_contiguous() and x2.stride(1) == 1:
        y = torch.empty(x2.size(0), N, dtype=dtype)  # (M, N)
        status = kernels.library().gl_sgemm_nt(
            x2.size(0), N, K, x2.data_ptr(), x2.stride(0), int(x.dtype is torch.bfloat16), weight.data_ptr(),
            int(weight.dtype is torch.bfloat16), y.data_ptr(), N, int(dtype is torch.bfloat16), ptr(b),
            torch.get_num_threads(),
        )  # fmt: skip
        check(status)
    else:
        y = mm(x2, weight.detach().t(), torch.empty(x2.size(0), N), bias=b).to(dtype)  # W fp32 or bf16
    return y.view(*x.shape[:-1], N)
