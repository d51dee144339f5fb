"""Whose fp32 GEMM an Intel CPU runs, gptlab's or PyTorch's, measured once per machine.

On x86 CPUs not made by Intel, gptlab's GEMM (csrc/gemm.c) runs prompts' layers and the training
head without measuring: PyTorch's x86 builds multiply with Intel's MKL, measured slower on every
AMD EPYC tried (Zen 3, 4 and 5; `gptlab bench gemm`). On Intel CPUs MKL is tuned for the very
chip, and gptlab's GEMM has not been timed against it on one: rather than guess, `auto` times both
on two kinds of work the first time it is asked on a machine, and caches the timings
(gptlab.machine_cache), so that every later process makes the same choice:

- prompts: GPT-2 small's four block layers at PROMPT_ROWS rows of x, gemm.sgemm_linear (the
  weights read in place) against F.linear; a prompt takes what ran the row count nearest its own
  (prompt_work), as the two can disagree: on an Intel Xeon 6/207 gptlab's GEMM ran 64 rows 1.13x
  MKL's speed and 512 rows 0.92x;
- the training head: its three products for 1,024 tokens 128 wide (the demo's) against a slice
  of HEAD_VOCAB rows of the vocabulary, gl_sgemm against torch.mm.

Each kind of work takes the GEMM that ran it faster (gemm.prompt_gemm_choice for prompts of a
number of rows, gemm.gemm_choice for the head; a tie keeps PyTorch's). Both sides are timed in alternating
rounds, the first a warm-up, and the fastest of the others counts. The whole measurement takes
about a second on two cores. gptlab's side is what kernels hands in (gemm.measure_gemms), so
that this module sits below kernels in the import graph.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gptlab.machine_cache import are_seconds_per_work, cached

log = logging.getLogger(__name__)

CACHE_FILE = "gemm.json"
ROUNDS = 3  # timed rounds per side, after one to warm up
# GPT-2 small's block layers, (out_features, in_features)
LAYERS = {"attn c_attn": (2304, 768), "attn c_proj": (768, 768), "mlp c_fc": (3072, 768), "mlp c_proj": (768, 3072)}
PROMPT_ROWS = (64, 512)  # both within gemm.NT_ROWS: sgemm_linear then never asks gemm_choice
WORK = (*(f"prompts {rows} rows" for rows in PROMPT_ROWS), "head")  # measure()'s workloads, each chosen apart
SIDES = ("gptlab", "torch")  # whose GEMM each workload is timed through
HEAD_VOCAB, HEAD_ROWS, HEAD_WIDTH = 8192, 1024, 128
# A training chunk's logits, and the softmax e written over them, have rows this many floats longer
# than the chunk's 1,024 columns (chunked_loss.ROW_PAD: rows exactly 4 KB apart put a column's values
# in the same few cache sets); they are timed laid out so.
E_ROW_PAD = 16


def choice(work: str, timings: dict) -> str:
    """ "gptlab" or "torch": whose GEMM ran `work` (one of WORK) faster in `timings`."""
    if work not in WORK:
        raise ValueError(f"gemm_probe.choice: work must be one of {', '.join(WORK)}, not {work!r}")
    t = timings[work]
    return "gptlab" if t["torch"] > t["gptlab"] else "torch"


def prompt_work(rows: int) -> str:
    """The prompts' workload (one of WORK) whose row count is nearest `rows` on a log scale: 64
    rows' up to 181 rows (the geometric mean of 64 and 512), 512 rows' beyond. On the Intel Xeon
    6/207 (2026-12-06), GPT-2's 512-token fp32 prefill with gptlab's GEMM against MKL, alternating,
    medians of 9, two alternations: 0.89x / 0.90x at 512 tokens, 0.98x / 0.98x at 256, 1.02x / 1.03x
    at 128; the probe, 1.13x at 64 rows."""
    nearest = min(PROMPT_ROWS, key=lambda n: abs(math.log(max(rows, 1) / n)))
    return f"prompts {nearest} rows"


def timings(key: str, measure: Callable[[], dict]) -> dict:
    """The timings of this machine (`key`, gptlab.machine_cache.machine_key): the cache file's, or
    measure() now (gemm.measure_gemms), logged (at DEBUG when cached: `gptlab generate` would
    print it amid its output in every process)."""
    result, source, fresh = cached(CACHE_FILE, key, measure, lambda entry: are_seconds_per_work(entry, WORK, SIDES))
    level = logging.INFO if fresh else logging.DEBUG
    log.log(level, "gptlab's GEMM against PyTorch's on this CPU (%s): %s", source, describe(result))
    return result


def describe(timings: dict) -> str:
    """One line: each workload's seconds both ways and the speedup of gptlab's GEMM."""
    return "; ".join(f"{name} {t['gptlab'] * 1e3:.1f} ms against {t['torch'] * 1e3:.1f} ({t['torch'] / t['gptlab']:.2f}x)"
                     for name, t in timings.items())  # fmt: skip


def measure(sgemm_linear: Callable, sgemm: Callable) -> dict[str, dict[str, float]]:
    """Seconds of each workload ("prompts 64 rows", "prompts 512 rows", "head") on each side:
    gptlab's through `sgemm_linear` (x, W, bias) -> x W^T + bias and `sgemm` (a, b, out), out =
    a @ b (gemm.sgemm_linear, gl_sgemm), PyTorch's through F.linear and torch.mm."""
    g = torch.Generator().manual_seed(0)
    result = {}
    weights = [torch.randn(N, K, generator=g) * 0.02 for N, K in LAYERS.values()]
    for rows in PROMPT_ROWS:
        layers = [(torch.randn(rows, w.size(1), generator=g), w) for w in weights]  # (x (rows, K), W (N, K))
        result[f"prompts {rows} rows"] = fastest(prompt_layers(layers, sgemm_linear))
    result["head"] = fastest(head_products(g, sgemm))
    return result


def prompt_layers(layers: list, sgemm_linear: Callable) -> dict:
    """The layers' products y = x W^T on each side, for (x, W) pairs."""
    return {
        "gptlab": lambda: [sgemm_linear(x, w, None) for x, w in layers],
        "torch": lambda: [F.linear(x, w) for x, w in layers],
    }


def head_operands(V: int, n: int, C: int, g: torch.Generator) -> tuple:
    """The head W (V, C), rows x (n, C), a softmax chunk e (V, n), and outputs for the three
    products: logits (V, n), grad_x (n, C), grad_w (V, C); fp32, e's and the logits' rows
    E_ROW_PAD floats apart more, as training's chunk buffer."""
    w, x = torch.randn(V, C, generator=g) * 0.02, torch.randn(n, C, generator=g)
    e = torch.rand(V, n + E_ROW_PAD, generator=g)[:, :n].div_(V)
    logits = torch.empty(V, n + E_ROW_PAD)[:, :n]
    return w, x, e, logits, torch.empty(n, C), torch.empty(V, C)


def head_products(g: torch.Generator, sgemm: Callable) -> dict:
    """The head's three products on each side: logits W x^T, then e^T W and e x (e the softmax)."""
    w, x, e, logits, grad_x, grad_w = head_operands(HEAD_VOCAB, HEAD_ROWS, HEAD_WIDTH, g)
    products = [(w, x.t(), logits), (e.t(), w, grad_x), (e, x, grad_w)]
    return {
        "gptlab": lambda: [sgemm(a, b, out) for a, b, out in products],
        "torch": lambda: [torch.mm(a, b, out=out) for a, b, out in products],
    }


def fastest(runs: dict) -> dict[str, float]:
    """The fastest of ROUNDS timed calls of each of `runs` (side -> callable), alternating."""
    best = {side: math.inf for side in runs}
    for round_ in range(ROUNDS + 1):  # the first round warms up
        for side, run in runs.items():
            t0 = time.perf_counter()
            run()
            if round_:
                best[side] = min(best[side], time.perf_counter() - t0)
    return best
