"""Whose int8 x int8 product multiplies the prompts of an int8 layer (gptlab.quantize.Int8Linear).

Decoding (a few rows) runs gptlab's int8 kernel. Prompts and batches (many rows), on a CPU where
fbgemm's int8 product keeps full precision (AVX-512 VNNI, ops.fbgemm_int8_is_exact), take one of
PyTorch's two:

- "fbgemm": `quantized::linear_dynamic`, x quantized with one scale for all its rows;
- "onednn": `onednn::qlinear_pointwise` (AMX where the CPU has it), on x quantized per row by
  gptlab's kernel, as decoding quantizes it (`OnednnInt8Weight` holds the weight in its layout).

`gemm_choice()` takes the one measured faster on GPT-2 small's block layers, once per machine
(cached with gptlab.machine_cache, as gptlab.gemm_probe caches the fp32 GEMM's timings), and
never oneDNN's where its sums saturate (no VNNI, or ONEDNN_MAX_CPU_ISA holding it below).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn as nn

from gptlab import gemm_probe, kernels
from gptlab.machine_cache import are_seconds_per_work, cached, machine_key

log = logging.getLogger(__name__)

GEMMS = ("auto", "fbgemm", "onednn")
SIDES = GEMMS[1:]  # the products measure() times
WORK = tuple(f"prompts {rows} rows" for rows in gemm_probe.PROMPT_ROWS)  # measure()'s workloads
CACHE_FILE = "int8.json"
_chosen: dict[tuple[int, str | None], str] = {}  # (threads, kernel variant) -> this process's choice


class OnednnInt8Weight:
    """An int8 weight (N, K) with its row scales (N,) in oneDNN's own layout (qlinear_prepack), for
    qlinear_pointwise. The packed weight is an opaque tensor, with no storage to copy: a copied or
    pickled layer packs its own weight again (QuantizedLinear.__getstate__)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        self.weight, self.scales = weight, scales  # the layer's buffers, not copies: int8 (N, K), bf16 (N,)
        self.packed = torch.ops.onednn.qlinear_prepack(weight, None)
        self.scales_f32 = scales.float()  # (N,)
        self.zero_points = torch.zeros(weight.size(0), dtype=torch.long)  # symmetric: none

    def scaled_sums(self, xq: torch.Tensor) -> torch.Tensor:
        """(M, N) fp32: sum_k (xq[m, k] - 128) w[n, k] times w's row scale, for xq (M, K) uint8
        stored + 128 (oneDNN's zero point for x, whose scale is given as 1)."""
        return torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, self.packed, self.scales_f32, self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")  # fmt: skip


def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's int8 linear layer (torch.ops.onednn.qlinear_pointwise: x86 builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def onednn_is_exact() -> bool:
    """Whether oneDNN's int8 product sums exactly here. Without VNNI, or held below it by
    ONEDNN_MAX_CPU_ISA, it multiplies u8 x s8 pairs into 16-bit sums, which saturate (this Xeon
    6/207 under ONEDNN_MAX_CPU_ISA=AVX2: 0.29 of the largest output off). Checked on the worst
    case: every activation byte 255 (x quantized to 127) against every weight 127."""
    K, N = 256, 16
    weight = OnednnInt8Weight(torch.full((N, K), 127, dtype=torch.int8), torch.ones(N, dtype=torch.bfloat16))
    y = weight.scaled_sums(torch.full((8, K), 255, dtype=torch.uint8))  # (8, N)
    return bool((y == 127 * 127 * K).all())  # exact in fp32 (< 2**24)


def gemm_choice(layer_class: type) -> str:
    """Whose int8 x int8 product multiplies int8 prompts (more rows than the decoding kernel takes)
    on a CPU where fbgemm's keeps full precision: "onednn" or "fbgemm" (the module's docstring).
    GPTLAB_INT8_GEMM=fbgemm|onednn forces one; auto (the default) takes fbgemm where oneDNN's
    sums would saturate (onednn_is_exact), else times both the first time a machine asks
    (measure(layer_class)), caches the timings, and takes the faster (a tie keeps fbgemm).
    layer_class: gptlab.quantize.Int8Linear, passed in as quantize imports this module."""
    want = _requested()
    if want == "onednn" and not onednn_available():
        raise ValueError("GPTLAB_INT8_GEMM=onednn: this PyTorch has no oneDNN int8 linear (qlinear_pointwise)")
    if want == "onednn" and not onednn_is_exact():
        raise ValueError(
            "GPTLAB_INT8_GEMM=onednn: oneDNN's int8 product saturates its 16-bit sums here (no VNNI, or "
            "ONEDNN_MAX_CPU_ISA holds it below); use fbgemm"
        )
    if want != "auto":
        return want
    if not (onednn_available() and kernels.available()[1] and onednn_is_exact()):
        return "fbgemm"
    at = (torch.get_num_threads(), kernels.variant())
    if at not in _chosen:
        key = machine_key(kernels.cpu_description(), f"kernels {at[1]}", "int8 prompts")
        timings, source, fresh = cached(
            CACHE_FILE, key, lambda: measure(layer_class), lambda entry: are_seconds_per_work(entry, WORK, SIDES)
        )
        total = {side: sum(timings[work][side] for work in WORK) for side in SIDES}
        _chosen[at] = "onednn" if total["onednn"] < total["fbgemm"] else "fbgemm"
        said = "; ".join(f"{n} {t['fbgemm'] * 1e3:.2f} ms against {t['onednn'] * 1e3:.2f}" for n, t in timings.items())
        level = logging.INFO if fresh else logging.DEBUG  # cached: DEBUG, as gemm_probe.timings
        log.log(level, "int8 prompts, fbgemm against oneDNN on this CPU (%s): %s; taking %s", source, said, _chosen[at])
    return _chosen[at]


def _requested() -> str:
    """GPTLAB_INT8_GEMM's value, one of GEMMS (auto when unset); ValueError for another."""
    want = os.environ.get("GPTLAB_INT8_GEMM", "auto").strip().lower() or "auto"
    if want not in GEMMS:
        raise ValueError(f"GPTLAB_INT8_GEMM={want!r}: expected one of {', '.join(GEMMS)}")
    return want


def warn_if_forced_in_vain(kernel: bool, exact: bool, no_kernel: str) -> None:
    """Warn, once per process, where GPTLAB_INT8_GEMM forces a product that int8 prompts cannot
    take here, so that it is not ignored unsaid: without AVX-512 VNNI (`exact` False: fbgemm's sums
    would saturate) they run gptlab's own int8 kernel, or the weight-only product without it;
    without gptlab's kernels (`kernel` False; `no_kernel` says why) fbgemm's, as oneDNN's takes x
    quantized per row by them."""
    want = _requested()
    if want == "auto" or exact and (kernel or want == "fbgemm"):  # honoured: gemm_choice's, or fbgemm's
        return
    if exact:  # without gptlab's kernels
        why = f"oneDNN's product takes x as gptlab's kernels quantize it, and they are not running ({no_kernel})"
        used = "fbgemm's"
    else:
        why = "without AVX-512 VNNI neither is taken (fbgemm's 16-bit sums would saturate)"
        used = "gptlab's int8 kernel" if kernel else "the weight-only product (bf16 activations)"
    kernels.warn_once(log, f"GPTLAB_INT8_GEMM={want} is ignored here: {why}; int8 prompts run {used}")


def measure(layer_class: type) -> dict[str, dict[str, float]]:
    """Seconds of GPT-2 small's four block layers in int8 (gemm_probe.LAYERS) at each of
    gemm_probe.PROMPT_ROWS rows, through each side's `layer_class` (Int8Linear; quantizing x
    included): the fastest of gemm_probe.ROUNDS alternating rounds after a warm-up."""
    kernels.wait_for_huge_pages()  # a timing taken while Linux copies a model's pages runs slow, and this one is cached
    g = torch.Generator().manual_seed(0)
    sides = {side: [] for side in SIDES}  # side -> its Int8Linear of each of LAYERS
    for N, K in gemm_probe.LAYERS.values():
        linear = nn.Linear(K, N)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(N, K, generator=g) * 0.02)
        for side, layers in sides.items():
            layer = layer_class.from_linear(linear, "int8")
            layer.prepare(prompts_gemm=side)
            layers.append(layer)
    result = {}
    for rows, work in zip(gemm_probe.PROMPT_ROWS, WORK, strict=True):
        xs = [torch.randn(rows, layer.in_features, generator=g) for layer in sides["fbgemm"]]

        def run(layers, xs=xs):
            with torch.no_grad():
                return [layer(x) for layer, x in zip(layers, xs, strict=True)]

        result[work] = gemm_probe.fastest({side: lambda ls=ls: run(ls) for side, ls in sides.items()})
    return result
