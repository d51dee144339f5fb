"""Measurements cached per machine.

Where gptlab chooses between two ways of doing something by timing both (training's precision,
gptlab.train.precision; whose GEMM an Intel CPU runs, gptlab.gemm_probe), the timings are kept
in a JSON file in gptlab's cache directory, one entry per machine: the CPU's model and features,
the torch version, the thread count and any setting that holds a library to fewer instructions
than the CPU has. A later process on the same machine reads them instead of measuring again, and
so makes the same choice (a resumed training run multiplies as the run before it did).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Settings that hold the libraries to fewer instructions than the CPU has (e.g. to stand in for an
# AVX2-only CPU, gptlab.bench.isa.AVX2_ENV): a timing taken without them does not hold with
# them (bf16 under ONEDNN_MAX_CPU_ISA=AVX2 on a Zen 5: 45 s a demo step).
ISA_SETTINGS = ("GPTLAB_KERNELS", "GPTLAB_GEMM", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# Values that ask for what no setting gives (gptlab.kernels reads them stripped and lowercased): the
# same key, so that GPTLAB_GEMM=auto reuses the unset probe's timings instead of measuring again.
DEFAULT_VALUES = {"GPTLAB_KERNELS": ("auto", "1"), "GPTLAB_GEMM": ("auto",)}


def held_settings() -> dict[str, str]:
    """The ISA_SETTINGS this process runs under, {name: value}, those that ask for the default left out."""
    return {
        name: value
        for name in ISA_SETTINGS
        if (value := os.environ.get(name)) and value.strip().lower() not in DEFAULT_VALUES.get(name, ())
    }


def isa_settings() -> str:
    """The ISA_SETTINGS this process runs under, as the end of a cache key ("" for none)."""
    settings = " ".join(f"{name}={value}" for name, value in held_settings().items())
    return f" | {settings}" if settings else ""


def cache_dir() -> Path:
    """gptlab's cache directory (first-use kernel builds, these timings): $GPTLAB_CACHE, else
    $XDG_CACHE_HOME/gptlab, else ~/.cache/gptlab."""
    if os.environ.get("GPTLAB_CACHE"):
        return Path(os.environ["GPTLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptlab"


def machine_key(cpu: str, *parts: str) -> str:
    """This machine as a cache key: `cpu` (its model and features, kernels.cpu_description), the
    torch version and thread count, then `parts` (what was measured), then isa_settings()."""
    fields = [cpu, f"torch {torch.__version__}", f"{torch.get_num_threads()} threads", *parts]
    return " | ".join(fields) + isa_settings()


def cached(file: str, key: str, measure: Callable[[], dict], valid: Callable[[object], bool]) -> tuple[dict, str, bool]:
    """(timings, where they came from, whether measured now): the entry `key` of `file` in
    cache_dir(), or measure() now, stored there (a temporary file renamed: a crash never leaves half
    a file). An entry that valid(entry) refuses (a file edited by hand, or written by a version
    that measured something else) counts as missing: measured again and replaced, where reading
    it was a traceback in whatever asked."""
    path = cache_dir() / file
    cache = _read(path)
    if key in cache:
        if valid(cache[key]):
            return cache[key], f"measured earlier on this machine, cached in {path}", False
        log.warning("the timings cached for this machine in %s are not as expected (%.80r): measuring again",
                    path, cache[key])  # fmt: skip
    timings = measure()
    cache = _read(path)  # as it is now: another process may have added an entry meanwhile
    cache[key] = timings
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache the timings in %s: %s", path, e)
    return timings, f"measured now, cached in {path}", True


def are_seconds(entry: object, names: tuple[str, ...]) -> bool:
    """Whether a cached entry is a dict holding a number of seconds (finite, above 0: readers
    divide by them) under each of `names`, e.g. {"float32": 0.31, "bfloat16": 0.24}: a check for
    `cached`'s `valid`."""
    return isinstance(entry, dict) and all(_is_seconds(entry.get(name)) for name in names)


def are_seconds_per_work(entry: object, work: tuple[str, ...], sides: tuple[str, ...]) -> bool:
    """Whether a cached entry holds `work` and nothing else (its readers log each item), under
    each the seconds of each of `sides` (are_seconds): {"prompts 64 rows": {"gptlab": 0.01,
    "torch": 0.012}, ...}."""
    return isinstance(entry, dict) and entry.keys() == set(work) and all(are_seconds(entry[n], sides) for n in work)


def _is_seconds(value: object) -> bool:
    # bool is an int to Python, and JSON reads NaN and Infinity back as floats
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _read(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}
