"""Building gptlab's CPU kernels: one C source (csrc/kernels.c), one shared library per variant.

Each variant is the same source compiled with its own target flags, never -march=native, so a
library runs on every CPU that has the variant's instructions, whichever machine built it (a wheel,
a shared home directory). `gptlab.kernels` picks, at load, the best variant the CPU reports.

This module imports nothing but the standard library: setup.py runs it at install time (`pip
install .`, `make install`) to put the libraries into the package, and gptlab.kernels runs it at
first use for a checkout without them, into the user's cache directory. Run as a script
(`python src/gptlab/kernel_build.py`), it builds them into the source tree: `make install` does
that while pip installs torch, and setup.py then finds them current.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"

# The variants, best first: name -> (GL_VARIANT, target flags, CPU features it needs). Feature
# names are gl_cpu_features()'s bits (kernels.FEATURES). Each is for one architecture (ARCHES),
# except "portable", which compiles anywhere.
VARIANTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "avx512": (
        "GL_AVX512",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma", "f16c"),
    ),
    "avx512-256": (  # the AVX2 code with AVX-512's encodings: vpdpbusd on ymm, 32 vector registers
        "GL_AVX2",
        (
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512vnni",
            "-mprefer-vector-width=256",
        ),
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"),
    ),
    "avx2-vnni": ("GL_AVX2", ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avxvnni")),
    "avx2": ("GL_AVX2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "neon-dotprod": ("GL_NEON", ("-march=armv8.2-a+dotprod",), ("asimd", "asimddp")),
    "neon": ("GL_NEON", (), ("asimd",)),
    "portable": ("GL_PORTABLE", (), ()),
}
ARCHES = {"x86-64": ("avx512", "avx512-256", "avx2-vnni", "avx2"), "aarch64": ("neon-dotprod", "neon")}
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")


def arch(machine: str | None = None) -> str | None:
    """The ARCHES key of this machine (or of `machine`, as platform.machine() names it), or None."""
    m = (machine or platform.machine()).lower()
    return "x86-64" if m in ("x86_64", "amd64", "i686", "i386") else "aarch64" if m in ("aarch64", "arm64") else None


def is_x86() -> bool:
    return arch() == "x86-64"


def buildable(machine: str | None = None) -> list[str]:
    """The variants this machine's architecture can compile, best first (portable everywhere)."""
    return [*ARCHES.get(arch(machine), ()), "portable"]


def variant_arch(variant: str) -> str | None:
    """The architecture a variant is for (None: portable, any)."""
    return next((a for a, names in ARCHES.items() if variant in names), None)


def sources() -> list[Path]:
    """Every file the libraries are built from."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


@functools.cache
def source_digest() -> str:
    """A digest of the sources (and the flags), compiled into each library (gl_source_digest) so
    a stale one is noticed; read once per process."""
    h = hashlib.sha256(repr((COMMON_FLAGS, VARIANTS)).encode())
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


def compiler() -> str:
    """The C compiler as a shell command line: $CC (it may hold arguments, "ccache gcc" or "gcc -g",
    as make and setuptools allow), else gcc, else cc; RuntimeError when there is none."""
    if os.environ.get("CC", "").strip():
        return os.environ["CC"]
    found = shutil.which("gcc") or shutil.which("cc")
    if found is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    return shlex.quote(found)


def command(variant: str, out: str | Path, cc: str | None = None) -> list[str]:
    """The compiler command that builds `variant` into `out`; cc: a command line as $CC (compiler())."""
    macro, flags, _ = VARIANTS[variant]
    return [
        *shlex.split(cc or compiler()), *COMMON_FLAGS, f"-DGL_VARIANT={macro}", f'-DGL_SOURCE_DIGEST="{source_digest()}"',
        *flags, "-o", str(out), str(CSRC / "kernels.c"), "-lm",
    ]  # fmt: skip


def build(variant: str, out: Path, cc: str | None = None) -> Path:
    """Compile one variant into `out` (through a temporary file, renamed when complete);
    RuntimeError with the compiler's message when it fails."""
    if variant not in buildable():
        raise RuntimeError(f"the {variant} variant is for {variant_arch(variant)}; this is {platform.machine()}")
    cc = cc or compiler()  # before the temporary file: without a compiler it was left behind, empty

    def compile_into(tmp: str) -> None:
        cmd = command(variant, tmp, cc)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")

    return _write_whole(out, compile_into)


def _write_whole(out: Path, write) -> Path:
    """write(tmp) into a temporary file beside `out`, then rename it to `out`: a library is there
    whole or not at all (gptlab.atomic's pattern; this module also runs alone, from setup.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library_name(variant: str) -> str:
    """The file name of a variant's library, in the package (built at install) or the cache."""
    return f"libgptlab-{variant}.so"


def is_current(path: str | Path) -> bool:
    """Whether the library at `path` was built from these sources and flags (its compiled-in
    gl_source_digest is this source_digest()) and is whole (is_whole). Read from the file, never
    loaded (it may be for instructions this CPU lacks)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return False
    return source_digest().encode() in data and is_whole(data)


def is_whole(data: bytes) -> bool:
    """False for a 64-bit ELF file shorter than its headers say (a copy or a write cut short): dlopen
    maps it anyway, and the process dies of SIGBUS at the first page past its end. What is not ELF
    counts as whole: dlopen refuses it with an error that says why."""
    if data[:4] != b"\x7fELF":
        return True
    if len(data) < 64:  # cut inside the ELF header
        return False
    if data[4] != 2:  # not ELFCLASS64 (x86-64's and aarch64's): not read here
        return True
    order = "<" if data[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(f"{order}2Q", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(f"{order}4H", data, 0x36)
    ends = [phoff + phnum * phentsize, shoff + shnum * shentsize]  # the tables of segments and sections
    if ends[0] <= len(data):
        for entry in range(phoff, ends[0], phentsize):  # each segment's p_offset + p_filesz
            ends.append(sum(struct.unpack_from(f"{order}Q", data, entry + field)[0] for field in (8, 32)))
    return max(ends) <= len(data)


def build_all(directory: str | Path, reuse: str | Path | None = None) -> list[str]:
    """Every variant this machine compiles, into `directory`, one compiler per core, portable's
    (the slowest to compile: its C is vectorized by the compiler) first. A library already current
    there is kept, one current in `reuse` copied. Returns what happened to each, a line per
    variant; a variant that cannot be built (no compiler) is reported, not raised: gptlab then
    builds it at first use, or runs PyTorch's kernels."""
    directory = Path(directory)

    def one(variant: str) -> str:
        out = directory / library_name(variant)
        found = Path(reuse) / library_name(variant) if reuse is not None else None
        try:
            if is_current(out):
                return f"gptlab: the {variant} kernels in {out} are current"
            if found is not None and is_current(found):
                _write_whole(out, lambda tmp: shutil.copyfile(found, tmp))  # a copy cut short is not left
                return f"gptlab: copied the current {variant} kernels from {found} to {out}"
            build(variant, out)
            return f"gptlab: built the {variant} kernels into {out}"
        except (OSError, RuntimeError) as e:  # no compiler, or it refused: gptlab still runs
            return f"gptlab: could not build the {variant} kernels ({e}); gptlab will try at first use"

    order = sorted(buildable(), key=lambda v: v != "portable")
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # the five x86 variants: 19 s, not 35, on 2 cores
        lines = dict(zip(order, pool.map(one, order), strict=True))
    return [lines[v] for v in buildable()]


if __name__ == "__main__":
    for line in build_all(Path(__file__).parent):
        print(line)
