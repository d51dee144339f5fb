"""What Linux says about the CPU in /proc/cpuinfo: its name, vendor, family and flags.

gptlab chooses a few paths by them: the GEMM by vendor (gptlab.gemm), the kernels' variant on a
half-width AVX-512 by vendor and family (gptlab.kernels.auto_variant), bf16 by the flags
(training's precision, linear's bf16 products). The instruction sets the kernels need come from
cpuid instead (gptlab.kernels.cpu_features), as the library sees it run: under qemu-user the two
differ, /proc/cpuinfo being the host's (tests/emulated_cpu.py).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


def name() -> str:
    """The CPU model name (/proc/cpuinfo), or the platform's machine type."""
    return cpuinfo("model name") or platform.machine() or "unknown"


def cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo, or "" where there is none (or no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == field:
                return value.strip()
    except OSError:
        pass
    return ""


BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")  # /proc/cpuinfo names of x86's bf16 instructions


def may_have_native_bf16() -> bool:
    """False for an x86 Linux CPU whose flags name none of BF16_FLAGS (bf16 matmuls are then
    emulated, slower than fp32); True where that cannot be told (other CPUs, no /proc/cpuinfo)."""
    flags = cpuinfo("flags").split()
    if "sse2" not in flags:  # not x86, or no /proc/cpuinfo
        return True
    return any(f in flags for f in BF16_FLAGS)


@functools.cache
def vendor() -> str:
    """The CPU's vendor as cpuid names it (/proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD,
    ...), or "" where that cannot be read."""
    return cpuinfo("vendor_id")


@functools.cache
def family() -> int | None:
    """The CPU's family as cpuid reports it (/proc/cpuinfo's cpu family: 25 for AMD Zen 3 and 4,
    26 for Zen 5, 6 for most Intel CPUs), or None where that cannot be read."""
    value = cpuinfo("cpu family")
    return int(value) if value.isdigit() else None
