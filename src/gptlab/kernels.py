"""CPU kernels for decoding: matrix-vector products that stream each weight once (csrc/).

Decoding a token reads every weight once, so on a CPU its speed is the rate at which weights
stream from memory. PyTorch's own kernels for a (1, K) x (K, N) product either read a plain fp32
weight slowly (one thread) or want a second copy in oneDNN's blocked layout. The small C library
here reads the weights in the layout the model already stores them, on all threads: fp32 and bf16
(fp32 arithmetic, so CPUs without native bf16 gain the halved bytes too), and int8/int4 with
8-bit activations and integer dot products (as llama.cpp's Q8_0/Q4_0).

One source, several variants (gptlab.kernel_build): on x86-64 AVX-512 with VNNI, the same
instructions on 256-bit vectors (avx512-256: the AVX2 code with AVX-512 VNNI's vpdpbusd), AVX2 with
AVX-VNNI, AVX2 (+FMA, F16C); on aarch64 NEON with and without the dot-product instructions; and
portable C that compiles anywhere. Each is compiled with its own target flags at install time
(`pip install .`, `make install`) into the package, or at first use into the user's cache
directory. At load the best variant the CPU reports (cpuid or HWCAP, `cpu_features`) is chosen
(`auto_variant`: but avx512-256 on a CPU whose AVX-512 is half width, AMD Zen 4);
`GPTLAB_KERNELS=auto|avx512|avx512-256|avx2-vnni|avx2|neon-dotprod|neon|portable|0` forces one (0: PyTorch's
kernels only), and a variant this CPU cannot run is a ValueError naming what it lacks (the CLI's
one-line error, as for an unknown name). Without a C compiler and without a built library,
`available()` says why and every caller falls back to PyTorch's kernels.

This module chooses, builds if need be and loads the library, and holds what every call into it
shares (`library`, `stream` for weights, `inference_on_cpu`, `check`). The calls themselves are
above it: gptlab.ops (each kernel as a function on tensors), gptlab.gemm (gptlab's GEMM or
PyTorch's, for prompts and the training head) and gptlab.linear (the model's `Linear`). A
decoding step usually runs the whole model in C instead (gl_decode_step, described to it by
gptlab.fused_step), with the same kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import re
import sys
import threading
import weakref
from pathlib import Path

import torch

from gptlab import cpu, gemm_probe, kernel_build
from gptlab.machine_cache import cache_dir

log = logging.getLogger(__name__)

MAX_ROWS = 8  # rows of x one kernel call takes (MAX_ROWS in kernels.c); more go to PyTorch's GEMM
MAX_HEAD_SIZE = 256  # the C attention's limit (MAX_HS in attention.c)
VARIANTS = tuple(kernel_build.VARIANTS)  # best first
FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avxvnni",
            "asimd", "asimddp", "avx512bf16", "amxbf16")  # fmt: skip  # gl_cpu_features' bits, in order
_ABI = 23
_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_long
_SIGNATURES = {  # name: argument types; each returns 0, or -1 when out of memory
    "gl_linear_f32": [_P, _P, _P, _P, _I, _I, _I, _I],  # x, w, bias, y, M, N, K, threads
    "gl_linear_bf16": [_P, _P, _P, _P, _I, _I, _I, _I],
    "gl_linear_i8": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "gl_linear_i4": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I],
    "gl_dequantize_i4": [_P, _P, _P, _P, _I, _I, _I, _I, _I],  # weight, scales, zeros, out, N, K, g, bf16, threads
    "gl_dequantize_i8": [_P, _P, _P, _I, _I, _I],
    "gl_quantize_rows_u8": [_P, _P, _P, _I, _I, _I],  # x, xq, scales, M, K, threads
    "gl_attend_one": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I],
    "gl_argmax_f32": [_P, _P, _I, _I],
    "gl_top_p_keep": [_P, _P, _I, _I, ctypes.c_double],  # probs, keep, M, V, p
    "gl_draw": [_P, _P, _P, _I, _I],  # probs, u, ids, M, V; -3: a row's sum not finite and positive
    "gl_gelu_tanh": [_P, _P, _L, _I, _I],  # x, y, n, bf16, threads
    "gl_gelu_tanh_backward": [_P, _P, _P, _L, _I],  # x, dy, dx, n, threads
    # q, its (batch, head, row) strides, k, strides, v, strides, out, B, nh, T, S, hs, whether bf16, threads
    "gl_attend_prompt": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I],
    # logits (V, n), its row stride, targets, loss, peak, inv, n, V, grad, the peaks given or NULL, threads
    "gl_softmax_xent": [_P, _L, _P, _P, _P, _P, _I, _I, _I, _P, _I],
    # model, kv caches, whether they are bf16, tokens, positions, B, T, pos, max_len, mask, rope, logits,
    # all_logits, threads
    "gl_decode_step": [_P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _P, _I, _I],
    # M, N, K, a, a's row and column strides, b, its strides, c, c's row stride, bias, accumulate, threads
    "gl_sgemm": [_I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _P, _I, _I],
    "gl_gemm_bf16": [_I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _P, _I, _I],  # as gl_sgemm; -2: no AVX512-BF16
    "gl_sgemm_bf16_b": [_I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _P, _I, _I],  # as gl_sgemm, b bf16
    "gl_sgemm_bf16_ab": [_I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _P, _I, _I],  # as gl_sgemm, a and b bf16
    "gl_sgemm_colmax": [_I, _I, _I, _P, _L, _L, _P, _L, _L, _P, _L, _P, _I, _I],  # ..., c, ldc, colmax, bf16, threads
    # M, N, K, x, its row stride, whether bf16, W (N, K), whether bf16, y, its row stride, whether bf16, bias, threads
    "gl_sgemm_nt": [_I, _I, _I, _P, _L, _I, _P, _I, _P, _L, _I, _P, _I],
    "gl_gemm_columns": [],
    "gl_has_gemm_bf16": [],
    "gl_set_decode_rows": [_I],  # 1 or ROWS, 0 for the CPU's default; returns the rows in use or -1
    "gl_decode_rows": [],
    "gl_set_prefetch_nta": [_I],  # 1 non-temporal, 0 temporal, -1 the CPU's default; returns the hint in use or -1
    "gl_prefetch_nta": [],
}
# id(weight) -> (a weak reference to it, its data pointer) for the weights handed to the huge-page
# thread, dropped as each weight dies: a weight allocated where a freed one was, or one given new
# data, is handed over again
_huge_paged: dict[int, tuple[weakref.ref, int]] = {}


# ---------------------------------------------------------------------------------------------
# Building, choosing and loading a variant


@functools.cache
def cpu_description() -> str:
    """The CPU's model name and the features of FEATURES it has, e.g. for a per-machine cache key."""
    return f"{cpu.name()} {' '.join(sorted(cpu_features()))}"


def installed_path(variant: str) -> Path:
    """Where `pip install` put a variant's library: in the package, next to this file."""
    return Path(__file__).parent / kernel_build.library_name(variant)


def cached_path(variant: str) -> Path:
    """A first-use build's path: one per source version and variant (no CPU in the name: the
    variants' flags name their instructions, so a build serves every CPU that has them)."""
    name = kernel_build.library_name(variant).replace(".so", f"-{kernel_build.source_digest()}.so")
    return cache_dir() / "kernels" / name


# First-use builds kept per variant, the one just built included: checkouts of a few gptlab versions
# sharing a cache directory (a cluster's home) keep theirs rather than each deleting the other's
# and building its own again at its next start.
KEPT_BUILDS = 3


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def _remove_older_builds(variant: str, path: Path) -> None:
    """Delete the cache's builds of `variant` from other sources than `path`'s, all but the
    KEPT_BUILDS - 1 newest. Only this variant's: "libgptlab-avx512-*.so" also names every
    avx512-256 build, which a process checking both variants (tests/c/run_check.py) would
    otherwise delete while it loads it."""
    stem = kernel_build.library_name(variant).removesuffix(".so")
    pattern = rf"{re.escape(stem)}-[0-9a-f]{{16}}\.so"
    others = [old for old in path.parent.glob(f"{stem}-*.so") if old != path and re.fullmatch(pattern, old.name)]
    for old in sorted(others, key=_mtime, reverse=True)[KEPT_BUILDS - 1 :]:
        old.unlink(missing_ok=True)


def _open(path: Path) -> ctypes.CDLL | None:
    """The library at path when it is current (this ABI, built from these sources) and whole, else None."""
    if not path.is_file():
        return None
    try:
        whole = kernel_build.is_whole(path.read_bytes())
    except OSError:  # removed since (another gptlab's first-use build): built again
        return None
    if not whole:
        log.warning("%s is cut short (an interrupted copy or write); not using it", path)
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        if path.is_file():
            raise
        return None  # removed since (another gptlab's first-use build): built again
    lib.gl_source_digest.restype = ctypes.c_char_p
    if lib.gl_abi() != _ABI or lib.gl_source_digest().decode() != kernel_build.source_digest():
        log.info("%s was built from other sources; not using it", path)
        return None
    return lib


def library_path(variant: str) -> Path:
    """The current library of `variant` (installed, or built into the cache now); see _load."""
    return _load(variant).path


def _load(variant: str) -> ctypes.CDLL:
    """The variant's library: the installed one when current, else a first-use build in the cache
    (built now if missing); its path is `lib.path`. RuntimeError or OSError saying why it cannot be
    had, also for a library that names itself another variant (gl_variant)."""
    path = installed_path(variant)
    lib = _open(path)
    if lib is None:
        path = cached_path(variant)
        lib = _open(path)
        if lib is None:
            log.info("building gptlab's %s CPU kernels into %s", variant, path)
            kernel_build.build(variant, path)
            _remove_older_builds(variant, path)
            lib = _open(path)
            if lib is None:  # csrc/common.h's GL_ABI is not _ABI
                raise RuntimeError(f"the {variant} kernels just built at {path} are not of this gptlab's ABI ({_ABI})")
    lib.gl_variant.restype = ctypes.c_char_p
    if (built_as := lib.gl_variant().decode()) != variant:  # the log and benchmarks name what runs
        raise RuntimeError(
            f"{path} was built as the {built_as} variant, not {variant}: its flags and csrc/cpu.c disagree"
        )
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.gl_huge_pages.argtypes, lib.gl_huge_pages.restype = [_P, ctypes.c_size_t], ctypes.c_int
    lib.path = path
    return lib


def cpu_features() -> frozenset[str]:
    """The instruction sets this CPU and OS support, of FEATURES (cpuid and xgetbv, read by the
    portable library's gl_cpu_features; aarch64: the kernel's HWCAP); empty on other architectures
    or without a library (features_unread says why)."""
    return _features()[0]


def features_unread() -> str:
    """Why cpu_features() could not be read ("the portable library failed to load: ..."), or ""
    where it was (or this architecture has no features to read)."""
    return _features()[1]


@functools.cache
def _features() -> tuple[frozenset[str], str]:
    """(cpu_features(), features_unread()), read once."""
    if kernel_build.arch() is None:
        return frozenset(), ""
    try:
        bits = _load("portable").gl_cpu_features()
    except (OSError, RuntimeError) as e:
        log.warning("cannot read the CPU's features (%s)", e)
        return frozenset(), f"the portable library failed to load: {e}"
    return frozenset(name for i, name in enumerate(FEATURES) if bits >> i & 1), ""


def missing_features(variant: str) -> list[str]:
    """What this CPU lacks to run `variant` (empty: it can)."""
    if variant not in kernel_build.buildable():
        return [f"an {kernel_build.variant_arch(variant)} CPU (this is {platform.machine()})"]
    return [f for f in kernel_build.VARIANTS[variant][2] if f not in cpu_features()]


def refusal(variant: str) -> str:
    """Why this CPU is not given `variant` (missing_features is not empty), for an error: the
    features it lacks and what it can run instead, or, where its features could not be read, why
    (the CPU was blamed for lacking every feature when it was the portable library that failed)."""
    if features_unread() and variant in kernel_build.buildable():
        return f"cannot tell whether this CPU ({cpu.name()}) runs it, as its features could not be read: {features_unread()}"
    return (
        f"this CPU ({cpu.name()}) cannot run it, it lacks {', '.join(missing_features(variant))}"
        f" (it can run {', '.join(runnable_variants())})"
    )


def runnable_variants() -> list[str]:
    """The variants this CPU can run, best first (portable is always among them)."""
    return [v for v in VARIANTS if not missing_features(v)]


# CPUs (vendor, cpu family) whose AVX-512 is half width: AMD's family 0x19 (Zen 4; Zen 3, the same
# family, has none) runs each 512-bit instruction as two 256-bit halves, and there avx2 ran level or
# faster nearly everywhere. `gptlab bench variants --rounds 7 --new-tokens 128`, AMD EPYC Zen 4, 2
# threads, 2026-12-03, avx512 / avx2 (bench/results/variants-20261203-105447.json): gpt2-shaped
# decoding fp32 0.79x, bf16 0.93x, int8 0.73x, int4 1.05x; prefill 512 0.88-1.02x; the training
# head's GEMM 0.96x. A single fp32 layer with 768 inputs streamed 16-18 GB/s as avx512 against 24-29
# as avx2, the same loop in 512-bit loads (not the horizontal sums: a 256-bit sum tree changed
# nothing). Zen 5 (family 26) has full-width AVX-512 and keeps it (not measured). The next best is
# avx512-256, the AVX2 code with AVX-512 VNNI's vpdpbusd on ymm and 32 registers: against avx2 on
# that Zen 4 (`--rounds 7`, variants-20261203-144223.json) int4 prefill 1.08x (a bare 512-row int4
# forward 1.12-1.13x: 815 against 912 ms), everything else level within the VM's noise (0.96-1.04x).
HALF_WIDTH_AVX512 = frozenset({("AuthenticAMD", 25)})


def auto_variant() -> str:
    """The variant GPTLAB_KERNELS=auto runs: the best this CPU runs, except that a CPU whose AVX-512
    is half width (HALF_WIDTH_AVX512) takes the next best (avx512-256) instead of avx512."""
    runnable = runnable_variants()
    if runnable[0] == "avx512" and (cpu.vendor(), cpu.family()) in HALF_WIDTH_AVX512:
        return runnable[1]
    return runnable[0]


def requested_variant() -> str | None:
    """The variant GPTLAB_KERNELS asks for: auto_variant() for auto (the default; 1 too), None for
    0; ValueError for an unknown name, or one this CPU cannot run (a setting, as the name is: the
    CLI turns it into one line, where a RuntimeError from inside the first forward was a traceback)."""
    want = os.environ.get("GPTLAB_KERNELS", "auto").strip().lower() or "auto"
    if want == "0":
        return None
    if want in ("auto", "1"):
        return auto_variant()
    if want not in VARIANTS:
        raise ValueError(f"GPTLAB_KERNELS={want!r}: expected auto, 0 or one of {', '.join(VARIANTS)}")
    if missing_features(want):
        raise ValueError(f"GPTLAB_KERNELS={want}: {refusal(want)}")
    return want


_env_choice: dict[str | None, str | None] = {}


def _requested(value: str | None) -> str | None:
    """requested_variant() for this value of GPTLAB_KERNELS, remembered (errors are not)."""
    if value not in _env_choice:
        _env_choice[value] = requested_variant()
    return _env_choice[value]


class _Library:
    """One variant's loaded ctypes library, or why it is not there."""

    def __init__(self, variant: str | None):
        self.variant, self.lib, self.reason = variant, None, ""
        self.gemm_columns = 0  # columns of gptlab's fp32 GEMM tile (linear.float_kernel_rows)
        if variant is None:
            self.reason = "switched off by GPTLAB_KERNELS=0"
            return
        try:
            self.lib = _load(variant)
            self.gemm_columns = self.lib.gl_gemm_columns()
        except (OSError, RuntimeError, AttributeError) as e:
            self.reason = f"the {variant} kernels cannot be loaded: {e}"
            log.warning("gptlab CPU kernels unavailable, using PyTorch's: %s", self.reason)

    @property
    def float_ok(self) -> bool:
        return self.lib is not None

    int_ok = float_ok  # every variant has every kernel


_libraries: dict[str | None, _Library] = {}
_forced = threading.local()  # use_variant's choice, per thread


def _library() -> _Library:
    """The active variant's library (GPTLAB_KERNELS, or use_variant within its block). Called on
    every kernel dispatch: the environment's choice is resolved once per value it takes."""
    variant = getattr(_forced, "variant", "env")
    if variant == "env":
        variant = _requested(os.environ.get("GPTLAB_KERNELS"))
    if variant not in _libraries:
        _libraries[variant] = _Library(variant)
    return _libraries[variant]


@contextlib.contextmanager
def use_variant(variant: str):
    """Within the block (this thread), run the `variant` kernels, e.g. to test or time each one
    this CPU can run; RuntimeError for one it cannot. Layers prepared before keep their kernels'
    weight layouts, which are the same for every variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    if missing_features(variant):
        raise RuntimeError(f"the {variant} kernels: {refusal(variant)}")
    before = getattr(_forced, "variant", "env")
    _forced.variant = variant
    try:
        yield _library()
    finally:
        _forced.variant = before


def variant() -> str | None:
    """The name of the variant that runs (None: PyTorch's kernels only)."""
    lib = _library()
    return lib.variant if lib.lib is not None else None


def has_simd() -> bool:
    """Whether the variant that runs has SIMD (not portable C, not none): where gptlab's GEMM, prompt
    attention and GELU beat PyTorch's."""
    return variant() not in (None, "portable")


def decode_rows() -> int | None:
    """Weight rows per block in the active variant's decoding kernels (1: one memory stream per
    thread, 4: four), as chosen at load from the CPU (csrc/cpu.c: 4 for AVX-512 on CPUs other than
    AMD's, else 1) or set by use_decode_rows; None without kernels."""
    lib = _library().lib
    return None if lib is None else lib.gl_decode_rows()


@contextlib.contextmanager
def _tuned(setter: str, value: int, default: int, refused: str):
    """Within the block, every variant this CPU runs has a decoding tuning knob set to `value` by
    its library's `setter` (gl_set_decode_rows, gl_set_prefetch_nta), then back to `default` (the
    CPU's choice); ValueError(refused) when a library refuses the value (its setter returns -1)."""
    libs = [_load(v) for v in runnable_variants()]
    for lib in libs:
        if getattr(lib, setter)(value) == -1:
            raise ValueError(refused)
    try:
        yield
    finally:
        for lib in libs:
            getattr(lib, setter)(default)


def use_decode_rows(rows: int):
    """Within the block, every variant this CPU runs decodes `rows` (1 or 4) weight rows per block
    instead of its default, e.g. to test both paths or time them on one CPU (not thread-safe)."""
    return _tuned("gl_set_decode_rows", rows, 0, f"decode rows must be 1 or 4, got {rows}")


def prefetch_nta() -> bool | None:
    """Whether the active variant's decoding kernels prefetch the weights non-temporally (into L1
    only, so the weights read once do not push the activations, the KV cache and Python's objects
    out of L2 and L3): by default on AMD CPUs, where that measured faster (on an Intel Xeon it
    decoded 2-3.6x slower; csrc/cpu.c, gl_default_prefetch_nta), or as set by use_prefetch_nta;
    None without kernels."""
    lib = _library().lib
    return None if lib is None else bool(lib.gl_prefetch_nta())


def use_prefetch_nta(nta: bool):
    """Within the block, every variant this CPU runs prefetches decoding's weights non-temporally
    (True) or into every cache level (False) instead of its default, e.g. to time both on one CPU
    (`gptlab bench variants --variants avx2:nta,avx2:t0`) or test both paths (not thread-safe)."""
    return _tuned("gl_set_prefetch_nta", int(bool(nta)), -1, f"prefetch hint refused: {nta!r}")


_enabled = True


@contextlib.contextmanager
def use_kernels(enabled: bool):
    """Within the block, run (enabled=True) or skip (False) gptlab's kernels, e.g. to compare
    with PyTorch's own. A layer prepared while they were off keeps PyTorch's kernel (and its weight layout)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def release_threads() -> bool:
    """Let the OpenMP threads that this thread's parallel work started exit (gl_release_threads);
    True where the runtime did. Call it from a thread that computes no more while another one
    goes on, as a server's event loop once its model is loaded: libgomp, PyTorch's OpenMP on
    Linux, keeps every thread that has computed a team of helpers, and once it manages more threads
    than there are CPUs, its threads sleep between parallel regions instead of spinning, so each of
    a step's ~50 regions waits for a wake-up. GPT-2 int4 decoding (AMD EPYC Zen 5, 2 threads) took
    4.0-4.9 ms a token in a second thread and 1.5-1.8 in the first, or in the second once the first
    had let its helpers go (a team forms again at the next parallel region)."""
    if kernel_build.arch() is None:
        return False
    try:
        return _load("portable").gl_release_threads() == 0
    except (OSError, RuntimeError) as e:
        log.warning("cannot release the OpenMP threads (%s)", e)
        return False


def enabled() -> bool:
    """Whether gptlab's kernels may run (not switched off by use_kernels(False))."""
    return _enabled


def gemm_columns() -> int:
    """Columns of the active variant's fp32 GEMM tile (0 without kernels)."""
    return _library().gemm_columns


def available() -> tuple[bool, bool, str]:
    """(float kernels, int8/int4 kernels, why not) for this machine; builds the library if needed."""
    if not _enabled:
        return False, False, "switched off by use_kernels(False)"
    lib = _library()
    return lib.float_ok, lib.int_ok, lib.reason


# ---------------------------------------------------------------------------------------------
# Dispatch


def ptr(t: torch.Tensor | None) -> int | None:
    """t's data pointer, or None (NULL in C) for None."""
    return None if t is None else t.data_ptr()


def library():
    """The active variant's loaded ctypes library, or None where there is none (GPTLAB_KERNELS=0,
    or it could not be loaded: see available()). use_kernels(False) is checked apart (enabled)."""
    return _library().lib


def stream(weight: torch.Tensor) -> int:
    """The data pointer of a weight the kernels stream; the first time, its memory is handed to a
    background thread that moves it to 2 MiB pages (gl_huge_pages in csrc/cpu.c: fewer TLB misses,
    same bytes, no copy kept). Linux copies the pages to do it: 0.84 s for GPT-2's 500 MB (AMD EPYC
    Zen 5), which the first token of every process waited for when it was done here."""
    key, address = id(weight), weight.data_ptr()
    known = _huge_paged.get(key)  # a dead weight's entry is gone before its id can be reused
    if known is None or known[1] != address:
        _huge_paged[key] = weakref.ref(weight, lambda _: _huge_paged.pop(key, None)), address
        if weight.nbytes >= 4 << 20:
            _huge_page_queue().put((_library().lib, weight))
    return address


@functools.cache
def _huge_page_queue():
    """The queue of (library, weight) the huge-page thread works through (the weight is held until
    its pages are moved)."""
    import queue

    pending: queue.Queue = queue.Queue()

    def work():
        while True:
            lib, weight = pending.get()
            try:
                lib.gl_huge_pages(weight.data_ptr(), weight.nbytes)  # ctypes releases the GIL meanwhile
            finally:
                del lib, weight
                pending.task_done()

    threading.Thread(target=work, name="gptlab-huge-pages", daemon=True).start()
    os.register_at_fork(after_in_child=_huge_page_queue.cache_clear)  # a forked child starts its own
    return pending


def wait_for_huge_pages(timeout: float = 10.0) -> bool:
    """Wait (at most `timeout` seconds) until the huge-page thread has moved every weight handed to
    it so far; returns whether it has. Linux copies the pages meanwhile, and a timing taken then
    runs slow (see linear.bf16_matmul_is_fast)."""
    if not _huge_page_queue.cache_info().currsize:  # the thread never started here
        return True
    pending = _huge_page_queue()
    with pending.all_tasks_done:
        return pending.all_tasks_done.wait_for(lambda: not pending.unfinished_tasks, timeout)


def inference_on_cpu(x: torch.Tensor) -> bool:
    """The conditions every kernel shares: enabled, CPU, no autograd graph, not under torch.compile."""
    return (
        _enabled
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
    )


def check(status: int) -> None:
    """Raise for a kernel's failure status (-1: out of memory for its scratch buffers)."""
    if status:
        raise MemoryError("gptlab kernels: out of memory for the activations' scratch buffer")


@functools.cache
def warn_once(logger: logging.Logger, message: str) -> None:
    """logger.warning(message), once per process: a setting that every layer reads (GPTLAB_GEMM,
    GPTLAB_INT8_GEMM) would say it once per layer."""
    logger.warning(message)


def describe() -> str:
    """One line for logs and benchmarks: the variant that runs on this CPU, or why none does."""
    float_ok, _, why = available()
    return f"{variant()} on {cpu.name()}" if float_ok else f"none on {cpu.name()} ({why})"


def main() -> int:
    """`python -m gptlab.kernels`: load (building if needed) the variant for this CPU and say which;
    a bad setting (GPTLAB_KERNELS, GPTLAB_GEMM) is one line on stderr and exit status 2."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        lines = report()
    except (ValueError, RuntimeError) as e:
        print(f"gptlab kernels: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def report() -> list[str]:
    """main()'s lines: the variant, the CPU's features, the variants it runs, the GEMMs chosen, the
    decoding settings and the library; each setting read (and refused) before any line is printed."""
    lib = _library()
    unread = f"unknown, {features_unread()}" if features_unread() else ""
    lines = [
        f"gptlab kernels for {cpu.name()}: {describe().split(' on ')[0]}",
        f"  CPU features: {' '.join(sorted(cpu_features())) or unread or 'none of ' + ', '.join(FEATURES)}",
        f"  variants this CPU runs: {', '.join(runnable_variants())}",
    ]
    if auto_variant() != runnable_variants()[0]:
        lines.append(
            f"  auto takes {auto_variant()}: this CPU's AVX-512 is half width (family {cpu.family()}, see HALF_WIDTH_AVX512)"
        )
    from gptlab import gemm  # which imports this module

    prompts = ", ".join(f"{rows} rows {gemm.prompt_gemm_choice(rows)}" for rows in gemm_probe.PROMPT_ROWS)
    lines.append(f"  GEMM of prompts: {prompts}; of the training head: {gemm.gemm_choice()} "
                 "(gptlab: gl_sgemm_nt, gl_sgemm; torch: PyTorch's BLAS; GPTLAB_GEMM)")  # fmt: skip
    lines.append(f"  its bf16 products (bf16 autocast): {gemm.gemm_bf16_choice()}")
    if lib.lib is not None:
        hint = "non-temporally" if prefetch_nta() else "into every cache level"
        lines.append(f"  decoding: {decode_rows()} weight row(s) per block per thread "
                     f"({cpu.vendor() or 'unknown vendor'}), prefetched {hint}")  # fmt: skip
        lines.append(f"  {lib.lib.path}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
