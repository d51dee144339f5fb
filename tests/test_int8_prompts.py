"""int8 prompts: oneDNN's int8 product on x quantized per row, or fbgemm's, chosen by timing both
once per machine (gptlab.int8_prompts)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from gptlab import int8_prompts, kernels, ops
from gptlab.quantize import Int8Linear

INT_OK = kernels.available()[1]
needs_int = pytest.mark.skipif(not INT_OK, reason=f"gptlab's int kernels are not built here: {kernels.available()[2]}")
# PyTorch's x86 builds have oneDNN's int8 linear; its ARM builds may not (nor fbgemm's)
needs_onednn = pytest.mark.skipif(not int8_prompts.onednn_available(), reason="this PyTorch has no oneDNN int8 linear")
# oneDNN held below VNNI (make masquerade-check's Zen 3 holds it to AVX2): its int8 sums saturate;
# told from the setting, not from int8_prompts.onednn_is_exact, the function under test
ONEDNN_BELOW_VNNI = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ("SSE41", "AVX", "AVX2", "AVX512_CORE")


def per_row_reference(x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
    """y (M, N) in float64 for x (M, K) quantized per row as gptlab's kernel quantizes it:
    q = round(x * 127 / max|x|) (fp32, half to even), y = (q W^T) s_x s_w + b."""
    amax = x.abs().amax(-1, keepdim=True)  # (M, 1)
    q = torch.round(x * (127 / amax))  # (M, K), fp32 as in C
    y = q.double() @ layer.weight.double().t() * layer.scales.double() * (amax / 127).double()  # (M, N)
    return y if layer.bias is None else y + layer.bias.double()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


@needs_int
@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_int8_prompts_through_onednn_are_gptlabs_per_row_quantization(monkeypatch, bias):
    """Forced to oneDNN, a prompt's product is that of x quantized per row (the decoding kernel's
    scheme) and the weight's row scales, within fp32 rounding; fbgemm's, one scale for all rows,
    is measurably further off. Without AVX-512 VNNI, fbgemm would saturate, so prompts stay in
    gptlab's kernel (the same per-row product) whatever is asked."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 70, bias=bias)
    x = torch.randn(40, 96) * torch.logspace(-1, 1, 40)[:, None]  # rows of different sizes
    monkeypatch.setenv("GPTLAB_INT8_GEMM", "onednn")
    layer = Int8Linear.from_linear(linear, "int8")
    if ops.fbgemm_int8_is_exact():  # AVX-512 VNNI: oneDNN's sums are exact too, unless held below it
        assert int8_prompts.onednn_is_exact() == (not ONEDNN_BELOW_VNNI)
    if ops.fbgemm_int8_is_exact() and ONEDNN_BELOW_VNNI:
        with pytest.raises(ValueError, match="saturates its 16-bit sums"):
            layer.prepare()
        monkeypatch.setenv("GPTLAB_INT8_GEMM", "auto")
        layer.prepare()
        assert layer._prompts_gemm == "fbgemm"
        return
    layer.prepare()
    with torch.no_grad():
        y = layer(x)
    ref = per_row_reference(x, layer)
    # measured 3.9e-8 / 5.3e-8 (with / without bias; oneDNN, Intel Xeon 6/207 with AMX); gptlab's
    # avx2 kernel 6.5e-8 / 3.9e-8
    assert y.dtype is torch.float32 and relative(y, ref) < 1e-6
    if not ops.fbgemm_int8_is_exact():
        assert layer._prompts_gemm == "fbgemm" and layer._prompts_in_kernel
        return
    assert layer._prompts_gemm == "onednn" and not layer._prompts_in_kernel
    monkeypatch.setenv("GPTLAB_INT8_GEMM", "fbgemm")
    layer.prepare()
    with torch.no_grad():
        y_fbgemm = layer(x)
    assert layer._prompts_gemm == "fbgemm" and relative(y_fbgemm, ref) > 1e-3  # measured 1.7e-2 / 1.0e-2: x's one scale


def row_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest error of a row of a against b (M, N), relative to that row's largest value."""
    return ((a.double() - b).abs().amax(-1) / b.abs().amax(-1)).max().item()


@pytest.mark.parametrize(
    "kernel", [pytest.param(True, marks=needs_int, id="gptlab-kernel"), pytest.param(False, id="no-kernels")]
)
def test_without_vnni_no_prompt_takes_fbgemms_saturating_product(monkeypatch, kernel):
    """Without AVX-512 VNNI fbgemm's int8 sums saturate (issue 22: +1.08% perplexity on the AMD
    EPYC Zen 3), so an int8 layer never runs or holds it (its packed copy of the weight took
    130-150 MB more for GPT-2 small): prompts take gptlab's kernel, or without gptlab's kernels
    (GPTLAB_KERNELS=0, no C compiler) PyTorch's weight-only int8 product on bf16 activations.
    Rows 10^4 apart in size tell them apart from fbgemm, which quantizes x with one scale for all
    of them, even on a CPU where fbgemm is exact."""
    monkeypatch.setattr(ops, "fbgemm_int8_is_exact", lambda: False)
    torch.manual_seed(0)
    linear = nn.Linear(96, 70)
    x = torch.randn(40, 96) * torch.logspace(-2, 2, 40)[:, None]  # (M, K), rows of very different sizes
    layer = Int8Linear.from_linear(linear, "int8")
    with kernels.use_kernels(kernel):
        layer.prepare()
        with torch.no_grad():
            y = layer(x)  # (M, N)
    assert layer._kernel_weights[2] is None  # no fbgemm (or oneDNN) copy of the weight
    if kernel:  # measured 6.5e-8 (avx512, Intel Xeon 6/207)
        assert relative(y, per_row_reference(x, layer)) < 1e-6
    else:  # bf16 activations and output: measured 4.3e-3 (fbgemm's one scale: 1.2, the small rows lost)
        assert row_relative(y, x.double() @ layer.dequantize().double().t() + linear.bias.double()) < 1e-2


@pytest.fixture
def int8_probe(monkeypatch, tmp_path):
    """gptlab's cache in tmp_path, no choice made yet in this process, oneDNN's int8 product
    present; returns the list of probes run (fake_probe sets their timings)."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GPTLAB_INT8_GEMM", raising=False)
    monkeypatch.setattr(int8_prompts, "_chosen", {})
    monkeypatch.setattr(int8_prompts, "onednn_available", lambda: True)
    monkeypatch.setattr(int8_prompts, "onednn_is_exact", lambda: True)
    return []


def fake_probe(monkeypatch, probes: list, fbgemm: float, onednn: float) -> None:
    """int8_prompts.measure gives these seconds at each row count (and counts its calls)."""
    timings = {f"prompts {rows} rows": {"fbgemm": fbgemm, "onednn": onednn} for rows in (64, 512)}
    monkeypatch.setattr(int8_prompts, "measure", lambda layer_class: probes.append(1) or timings)


@needs_int
@pytest.mark.parametrize(
    ("fbgemm", "onednn", "chosen"), [(2.0, 1.0, "onednn"), (1.0, 2.0, "fbgemm"), (1.0, 1.0, "fbgemm")]
)
def test_int8_prompts_take_the_product_measured_faster_once_per_machine(
    int8_probe, monkeypatch, tmp_path, caplog, fbgemm, onednn, chosen
):
    fake_probe(monkeypatch, int8_probe, fbgemm, onednn)
    with caplog.at_level("DEBUG", logger="gptlab.int8_prompts"):
        assert int8_prompts.gemm_choice(Int8Linear) == chosen and int8_prompts.gemm_choice(Int8Linear) == chosen
    assert len(int8_probe) == 1  # measured once
    (key, timings), *others = json.loads((tmp_path / "cache" / int8_prompts.CACHE_FILE).read_text()).items()
    assert not others and "int8 prompts" in key and timings["prompts 512 rows"] == {"fbgemm": fbgemm, "onednn": onednn}
    monkeypatch.setattr(int8_prompts, "_chosen", {})  # a new process on the same machine reads the file
    fake_probe(monkeypatch, int8_probe, onednn, fbgemm)  # timings that would choose the other
    with caplog.at_level("DEBUG", logger="gptlab.int8_prompts"):
        assert int8_prompts.gemm_choice(Int8Linear) == chosen and len(int8_probe) == 1
    # measured: said (INFO); read back: said only with -v (DEBUG), as gemm_probe's timings
    said = [(r.levelname, "measured now" in r.message) for r in caplog.records if r.name == "gptlab.int8_prompts"]
    assert said == [("INFO", True), ("DEBUG", False)]
    layer = Int8Linear.from_linear(nn.Linear(32, 16), "int8")
    layer.prepare()  # a layer takes the choice as it binds its weights
    assert layer._prompts_gemm == (chosen if ops.fbgemm_int8_is_exact() else "fbgemm")


GOOD_INT8 = {"prompts 64 rows": {"fbgemm": 2.0, "onednn": 1.0}, "prompts 512 rows": {"fbgemm": 2.0, "onednn": 1.0}}


@needs_int
@pytest.mark.parametrize(
    "entry",
    [
        "garbage",
        None,
        {"prompts 64 rows": {"fbgemm": 1.0}, "prompts 512 rows": {"fbgemm": 1.0}},  # a side missing
        {**GOOD_INT8, "prompts 512 rows": {"fbgemm": "1.0", "onednn": 2.0}},  # a timing as a string
        {**GOOD_INT8, "prompts 512 rows": {"fbgemm": float("nan"), "onednn": 2.0}},
        {"prompts 64 rows": GOOD_INT8["prompts 64 rows"]},  # a workload missing
        {**GOOD_INT8, "prompts 128 rows": "x"},  # a workload this version does not measure
    ],
    ids=["string", "null", "side-missing", "string-timing", "nan", "work-missing", "other-work"],
)
def test_a_corrupt_int8_cache_entry_is_measured_again(int8_probe, monkeypatch, tmp_path, entry):
    """An entry of this machine's that is not the timings measure() writes was an AttributeError,
    KeyError or TypeError in gemm_choice: it counts as missing, measured again and replaced."""
    fake_probe(monkeypatch, int8_probe, 2.0, 1.0)
    assert int8_prompts.gemm_choice(Int8Linear) == "onednn"
    path = tmp_path / "cache" / int8_prompts.CACHE_FILE
    (key, _), *others = json.loads(path.read_text()).items()
    assert not others
    path.write_text(json.dumps({key: entry}))
    monkeypatch.setattr(int8_prompts, "_chosen", {})  # a new process on the same machine
    fake_probe(monkeypatch, int8_probe, 1.0, 2.0)
    assert int8_prompts.gemm_choice(Int8Linear) == "fbgemm" and len(int8_probe) == 2
    assert json.loads(path.read_text())[key]["prompts 64 rows"] == {"fbgemm": 1.0, "onednn": 2.0}


def test_int8_prompts_forced_or_without_onednn_are_never_probed(int8_probe, monkeypatch):
    monkeypatch.setattr(int8_prompts, "measure", lambda layer_class: pytest.fail("probed"))
    for forced in ("fbgemm", "onednn", " FBGEMM "):
        monkeypatch.setenv("GPTLAB_INT8_GEMM", forced)
        assert int8_prompts.gemm_choice(Int8Linear) == forced.strip().lower()
    monkeypatch.setenv("GPTLAB_INT8_GEMM", "mkl")
    with pytest.raises(ValueError, match="GPTLAB_INT8_GEMM='mkl': expected one of auto, fbgemm, onednn"):
        int8_prompts.gemm_choice(Int8Linear)
    monkeypatch.setattr(int8_prompts, "onednn_is_exact", lambda: False)  # saturating: refused, never timed
    monkeypatch.setenv("GPTLAB_INT8_GEMM", "onednn")
    with pytest.raises(ValueError, match="saturates its 16-bit sums"):
        int8_prompts.gemm_choice(Int8Linear)
    monkeypatch.setenv("GPTLAB_INT8_GEMM", "auto")
    assert int8_prompts.gemm_choice(Int8Linear) == "fbgemm"
    monkeypatch.setattr(int8_prompts, "onednn_available", lambda: False)
    monkeypatch.setenv("GPTLAB_INT8_GEMM", "onednn")
    with pytest.raises(ValueError, match="no oneDNN int8 linear"):
        int8_prompts.gemm_choice(Int8Linear)
    monkeypatch.setenv("GPTLAB_INT8_GEMM", "auto")
    assert int8_prompts.gemm_choice(Int8Linear) == "fbgemm"


@pytest.mark.parametrize(
    ("kernels_on", "exact", "forced", "runs"),
    [
        (False, True, "onednn", "fbgemm's"),  # oneDNN's takes x quantized by gptlab's kernels
        (False, True, "fbgemm", None),  # honoured
        (True, False, "onednn", "gptlab's int8 kernel"),  # no VNNI: neither product is exact
        (True, False, "fbgemm", "gptlab's int8 kernel"),
        (False, False, "onednn", "the weight-only product (bf16 activations)"),
    ],
)
def test_a_forced_int8_product_that_cannot_run_here_is_warned_of_once(
    monkeypatch, caplog, kernels_on, exact, forced, runs
):
    """GPTLAB_INT8_GEMM=onednn with GPTLAB_KERNELS=0 ran fbgemm's product unsaid, as the README
    said it "forces one": where the product forced cannot run, a warning says so, once."""
    if kernels_on and not INT_OK:
        pytest.skip(f"gptlab's int kernels are not built here: {kernels.available()[2]}")
    monkeypatch.setenv("GPTLAB_KERNELS", "auto" if kernels_on else "0")
    monkeypatch.setenv("GPTLAB_INT8_GEMM", forced)
    monkeypatch.setattr(ops, "fbgemm_int8_is_exact", lambda: exact)
    kernels.warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="gptlab.int8_prompts"):
        for _ in range(2):
            Int8Linear.from_linear(nn.Linear(32, 16), "int8").prepare()
    said = [r.message for r in caplog.records if r.name == "gptlab.int8_prompts"]
    if runs is None:
        assert not said
    else:
        assert len(said) == 1 and said[0].startswith(f"GPTLAB_INT8_GEMM={forced} is ignored here: ")
        assert said[0].endswith(f"; int8 prompts run {runs}")
        assert "GPTLAB_KERNELS=0" in said[0] or kernels_on or not exact


@needs_onednn
def test_onednn_held_below_vnni_is_found_inexact_and_not_taken(tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN's int8 product sum u8 x s8 pairs in 16 bits, which
    saturate: found by the check (here and on any CPU: it holds oneDNN to AVX2 wherever it runs),
    so int8 prompts keep fbgemm without timing oneDNN. In a child process: oneDNN reads its ISA
    setting once."""
    code = (
        "from gptlab import int8_prompts\n"
        "from gptlab.quantize import Int8Linear\n"
        "int8_prompts.measure = None  # timing it would fail\n"
        "print(int8_prompts.onednn_is_exact(), int8_prompts.gemm_choice(Int8Linear))"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "GPTLAB_CACHE": str(tmp_path)}
    env.pop("GPTLAB_INT8_GEMM", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "fbgemm"]


@needs_int
@needs_onednn
def test_the_int8_probe_times_both_products_on_gpt2_block_layers(monkeypatch):
    from gptlab import gemm_probe

    monkeypatch.setattr(kernels, "wait_for_huge_pages", lambda timeout=10.0: True)
    monkeypatch.setattr(gemm_probe, "ROUNDS", 1)
    if not ops.fbgemm_int8_is_exact():  # the probe's layers bind their weights as on a VNNI CPU
        monkeypatch.setattr(ops, "fbgemm_int8_is_exact", lambda: True)
    seen = []
    onednn_product = Int8Linear._onednn_product
    monkeypatch.setattr(
        Int8Linear, "_onednn_product", lambda self, *a: seen.append(self.out_features) or onednn_product(self, *a)
    )
    result = int8_prompts.measure(Int8Linear)
    assert list(result) == ["prompts 64 rows", "prompts 512 rows"]
    assert all(set(t) == {"fbgemm", "onednn"} and min(t.values()) > 0 for t in result.values())
    # oneDNN's side ran GPT-2's four block layers, warm-up and timed round, at both row counts
    assert seen == [N for N, _ in gemm_probe.LAYERS.values()] * 2 * 2


@needs_int
@needs_onednn
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_an_int8_model_multiplies_its_own_weights(monkeypatch, how):
    """oneDNN's packed weight is an opaque tensor, which neither copy.deepcopy nor pickle can copy:
    a copied model packs its own copy of the int8 weight again, and prompts give the same logits."""
    import copy
    import pickle

    from conftest import tiny_model
    from gptlab.quantize import quantize_model

    if int8_prompts.onednn_is_exact():  # else refused (ONEDNN_MAX_CPU_ISA below VNNI)
        monkeypatch.setenv("GPTLAB_INT8_GEMM", "onednn")
    model = quantize_model(tiny_model(), "int8")
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    layer, copied = model.transformer.h[0].mlp.c_fc, twin.transformer.h[0].mlp.c_fc
    if layer._prompts_gemm == "onednn":  # AVX-512 VNNI CPUs
        assert copied._kernel_weights[2].weight is copied.weight and copied.weight is not layer.weight
    idx = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        assert torch.equal(model(idx)[0], twin(idx)[0])
