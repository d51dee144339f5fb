"""llama.cpp as a peer of `gptlab bench generate --peer llama.cpp`: the same weights, both engines.

llama.cpp comes from the `llama-cpp-python` sdist on PyPI, which vendors a whole llama.cpp tree
(`vendor/llama.cpp`: the C++ sources, `convert_hf_to_gguf.py` and `gguf-py`), so pip is the only
client needed. It is built with GGML_NATIVE=ON, i.e. for this CPU's instruction set, and cached
per CPU under `$XDG_CACHE_HOME/gptlab/llama.cpp/VERSION-CPU` (default `~/.cache`): a binary built
on another machine may stop with an illegal instruction here. The CPU part of the name is the
model name plus a hash of the ISA flags, because VMs often report a generic model name
("Intel(R) Xeon(R) Processor") for different hosts.

`isa="avx2"` builds it instead for the x86-64 AVX2 level (AVX2, FMA, F16C, BMI2; no AVX-512, no
VNNI), the build an AVX2-only CPU such as AMD Zen 1-3 gets; it runs on any newer x86-64 CPU and
is cached as `VERSION-x86-64-avx2`, so an AVX-512 machine can stand in for an AVX2-only one.
`isa="avx512-vnni"` builds it for AVX-512 with VBMI and VNNI but no BF16 or AMX (Intel's Ice
Lake servers, this project's first Intel Xeon), so that a newer Xeon with AMX can stand in for one.

A gptlab model exported with `save_pretrained` is converted to GGUF F32, BF16 and Q8_0 by the
vendored converter and to Q4_0 by `llama-quantize --pure` from the F32 file: every matrix in
Q4_0, the head included, as gptlab's int4 with groups of 32 (without `--pure` llama-quantize
keeps the head at Q6_K). `llama-bench` then times decoding (`-p 0 -n 128`) and prefill
(`-p 512 -n 0`).

On a CPU with AMX, this llama.cpp's int8 and int4 products (ggml-cpu/amx) die with an illegal
instruction: the tile configuration they load is filled on the stack, and GCC drops the stores.
The build fixes that one spot first (SOURCE_FIXES, as llama.cpp's PR #26954 does), so that
llama.cpp runs its AMX kernels, its fastest here, instead of crashing.

Each step raises RuntimeError naming the step, with the tail of the tool's output, when it fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger(__name__)

# llama-cpp-python 0.3.36 vendors llama.cpp commit 0c1e57098bba (2026-10-01); checked to build
# offline and to convert and run gptlab's gpt2 exports.
LLAMA_CPP_PYTHON = "0.3.36"
# The instruction set llama.cpp is built for: this CPU's, or a fixed level (ggml's extensions on
# and off, ISA_EXTENSIONS) that any CPU with the /proc/cpuinfo flags of ISA_NEEDS runs.
AVX2_EXTENSIONS = ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2")  # the x86-64 AVX2 (Haswell) level
ISA_EXTENSIONS = {
    "avx2": AVX2_EXTENSIONS,
    "avx512-vnni": (*AVX2_EXTENSIONS, "AVX512", "AVX512_VBMI", "AVX512_VNNI"),  # Ice Lake server
}
# the x86 extensions ggml leaves off by default, each switched on or off by a level
GGML_EXTENSIONS = tuple("AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8 AMX_BF16".split())
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    **{
        isa: (
            "-DGGML_NATIVE=OFF",
            *(f"-DGGML_{ext}=ON" for ext in on),
            *(f"-DGGML_{ext}=OFF" for ext in GGML_EXTENSIONS if ext not in on),
        )
        for isa, on in ISA_EXTENSIONS.items()
    },
}
AVX2_LEVEL = {"avx2", "fma", "f16c", "bmi2"}
ISA_NEEDS = {  # the /proc/cpuinfo flags each level's build needs
    "native": set(),
    "avx2": AVX2_LEVEL,
    "avx512-vnni": AVX2_LEVEL | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi", "avx512_vnni"},
}
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: the tree is renamed into the cache after the build
    "-DLLAMA_CURL=OFF",  # no network code: older trees use curl, this one openssl
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",  # the tests would download models
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
TARGETS = ("llama-bench", "llama-quantize", "llama-perplexity")
INFO_FILE = "gptlab-build.json"
# gptlab mode -> GGUF tensor type of the matching file
GGUF_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
# ISA flags that -march=native turns into instructions; other /proc/cpuinfo flags don't matter
ISA_FLAG = re.compile(r"^(sse|ssse|avx|amx|fma|f16c|bmi|vnni|vpclmul|vaes|gfni|sha_ni|asimd|sve|i8mm|bf16|fp16)")
TAIL_LINES = 30


@dataclass(frozen=True)
class SourceFix:
    """A text replacement made in the vendored tree before it is built."""

    name: str
    path: str  # relative to the llama.cpp tree
    old: str
    new: str


# llama.cpp 0c1e570's ggml_tile_config_init (ggml-cpu/amx/mmq.cpp) fills a tile_config_t on the
# stack and hands it to _tile_loadconfig; GCC 12 keeps only the palette byte (ldtilecfg reads a
# zeroed block), so the first tileloadd of a Q8_0 or Q4_0 product raises SIGILL (Intel Xeon, family
# 6 model 207, whose AMX runs). A static constant holds the same configuration: rows 8, 8, 16 x 6
# and column bytes 64, 64, 32, 32, 64 x 4 for tiles 0-7, as the code it replaces.
_AMX_TILE_CONFIG_OLD = """    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.start_row = 0;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    tc.rows[1] = 8;   tc.colsb[1] = 64;
    tc.rows[2] = 16;  tc.colsb[2] = 32;
    tc.rows[3] = 16;  tc.colsb[3] = 32;
    tc.rows[4] = 16;  tc.colsb[4] = 64;
    tc.rows[5] = 16;  tc.colsb[5] = 64;
    tc.rows[6] = 16;  tc.colsb[6] = 64;
    tc.rows[7] = 16;  tc.colsb[7] = 64;
"""
_AMX_TILE_CONFIG_NEW = """    alignas(64) static const tile_config_t tc = {
        1, 0, {0}, {64, 64, 32, 32, 64, 64, 64, 64}, {8, 8, 16, 16, 16, 16, 16, 16}};  // gptlab: static (PR #26954)
"""
SOURCE_FIXES = (
    SourceFix("amx-tile-config-static", "ggml/src/ggml-cpu/amx/mmq.cpp", _AMX_TILE_CONFIG_OLD, _AMX_TILE_CONFIG_NEW),
)


def apply_source_fixes(source: Path) -> dict[str, bool]:
    """Make SOURCE_FIXES in the tree at `source`: {name: whether it was made}. A fix whose code is
    not there (another llama.cpp version) is not made, with a warning."""
    made = {}
    for fix in SOURCE_FIXES:
        path = source / fix.path
        text = path.read_text() if path.is_file() else ""
        made[fix.name] = text.count(fix.old) == 1
        if made[fix.name]:
            path.write_text(text.replace(fix.old, fix.new))
        else:
            log.warning("llama.cpp: fix %s not made: its code is not in %s", fix.name, fix.path)
    return made


# ---------------------------------------------------------------------------------------------
# Running a tool


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_step(step: str, cmd: list, *, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run `cmd`, returning its captured (text) output; RuntimeError naming `step` when it cannot
    start or exits non-zero, with the tail of its output."""
    cmd = [str(c) for c in cmd]
    log.info("%s", step)
    log.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, errors="replace")
    except OSError as e:
        raise RuntimeError(f"{step}: cannot run {cmd[0]}: {e}") from e
    if proc.returncode != 0:
        output = tail("\n".join(out.rstrip() for out in (proc.stdout, proc.stderr) if out.strip()))
        raise RuntimeError(f"{step} failed (exit {proc.returncode}): {' '.join(cmd)}\n{output}")
    return proc


# ---------------------------------------------------------------------------------------------
# Where the build lives


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model name")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown-cpu"


def cpu_flags() -> list[str]:
    """The ISA flags of this CPU (x86 `flags`, Arm `Features`), sorted; empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return sorted({f for f in line.split(":", 1)[1].split() if ISA_FLAG.match(f)})
    except OSError:
        pass
    return []


def cpu_slug(model_name: str, flags=()) -> str:
    """'Intel(R) Xeon(R) Processor', [avx2, ...] -> 'intel-r-xeon-r-processor-1a2b3c4d'."""
    slug = re.sub(r"[^a-z0-9]+", "-", model_name.lower()).strip("-") or "unknown-cpu"
    if flags:
        slug += "-" + hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]
    return slug


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptlab" / "llama.cpp"


def build_root(version: str = LLAMA_CPP_PYTHON, cache: Path | None = None, isa: str = "native") -> Path:
    """The llama.cpp tree (with build/bin) for this version, built for this CPU or for `isa`."""
    check_isa(isa)
    where = cpu_slug(cpu_model_name(), cpu_flags()) if isa == "native" else f"x86-64-{isa}"
    return (cache or cache_root()) / f"{version}-{where}"


def check_isa(isa: str) -> None:
    """ValueError unless `isa` names a build this CPU can run."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown llama.cpp ISA {isa!r}; choose from {', '.join(ISA_FLAGS)}")
    missing = ISA_NEEDS[isa] - set(cpu_flags())
    if missing:
        raise ValueError(f"this CPU cannot run llama.cpp's {isa} build: it lacks {', '.join(sorted(missing))}")


# ---------------------------------------------------------------------------------------------
# Fetch and build


@dataclass
class LlamaCpp:
    """A built llama.cpp tree: its tools, converter and build facts (`info`)."""

    root: Path
    info: dict

    def tool(self, name: str) -> Path:
        return self.root / "build" / "bin" / name

    @property
    def converter(self) -> Path:
        return self.root / "convert_hf_to_gguf.py"

    def is_complete(self) -> bool:
        return self.converter.is_file() and all(self.tool(t).is_file() for t in TARGETS)


def load_build(root: Path) -> LlamaCpp | None:
    """The cached build at `root`, or None when there is none (or it is incomplete)."""
    try:
        built = LlamaCpp(root, json.loads((root / INFO_FILE).read_text()))
    except (OSError, ValueError):
        return None
    fixed = set(built.info.get("source_fixes", ())) == {fix.name for fix in SOURCE_FIXES}  # else built before a fix
    return built if fixed and built.is_complete() else None


def ensure_built(
    version: str = LLAMA_CPP_PYTHON, *, cache: Path | None = None, jobs: int | None = None, isa: str = "native"
) -> LlamaCpp:
    """The cached llama.cpp build for this CPU (or for `isa`, see ISA_FLAGS), fetching and building
    it first if needed (~8 min on 2 cores)."""
    root = build_root(version, cache, isa)
    built = load_build(root)
    if built is not None:
        log.debug("llama.cpp: using the build cached at %s", root)
        return built
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp needs cmake, which is not on PATH (e.g. apt-get install -y cmake)")
    root.parent.mkdir(parents=True, exist_ok=True)
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        source = fetch_source(version, Path(tmp))
        commit = vendored_commit(source)
        shutil.move(source, partial)
    info = {**build(partial, version, commit, jobs or os.cpu_count() or 1, isa), "path": str(root)}
    (partial / INFO_FILE).write_text(json.dumps(info, indent=2))  # the marker of a finished build
    shutil.rmtree(root, ignore_errors=True)
    os.replace(partial, root)
    return LlamaCpp(root, info)


def fetch_source(version: str, tmp: Path) -> Path:
    """Download the llama-cpp-python sdist with pip and extract it; returns its vendor/llama.cpp."""
    spec = f"llama-cpp-python=={version}"
    run_step(
        f"downloading {spec}",
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", tmp],
    )
    sdists = list(tmp.glob("llama_cpp_python-*.tar.gz"))
    if len(sdists) != 1:
        raise RuntimeError(f"downloading {spec}: expected one sdist in {tmp}, found {[p.name for p in sdists]}")
    try:
        with tarfile.open(sdists[0]) as tar:
            # the "data" filter (no absolute paths, links out of the tree, devices) is in 3.10.12+ / 3.11.4+
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    except (OSError, tarfile.TarError) as e:
        raise RuntimeError(f"extracting {sdists[0].name}: {e}") from e
    source = tmp / sdists[0].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file() or not (source / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdists[0].name} has no vendored llama.cpp tree at vendor/llama.cpp")
    return source


def vendored_commit(source: Path) -> str:
    """The llama.cpp commit of the vendored tree, from the git metadata the sdist carries; 'unknown' if none.

    The tree's `.git` file points into the sdist's `.git/modules`, which stays behind when the tree
    moves to the cache, so the commit is read here and passed to cmake (LLAMA_BUILD_COMMIT)."""
    try:
        gitdir = (source / ".git").read_text().strip().removeprefix("gitdir:").strip()
        head = ((source / gitdir) / "HEAD").read_text().strip()
    except OSError:
        return "unknown"
    return head if re.fullmatch(r"[0-9a-f]{40}", head) else "unknown"


def build(source: Path, version: str, commit: str, jobs: int, isa: str = "native") -> dict:
    """cmake configure + build of TARGETS in source/build for `isa`; returns the build facts."""
    (source / ".git").unlink(missing_ok=True)  # dangling once moved: cmake would ask git and fail
    fixes = apply_source_fixes(source)
    cmake_flags = [*ISA_FLAGS[isa], *CMAKE_FLAGS]
    flags = [*cmake_flags, f"-DLLAMA_BUILD_COMMIT={commit[:7]}"]
    run_step("configuring llama.cpp (cmake)", ["cmake", "-S", source, "-B", source / "build", *flags])
    run_step(
        f"building llama.cpp ({', '.join(TARGETS)})",
        ["cmake", "--build", source / "build", "--config", "Release", "-j", jobs, "--target", *TARGETS],
    )
    built = LlamaCpp(source, {})
    missing = [t for t in TARGETS if not built.tool(t).is_file()]
    if missing:
        raise RuntimeError(
            f"building llama.cpp: the build finished without {', '.join(missing)} in {source / 'build/bin'}"
        )
    return {
        "llama_cpp_python": version,
        "llama_cpp_commit": commit,
        "isa": isa,
        "cmake_flags": cmake_flags,
        "source_fixes": fixes,
        "targets": list(TARGETS),
        "cpu": cpu_model_name(),
        "cpu_isa_flags": cpu_flags(),
        "built": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------
# Convert and bench


def convert(llama: LlamaCpp, hf_dir, out_dir, types=None) -> dict[str, Path]:
    """GGUF files of the Hugging Face GPT-2 directory `hf_dir`, one per GGUF type (default: all of
    GGUF_TYPES): {type: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(llama.root / "gguf-py"), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    files = {}
    for gguf_type in types or GGUF_TYPES.values():
        path = out_dir / f"model-{gguf_type}.gguf"
        if gguf_type == "Q4_0":  # the converter writes no Q4_0: quantize the F32 file
            source = files.get("F32") or convert(llama, hf_dir, out_dir, ["F32"])["F32"]
            run_step(
                "quantizing to Q4_0 (llama-quantize)", [llama.tool("llama-quantize"), "--pure", source, path, "Q4_0"]
            )
        else:
            cmd = [sys.executable, llama.converter, hf_dir, "--outtype", gguf_type.lower(), "--outfile", path]
            run_step(f"converting {hf_dir} to GGUF {gguf_type} (convert_hf_to_gguf.py)", cmd, env=env)
        files[gguf_type] = path
    return files


def parse_bench_json(text: str) -> dict:
    """The one test in llama-bench's `-o json` output: tok/s (average and best repetition) and facts."""
    try:
        tests = json.loads(text)
    except ValueError as e:
        raise RuntimeError(f"llama-bench printed no JSON ({e}):\n{tail(text)}") from e
    if not isinstance(tests, list) or len(tests) != 1:
        raise RuntimeError(f"llama-bench: expected one test in its JSON output, got:\n{tail(text)}")
    (test,) = tests
    samples = test.get("samples_ts") or [test["avg_ts"]]
    keys = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size", "n_threads",
            "n_prompt", "n_gen", "avg_ts", "stddev_ts")  # fmt: skip
    return {**{k: test[k] for k in keys if k in test}, "best_ts": max(samples), "samples_ts": samples}


def llama_bench(
    llama: LlamaCpp, gguf: Path, *, threads: int, prompt: int, gen: int, repetitions: int, depth: int = 0
) -> dict:
    """llama-bench on one file: `-p prompt -n gen` (one of them 0) after `-d depth` tokens of
    context (not timed), `repetitions` timed runs."""
    cmd = [
        llama.tool("llama-bench"),
        "-m",
        gguf,
        "-p",
        prompt,
        "-n",
        gen,
        "-d",
        depth,
        "-t",
        threads,
        "-r",
        repetitions,
        "-o",
        "json",
    ]
    proc = run_step(f"llama-bench on {Path(gguf).name}", cmd)
    return parse_bench_json(proc.stdout)


# ---------------------------------------------------------------------------------------------
# gptlab side by side: the path a user takes, the figures llama-bench reports

DECODE_TOKENS = 128  # llama-bench -n 128: batch 1, from one token
PREFILL_TOKENS = 512  # llama-bench -p 512
EOT = 50256  # GPT-2's <|endoftext|>, the single token decoding starts from


def load_gptlab(hf_dir, mode: str, kv_cache: str = "auto"):
    """gptlab's model in `mode` through the public API only: from_pretrained, then quantize_model
    (int4 in groups of 32, as Q4_0's blocks); whatever those do by default (e.g. prepacking, a
    quantized model's bf16 KV cache) counts. kv_cache "float32" or "bfloat16" sets the KV cache's
    dtype instead of the default ("auto")."""
    import torch

    from gptlab.model import GPT
    from gptlab.quantize import quantize_model

    if mode not in GGUF_TYPES:
        raise ValueError(f"unknown mode {mode!r} for llama.cpp; choose from {', '.join(GGUF_TYPES)}")
    model = GPT.from_pretrained(hf_dir, dtype=torch.bfloat16 if mode == "bf16" else None)
    if mode == "int8":
        model = quantize_model(model, "int8")
    elif mode == "int4":
        model = quantize_model(model, "int4", group_size=32)
    if kv_cache != "auto":
        model.kv_cache_dtype = getattr(torch, kv_cache)
    return model


def decode_after(model, context) -> float:
    """Seconds for DECODE_TOKENS greedy steps after the context (1, D) was prefilled: the tokens
    gptlab.generation.generate_tokens yields, timed from the first (the prefill's) to the last."""
    from gptlab.generation import generate_tokens, sampling_params

    params = sampling_params(max_new_tokens=DECODE_TOKENS + 1, temperature=0)
    stamps = [time.perf_counter() for _ in generate_tokens(model, context, params)]
    return stamps[-1] - stamps[0]


def time_gptlab(model, prompt, repeats: int, context=None) -> dict:
    """Best-of-`repeats` decode tok/s (DECODE_TOKENS new tokens, greedy: from [[EOT]], the whole
    generate call; or after `context` (1, D), its prefill not timed, as llama-bench -d) and prefill
    tok/s (`prompt` (1, T) with one new token: T / time), after a warm-up."""
    from gptlab.bench.common import repeat_seconds
    from gptlab.generation import generate

    def best_seconds(fn) -> float:
        return min(repeat_seconds(fn, repeats))

    if context is None:
        decode = best_seconds(lambda: generate(model, [[EOT]], DECODE_TOKENS, temperature=0))
    else:
        decode = min([decode_after(model, context) for _ in range(repeats + 1)][1:])  # after a warm-up
    prefill = best_seconds(lambda: generate(model, prompt, 1, temperature=0))
    return {"decode_tok_s": DECODE_TOKENS / decode, "prefill_tok_s": prompt.shape[-1] / prefill}


def time_llamacpp(llama: LlamaCpp, gguf: Path, *, threads: int, repeats: int, depth: int = 0) -> dict:
    """llama-bench's best repetition for decoding (after `depth` tokens) and prefill, and its
    facts about the run."""
    decode = llama_bench(llama, gguf, threads=threads, prompt=0, gen=DECODE_TOKENS, repetitions=repeats, depth=depth)
    prefill = llama_bench(llama, gguf, threads=threads, prompt=PREFILL_TOKENS, gen=0, repetitions=repeats)
    return {
        "decode_tok_s": decode["best_ts"],
        "prefill_tok_s": prefill["best_ts"],
        "decode": decode,
        "prefill": prefill,
    }


def time_interleaved(
    models: dict, ggufs: dict, prompt, llama: LlamaCpp, threads: int, repeats: int, context=None
) -> dict[str, tuple[dict, dict]]:
    """Per mode of `models` (mode -> gptlab model; `ggufs`: mode -> llama.cpp's file), (gptlab's,
    llama.cpp's) best timings over `repeats` rounds. Each round runs every mode once, each engine
    right after the other. This VM's memory bandwidth drifts over minutes (the same llama.cpp file
    measured 38 and 45 tok/s an hour apart on the AMD EPYC; gptlab's fp32 decoding 74-114 tok/s
    within 15 minutes on the Zen 4): alternating makes a slow phase hit both engines alike, and
    interleaving the modes makes it hit every precision alike, so that the rows' ratios to each
    other (int4 decoding against fp32's) hold as well as each row's ratio to llama.cpp."""
    best = {mode: ({}, {}) for mode in models}
    depth = 0 if context is None else context.size(1)
    for _ in range(repeats):
        for mode, model in models.items():
            mine = time_gptlab(model, prompt, 1, context)
            peer = time_llamacpp(llama, ggufs[mode], threads=threads, repeats=1, depth=depth)
            ours, theirs = best[mode]
            for key in ("decode_tok_s", "prefill_tok_s"):
                ours[key] = max(ours.get(key, 0.0), mine[key])
                if peer[key] > theirs.get(key, 0.0):
                    theirs[key], theirs[key.split("_")[0]] = peer[key], peer[key.split("_")[0]]
    return best


def peer_row(mode: str, ours: dict, theirs: dict) -> dict:
    """One precision: both engines' tok/s and the ratios gptlab / llama.cpp."""
    row = {"mode": mode, "gguf_type": GGUF_TYPES[mode]}
    for phase in ("decode", "prefill"):
        a, b = ours[f"{phase}_tok_s"], theirs[f"{phase}_tok_s"]
        row[f"gptlab_{phase}_tok_s"] = round(a, 2)
        row[f"llamacpp_{phase}_tok_s"] = round(b, 2)
        row[f"{phase}_ratio"] = round(a / b, 3) if b > 0 else None
    return row


def row_header(depth: int = 0) -> str:
    """The table's header: decoding (after `depth` tokens of context) and prefill, each engine and the ratio."""
    context = f"decoding after {depth} tokens of context (llama-bench -d {depth}), not timed\n" if depth else ""
    return (
        f"{context}{'':<11}{f'decode tok/s (B=1, {DECODE_TOKENS} new)':<31}{f'prefill tok/s ({PREFILL_TOKENS}-token prompt)'}\n"
        f"{'mode':<5} {'gguf':<5}{'gptlab':>9} {'llama.cpp':>9} {'ratio':>6}   {'gptlab':>9} {'llama.cpp':>9} {'ratio':>6}"
    )


def format_peer_row(row: dict) -> str:
    """One line under row_header(); the ratios are gptlab / llama.cpp."""

    def ratio(r):
        return f"{r:5.2f}x" if r is not None else f"{'-':>6}"

    return (
        f"{row['mode']:<5} {row['gguf_type']:<5}{row['gptlab_decode_tok_s']:9.2f} {row['llamacpp_decode_tok_s']:9.2f} "
        f"{ratio(row['decode_ratio'])}   {row['gptlab_prefill_tok_s']:9.1f} {row['llamacpp_prefill_tok_s']:9.1f} "
        f"{ratio(row['prefill_ratio'])}"
    )
