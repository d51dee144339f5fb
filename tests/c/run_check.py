"""Build the kernel variants of an architecture and run kernel_check.c on them.

    python tests/c/run_check.py                   # this machine's variants, natively
    python tests/c/run_check.py --arch aarch64    # cross-compiled, run under qemu-user
    python tests/c/run_check.py --arch aarch64 --mutants   # and plant bugs, which must fail it

For aarch64 (`make neon-check`) it needs Debian's gcc-aarch64-linux-gnu and qemu-user; the
libraries go to a temporary directory, never into the package. Exit status 0 when every check
passes (and, with --mutants, every planted bug is caught).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gptlab import kernel_build, kernels

CHECK = Path(__file__).with_name("kernel_check.c")
CROSS = {"aarch64": ("aarch64-linux-gnu-gcc", ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"])}

# (name, the variant it is built into, the snippet of csrc/simd.h, its replacement)
MUTANTS = {
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


def build(variant: str, out: Path, cc: str, csrc: Path = kernel_build.CSRC) -> Path:
    cmd = [c.replace(str(kernel_build.CSRC), str(csrc)) for c in kernel_build.command(variant, out, cc)]
    subprocess.run(cmd, check=True)
    return out


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
    variants = (
        [v for v in kernels.runnable_variants() if v != "portable"] if native else list(kernel_build.ARCHES[args.arch])
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        program = tmp / "kernel_check"
        subprocess.run([cc, "-O1", "-o", str(program), str(CHECK), "-ldl", "-lm"], check=True)
        libs = [build(v, tmp / kernel_build.library_name(v), cc) for v in ["portable", *variants]]
        status = check(runner, program, libs)
        if status or not args.mutants:
            return status
        missed = 0
        for name, variant, old, new in MUTANTS.get(args.arch or kernel_build.arch(), []):
            csrc = tmp / "mutant"
            shutil.rmtree(csrc, ignore_errors=True)
            shutil.copytree(kernel_build.CSRC, csrc)
            simd = csrc / "simd.h"
            text = simd.read_text()
            if text.count(old) != 1:
                print(f"stale    {name}: its snippet is not in simd.h once")
                missed += 1
                continue
            simd.write_text(text.replace(old, new))
            lib = build(variant, tmp / "mutant.so", cc, csrc)
            caught = check(runner, program, [libs[0], lib], quiet=True) == 1
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'}   {variant}: {name}")
        return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
