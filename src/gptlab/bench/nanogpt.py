"""gptlab bench nanogpt: gptlab's trainer against karpathy/nanoGPT's train.py, same data, model, batch, time.

Both train the demo's model (4 layers, 128 wide, 4 heads, block 128, biases, no dropout; GPT-2's
vocabulary: 50,257 in gptlab, nanoGPT's 50,304 padding) on the same train.bin (nanoGPT's uint16
format, as `gptlab prepare` writes it) with batch 8 x 128 on the CPU in fp32, for the same wall
time each (`--seconds`):
- gptlab: `gptlab train` with the demo config (src/gptlab/configs/demo.toml) and max_time, with
  AdamW for every parameter as nanoGPT (the demo's Muon for the blocks is a recipe, not speed);
- nanoGPT: its own train.py and model.py from `--nanogpt-dir` (a checkout; never vendored here),
  with the demo's learning rate, warmup, minimum and Adam betas, its cosine schedule stretched over the number
  of iterations that fit in the same time (measured by a short calibration run first).
Then both final models are scored by the same code on the same batches (the whole validation
split, as the trainer's evaluation sees it). Reported: training tokens/s (median step time,
evaluation excluded), validation loss, and the wall time each took. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gptlab.bench.common import (
    add_out_argument,
    check_prepared,
    positive,
    positive_seconds,
    run_child,
    train_command,
    write_results,
)

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=8)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench nanogpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt-dir", required=True, help="a checkout of karpathy/nanoGPT (train.py, model.py)")
    p.add_argument("--data", default="runs/demo/data", help="prepared demo data: train.bin, val.bin (gptlab demo)")
    p.add_argument("--seconds", type=positive_seconds, default=120.0, help="training wall time for each side")
    p.add_argument("--calibrate-iters", type=positive, default=15, help="nanoGPT iterations timed to size its run")
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    add_out_argument(p)
    return p.parse_args(argv)


def demo_recipe() -> dict:
    from importlib import resources

    from gptlab.train_config import TrainConfig

    return TrainConfig.from_toml(resources.files("gptlab") / "configs" / "demo.toml").to_dict()


def settled(step_times: list[float]) -> list[float]:
    """Step times without the first few (allocator and caches warming up), or all of a short run."""
    return step_times[min(5, len(step_times) // 2) :]


def run_gptlab(data: Path, work: Path, seconds: float) -> dict:
    """`gptlab train` with the demo config for `seconds`; its step times and the final model."""
    out = work / "gptlab"
    settings = dict(data_dir=data, out_dir=out, max_time=f"{seconds}s", max_steps=10**9, optimizer="adamw", muon_lr=None,
                    eval_interval=10**9, sample_tokens=0, progress="false", log_interval=1)  # fmt: skip
    t0 = time.perf_counter()
    run_child("gptlab train", train_command(Path(__file__).parents[1] / "configs" / "demo.toml", settings), quiet=True)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = settled([r["step_s"] for r in records if "step_s" in r])
    return {"model": str(out / "latest"), "steps": max(r["step"] for r in records), "step_s": step_s, "wall_s": wall}


def nanogpt_command(nanogpt: Path, iters: int, recipe: dict) -> list[str]:
    warmup = min(recipe["warmup_steps"], max(1, iters // 10))
    settings = dict(dataset="demo", device="cpu", compile=False, dtype="float32", bias=True, dropout=0.0,
                    gradient_accumulation_steps=1, max_iters=iters, lr_decay_iters=iters, warmup_iters=warmup,
                    learning_rate=recipe["lr"], min_lr=recipe["min_lr"], weight_decay=recipe["weight_decay"],
                    beta1=recipe["beta1"], beta2=recipe["beta2"],
                    eval_interval=iters, eval_iters=1, log_interval=1, always_save_checkpoint=True,
                    out_dir="out", **MODEL)  # fmt: skip
    return [sys.executable, str(nanogpt / "train.py")] + [f"--{k}={v}" for k, v in settings.items()]


def run_nanogpt(nanogpt: Path, data: Path, work: Path, iters: int, recipe: dict) -> dict:
    """nanoGPT's train.py for `iters` iterations in a directory laid out as it expects."""
    cwd = work / f"nanogpt-{iters}"
    (cwd / "data").mkdir(parents=True, exist_ok=True)
    (cwd / "data" / "demo").unlink(missing_ok=True)
    (cwd / "data" / "demo").symlink_to(data.resolve())
    (cwd / "configurator.py").unlink(missing_ok=True)
    (cwd / "configurator.py").symlink_to((nanogpt / "configurator.py").resolve())  # train.py exec()s it from cwd
    t0 = time.perf_counter()
    done = subprocess.run(nanogpt_command(nanogpt, iters, recipe), cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"nanoGPT's train.py failed:\n{done.stderr[-3000:]}")
    step_ms = [float(m) for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", done.stdout, re.M)]
    return {"model": str(cwd / "out" / "ckpt.pt"), "steps": iters, "step_s": settled([t / 1e3 for t in step_ms]),
            "wall_s": wall}  # fmt: skip


def val_loss(model_spec: str, data: Path) -> float:
    """Mean loss over the whole validation split in the trainer's evaluation batches (B8 x T128)."""
    import torch

    from gptlab.data import TokenLoader, read_manifest
    from gptlab.loading import load_model

    model = load_model(model_spec).eval()
    loader = TokenLoader(data / "val.bin", MODEL["batch_size"], MODEL["block_size"], mode="sequential",
                         dtype=read_manifest(data)["dtype"])  # fmt: skip
    n = (len(loader.tokens) - 1) // (MODEL["batch_size"] * MODEL["block_size"])
    with torch.no_grad():
        losses = [float(model(*loader.batch(k))[1]) for k in range(n)]
    return sum(losses) / len(losses)


def summarize(name: str, run: dict, data: Path) -> dict:
    tokens_per_step = MODEL["batch_size"] * MODEL["block_size"]
    out = {
        **run,
        "tok_per_s": tokens_per_step / statistics.median(run["step_s"]),
        "val_loss": val_loss(run["model"], data),
    }
    print(f"{name:>8}: {out['steps']:>5} steps in {out['wall_s']:6.1f} s, {out['tok_per_s']:>7,.0f} tok/s, "
          f"val loss {out['val_loss']:.4f}")  # fmt: skip
    return {k: v for k, v in out.items() if k != "step_s"} | {"median_step_s": statistics.median(run["step_s"])}


def main(argv=None) -> int:
    args = parse_args(argv or [])
    nanogpt, data = Path(args.nanogpt_dir), Path(args.data)
    if not (nanogpt / "train.py").is_file() or not (nanogpt / "model.py").is_file():
        raise ValueError(f"--nanogpt-dir {nanogpt}: no train.py and model.py there (a karpathy/nanoGPT checkout)")
    check_prepared(data)
    recipe = demo_recipe()
    from gptlab import gemm, kernels

    print(f"gptlab kernels: {kernels.describe()}; the training head's GEMM: {gemm.head_gemm()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        calib = run_nanogpt(nanogpt, data, work, args.calibrate_iters, recipe)
        per_iter = statistics.median(calib["step_s"])
        overhead = calib["wall_s"] - per_iter * args.calibrate_iters  # start-up, the two evaluations
        iters = max(10, int((args.seconds - overhead) / per_iter))
        print(f"nanoGPT: {per_iter * 1e3:.0f} ms per iteration -> {iters} iterations in {args.seconds:.0f} s")
        results = {"nanogpt": summarize("nanoGPT", run_nanogpt(nanogpt, data, work, iters, recipe), data),
                   "gptlab": summarize("gptlab", run_gptlab(data, work, args.seconds), data)}  # fmt: skip
    ratio = results["gptlab"]["tok_per_s"] / results["nanogpt"]["tok_per_s"]
    print(f"gptlab / nanoGPT tokens/s: {ratio:.2f}x; val loss {results['gptlab']['val_loss']:.4f} vs "
          f"{results['nanogpt']['val_loss']:.4f} after ~{args.seconds:.0f} s each")  # fmt: skip
    write_results("nanogpt", {"config": vars(args), "recipe": recipe, "ratio": ratio, **results}, args.out)
    return 0
