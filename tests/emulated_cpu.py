"""Run the CPU-dependent tests on emulated x86-64 CPUs: the machine kinds this project is not lent.

    python tests/emulated_cpu.py                                # every CPU in CPUS, the TESTS
    python tests/emulated_cpu.py --cpu avx2 tests/test_quantize.py -k int8

`make emulated-check` runs it (not part of `make test`: ~30 min on 2 cores of an AMD EPYC host;
on an Intel Xeon host its Haswell takes hours, TCG running AVX2 code several times slower there,
while Westmere takes ~20 min). qemu-user runs this
Python, PyTorch and gptlab's kernels on a CPU whose cpuid is a qemu CPU model's, so everything
that chooses by cpuid chooses as on that CPU: gptlab's variant, PyTorch's ATen level, oneDNN,
MKL, and fbgemm's int8 path (without VNNI it quantizes activations to 7 bits, the failure issue
22 found on the AMD EPYC Zen 3). The models:

- avx2: an AVX2 CPU without AVX-512 or VNNI of the host's vendor: on an AMD host EPYC-Milan (Zen
  3, the AMD EPYC Zen 3 this project was lent once), on an Intel host Haswell (Intel's client
  chips up to Comet Lake). auto must take `avx2`.
- portable: Westmere (SSE4.2, no AVX): a CPU without any SIMD level gptlab has a variant for.
  auto must take `portable`.

What emulation does not show: speed (qemu's TCG runs these tests ~50x slower), and what comes
from /proc/cpuinfo, which qemu-user passes through from the host (the vendor and family gptlab
reads there; hence the host's vendor for avx2). Programs a test starts run natively (qemu-user
does not follow exec), and so does the compiler: torch.compile's C++ is built for the emulated
CPU's x86-64 level (TORCHINDUCTOR_CPP_MARCH), not -march=native, in a cache of its own. And the
emulation can be wrong: qemu 7.2 runs NumPy's AVX2 argsort wrongly (below), and a test that
fails here only is to be checked natively before it is believed (tests/test_kernel_variants.py's
tests of cpuid against /proc/cpuinfo, the vendor's included, fail here by design and are left out:
/proc/cpuinfo is the host's). Exit status 0 when, on every CPU, the variant is the expected one
and every test passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from masquerade_cpu import BY_DESIGN

ROOT = Path(__file__).resolve().parent.parent

# name: ({host vendor: qemu CPU model}, the x86-64 level for torch.compile's C++, auto's variant there)
CPUS = {
    "avx2": ({"AuthenticAMD": "EPYC-Milan", "GenuineIntel": "Haswell"}, "x86-64-v3", "avx2"),
    "portable": ({"AuthenticAMD": "Westmere", "GenuineIntel": "Westmere"}, "x86-64-v2", "portable"),
}

# The tests whose paths depend on the CPU: the kernels, quantization, the fused step, the loss's
# softmax, the GEMM, the model's forward, generation and sampling's thresholds (~27 s natively,
# ~25 min emulated).
TESTS = [
    "tests/test_kernels.py",
    "tests/test_quantize.py",
    "tests/test_fused_step.py",
    "tests/test_chunked_loss.py",
    "tests/test_gemm.py",
    "tests/test_model.py",
    "tests/test_generate.py",
    "tests/test_sampling.py",
    # the variant auto takes, forcing one the CPU lacks, each library's name and instructions; less
    # the tests of cpuid against /proc/cpuinfo, as under make masquerade-check: qemu passes the host's
    # through, and its CPU model names its own vendor in cpuid (Westmere is Intel's on an AMD host)
    "tests/test_kernel_variants.py",
    *(f"--deselect={test}" for test in BY_DESIGN),
]

PROBE = """
import json, torch
from gptlab import kernels
print(json.dumps({"auto": kernels.auto_variant(), "runs": kernels.runnable_variants(),
                  "features": sorted(kernels.cpu_features()), "aten": torch.backends.cpu.get_cpu_capability()}))
"""


def qemu_model(cpu: str) -> str:
    """The qemu CPU model that stands in for `cpu` on this host."""
    from gptlab.cpu import vendor as host_vendor

    models = CPUS[cpu][0]
    vendor = host_vendor()
    if vendor not in models:
        raise SystemExit(f"no {cpu} CPU model for a host made by {vendor or 'an unknown vendor'}")
    return models[vendor]


def emulated_env(cpu: str, cache: Path) -> dict:
    """The environment that runs Python under qemu as `cpu`."""
    return {
        **os.environ,
        "QEMU_CPU": qemu_model(cpu),
        "TORCHINDUCTOR_CPP_MARCH": CPUS[cpu][1],
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        # NumPy's AVX2 argsort returns unsorted rows under qemu 7.2 (Debian 12's), correct on the
        # same code natively (NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL" on an AVX-512 CPU): a
        # flaw of the emulation, so NumPy keeps to its SSE baseline here.
        "NPY_DISABLE_CPU_FEATURES": "X86_V3",
        # On an Intel host auto would time whose GEMM to run (gptlab.gemm_probe): under qemu, the
        # emulator's speed, for minutes. gptlab's, as auto takes on an AMD host without timing.
        "GPTLAB_GEMM": "gptlab",
    }


def _noted_by_qemu(line: str) -> bool:
    return "TCG doesn't support" in line  # qemu's notes on the host features TCG lacks


def run(cpu: str, args: list[str], cache: Path, echo: str | None = None) -> subprocess.CompletedProcess:
    """`python args...` under qemu-x86_64 as `cpu`, its output captured, qemu's notes left out.
    With `echo`, stdout and stderr are captured together and each line is also printed as it comes,
    after that prefix: the tests take minutes to hours under emulation."""
    command, env = ["qemu-x86_64", sys.executable, *args], emulated_env(cpu, cache)
    if echo is None:
        proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
        proc.stderr = "".join(line for line in proc.stderr.splitlines(True) if not _noted_by_qemu(line))
        return proc
    lines = []
    with subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            if not _noted_by_qemu(line):
                lines.append(line)
                print(f"{echo}{line}", end="", flush=True)
    return subprocess.CompletedProcess(command, p.returncode, "".join(lines), "")


def check(cpu: str, pytest_args: list[str], echo: bool = False) -> tuple[bool, str]:
    """(passed, report) for one emulated CPU: its probe, then the tests (their output printed as
    it comes, each line after "[cpu] ", with `echo`)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = run(cpu, ["-c", PROBE], Path(tmp))
        if probe.returncode:
            return False, f"{cpu}: the probe failed\n{probe.stdout}{probe.stderr}"
        seen = json.loads(probe.stdout.splitlines()[-1])
        head = f"{cpu} ({qemu_model(cpu)}): auto {seen['auto']}, runs {seen['runs']}, ATen {seen['aten']}"
        head += f", features {' '.join(seen['features']) or 'none'}"
        if seen["auto"] != CPUS[cpu][2]:
            return False, f"{head}\nFAILED: auto must take {CPUS[cpu][2]} here"
        if echo:
            print(head, flush=True)
        pytest = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *pytest_args]
        tests = run(cpu, pytest, Path(tmp), echo=f"[{cpu}] " if echo else None)
        return tests.returncode == 0, f"{head}\n{tests.stdout}{tests.stderr}"


def unavailable() -> str | None:
    """Why this host cannot emulate the CPUS, or None when it can."""
    if os.uname().machine != "x86_64":
        return "emulated x86-64 CPUs need an x86-64 host (qemu-user runs the host's binaries)"
    if shutil.which("qemu-x86_64") is None:
        return "qemu-x86_64 not found: apt-get install qemu-user"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="append", choices=sorted(CPUS), help="emulate this one (default: each)")
    args, pytest_args = parser.parse_known_args(argv)
    if why := unavailable():
        raise SystemExit(why)
    cpus = args.cpu or list(CPUS)
    start = time.monotonic()

    def timed_check(cpu: str) -> tuple[bool, str]:
        passed, report = check(cpu, pytest_args or TESTS, echo=True)
        return (
            passed,
            f"{report.splitlines()[0]}\n{report.rstrip().splitlines()[-1]} ({(time.monotonic() - start) / 60:.0f} min)",
        )

    with ThreadPoolExecutor(len(cpus)) as pool:  # qemu runs each on about one core
        results = list(pool.map(timed_check, cpus))
    print()
    for passed, summary in results:  # each CPU's tests' last line again, after the interleaved output
        print(summary)
        print("passed" if passed else "FAILED", end="\n\n")
    return 0 if all(passed for passed, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
