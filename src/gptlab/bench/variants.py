"""gptlab bench variants: every kernel variant this CPU runs, side by side, and which one auto takes.

The same model (random weights, seeded) per precision decodes greedily and fills a prompt under
each variant in turn (kernels.use_variant), the variants interleaved round by round so that the
machine's drift (20% within minutes on a shared VM) falls on all of them alike; the training
head's three fp32 products (gl_sgemm, as `gptlab bench gemm` times them) likewise. Medians are
printed with each variant's ratio to the one auto picks (kernels.auto_variant): the evidence for
a CPU rule such as kernels.HALF_WIDTH_AVX512, measurable on any CPU. A variant named NAME:nta or
NAME:t0 runs with decoding's weights prefetched non-temporally or into every cache level
(kernels.use_prefetch_nta), the evidence for that rule likewise.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from gptlab import cpu, kernels
from gptlab.bench.common import add_out_argument, positive, write_results
from gptlab.bench.gemm import gemm_env_kept, operands, time_products
from gptlab.bench.generate import build_mode, gptlab_engine
from gptlab.config import GPTConfig
from gptlab.model import GPT


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2", help="model shape (random weights, seeded)")
    p.add_argument("--modes", default="fp32,bf16,int8,int4", help="comma-separated precisions")
    p.add_argument(
        "--variants",
        default="",
        help="comma-separated NAME, NAME:nta or NAME:t0 (with decoding's prefetch hint set); "
        "default: every SIMD one this CPU runs",
    )
    p.add_argument("--new-tokens", type=positive, default=64, help="tokens decoded per timed run, batch 1")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens filled per timed run (0: skip)")
    p.add_argument("--rounds", type=positive, default=3, help="timed rounds, every variant once per round")
    p.add_argument("--gemm-rows", type=int, default=1024, help="rows of the head GEMM's x (0: skip the GEMM)")
    p.add_argument("--gemm-width", type=positive, default=128, help="the head GEMM's width (the demo model's)")
    add_out_argument(p)
    return p.parse_args(argv)


def chosen_variants(arg: str) -> list[str]:
    """The variants to time: `arg`'s (each one this CPU must run, with an optional :nta or :t0), or
    every one it runs but the portable reference (unless that is all it runs)."""
    variants = [v.strip() for v in arg.split(",") if v.strip()]
    variants = variants or [v for v in kernels.runnable_variants() if v != "portable"] or ["portable"]
    for v in variants:
        name, _, hint = v.partition(":")
        if hint not in ("", "nta", "t0"):
            raise SystemExit(f"gptlab bench variants: {v!r}: a prefetch hint is :nta or :t0")
        if name not in kernels.VARIANTS or kernels.missing_features(name):
            raise SystemExit(
                f"gptlab bench variants: this CPU cannot run {name!r} (it runs {', '.join(kernels.runnable_variants())})"
            )
    return variants


@contextlib.contextmanager
def running(spec: str):
    """Within the block, the variant NAME[:nta|:t0] runs, with decoding's prefetch hint when it names one."""
    name, _, hint = spec.partition(":")
    hinted = kernels.use_prefetch_nta(hint == "nta") if hint else contextlib.nullcontext()
    with kernels.use_variant(name), hinted:
        yield


def time_mode(model, variants: list[str], args, vocab: int) -> dict[str, dict[str, list[float]]]:
    """Per variant, per round: decode tok/s (batch 1) and prefill tok/s of `model`."""
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(0, vocab, (1, 4), generator=gen)
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=gen) if args.prompt_len else None
    run = gptlab_engine(model)
    times = {v: {"decode_tok_s": [], "prefill_tok_s": []} for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            with running(v), torch.no_grad():
                run(short, 2)  # warm-up: this variant's library and caches
                t0 = time.perf_counter()
                run(short, args.new_tokens)
                times[v]["decode_tok_s"].append(args.new_tokens / (time.perf_counter() - t0))
                if prompt is not None:
                    t0 = time.perf_counter()
                    run(prompt, 1)
                    times[v]["prefill_tok_s"].append(args.prompt_len / (time.perf_counter() - t0))
    return times


def time_gemm(variants: list[str], args) -> dict[str, list[float]]:
    """Per variant, per round: GFLOP/s of the training head's three products in gl_sgemm."""
    vocab = GPTConfig.from_name(args.preset).vocab_size
    tensors = operands(vocab, args.gemm_rows, args.gemm_width)
    flop = 3 * 2.0 * vocab * args.gemm_rows * args.gemm_width
    out = {v: [] for v in variants}
    with gemm_env_kept():
        for r in range(args.rounds + 1):  # the first round warms up
            for v in variants:
                with running(v):
                    seconds = sum(time_products("gptlab", False, *tensors))  # fp32
                if r:
                    out[v].append(flop / seconds / 1e9)
    return out


def medians(per_round: dict) -> dict:
    return {k: round(statistics.median(v), 1) for k, v in per_round.items() if v}


def main(argv=None) -> int:
    args = parse_args(argv or [])
    if not kernels.available()[0]:
        raise SystemExit(f"gptlab's kernels are not available here: {kernels.available()[2]}")
    variants, auto = chosen_variants(args.variants), kernels.auto_variant()
    torch.manual_seed(0)
    config = GPTConfig.from_name(args.preset)
    state = GPT(config).eval().state_dict()
    print(f"kernel variants on {cpu.name()} (family {cpu.family()}), {torch.get_num_threads()} threads;"
          f" auto takes {auto}; medians of {args.rounds} interleaved rounds")  # fmt: skip
    rows = []
    for mode in args.modes.split(","):
        per_variant = time_mode(build_mode(mode, state, config), variants, args, config.vocab_size)
        for v in variants:
            rows.append({"mode": mode, "variant": v, **medians(per_variant[v])})
    if args.gemm_rows:
        for v, gflops in time_gemm(variants, args).items():
            rows.append({"mode": "head GEMM", "variant": v, "gflop_s": round(statistics.median(gflops), 1)})
    print_rows(rows, auto if auto in variants else variants[0], auto)
    write_results("variants", {"config": vars(args), "auto": auto, "rows": rows}, args.out)
    return 0


def print_rows(rows: list[dict], base_variant: str, auto: str) -> None:
    """One line per (mode, variant): its medians and their ratios to base_variant's (auto's variant,
    or the first one timed when auto's is not among them)."""
    base = {
        (r["mode"], k): v
        for r in rows
        if r["variant"] == base_variant
        for k, v in r.items()
        if k not in ("mode", "variant")
    }
    for r in rows:
        cells = []
        for key, unit in (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"), ("gflop_s", "GFLOP/s")):
            if key in r:
                ratio = r[key] / base[r["mode"], key] if base.get((r["mode"], key)) else float("nan")
                cells.append(f"{unit} {r[key]:8.1f} ({ratio:.2f}x)")
        mark = "  <- auto" if r["variant"] == auto else ""
        print(f"  {r['mode']:9s} {r['variant']:10s} " + "   ".join(cells) + mark)
