"""gptlab bench summary: the README's speed-table figures for a machine, read from the latest
results in bench/results/ (what `make bench` writes); it runs no benchmark.

Every result records the machine it ran on (bench.common.machine). Runs are grouped by that
machine's CPU name and family/model, the gptlab kernel variant that ran, ATen's CPU capability
and the settings that held oneDNN or MKL below the CPU's level, so a run held to AVX2 on an
AVX-512 CPU, or to AVX-512 VNNI on one with AMX, counts as a machine of its own. For each
group the latest run of each kind gives its rows:

- decode and a 512-token prefill against llama.cpp at fp32 / bf16 / int8 / int4, and int4 and
  bf16 decoding against gptlab's own fp32: `gptlab bench generate --peer llama.cpp` without
  --depth, on every core (its default --threads), the latest run with all four precisions;
- the default path against transformers (fp32 decoding, a 64-token prefill): `gptlab bench
  generate`'s fp32 batch-1 rows;
- training against nanoGPT (`gptlab bench nanogpt`) and transformers (`gptlab bench train`, fp32).

Only runs made as `make bench` makes these rows count (MADE_AS_MAKE_BENCH): GPT-2's shape, each
command's default shapes and at least make bench's repeats, rounds or seconds; a quick run with a
tiny model, or a llama.cpp built for a lower level than gptlab ran at, is left out.
"""

from __future__ import annotations

import argparse
import json
import logging
from datetime import datetime, timezone
from pathlib import Path

from gptlab.bench.isa import ISA_ENV

log = logging.getLogger(__name__)

MODES = ("fp32", "bf16", "int8", "int4")
ROWS = (
    "decode vs llama.cpp",
    "prefill 512 vs llama.cpp",
    "int4 / bf16 decode vs gptlab's fp32",
    "default path vs transformers",
    "training vs nanoGPT",
    "training vs transformers (fp32)",
)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench summary", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="bench/results", help="the results directory to read")
    p.add_argument("--all", action="store_true", help="every machine in the results, not only this one")
    p.add_argument("--markdown", action="store_true", help="a Markdown table, one column per machine")
    return p.parse_args(argv)


# Settings that hold a library below the CPU's level (or force a GEMM) without changing the kernel
# variant or ATen's level, which the key names already: a Xeon with AMX held to AVX-512 VNNI, as a
# stand-in for an older one, runs the same variant at the same ATen level as unheld.
HELD_IN_KEY = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "GPTLAB_GEMM")


def machine_key(machine: dict, settings: dict | None = None) -> str:
    """The machine a result ran on, as runs are grouped: CPU, family/model, kernels, ATen's level,
    and the HELD_IN_KEY settings it ran under (the machine's record, or for results written before
    it had one, the llama.cpp bench's `settings["isa_env"]`)."""
    cpu = machine.get("cpu", "?")
    family = machine.get("cpu_family_model", "?")
    kernels = machine.get("gptlab_kernels", "?")
    key = f"{cpu} ({family}), kernels {kernels}, ATen {machine.get('cpu_capability', '?')}"
    held = machine.get("isa_settings", (settings or {}).get("isa_env") or {})
    return " ".join([key, *(f"{name}={held[name]}" for name in HELD_IN_KEY if held.get(name))])


class AtLeast(int):
    """A setting that counts at this value or above (more repeats, rounds or seconds)."""


# What each command behind the README's rows records of how it ran ("settings" or "config"), and
# the values the rows take: the command's defaults, and at least the repeats, rounds or seconds
# that `make bench` passes (Makefile). A setting an older file does not record is the default it
# ran with, which counts.
MADE_AS_MAKE_BENCH = {
    # gptlab bench generate --peer llama.cpp --repeats 3 (peer_isa and threads: _llamacpp_made_so)
    "generate-llamacpp": ("settings", {"preset": "gpt2", "depth": 0, "kv_cache": "auto", "repeats": AtLeast(3)}),
    # gptlab bench generate --modes fp32 --batch 1 --repeats 3
    "generate": ("settings", {"preset": "gpt2", "prompt_len": 64, "new_tokens": 256, "repeats": AtLeast(3)}),
    # gptlab bench nanogpt --nanogpt-dir DIR --seconds 60
    "nanogpt": ("config", {"seconds": AtLeast(60)}),
    # gptlab bench train --rounds 3 --steps 2
    "train": ("config", {"batch_size": 16, "block_size": 128, "n_layer": 4, "n_embd": 128, "n_head": 4,
                         "vocab_multiple": 1, "rounds": AtLeast(3), "steps": AtLeast(2)}),
}  # fmt: skip


def made_as_make_bench(run: dict) -> bool:
    """Whether `run` was made as make bench makes the README's rows (MADE_AS_MAKE_BENCH)."""
    if run["benchmark"] not in MADE_AS_MAKE_BENCH:
        return True
    section, wanted = MADE_AS_MAKE_BENCH[run["benchmark"]]
    recorded = run.get(section) or {}
    if not all(_counts(recorded[key], want) for key, want in wanted.items() if key in recorded):
        return False
    return run["benchmark"] != "generate-llamacpp" or _llamacpp_made_so(run)


def _counts(value, want) -> bool:
    if isinstance(want, AtLeast):
        return isinstance(value, int | float) and value >= want
    return value == want


def _llamacpp_made_so(run: dict) -> bool:
    """A llama.cpp run on every core (its default --threads), with llama.cpp built for the level
    gptlab ran at: natively, or for --peer-isa's level with gptlab held to that level's settings."""
    settings = run.get("settings") or {}
    if settings.get("threads", run["machine"].get("cores")) != run["machine"].get("cores"):
        return False
    isa, held = settings.get("peer_isa", "native"), settings.get("isa_env") or {}
    return isa in ISA_ENV and all(held.get(k) == v for k, v in ISA_ENV[isa].items())


def load_results(directory: str | Path) -> list[dict]:
    """Every result file in `directory` (a dict with its file's stem as "file"), oldest first; a file
    that is not a result (unreadable JSON, no machine or time) or not of a result's shape where the
    summary reads it (malformed) is skipped with a warning naming the file and what is wrong."""
    if not Path(directory).is_dir():
        raise ValueError(f"--results {directory}: no such directory")
    runs = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("skipped %s: %s", path, e)
            continue
        if not isinstance(run, dict) or not {"benchmark", "time", "machine"} <= run.keys():
            log.warning("skipped %s: not a gptlab bench result", path)
            continue
        if problem := malformed(run):
            log.warning("skipped %s: %s", path, problem)
            continue
        runs.append({**run, "file": path.stem})
    return sorted(runs, key=lambda run: (_when(run["time"]), run["file"]))


def _when(text: str) -> datetime | None:
    """A result's time (ISO 8601; UTC where it names no zone, as write_results writes it)."""
    try:
        when = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


# Where the summary reads each kind of result's figures (a list of rows or results, the summary
# object, or the result itself: None), the fields each must have, and those that must be numbers
# (or null).
FIGURES = {
    "generate-llamacpp": ("rows", ("mode", "gptlab_decode_tok_s"), ("decode_ratio", "prefill_ratio", "gptlab_decode_tok_s")),
    "generate": ("summary", (), ("fp32_eager_decode_vs_transformers", "fp32_eager_prefill_vs_transformers")),
    "nanogpt": (None, (), ("ratio",)),
    "train": ("results", (), ("ratio",)),
}  # fmt: skip


def malformed(run: dict) -> str | None:
    """What keeps the summary from reading `run`, a result file's JSON (None: nothing): a time that
    is not an ISO date; a machine, settings, config or summary that is not an object; rows that are
    not a list of objects, a row without a field read (FIGURES), or a figure that is not a number."""
    if _when(run["time"]) is None:
        return f"time {json.dumps(run['time'])} is not an ISO 8601 date"
    for key in ("machine", "settings", "config", "summary"):
        if key in run and not isinstance(run[key], dict):
            return f"{key} is {json.dumps(run[key])}, not an object"
    if run["benchmark"] not in FIGURES:
        return None
    where, required, numbers = FIGURES[run["benchmark"]]
    rows = run.get(where, []) if where in ("rows", "results") else [run.get(where, {}) if where else run]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        return f"{where} is {json.dumps(run[where])}, not a list of objects"
    for row in rows:
        if missing := [name for name in required if name not in row]:
            return f"an entry of {where} has no {', '.join(missing)}"
        if wrong := [name for name in numbers if not _number(row.get(name))]:
            return f"{wrong[0]} is {json.dumps(row[wrong[0]])}, not a number"
    return None


def _number(value) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _ratios(values) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in values) + "x"


def _llamacpp_rows(runs: list[dict]) -> dict[str, tuple[str, str]]:
    runs = [r for r in runs if r["benchmark"] == "generate-llamacpp"]
    full = [r for r in runs if {row.get("mode") for row in r.get("rows", [])} >= set(MODES)]
    if not (full or runs):
        return {}
    run = (full or runs)[-1]
    by_mode = {row["mode"]: row for row in run.get("rows", [])}
    rows = {
        "decode vs llama.cpp": _ratios(by_mode.get(m, {}).get("decode_ratio") for m in MODES),
        "prefill 512 vs llama.cpp": _ratios(by_mode.get(m, {}).get("prefill_ratio") for m in MODES),
    }
    fp32 = by_mode.get("fp32", {}).get("gptlab_decode_tok_s")
    if fp32:
        rows["int4 / bf16 decode vs gptlab's fp32"] = _ratios(
            by_mode[m]["gptlab_decode_tok_s"] / fp32 if m in by_mode else None for m in ("int4", "bf16")
        )
    return {name: (value, run["file"]) for name, value in rows.items()}


def _latest(runs: list[dict], benchmark: str, value) -> tuple[str, str] | None:
    """(value(run), its file) for the latest run of `benchmark` for which value gives one."""
    for run in reversed(runs):
        if run["benchmark"] == benchmark and (v := value(run)) is not None:
            return v, run["file"]
    return None


def _default_path(run: dict) -> str | None:
    summary = run.get("summary", {})
    decode, prefill = (summary.get(f"fp32_eager_{k}_vs_transformers") for k in ("decode", "prefill"))
    return None if decode is None else _ratios((decode, prefill))


def _nanogpt(run: dict) -> str | None:
    return None if run.get("ratio") is None else _ratios([run["ratio"]])


def _train_fp32(run: dict) -> str | None:
    ratios = [r["ratio"] for r in run.get("results", []) if r.get("dtype") == "float32" and "ratio" in r]
    return _ratios(ratios[:1]) if ratios else None


def summarize(runs: list[dict]) -> dict[str, dict[str, tuple[str, str]]]:
    """{machine: {row: (figure, results file)}} from results (oldest first), rows as in ROWS."""
    machines: dict[str, list[dict]] = {}
    for run in filter(made_as_make_bench, runs):
        machines.setdefault(machine_key(run["machine"], run.get("settings")), []).append(run)
    table = {}
    for key, group in machines.items():
        rows = _llamacpp_rows(group)
        found = {
            "default path vs transformers": _latest(group, "generate", _default_path),
            "training vs nanoGPT": _latest(group, "nanogpt", _nanogpt),
            "training vs transformers (fp32)": _latest(group, "train", _train_fp32),
        }
        rows.update({name: cell for name, cell in found.items() if cell is not None})
        if rows:
            table[key] = rows
    return table


def render_text(table: dict) -> str:
    lines = []
    for key, rows in table.items():
        lines.append(key)
        lines += [f"  {name:38s} {rows[name][0]:28s} {rows[name][1]}" for name in ROWS if name in rows]
    return "\n".join(lines)


def render_markdown(table: dict) -> str:
    keys = list(table)
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name in ROWS:
        cells = [f"{table[k][name][0]} (`{table[k][name][1]}`)" if name in table[k] else "-" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv or [])
    table = summarize(load_results(args.results))
    if not args.all:
        from gptlab.bench.common import machine

        here = machine_key(machine())
        table = {key: rows for key, rows in table.items() if key == here}
        if not table:
            print(f"no results for this machine ({here}) in {args.results}: run `make bench`, or pass --all")
            return 1
    if not table:
        print(f"no results in {args.results}")
        return 1
    print(render_markdown(table) if args.markdown else render_text(table))
    return 0
