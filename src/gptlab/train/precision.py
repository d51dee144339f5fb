"""Training precision: which autocast dtype a run uses, and `auto`'s measured choice.

`precision="auto"` on a CPU: bf16 autocast pays only where the matmuls run natively in bf16
(AMX, AVX512-BF16); elsewhere oneDNN emulates them and a bf16 step is slower than fp32 (issue 13:
0.85-0.95 s against 0.66 s per demo step on an Intel Xeon without native bf16). An x86 CPU whose
flags name no bf16 instructions therefore trains in fp32 without measuring (the probe cost 20 s
on an AMD EPYC, issue 22), as does one where oneDNN is held below AVX-512 (ONEDNN_MAX_CPU_ISA).
Where they are named the flags are not trusted further: auto times one forward + backward of the
model being trained, on its own shapes, in fp32 and under bf16 autocast, takes bf16 only if
clearly faster (BF16_MARGIN), and caches the timings per machine (gptlab.machine_cache: CPU model
and features, torch version, threads, model shape) in gptlab's cache directory. On CUDA auto is
bf16 where supported.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import torch

from gptlab import kernels
from gptlab.cpu import may_have_native_bf16
from gptlab.machine_cache import are_seconds, cached, machine_key

log = logging.getLogger(__name__)

CACHE_FILE = "precision.json"
PRECISIONS = ("float32", "bfloat16")  # what probe() times
PROBE_TOKENS = 1024  # at most this many tokens per timed forward + backward
PROBE_REPEATS = 2  # timed runs per precision; the fastest counts
# bf16 autocast only where its probed step takes under this fraction of fp32's: the probe is one
# step, the run hundreds, and bf16 costs some loss per step. AMD EPYC Zen 4 (AVX512-BF16),
# 2026-12-03: with oneDNN's bf16 head the probe gave 301 against 316 ms (0.95) and took bf16, and
# `make demo` then ran 609 steps to a validation loss of 5.054, where fp32 ran 688 steps to 5.017 in
# the same 4 minutes. With the head in gl_gemm_bf16 (vdpbf16ps) the probe gives 241 against 354 ms
# (0.68), and the demo ran 790 steps to 4.956 against fp32's 512 steps to 5.125, run after it.
BF16_MARGIN = 0.9


def autocast(device: torch.device, dtype: torch.dtype):
    """The autocast context for a training precision (none for float32)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def resolve_precision(name: str, device: torch.device, model=None, rows: tuple[int, int] = (1, 1)):
    """(autocast dtype, why): the precision to train in for `name` (auto|float32|bfloat16|float16).

    `auto` on CPU measures `model` on a (batch, block) of `rows` (see the module docstring).
    """
    if name == "float16" and device.type != "cuda":
        raise ValueError("precision float16 needs CUDA (a GradScaler on CPU buys nothing); use bfloat16 or float32")
    if name != "auto":
        if name == "bfloat16" and device.type == "cpu" and not onednn_runs_bf16():
            log.warning("precision bfloat16: this CPU has no native bf16, its matmuls are emulated and usually slower "
                        "than float32 (precision=auto measures)")  # fmt: skip
        return getattr(torch, name), "as configured"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: this GPU supports bf16"
        return torch.float32, "auto: this GPU has no bf16"
    if model is None:
        return torch.float32, "auto: no model to measure"
    if not may_have_native_bf16():
        return torch.float32, "auto: this CPU has no bf16 instructions (no AVX512-BF16 or AMX), bf16 would be emulated"
    if not onednn_runs_bf16():
        return torch.float32, "auto: oneDNN runs no bf16 instructions here (the CPU, or ONEDNN_MAX_CPU_ISA): emulated"
    timings, source = cached_probe(model, device, rows)
    choice = torch.bfloat16 if timings["bfloat16"] < BF16_MARGIN * timings["float32"] else torch.float32
    why = (f"auto: one forward + backward of this model took {timings['float32'] * 1e3:.0f} ms in float32 and "
           f"{timings['bfloat16'] * 1e3:.0f} ms in bfloat16 autocast ({source})")  # fmt: skip
    return choice, why


def onednn_runs_bf16() -> bool:
    """Whether oneDNN may use bf16 instructions at all: not on a CPU without them (an aarch64 one),
    nor below AVX-512, which ONEDNN_MAX_CPU_ISA can impose on a CPU whose flags name bf16. Held to
    AVX2 so, the Intel Xeon 6/207's probe took 41.6 s per bf16 step against 0.29 s in fp32
    (2026-12-07): its three bf16 runs cost two minutes. True where PyTorch cannot say (a build
    without oneDNN): the probe then measures."""
    try:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return True


def cached_probe(model, device: torch.device, rows: tuple[int, int]) -> tuple[dict, str]:
    """Seconds per forward + backward in each precision, from the cache or measured now."""
    batch, block = _probe_shape(*rows)
    cfg = model.config
    shape = f"L{cfg.n_layer} C{cfg.n_embd} H{cfg.n_head} V{cfg.vocab_size}"
    key = machine_key(kernels.cpu_description(), shape, f"{batch}x{block}")
    timings, source, _ = cached(
        CACHE_FILE, key, lambda: probe(model, device, batch, block), lambda entry: are_seconds(entry, PRECISIONS)
    )
    return timings, source


def _probe_shape(batch: int, block: int) -> tuple[int, int]:
    return max(1, min(batch, PROBE_TOKENS // block)), block


def probe(model, device: torch.device, batch: int, block: int) -> dict[str, float]:
    """Fastest of PROBE_REPEATS timed forward + backward passes per precision, alternating.

    The model is run in eval mode (no dropout, so the global RNG is untouched) and its
    gradients are cleared afterwards: the weights and the run's randomness are as before. It first
    waits for the huge-page thread (kernels.wait_for_huge_pages): a model decoded in this process
    has its pages copied by Linux meanwhile, which slows a timing, and this one is cached.
    """
    kernels.wait_for_huge_pages()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (batch, block + 1), generator=g).to(device)
    x, y = idx[:, :-1], idx[:, 1:]  # (B, T) each
    if model.config.num_labels:  # a classifier's targets: one label per row, (B,)
        y = torch.randint(0, model.config.num_labels, (batch,), generator=g).to(device)
    was_training = model.training
    model.eval()
    best = {"float32": float("inf"), "bfloat16": float("inf")}
    try:
        for repeat in range(PROBE_REPEATS + 1):  # the first round warms up
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                t0 = time.perf_counter()
                with autocast(device, dtype):
                    _, loss = model(x, y, return_logits=False)
                loss.backward()
                if repeat:
                    best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return best
