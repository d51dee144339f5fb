"""gptlab bench recipes: validation loss against wall time for the demo's old and new recipes.

Each recipe is `gptlab train` with the demo config (src/gptlab/configs/demo.toml) plus its
overrides, on the demo's prepared data, evaluating the whole validation split every
`--eval-interval` steps; the curves (validation loss against seconds since the run started,
evaluations included) go to one plot, by default docs/demo-loss.png, and the points to a JSON file
in bench/results. `--runs NAME=DIR` plots finished runs instead of training.

- old: the recipe before issue 13 (1,200 steps, cosine by step, bf16 autocast as `dtype=auto`
  chose it on this project's CPUs);
- adamw: demo.toml with AdamW for every parameter (the recipe before Muon, 2026-12-04);
- new: demo.toml as it is (max_time, precision=auto measured, the fixed spike guard, Muon for the
  blocks' matrices).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.bench.common import add_out_argument, check_prepared, positive, run_child, train_command, write_results

CONFIG = Path(__file__).parents[1] / "configs" / "demo.toml"
RECIPES = {
    "old": dict(
        max_steps=1200,
        max_time="none",
        lr=2e-3,
        min_lr=1e-4,
        warmup_steps=50,
        batch_size=8,
        precision="bfloat16",
        optimizer="adamw",
        muon_lr="none",
    ),
    "adamw": dict(optimizer="adamw", muon_lr="none"),
    "new": {},
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench recipes", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="runs/demo/data", help="prepared demo data (gptlab demo writes runs/demo/data)")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--runs", nargs="*", default=[], metavar="NAME=DIR", help="plot these finished runs instead")
    p.add_argument(
        "--points",
        nargs="*",
        default=[],
        metavar="NAME=STEP:LOSS,...",
        help="validation losses recorded elsewhere (e.g. the README's), plotted as given",
    )
    p.add_argument(
        "--step-seconds",
        nargs="*",
        default=[],
        metavar="NAME=SECONDS",
        help="place NAME's points at step x SECONDS (a quiet machine's step time) instead of "
        "the wall time the run logged: loss-at-step is robust to load, wall time is not",
    )
    p.add_argument("--eval-interval", type=positive, default=100)
    p.add_argument("--work", default="runs/recipes", help="where the runs go")
    p.add_argument("--plot", default="docs/demo-loss.png")
    p.add_argument("--title", default=None, help="plot title (default: the CPU)")
    add_out_argument(p)
    return p.parse_args(argv)


def train_recipe(name: str, data: str, work: Path, eval_interval: int) -> Path:
    out = work / name
    settings = {**RECIPES[name], "data_dir": data, "out_dir": out, "eval_interval": eval_interval,
                "eval_steps": 33, "sample_tokens": 0, "progress": "false"}  # fmt: skip
    cmd = train_command(CONFIG, settings)
    print(f"{name}: {' '.join(cmd[3:])}")
    run_child(f"gptlab train ({name})", cmd)
    return out


def curve(run_dir: Path, step_seconds: float | None = None) -> list[tuple[float, float]]:
    """(seconds, validation loss) of a run's evaluations: logged wall time, or step x step_seconds."""
    from gptlab import run_files

    evals = [r for r in run_files.read_metrics(run_dir) if "val_loss" in r]
    if not evals:  # a mistyped DIR plotted an empty curve
        raise ValueError(f"{run_dir}: no evaluations in its metrics.jsonl (a finished gptlab training run?)")
    return [(r["step"] * step_seconds if step_seconds else r["elapsed_s"], r["val_loss"]) for r in evals]


def given_points(text: str, step_seconds: float) -> list[tuple[float, float]]:
    """ "600:5.088,1200:4.838" -> [(600 * step_seconds, 5.088), ...]."""
    try:
        return [(int(step) * step_seconds, float(loss)) for step, loss in (p.split(":") for p in text.split(","))]
    except ValueError:
        raise ValueError(
            f"--points {text!r}: expected STEP:LOSS pairs separated by commas, e.g. 600:5.088,1200:4.838"
        ) from None


def plot(curves: dict[str, list], path: Path, title: str, xlabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        ax.plot(*zip(*points, strict=True), "o-", label=name, markersize=3)
    ax.axhline(5.0, color="grey", linestyle="--", linewidth=1, label="target 5.0")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    from gptlab.bench.common import machine

    args = parse_args(argv or [])
    seconds = {name: float(v) for name, _, v in (a.partition("=") for a in args.step_seconds)}
    if args.runs or args.points:
        runs = {name: Path(d) for name, _, d in (r.partition("=") for r in args.runs)}
    else:
        check_prepared(args.data)
        runs = {name: train_recipe(name, args.data, Path(args.work), args.eval_interval) for name in args.recipes}
    curves = {name: curve(d, seconds.get(name)) for name, d in runs.items()}
    for name, _, text in (p.partition("=") for p in args.points):
        if name not in seconds:
            raise ValueError(f"--points {name}=...: give its step time with --step-seconds {name}=SECONDS")
        curves[name] = given_points(text, seconds[name])
    for name, points in curves.items():
        print(f"{name}: " + ", ".join(f"{s:.0f}s {v:.3f}" for s, v in points))
    xlabel = "seconds of training" + (" (steps x the step time given)" if seconds else " (evaluations included)")
    plot(curves, Path(args.plot), args.title or f"gptlab demo recipes, {machine()['cpu']}", xlabel)
    print(f"plot: {args.plot}")
    write_results("recipes", {"config": vars(args), "curves": curves}, args.out)
    return 0
