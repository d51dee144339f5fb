"""gptlab bench gemm: the training head's three products, gptlab's GEMM against PyTorch's.

A small model's training step is mostly its head: logits W x^T (V, n), then the gradients of the
inputs e^T W (n, C) and of the weight e x (V, C), with e the (V, n) softmax chunk. This times each
product with gl_sgemm (csrc/gemm.c) and with torch.mm (Intel's MKL in PyTorch's x86 builds) on the
same operands, alternating the two round by round (this machine's speed drifts by 20% within
minutes), and prints the medians, GFLOP/s and the ratios; `gemm.gemm_choice` says which one
training takes here (auto: gptlab's on AMD CPUs, on Intel ones whichever a probe measured faster,
`gptlab.gemm_probe`). Defaults: the demo's shape (GPT-2's vocabulary, B8xT128 = 1,024 rows, 128 wide).
Where gl_gemm_bf16 runs (AVX512-BF16, `gemm.gemm_bf16_runs`) it also times the bf16 products
of bf16 autocast both ways: `gemm.mm(..., bf16=True)`, gl_gemm_bf16 against torch's bf16 product
(oneDNN), each from the same fp32 operands.

Then prompts' products, which `gemm.prompt_gemm_choice` decides: GPT-2 small's four block layers
at --layer-rows rows of x, fp32 weights through `gemm.sgemm_linear` (gl_sgemm_nt reading the
weights in place up to `gemm.NT_ROWS` rows, else gl_sgemm) against F.linear, and bf16 weights
through `linear.bf16_linear_in_fp32` both ways (gptlab's GEMM widening the weight as it reads it,
against converting it for F.linear). These rows and the head's are the probe's measurement at
length, over more rounds and shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

from gptlab.bench.common import add_out_argument, positive, write_results

PRODUCTS = ("W x^T", "e^T W", "e x")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=positive, default=50257)
    p.add_argument("--rows", type=positive, default=1024, help="rows of x (tokens per chunk)")
    p.add_argument("--width", type=positive, default=128, help="the model's width (n_embd)")
    p.add_argument("--rounds", type=positive, default=9, help="timed rounds per side, alternating")
    p.add_argument("--layer-rows", type=positive, nargs="*", default=[16, 64, 512],
                   help="rows of x for the block layers' products (none: skip them)")  # fmt: skip
    add_out_argument(p)
    return p.parse_args(argv)


@contextlib.contextmanager
def gemm_env_kept():
    """Within the block the timings set GPTLAB_GEMM to each side in turn; after it, it is as it was."""
    before = os.environ.get("GPTLAB_GEMM")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GPTLAB_GEMM", None)
        else:
            os.environ["GPTLAB_GEMM"] = before


def operands(V: int, n: int, C: int):
    """The head W (V, C), rows x (n, C), a softmax chunk e (V, n) and the outputs, fp32, laid out
    as training's (gemm_probe.head_operands)."""
    import torch

    from gptlab.gemm_probe import head_operands

    return head_operands(V, n, C, torch.Generator().manual_seed(0))


def time_products(choice: str, bf16: bool, w, x, e, logits, grad_x, grad_w) -> list[float]:
    """Seconds of each of the three products through gemm.mm(bf16=bf16) with GPTLAB_GEMM=choice."""
    from gptlab import gemm

    os.environ["GPTLAB_GEMM"] = choice
    seconds = []
    for a, b, out in ((w, x.t(), logits), (e.t(), w, grad_x), (e, x, grad_w)):
        t0 = time.perf_counter()
        gemm.mm(a, b, out, bf16=bf16)
        seconds.append(time.perf_counter() - t0)
    return seconds


def time_layers(choice: str, dtype, xs: dict, weights: dict, reps: int) -> float:
    """Seconds of `reps` forwards of the four block layers (x fp32 or bf16 as the weights), with
    GPTLAB_GEMM=choice: fp32 through gemm.sgemm_linear or F.linear, bf16 through
    linear.bf16_linear_in_fp32 (which takes gptlab's GEMM or converts for F.linear by the choice)."""
    import torch
    import torch.nn.functional as F

    from gptlab import gemm, linear

    os.environ["GPTLAB_GEMM"] = choice
    if dtype is torch.float32:
        forward = gemm.sgemm_linear if choice == "gptlab" else F.linear
    else:
        forward = linear.bf16_linear_in_fp32
    t0 = time.perf_counter()
    for _ in range(reps):
        for name, w in weights.items():
            forward(xs[name], w, None)
    return time.perf_counter() - t0


def layer_rows(rows_list: list[int], rounds: int) -> list[dict]:
    """Medians (ms) of the four block layers' products per row count and weight dtype, gptlab's GEMM
    against torch's, alternating round by round."""
    import torch

    from gptlab.gemm_probe import LAYERS

    g = torch.Generator().manual_seed(0)
    weights32 = {name: torch.randn(N, K, generator=g) * 0.02 for name, (N, K) in LAYERS.items()}
    rows = []
    for M in rows_list:
        reps = max(1, 2048 // M)  # ~0.1 GFLOP or more per timing
        for dtype in (torch.float32, torch.bfloat16):
            weights = {name: w.to(dtype) for name, w in weights32.items()}
            xs = {name: torch.randn(M, LAYERS[name][1], generator=g).to(dtype) for name in LAYERS}
            times = {"gptlab": [], "torch": []}
            for side in times:
                time_layers(side, dtype, xs, weights, 1)  # warm-up
            for _ in range(rounds):
                for side in times:
                    times[side].append(time_layers(side, dtype, xs, weights, reps) / reps)
            ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
            rows.append({"rows": M, "weights": str(dtype).removeprefix("torch."), "gptlab_ms": round(ms["gptlab"], 4),
                         "torch_ms": round(ms["torch"], 4), "speedup": round(ms["torch"] / ms["gptlab"], 3)})  # fmt: skip
    return rows


def main(argv=None) -> int:
    import torch

    from gptlab import gemm, gemm_probe, kernels

    args = parse_args(argv or [])
    if not kernels.available()[0]:
        raise SystemExit(f"gptlab's kernels are not available here: {kernels.available()[2]}")
    chosen, bf16_runs = gemm.gemm_choice(), gemm.gemm_bf16_runs()
    prompts = {rows: gemm.prompt_gemm_choice(rows) for rows in gemm_probe.PROMPT_ROWS}
    V, n, C = args.vocab, args.rows, args.width
    tensors = operands(V, n, C)
    flop = 2.0 * V * n * C
    print(f"head products V={V} n={n} C={C}, {torch.get_num_threads()} threads, kernels {kernels.describe()}")
    print(f"training takes: {chosen}, prompts: {', '.join(f'{n} rows {c}' for n, c in prompts.items())}"
          " (GPTLAB_GEMM=auto: by CPU vendor, measured on Intel's)")  # fmt: skip
    results = {
        "config": vars(args),
        "chosen": chosen,
        "prompts_take": {str(rows): c for rows, c in prompts.items()},
        "bf16_products": gemm.gemm_bf16_choice(),
    }
    for dtype in ("float32", "bfloat16") if bf16_runs else ("float32",):
        bf16 = dtype == "bfloat16"
        times = {"gptlab": [], "torch": []}
        with gemm_env_kept():
            for side in times:  # warm-up
                time_products(side, bf16, *tensors)
            for _ in range(args.rounds):
                for side in times:
                    times[side].append(time_products(side, bf16, *tensors))
        print(f" {dtype} ({'gl_gemm_bf16 against torch bf16 (oneDNN)' if bf16 else 'gl_sgemm against torch.mm'}):")
        rows = []
        for i, name in enumerate(PRODUCTS):
            ms = {side: statistics.median(t[i] for t in times[side]) * 1e3 for side in times}
            ratio = ms["torch"] / ms["gptlab"]
            rows.append({"product": name, "gptlab_ms": ms["gptlab"], "torch_ms": ms["torch"], "speedup": ratio})
            print(f"  {name:6s}  gptlab {ms['gptlab']:7.1f} ms ({flop / ms['gptlab'] / 1e6:5.1f} GFLOP/s)   "
                  f"torch {ms['torch']:7.1f} ms ({flop / ms['torch'] / 1e6:5.1f} GFLOP/s)   {ratio:.2f}x")  # fmt: skip
        total = {side: sum(r[f"{side}_ms"] for r in rows) for side in times}
        print(f"  all three: gptlab {total['gptlab']:.1f} ms, torch {total['torch']:.1f} ms, "
              f"{total['torch'] / total['gptlab']:.2f}x")  # fmt: skip
        key = "" if dtype == "float32" else "_bf16"  # fp32's keys as before
        results[f"products{key}"], results[f"total_ms{key}"] = rows, total
    if args.layer_rows:
        with gemm_env_kept():
            results["block_layers"] = layer_rows(args.layer_rows, args.rounds)
        print(" GPT-2's four block layers, prompts (fp32: sgemm_linear against F.linear; bf16: gptlab's GEMM widening the weight against converting it for F.linear):")  # fmt: skip
        for r in results["block_layers"]:
            print(f"  {r['rows']:4d} rows, {r['weights']:8s} weights  gptlab {r['gptlab_ms']:7.2f} ms   torch {r['torch_ms']:7.2f} ms   {r['speedup']:.2f}x"
                  f"   (takes {gemm.prompt_gemm_choice(r['rows'])})")  # fmt: skip
    write_results("gemm", results, args.out)
    return 0
