"""torch.compile's cache per CPU (gptlab.compile_cache): inductor builds its C++
with -march=native and keys neither its graphs nor its C++ by the CPU, so a cache another CPU wrote
(or this one under ATEN_CPU_CAPABILITY=avx2: a segmentation fault in a compiled training step,
measured) must not be read."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from conftest import tiny_model
from gptlab import compile_cache, cpu, kernels, machine_cache
from gptlab.generation import compile_decode
from gptlab.train import Trainer, precision
from test_train import byte_data, config  # noqa: F401 (byte_data is a fixture)

ZEN4 = {"model name": "AMD EPYC", "flags": "fpu sse2 avx2 fma avx512f avx512_vnni"}  # /proc/cpuinfo's fields
ZEN3 = {"model name": "AMD EPYC", "flags": "fpu sse2 avx2 fma"}


@pytest.fixture
def plain(monkeypatch):
    """No cache directory chosen and no ISA settings, on a Zen 4's /proc/cpuinfo."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    for name in machine_cache.ISA_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu, "cpuinfo", lambda field: ZEN4.get(field, ""))
    return monkeypatch


def test_each_cpu_and_isa_setting_compiles_into_a_directory_of_its_own(plain):
    zen4 = compile_cache.directory()
    assert zen4.parent == Path(default_cache_dir()) and zen4.name.startswith("cpu-")
    assert compile_cache.directory() == zen4  # the same CPU: the same builds, reused
    plain.setattr(cpu, "cpuinfo", lambda field: ZEN3.get(field, ""))  # the same model name, without AVX-512
    zen3 = compile_cache.directory()
    plain.setattr(cpu, "cpuinfo", lambda field: ZEN4.get(field, ""))
    plain.setenv("ATEN_CPU_CAPABILITY", "avx2")  # a Zen 4 standing in for an AVX2 CPU
    held = compile_cache.directory()
    plain.delenv("ATEN_CPU_CAPABILITY")
    plain.setattr(kernels, "cpu_description", lambda: "AMD EPYC avx2 f16c fma")  # an emulated Zen 3's cpuid
    emulated = compile_cache.directory()
    assert len({zen4, zen3, held, emulated}) == 4


def test_settings_that_ask_for_the_default_share_its_directory_and_timings(plain):
    """GPTLAB_KERNELS=auto (or 1) and GPTLAB_GEMM=auto are what no setting gives: the same compile
    directory and the same cached probe timings (gemm.json), not a second measurement that can
    choose otherwise (an Intel Xeon's head: 0.94x unset, 1.01x measured again under GPTLAB_GEMM=auto)."""
    unset = compile_cache.directory(), machine_cache.machine_key("cpu", "kernels avx512")
    for name, value in (("GPTLAB_GEMM", "auto"), ("GPTLAB_KERNELS", " Auto "), ("GPTLAB_KERNELS", "1")):
        plain.setenv(name, value)
        assert (compile_cache.directory(), machine_cache.machine_key("cpu", "kernels avx512")) == unset, value
        plain.delenv(name)
    plain.setenv("GPTLAB_GEMM", "torch")
    assert machine_cache.machine_key("cpu", "kernels avx512") == unset[1] + " | GPTLAB_GEMM=torch"
    assert compile_cache.directory() != unset[0]


def test_use_compile_cache_points_inductor_there_unless_the_user_chose(plain, tmp_path):
    assert compile_cache.use() == compile_cache.directory()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compile_cache.directory())
    plain.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes there once it has run
    assert compile_cache.use() == compile_cache.directory()
    plain.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.use() == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_compiled_decoding_and_training_build_into_this_cpus_directory(plain, byte_data, tmp_path):  # noqa: F811
    compile_decode(tiny_model(0))  # compiles on its first step; the directory is set before
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compile_cache.directory())
    plain.delenv("TORCHINDUCTOR_CACHE_DIR")
    Trainer(config(byte_data, tmp_path / "run", compile=True))  # compiles on its first step too
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compile_cache.directory())


@pytest.mark.parametrize(
    "entry",
    ["garbage", None, {"float32": 0.2}, {"float32": 0.2, "bfloat16": "0.1"}, {"float32": True, "bfloat16": 0.1}],
    ids=["string", "null", "side-missing", "string-timing", "bool-timing"],
)
def test_a_corrupt_precision_cache_entry_is_measured_again(plain, tmp_path, entry):
    """precision.json (training's precision=auto, gptlab.machine_cache): an entry of this machine's
    without both timings was a TypeError or KeyError in resolve_precision; it counts as missing."""
    plain.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    plain.setattr(precision, "may_have_native_bf16", lambda: True)
    plain.setattr(precision, "onednn_runs_bf16", lambda: True)
    probes = []
    plain.setattr(precision, "probe", lambda *a: probes.append(1) or {"float32": 0.5, "bfloat16": 0.2})
    model, cpu_device = tiny_model(), torch.device("cpu")
    assert precision.resolve_precision("auto", cpu_device, model, (4, 32))[0] == torch.bfloat16
    path = tmp_path / "cache" / precision.CACHE_FILE
    (key, _), *others = json.loads(path.read_text()).items()
    assert not others
    path.write_text(json.dumps({key: entry}))
    dtype, why = precision.resolve_precision("auto", cpu_device, model, (4, 32))
    assert dtype == torch.bfloat16 and "measured now" in why and len(probes) == 2
    assert json.loads(path.read_text()) == {key: {"float32": 0.5, "bfloat16": 0.2}}
