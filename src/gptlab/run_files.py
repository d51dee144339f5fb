"""The files of a training run directory: checkpoints, the `latest` pointer, metrics and the plot.

    out_dir/
      ckpt-000500/          one checkpoint: a native model directory (model.safetensors +
        model.safetensors   gptlab.json, loadable by every --model) plus optimizer.pt,
        gptlab.json         rng.pt (torch.load(weights_only=True)) and train_state.json
        optimizer.pt        (step, data cursor, guard history, resolved config)
        rng.pt
        train_state.json
      latest -> ckpt-000500 a symlink, replaced atomically once a checkpoint is complete
      metrics.jsonl         one JSON record per logged step and per evaluation
      loss.png              train/val loss against tokens

A checkpoint is written into a hidden temporary directory, fsynced, renamed to its final name,
and only then does `latest` move to it; a process killed at any moment leaves `latest` pointing
at a complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from gptlab.atomic import atomic_write, atomic_write_text

log = logging.getLogger(__name__)
LATEST = "latest"
METRICS = "metrics.jsonl"
PLOT = "loss.png"
STATE_FILE = "train_state.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The directory `latest` points to, or None when the run has no checkpoint yet."""
    link = Path(out_dir) / LATEST
    if not link.is_symlink() and not link.exists():
        return None
    target = link.resolve()
    if not (target / STATE_FILE).is_file():
        raise ValueError(f"{link} points to {target}, which is not a complete checkpoint")
    return target


def write_checkpoint(out_dir: str | os.PathLike, step: int, write: Callable[[Path], None], keep: int = 2) -> Path:
    """Create checkpoint `step` by calling write(tmp_dir), then publish it as `latest`.

    Older checkpoints beyond the newest `keep` are deleted afterwards.
    """
    out_dir = Path(out_dir)
    final = out_dir / checkpoint_name(step)
    tmp = out_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    _fsync_dir(tmp)
    current = latest_checkpoint(out_dir)
    if final.exists() and final != current:  # left over from a run killed before publishing it
        shutil.rmtree(final)
    if final != current:
        os.replace(tmp, final)
    else:  # re-saving the step `latest` already names: publish under a fresh name first
        final = out_dir / f"{checkpoint_name(step)}-{os.getpid()}"
        os.replace(tmp, final)
    _point_latest(out_dir, final.name)
    _prune(out_dir, keep, final)
    return final


def _point_latest(out_dir: Path, name: str) -> None:
    tmp_link = out_dir / f".{LATEST}.tmp"
    tmp_link.unlink(missing_ok=True)
    os.symlink(name, tmp_link)
    os.replace(tmp_link, out_dir / LATEST)  # rename is atomic: readers see the old or the new
    _fsync_dir(out_dir)


def _prune(out_dir: Path, keep: int, newest: Path) -> None:
    ckpts = sorted(p for p in out_dir.glob("ckpt-*") if p.is_dir() and p != newest)
    for old in ckpts[: max(0, len(ckpts) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_torch(path: Path, obj) -> None:
    """torch.save through an atomic write (tensors, numbers, strings, lists and dicts only)."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def load_torch(path: Path):
    """torch.load with weights_only=True: never unpickles arbitrary objects."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file: say which
        raise ValueError(f"{path}: cannot read ({e})") from e


def save_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2))


def load_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from e


# ---------------------------------------------------------------------------------------------
# Metrics and plot


class MetricsLog:
    """Append-only JSON lines; reopening after a resume drops records past the resumed step."""

    def __init__(self, out_dir: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(out_dir) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [json.dumps(r) for r in read_metrics(out_dir) if r["step"] <= resume_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        elif resume_step is None:
            self.path.unlink(missing_ok=True)
        self.file = open(self.path, "a")
        self.tb = _tensorboard(Path(out_dir))

    def write(self, record: dict) -> None:
        """Append one record; a non-finite number (a diverged loss) is written null, as strict
        JSON has no NaN (jq, JavaScript and pandas' strict readers refused the line)."""
        strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.file.write(json.dumps(strict, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:  # TensorBoard takes NaN
            for key, value in record.items():
                if key not in ("step", "tokens") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _tensorboard(out_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(out_dir / "tensorboard"))


def read_metrics(out_dir: str | os.PathLike) -> list[dict]:
    """The records of out_dir's metrics.jsonl, in order. A last line cut short (the process died
    while writing it, or the disk filled) is left out with a warning: it failed --resume."""
    path = Path(out_dir) / METRICS
    lines = [line for line in path.read_text().splitlines() if line] if path.exists() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines) - 1:
                raise ValueError(f"{path} line {i + 1} is not JSON ({e})") from e
            log.warning("%s: its last line is cut short, left out: %r", path, line[:80])
    return records


def plot_losses(out_dir: str | os.PathLike) -> Path | None:
    """Write out_dir/loss.png: train loss and validation loss against tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(out_dir)
    train = [(r["tokens"], r["loss"]) for r in records if r.get("loss") is not None]  # null: not finite
    val = [(r["tokens"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train", linewidth=1, alpha=0.8)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(out_dir) / PLOT
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return path
