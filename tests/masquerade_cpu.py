"""Run the test suite natively under another machine kind's /proc/cpuinfo: the kinds this project
is lent now and then, as far as gptlab's Python reads them.

    python tests/masquerade_cpu.py                          # every kind in KINDS, the whole suite
    python tests/masquerade_cpu.py --kind xeon tests/test_kernels.py -k same_bits

gptlab chooses some paths from /proc/cpuinfo: the vendor (an Intel CPU times gptlab's GEMM against
MKL, per thread count, gptlab.gemm_probe), the flags (bf16 instructions or not: training's
precision, the bf16 GEMM probe; VNNI: whether fbgemm's int8 is exact) and the model (cache keys).
Here a copy of this CPU's /proc/cpuinfo, rewritten as KINDS says, is bind-mounted over it in a
private mount namespace (`unshare --mount`, so root), and pytest runs under it, with the kind's
ISA settings holding PyTorch's libraries to its level (the Xeon's: oneDNN and MKL without bf16
instructions or AMX, which a newer Xeon running this would otherwise use). It found the Intel
path's thread-count dependence (test_kernels' same-bits test took MKL at 3 threads only) and torch.compile's shared
cache crashing at AVX2 (gptlab.compile_cache), neither of which the emulated CPUs show, since
qemu-user passes the host's /proc/cpuinfo through (tests/emulated_cpu.py).

What it does not show: anything read by cpuid stays this CPU's (gptlab's variant and the C code's
vendor, PyTorch's ATen level unless held, fbgemm, MKL's code paths), and speed. The tests that
compare cpuid with /proc/cpuinfo fail here by design and are deselected (BY_DESIGN). Exit status
0 when every kind passes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# kind: (/proc/cpuinfo fields replaced, flags removed (regular expressions), environment)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# oneDNN and MKL capped at Ice Lake's level (no bf16 instructions, no AMX), as gptlab.bench.generate's
# ISA_ENV["avx512-vnni"]; caps, safe on any host (ATEN_CPU_CAPABILITY=avx512 is not: ATen takes it unchecked)
XEON_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E2"}
KINDS = {
    # this project's Intel Xeon: AVX-512 and VNNI, no AVX512-BF16 or AMX exposed
    "xeon": (
        {"vendor_id": "GenuineIntel", "cpu family": "6", "model": "106", "model name": "Intel(R) Xeon(R) Processor"},
        [r"avx512_bf16", r"amx\w*"],
        XEON_ENV,
    ),
    # the AMD EPYC Zen 3 (family 25 model 1): AVX2, FMA, F16C; no AVX-512, VNNI or GFNI
    "zen3": (
        {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "1", "model name": "AMD EPYC"},
        [r"avx512\w*", r"gfni", r"amx\w*", r"avx_vnni"],
        AVX2_ENV,
    ),
}
# cpuid against /proc/cpuinfo: they cannot agree here, nor under qemu-user (emulated_cpu.py takes this list)
BY_DESIGN = [
    "tests/test_kernel_variants.py::test_cpuid_reads_what_linux_reports",
    "tests/test_kernel_variants.py::test_decoding_takes_one_weight_stream_per_thread_but_on_intels_avx512",
    "tests/test_kernel_variants.py::test_decoding_prefetches_non_temporally_on_amd_cpus_only",
]


def rewrite(cpuinfo: str, kind: str) -> str:
    """This CPU's /proc/cpuinfo text as `kind`'s: its fields replaced and flags removed, in every
    processor's block."""
    fields, drop, _ = KINDS[kind]
    lines = []
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        name = key.strip()
        if sep and name in fields:
            line = f"{key}: {fields[name]}"
        elif sep and name == "flags":
            kept = [f for f in value.split() if not any(re.fullmatch(d, f) for d in drop)]
            line = f"{key}: {' '.join(kept)}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def run(kind: str, pytest_args: list[str], tmp: Path) -> int:
    """pytest under `kind`'s /proc/cpuinfo and ISA settings; its exit status."""
    fake = tmp / f"cpuinfo-{kind}"
    fake.write_text(rewrite(Path("/proc/cpuinfo").read_text(), kind))
    env = {**os.environ, **KINDS[kind][2], "XDG_CACHE_HOME": str(tmp / f"cache-{kind}")}  # probes measured afresh
    env.pop("GPTLAB_CACHE", None)
    deselect = [arg for test in BY_DESIGN for arg in ("--deselect", test)]
    command = ["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /proc/cpuinfo && exec "$@"', str(fake)]
    command += [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *deselect, *pytest_args]
    print(f"== {kind}: {' '.join(f'{k}={v}' for k, v in KINDS[kind][2].items()) or 'no ISA settings'}", flush=True)
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kind", choices=sorted(KINDS), action="append", help="the kinds to stand in for (default: all)"
    )
    args, pytest_args = parser.parse_known_args(argv)
    if os.geteuid() != 0 or not shutil.which("unshare"):
        print("masquerade_cpu needs root and unshare (util-linux): it bind-mounts over /proc/cpuinfo", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        failed = [kind for kind in args.kind or sorted(KINDS) if run(kind, pytest_args, Path(tmp))]
    print(f"FAILED: {', '.join(failed)}" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
