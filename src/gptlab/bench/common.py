"""What every benchmark shares: a description of the machine, a timer, and writing results."""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from gptlab.atomic import atomic_write_text
from gptlab.commands.demo import RELATIVE
from gptlab.machine_cache import held_settings

# tiny-shakespeare beside the repository, where this workplace keeps it (`make demo` reads it too)
CORPUS = str(Path(__file__).resolve().parents[3] / RELATIVE)


def at_least(minimum: int, why: str = ""):
    """argparse's type for a count of at least `minimum` (`why`, if given, says why in the error)."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{why}, got {value}")
        return value

    return count


def positive(text: str) -> int:
    """argparse's type for a count (rounds, tokens, threads, sizes): an integer of at least 1, so
    that 0 is refused as the flag is read, not by what it breaks later ("no median for empty data")."""
    return at_least(1)(text)


def positive_seconds(text: str) -> float:
    """argparse's type for a duration in seconds: a number above 0 (0 or less ran for minutes first)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def check_prepared(data: str | os.PathLike) -> Path:
    """`data` as a Path, or ValueError where it holds no prepared train.bin (before a run starts)."""
    if not (Path(data) / "train.bin").is_file():
        raise ValueError(f"--data {data}: no train.bin there (run `gptlab demo` or `gptlab prepare` first)")
    return Path(data)


def train_command(config: str | os.PathLike, settings: dict) -> list[str]:
    """`gptlab train --config CONFIG --set KEY=VALUE ...`, run by this Python."""
    cmd = [sys.executable, "-m", "gptlab", "train", "--config", str(config)]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def run_child(what: str, cmd: list[str], *, quiet: bool = False, lines: int = 8) -> None:
    """Run `cmd`, its stderr (and its stdout, unless quiet) passed on as it runs. Where it fails,
    ValueError naming `what` with the last `lines` of its stderr (a CalledProcessError traceback
    hid the child's own message, and with its output captured, the message itself)."""
    last: collections.deque[str] = collections.deque(maxlen=lines)
    stdout = subprocess.DEVNULL if quiet else None
    with subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace") as proc:
        for line in proc.stderr:
            if line.strip():
                last.append(line.rstrip())
            if not quiet:
                sys.stderr.write(line)
    if proc.returncode:
        raise ValueError(f"{what} failed (exit {proc.returncode}): " + " / ".join(last))


def machine() -> dict:
    """The facts a reader needs to compare a result: CPU (name, family and model, the features
    the kernels choose by), cores, memory, torch build, the gptlab kernel variant that runs and whose
    GEMM runs the training head (gemm.gemm_choice), and the settings holding the libraries below
    the CPU's level (machine_cache.held_settings)."""
    import torch

    from gptlab import cpu, gemm, kernels

    name = cpu.cpuinfo("model name") or platform.processor() or platform.machine()
    family_model = "/".join(cpu.cpuinfo(k) or "?" for k in ("cpu family", "model"))
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    info = {
        "cpu": name,
        "cpu_family_model": family_model,
        "cpu_features": " ".join(sorted(kernels.cpu_features())),
        "gptlab_kernels": kernels.variant() or f"none ({kernels.available()[2]})",
        "head_gemm": gemm.gemm_choice(),
        "head_gemm_bf16": gemm.gemm_bf16_choice(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem_gib,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_settings": held_settings(),  # libraries held below the CPU's level, e.g. to stand in for another
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def timed(fn, *, sync=None) -> tuple[object, float]:
    """Run fn() and return (result, seconds); `sync` (e.g. torch.cuda.synchronize) runs before each clock."""
    if sync:
        sync()
    t0 = time.perf_counter()
    out = fn()
    if sync:
        sync()
    return out, time.perf_counter() - t0


def repeat_seconds(fn, repeats: int) -> list[float]:
    """fn() once to warm up, then the seconds of each of `repeats` further calls."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """--out: where a bench writes its results (write_results; '' writes none), checked as it is read."""
    parser.add_argument(
        "--out", type=results_directory, default="bench/results", help="results directory ('' to skip writing)"
    )


def results_directory(text: str) -> str:
    """argparse's type for --out: '' (write nothing), or a directory that is there or can be made,
    and written to. Checked as the flag is read: found after the benchmark ran, it lost the results."""
    if not text:
        return text
    path = Path(text).expanduser()
    there = next(p for p in (path, *path.parents) if p.exists())  # the directory, or the nearest one above it
    if not there.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {there} is a file, not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {there} cannot be written to")
    return text


def write_results(name: str, results: dict, out_dir: str | os.PathLike = "bench/results") -> Path | None:
    """Write results (with the machine and a timestamp) to out_dir/NAME-YYYYmmdd-HHMMSS.json, or
    -2.json, -3.json ... where a run of the same second has that name, and print its path; an empty
    out_dir (every bench's `--out ''`) writes nothing and returns None."""
    if not str(out_dir):
        return None
    stamp = datetime.now(timezone.utc)
    payload = {"benchmark": name, "time": stamp.isoformat(timespec="seconds"), "machine": machine(), **results}
    text = json.dumps(payload, indent=2)
    path = new_file(Path(out_dir).expanduser(), f"{name}-{stamp:%Y%m%d-%H%M%S}")
    atomic_write_text(path, text)
    print(f"results: {path}", flush=True)
    return path


def new_file(directory: Path, stem: str) -> Path:
    """directory/STEM.json, or STEM-2.json, ...: the first name no file has, taken (created empty,
    exclusively) so that a run finishing in the same second never writes over another's results."""
    directory.mkdir(parents=True, exist_ok=True)
    names = (f"{stem}.json" if n == 1 else f"{stem}-{n}.json" for n in itertools.count(1))
    return next(directory / name for name in names if _claim(directory / name))


def _claim(path: Path) -> bool:
    try:
        path.open("x").close()
    except FileExistsError:
        return False
    return True
