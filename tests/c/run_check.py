"""Build the kernel variants of an architecture and run kernel_check.c on them.

    python tests/c/run_check.py                   # this machine's variants, natively
    python tests/c/run_check.py --arch aarch64    # cross-compiled, run under qemu-user
    python tests/c/run_check.py --arch aarch64 --mutants   # and plant bugs, which must fail it

For aarch64 (`make neon-check`) it needs Debian's gcc-aarch64-linux-gnu and qemu-user; the
libraries go to a temporary directory, never into the package, and are also disassembled: none may
hold an instruction past its variant's level (AARCH64_EXTENSIONS). Natively, a variant the CPU lacks
one instruction for runs with that instruction emulated (EMULATED): avx2-vnni's vpdpbusd on the
CPUs without AVX-VNNI, so its code is checked on every AVX2 machine. Exit status 0 when every
check passes (and, with --mutants, every planted bug is caught).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gptlab import kernel_build, kernels

CHECK = Path(__file__).with_name("kernel_check.c")
CROSS = {"aarch64": ("aarch64-linux-gnu-gcc", ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"])}
OBJDUMP = {"aarch64": "aarch64-linux-gnu-objdump"}

# aarch64 instructions past Armv8.0's NEON (an instruction matches by its objdump mnemonic, or SVE's
# by a z register among its operands), and the variants that may hold each: an Armv8.0 core (a
# Cortex-A53, a Raspberry Pi 3/4) dies of SIGILL on the others. The x86 variants' counterpart is
# tests/test_kernel_variants.py's audit, in `make test`.
AARCH64_EXTENSIONS = [  # (extension, mnemonic, variants that may hold it)
    ("DotProd", re.compile(r"[su]dot"), {"neon-dotprod"}),
    ("I8MM", re.compile(r"usdot|sudot|[su]mmla|usmmla"), set()),
    ("BF16", re.compile(r"bfdot|bfmmla|bfmlal[bt]|bfcvtn?2?"), set()),
    ("SVE", re.compile(r"ptrue|whilel[ot]|[a-z0-9.]+ .*\bz[0-9]+\..*"), set()),
]


# variant: (the variant the CPU must run, the flag that emulates what the variant adds to it)
EMULATED = {"avx2-vnni": ("avx2", "-DGL_EMULATE_AVXVNNI")}

# (name, the variant it is built into, a snippet of one of csrc/simd*.h, its replacement)
MUTANTS = {
    "x86-64": [
        ("vpdpbusd's operands swapped", "avx2-vnni",
         "return GL_DPBUSD(acc, aw, sx);", "return GL_DPBUSD(acc, sx, aw);"),
        ("vpdpbusd's operands swapped", "avx512-256",
         "return GL_DPBUSD(acc, aw, sx);", "return GL_DPBUSD(acc, sx, aw);"),
        ("nibble products use the low nibbles twice", "avx2-vnni",
         "return GL_DPBUSD(GL_DPBUSD(_mm256_setzero_si256(), lo, x0), hi, x1);",
         "return GL_DPBUSD(GL_DPBUSD(_mm256_setzero_si256(), lo, x0), lo, x1);"),
        ("the weights' sign is not moved onto x", "avx2",
         "const vi aw = _mm256_sign_epi8(w, w), sx = _mm256_sign_epi8(x, w);",
         "const vi aw = _mm256_sign_epi8(w, w), sx = x;"),
    ],
    "aarch64": [
        ("widening dot sums the low half twice", "neon",
         "vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi))", "vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(lo))"),
        ("odd bf16 weights shifted", "neon",
         "*odd = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xffff0000u)));",
         "*odd = vreinterpretq_f32_u32(vshlq_n_u32(vshrq_n_u32(v, 16), 15));"),
        ("deinterleaved bytes swapped", "neon-dotprod",
         "vst1q_u8((uint8_t *)q, eo.val[0]);", "vst1q_u8((uint8_t *)q, eo.val[1]);"),
        ("block scales ignore the group size", "neon-dotprod",
         "const uint32_t u = (uint32_t)s[b >> gshift] << 16;", "const uint32_t u = (uint32_t)s[b] << 16;"),
        ("max picks the smaller", "neon",
         "return vbslq_f32(vcgtq_f32(a, b), a, b);", "return vbslq_f32(vcgtq_f32(a, b), b, a);"),
    ],
}  # fmt: skip


def tools(arch: str | None) -> tuple[str, list[str]]:
    """(C compiler, command prefix that runs its programs) for `arch`, or this machine's."""
    if arch is None or arch == kernel_build.arch():
        return kernel_build.compiler(), []
    if arch not in CROSS:
        raise SystemExit(f"no cross toolchain known for {arch}; choose one of {', '.join(CROSS)}")
    cc, runner = CROSS[arch]
    missing = [t for t in (cc, runner[0]) if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not found: apt-get install gcc-aarch64-linux-gnu qemu-user")
    return cc, runner


def native_variants() -> list[str]:
    """This CPU's SIMD variants: those it runs, then those it runs with EMULATED's help."""
    runs = [v for v in kernels.runnable_variants() if v != "portable"]
    emulated = [v for v, (base, _) in EMULATED.items() if v not in runs and base in runs]
    return runs + emulated


def build(variant: str, out: Path, cc: str, csrc: Path = kernel_build.CSRC, native: bool = False, quick=False) -> Path:
    """Compile `variant` from `csrc` into `out`; natively, emulated where this CPU cannot run it.
    quick: at -O1 (~4 s, not ~60: the check and the planted bugs need the code's meaning only)."""
    base, extra = variant, []
    if native and variant in EMULATED and variant not in kernels.runnable_variants():
        base, flag = EMULATED[variant]
        extra = [flag]
    cmd = [c.replace(str(kernel_build.CSRC), str(csrc)) for c in kernel_build.command(base, out, cc)] + extra
    if quick:
        cmd = ["-O1" if c == "-O3" else c for c in cmd]
    subprocess.run(cmd, check=True)
    return out


def library(variant: str, tmp: Path, cc: str, native: bool) -> Path:
    """The library to check: natively the one gptlab runs (installed or cached, of these sources),
    else (cross, or emulated) built from the sources into tmp."""
    if native and variant in kernels.runnable_variants():
        return kernels.library_path(variant)
    return build(variant, tmp / kernel_build.library_name(variant), cc, native=native, quick=native)


def check(runner: list[str], program: Path, libs: list[Path], quiet: bool = False) -> int:
    proc = subprocess.run([*runner, str(program), *map(str, libs)], capture_output=quiet, text=True)
    return proc.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(kernel_build.ARCHES), help="cross-compile for this architecture")
    parser.add_argument("--mutants", action="store_true", help="also plant bugs in its variants: each must fail")
    args = parser.parse_args(argv)
    cc, runner = tools(args.arch)
    native = not runner
    # natively, only the variants this CPU can execute; cross, every variant of that architecture
    variants = native_variants() if native else list(kernel_build.ARCHES[args.arch])
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        tmp = Path(tmp)
        program = tmp / "kernel_check"
        subprocess.run([*shlex.split(cc), "-O1", "-o", str(program), str(CHECK), "-ldl", "-lm"], check=True)
        names = ["portable", *variants]
        libs = list(pool.map(lambda v: library(v, tmp, cc, native), names))
        status = check(runner, program, libs)
        if not native:
            status |= audit(args.arch, names, libs)
        if status or not args.mutants:
            return status
        mutants = []
        for mutant in MUTANTS.get(args.arch or kernel_build.arch(), []):
            if mutant[1] in variants:
                mutants.append(mutant)
            else:
                print(f"not run  {mutant[1]}: {mutant[0]} (this CPU runs neither the variant nor its emulation)")
        results = pool.map(lambda im: plant(*im[1], tmp / f"mutant{im[0]}", cc, native), enumerate(mutants))
        missed = 0
        for (name, variant, _, _), lib in zip(mutants, results, strict=True):
            caught = lib is not None and check(runner, program, [libs[0], lib], quiet=True) == 1
            missed += not caught
            print(f"{'caught' if caught else 'MISSED' if lib else 'stale '}   {variant}: {name}")
        return 1 if missed else 0


def foreign_instructions(arch: str, variant: str, library: Path) -> list[str]:
    """'function: instruction (extension)' for each instruction of `library` past `variant`'s level."""
    text = subprocess.run([OBJDUMP[arch], "-d", str(library)], capture_output=True, text=True, check=True).stdout
    found, function = [], None
    for line in text.splitlines():
        if m := re.fullmatch(r"[0-9a-f]+ <(.+)>:", line):
            function = m.group(1)
        elif (m := re.fullmatch(r"\s*[0-9a-f]+:\t[0-9a-f ]+\t(.+)", line)) and function is not None:
            instruction = " ".join(m.group(1).split())  # "sdot v0.4s, v1.16b, v2.16b"
            for extension, pattern, variants in AARCH64_EXTENSIONS:
                if variant not in variants and (
                    pattern.fullmatch(instruction.split()[0]) or pattern.fullmatch(instruction)
                ):
                    found.append(f"{function}: {instruction} ({extension})")
    return found


def audit(arch: str, names: list[str], libs: list[Path]) -> int:
    """Each library disassembled: 1 when one holds an instruction past its variant's, else 0."""
    bad = 0
    for variant, library in zip(names, libs, strict=True):
        foreign = foreign_instructions(arch, variant, library)
        print(f"{'FOREIGN' if foreign else 'ok     '}  {variant}: instructions past its level"
              + "".join(f"\n    {f}" for f in foreign[:10]))  # fmt: skip
        bad |= bool(foreign)
    return bad


def plant(name: str, variant: str, old: str, new: str, tmp: Path, cc: str, native: bool) -> Path | None:
    """`variant` built from a copy of the sources with `old` replaced by `new` in the csrc/simd*.h
    that holds it, or None when `old` is not in exactly one of them, once (a stale mutant)."""
    csrc = tmp / "csrc"
    shutil.copytree(kernel_build.CSRC, csrc)
    headers = [h for h in sorted(csrc.glob("simd*.h")) if old in h.read_text()]
    if len(headers) != 1 or headers[0].read_text().count(old) != 1:
        return None
    headers[0].write_text(headers[0].read_text().replace(old, new))
    return build(variant, tmp / "mutant.so", cc, csrc, native=native, quick=True)


if __name__ == "__main__":
    sys.exit(main())
