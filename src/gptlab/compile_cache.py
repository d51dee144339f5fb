"""torch.compile's builds, one cache directory per CPU.

Inductor (torch.compile's CPU backend) builds its C++ with -march=native into
/tmp/torchinductor_USER, and neither its graph cache's keys nor its C++ cache's name the CPU. A
cache written on an AVX-512 CPU and read on an AVX2 one (a /tmp or home directory that moves
between machines; a disk that outlives the CPU it was written on) brings back kernels the CPU
cannot run. Under ATEN_CPU_CAPABILITY=avx2 on the very CPU that built them (gptlab's stand-in for
an AVX2 CPU, an AMD EPYC Zen 4), a compiled training step crashed with a segmentation fault: the
graph's code, vectorized 16 floats wide, was built again at AVX2's 8. `use` gives each CPU its own
directory; gptlab's compiled decoding and training call it before compiling.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

from gptlab import cpu, kernels
from gptlab.machine_cache import isa_settings


def directory() -> Path:
    """Where inductor keeps what it builds on this CPU: below its default directory, one per CPU
    model, set of CPU flags, cpuid features, isa_settings() and TORCHINDUCTOR_CPP_MARCH."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()) / f"cpu-{_cpu_digest()}"


def use() -> Path:
    """Point inductor's cache (TORCHINDUCTOR_CACHE_DIR) at directory(), unless the user chose one,
    and return the directory in use. Call it before compiling."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):  # inductor writes its default there
        return Path(chosen)
    path = directory()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


def _cpu_digest() -> str:
    """12 hex digits that change with what the compiler sees of this CPU: the machine type, the
    model name and every flag /proc/cpuinfo lists (-march=native may use any), the features this
    process reads by cpuid (an emulated CPU's under qemu-user, which passes the host's
    /proc/cpuinfo through), isa_settings() and TORCHINDUCTOR_CPP_MARCH."""
    flags = cpu.cpuinfo("flags") or cpu.cpuinfo("Features")  # x86, aarch64
    parts = [platform.machine(), cpu.cpuinfo("model name"), " ".join(sorted(set(flags.split())))]
    parts += [kernels.cpu_description(), isa_settings(), os.environ.get("TORCHINDUCTOR_CPP_MARCH", "")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
