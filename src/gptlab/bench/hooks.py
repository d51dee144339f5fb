"""gptlab bench hooks: gptlab's hook points against TransformerLens 4's TransformerBridge.

The same random weights (a `--preset`-shaped GPT written by gptlab's save_pretrained, which the
Bridge boots with `boot_transformers`), 2 threads by default, in one process:
- run_with_cache of every hook point on a --tokens prompt: seconds (median of --repeats) and the
  bytes the cache holds; and of one hook point against a plain forward (gptlab's overhead);
- the layers x positions activation-patching grid of the 20-token IOI prompt pair: gptlab's
  batched `activation_patching` against the loop of single patches through the Bridge's
  `run_with_hooks` (one forward per cell), and the largest difference between the two grids;
- peak memory of run_with_cache of every hook point, each side in a fresh process (Linux): the
  resident set with the model loaded and warm, and its peak during the call.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from gptlab.bench.common import add_out_argument, positive, repeat_seconds, write_results

CLEAN = "Then, Mary and John had a long and happy day at the beach. John gave a drink to"  # 20 tokens
CORRUPT = "Then, Mary and John had a long and happy day at the beach. Mary gave a drink to"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench hooks", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2", help="model shape (random weights)")
    p.add_argument("--tokens", type=positive, default=128, help="prompt length for run_with_cache")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--no-patching", action="store_true", help="skip the patching grid")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--memory-side", choices=("gptlab", "bridge"), help=argparse.SUPPRESS)  # one side's process
    add_out_argument(p)
    return p.parse_args(argv)


def median_seconds(fn, repeats: int) -> float:
    return statistics.median(repeat_seconds(fn, repeats))


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in (cache[k] for k in cache.keys()))


def patching_loop(bridge, clean, corrupt, metric, n_layer: int) -> torch.Tensor:
    """The layers x positions grid, one Bridge forward per cell."""
    _, cache = bridge.run_with_cache(clean)
    grid = torch.empty(n_layer, clean.size(1))
    for layer in range(n_layer):
        name = f"blocks.{layer}.hook_resid_pre"
        for pos in range(clean.size(1)):

            def patch(x, hook, pos=pos, name=name):
                x = x.clone()
                x[:, pos] = cache[name][:, pos]
                return x

            with torch.no_grad():
                grid[layer, pos] = metric(bridge.run_with_hooks(corrupt, fwd_hooks=[(name, patch)]))[0]
    return grid


def peak_memory(args) -> dict:
    """Peak RSS (MiB) of run_with_cache of every hook point, each side in its own fresh process."""
    import json
    import subprocess
    import sys

    out = {}
    for side in ("gptlab", "bridge"):
        cmd = [sys.executable, "-m", "gptlab.bench.hooks", "--memory-side", side, "--preset", args.preset,
               "--tokens", str(args.tokens), "--threads", str(args.threads)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[side] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"loaded_mib": {k: v["loaded_mib"] for k, v in out.items()},
            "peak_mib": {k: v["peak_mib"] for k, v in out.items()},
            "added_by_the_call_mib": {k: round(v["peak_mib"] - v["loaded_mib"], 1) for k, v in out.items()}}  # fmt: skip


def _one_side(args) -> None:
    """In a fresh process: load one side, reset the peak RSS (Linux's clear_refs), run_with_cache
    every hook point, and print the resident set before and its peak during the call."""
    import json

    from gptlab.loading import random_model

    torch.manual_seed(0)
    model = random_model(args.preset).eval()
    idx = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    if args.memory_side == "bridge":
        from transformer_lens.model_bridge import TransformerBridge

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            del model
            runner = TransformerBridge.boot_transformers(tmp, device="cpu")
    else:
        runner = model
    with torch.no_grad():
        runner(idx)  # warm: allocator pools and lazy set-up belong to "loaded", not to the cache
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from the current resident set
        loaded = _status_mib("VmRSS")
        runner.run_with_cache(idx)
    print(json.dumps({"loaded_mib": loaded, "peak_mib": _status_mib("VmHWM")}))


def _status_mib(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return round(int(line.split()[1]) / 1024, 1)  # kB
    raise ValueError(f"/proc/self/status has no {key}")


def main(argv=None) -> int:
    args = parse_args(argv or [])
    torch.set_num_threads(args.threads)
    if args.memory_side:
        _one_side(args)
        return 0
    from transformer_lens.model_bridge import TransformerBridge

    from gptlab.loading import random_model
    from gptlab.patching import activation_patching, logit_diff
    from gptlab.tokenizer import get_tokenizer

    torch.manual_seed(0)
    model = random_model(args.preset).eval()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        bridge = TransformerBridge.boot_transformers(tmp, device="cpu")
    idx = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    one = f"blocks.{model.config.n_layer // 2}.hook_resid_post"
    with torch.no_grad():
        plain = median_seconds(lambda: model(idx), args.repeats)
        single = median_seconds(lambda: model.run_with_cache(idx, names_filter=one), args.repeats)
        ours = median_seconds(lambda: model.run_with_cache(idx), args.repeats)
        theirs = median_seconds(lambda: bridge.run_with_cache(idx), args.repeats)
        _, our_cache = model.run_with_cache(idx)
        _, their_cache = bridge.run_with_cache(idx)
    rows["one_hook"] = {"hook": one, "plain_forward_s": round(plain, 4), "cached_s": round(single, 4),
                        "overhead": round(single / plain - 1, 3)}  # fmt: skip
    rows["run_with_cache"] = {
        "tokens": args.tokens, "gptlab_s": round(ours, 4), "bridge_s": round(theirs, 4),
        "speedup": round(theirs / ours, 2), "gptlab_points": len(our_cache), "bridge_points": len(their_cache.keys()),
        "gptlab_cache_mib": round(cache_bytes(our_cache) / 2**20, 1),
        "bridge_cache_mib": round(cache_bytes(their_cache) / 2**20, 1),
    }  # fmt: skip
    if not args.no_patching:
        tok = get_tokenizer("gpt2")
        clean, corrupt = (torch.tensor([tok.encode(p)]) for p in (CLEAN, CORRUPT))
        metric = logit_diff(tok.encode(" Mary")[0], tok.encode(" John")[0])
        t0 = time.perf_counter()
        grid = activation_patching(model, clean, corrupt, metric)["grid"]
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        loop = patching_loop(bridge, clean, corrupt, metric, model.config.n_layer)
        theirs = time.perf_counter() - t0
        rows["patching_grid"] = {
            "tokens": clean.size(1), "cells": grid.numel(), "gptlab_s": round(ours, 3), "bridge_loop_s": round(theirs, 3),
            "speedup": round(theirs / ours, 2), "max_abs_difference": float((grid - loop).abs().max()),
        }  # fmt: skip
    if not args.no_memory:
        rows["run_with_cache_memory"] = peak_memory(args)
    for name, row in rows.items():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    write_results("hooks", {"settings": vars(args), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
