"""The AVX2 machine kind on every run: a few CPU-dependent tests on an emulated AVX2 CPU without
AVX-512 or VNNI (qemu-user; tests/emulated_cpu.py, whose `make emulated-check` runs them all).

On a CPU with AVX-512 VNNI, as the machines this runs on mostly are, fbgemm's int8 product is
exact and auto takes an AVX-512 variant, so nothing else here sees the AVX2-only path: auto's
`avx2`, and int8 prompts through gptlab's kernel because fbgemm would saturate there (issue 22's
four failures on the AMD EPYC Zen 3), or without gptlab's kernels through PyTorch's weight-only
int8 product. ~45 s on the Zen 4, nearly all of it emulated Python.
"""

import pytest

import emulated_cpu

QUICK = [
    "tests/test_quantize.py::test_quantized_linear_equals_dequantized_matmul",
    "tests/test_fused_step.py::test_quantized_step_matches_the_modules",
    "tests/test_int8_prompts.py::test_without_vnni_no_prompt_takes_fbgemms_saturating_product",
]


UNAVAILABLE = emulated_cpu.unavailable()  # a non-x86 host (nothing to emulate) or no qemu-user


@pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")
def test_an_avx2_cpu_without_vnni_takes_avx2_and_keeps_int8_exact():
    passed, report = emulated_cpu.check("avx2", ["-x", *QUICK])
    assert passed, report
    assert "auto avx2" in report and "ATen AVX2" in report and "avx512" not in report, report
