"""Whose GEMM an Intel CPU runs: measured once per machine (gptlab.gemm_probe), cached, obeyed."""

import json
import types

import pytest
import torch
import torch.nn.functional as F

from gptlab import cpu, gemm, gemm_probe, kernels, linear

OK, _, WHY = kernels.available()
needs_float = pytest.mark.skipif(not OK, reason=f"gptlab's float kernels are not built here: {WHY}")


def timings(prompts64: float, prompts512: float, head: float) -> dict:
    """Fake probe timings: each workload's speedup of gptlab's GEMM (torch's seconds / gptlab's)."""
    return {
        "prompts 64 rows": {"gptlab": 0.01, "torch": 0.01 * prompts64},
        "prompts 512 rows": {"gptlab": 0.04, "torch": 0.04 * prompts512},
        "head": {"gptlab": 0.03, "torch": 0.03 * head},
    }


@pytest.fixture
def intel(monkeypatch, tmp_path):
    """An Intel x86 CPU with SIMD kernels, gptlab's cache in tmp_path, nothing probed yet in this
    process; returns the list of probes run (replace gemm_probe.measure to fake their timings)."""
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GPTLAB_GEMM", raising=False)
    monkeypatch.setattr(kernels, "has_simd", lambda: True)
    monkeypatch.setattr(kernels.kernel_build, "is_x86", lambda: True)
    monkeypatch.setattr(cpu, "vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(gemm, "_measured_gemm", {})
    return []


def fake_probe(monkeypatch, probes: list, result: dict) -> None:
    monkeypatch.setattr(gemm_probe, "measure", lambda *gemms: probes.append(1) or result)


@pytest.mark.parametrize(
    ("speedups", "short", "long", "head"),
    [
        ((1.3, 1.1, 1.2), "gptlab", "gptlab", "gptlab"),
        ((0.8, 0.9, 0.7), "torch", "torch", "torch"),
        ((1.13, 0.92, 0.94), "gptlab", "torch", "torch"),  # the Intel Xeon 6/207's probe
        ((0.9, 1.1, 1.2), "torch", "gptlab", "gptlab"),
        ((1.0, 1.0, 1.0), "torch", "torch", "torch"),  # a tie keeps PyTorch's
    ],
)
def test_an_intel_cpu_takes_the_gemm_its_probe_measured_faster(intel, monkeypatch, caplog, speedups, short, long, head):
    """Prompts of up to 181 rows (the geometric mean of 64 and 512) take what ran 64 rows faster,
    longer ones what ran 512 rows faster; the training head what ran the head faster."""
    fake_probe(monkeypatch, intel, timings(*speedups))
    with caplog.at_level("INFO", logger="gptlab.gemm_probe"):
        assert [gemm.prompt_gemm_choice(rows) for rows in (9, 64, 181)] == [short] * 3
        assert [gemm.prompt_gemm_choice(rows) for rows in (182, 512, 4096)] == [long] * 3
        assert gemm.gemm_choice() == head
    assert linear.float_kernel_rows(torch.float32) == kernels.MAX_ROWS or short == "gptlab"
    assert len(intel) == 1  # measured once, for every kind of work
    said = [r for r in caplog.records if r.name == "gptlab.gemm_probe"]
    assert len(said) == 1  # and said once, not once per kind of work


def test_the_timings_are_cached_per_machine(intel, monkeypatch, tmp_path, caplog):
    fake_probe(monkeypatch, intel, timings(1.3, 1.1, 0.8))
    with caplog.at_level("DEBUG", logger="gptlab.gemm_probe"):
        assert gemm.prompt_gemm_choice(64) == "gptlab"
    (key, cached), *others = json.loads((tmp_path / "cache" / gemm_probe.CACHE_FILE).read_text()).items()
    assert not others and cached == timings(1.3, 1.1, 0.8)
    assert cpu.name() in key and f"torch {torch.__version__}" in key and f"kernels {kernels.variant()}" in key
    monkeypatch.setattr(gemm, "_measured_gemm", {})  # a new process on the same machine reads the file
    fake_probe(monkeypatch, intel, timings(0.5, 0.5, 0.5))
    with caplog.at_level("DEBUG", logger="gptlab.gemm_probe"):
        assert gemm.prompt_gemm_choice(64) == "gptlab" and gemm.gemm_choice() == "torch" and len(intel) == 1
    # measured: said (INFO); read back: said only with -v (DEBUG), not amid every `gptlab generate`'s output
    said = [(r.levelname, "measured now" in r.message) for r in caplog.records if r.name == "gptlab.gemm_probe"]
    assert said == [("INFO", True), ("DEBUG", False)]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another thread count is another machine: measured again
    try:
        assert gemm.prompt_gemm_choice(64) == "torch" and len(intel) == 2
    finally:
        torch.set_num_threads(threads)


def test_an_unreadable_cache_is_measured_again_and_rewritten(intel, monkeypatch, tmp_path):
    path = tmp_path / "cache" / gemm_probe.CACHE_FILE
    path.parent.mkdir(parents=True)
    path.write_text('{"half a file')
    fake_probe(monkeypatch, intel, timings(0.9, 0.9, 1.2))
    assert gemm.gemm_choice() == "gptlab" and len(intel) == 1
    assert list(json.loads(path.read_text()).values()) == [timings(0.9, 0.9, 1.2)]


@pytest.mark.parametrize(
    "entry",
    [
        "garbage",
        None,
        {**timings(1, 1, 1), "head": {"gptlab": 0.03}},  # a side missing
        {**timings(1, 1, 1), "head": {"gptlab": "0.03", "torch": 0.01}},  # a timing as a string
        {**timings(1, 1, 1), "head": {"gptlab": 0, "torch": 0.01}},  # describe() divides by it
        {name: t for name, t in timings(1, 1, 1).items() if name != "head"},  # a workload missing
        {**timings(1, 1, 1), "prompts 128 rows": None},  # a workload this version does not measure
    ],
    ids=["string", "null", "side-missing", "string-timing", "zero", "work-missing", "other-work"],
)
def test_a_corrupt_cache_entry_is_measured_again_and_replaced(intel, monkeypatch, tmp_path, entry):
    """This machine's entry not shaped as measure() writes it was an AttributeError, KeyError or
    TypeError in gemm_probe.choice: it counts as missing."""
    fake_probe(monkeypatch, intel, timings(1.3, 1.1, 0.8))
    assert gemm.gemm_choice() == "torch"
    path = tmp_path / "cache" / gemm_probe.CACHE_FILE
    (key, _), *others = json.loads(path.read_text()).items()
    assert not others
    path.write_text(json.dumps({key: entry}))
    monkeypatch.setattr(gemm, "_measured_gemm", {})  # a new process on the same machine
    fake_probe(monkeypatch, intel, timings(0.9, 0.9, 1.2))
    assert gemm.gemm_choice() == "gptlab" and len(intel) == 2
    assert json.loads(path.read_text()) == {key: timings(0.9, 0.9, 1.2)}


def test_gptlabs_gemm_forced_without_gptlabs_kernels_is_torch_said_once(monkeypatch, caplog):
    """GPTLAB_GEMM=gptlab with GPTLAB_KERNELS=0 ran PyTorch's GEMM unsaid, while `python -m
    gptlab.kernels` named gptlab's: the choice is torch, with one warning."""
    monkeypatch.setenv("GPTLAB_KERNELS", "0")
    monkeypatch.setenv("GPTLAB_GEMM", "gptlab")
    kernels.warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="gptlab.gemm"):
        assert gemm.gemm_choice() == gemm.prompt_gemm_choice(64) == gemm.bf16_prompt_gemm_choice() == "torch"
    said = [r.message for r in caplog.records if r.name == "gptlab.gemm"]
    assert said == [
        "GPTLAB_GEMM=gptlab is ignored: gptlab's kernels are not running (switched off by GPTLAB_KERNELS=0); "
        "PyTorch's GEMM runs"
    ]


def test_other_cpus_and_forced_choices_are_never_probed(intel, monkeypatch):
    monkeypatch.setattr(gemm_probe, "measure", lambda *gemms: pytest.fail("probed"))
    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    assert gemm.gemm_choice() == gemm.prompt_gemm_choice(64) == gemm.prompt_gemm_choice(512) == "torch"
    monkeypatch.setenv("GPTLAB_GEMM", "gptlab")
    assert gemm.gemm_choice() == gemm.prompt_gemm_choice(64) == gemm.prompt_gemm_choice(512) == "gptlab"
    monkeypatch.delenv("GPTLAB_GEMM")
    with monkeypatch.context() as tracing:  # inside torch.compile's trace nothing is timed (it runs PyTorch's)
        tracing.setattr(torch.compiler, "is_compiling", lambda: True)
        assert gemm.gemm_choice() == gemm.prompt_gemm_choice(64) == gemm.prompt_gemm_choice(512) == "torch"
    monkeypatch.setattr(cpu, "vendor", lambda: "AuthenticAMD")
    assert (
        gemm.gemm_choice() == gemm.prompt_gemm_choice(64) == gemm.prompt_gemm_choice(512) == "gptlab"
    )  # MKL's slow products on AMD
    monkeypatch.setattr(kernels, "has_simd", lambda: False)
    assert (
        gemm.gemm_choice() == gemm.prompt_gemm_choice(64) == gemm.prompt_gemm_choice(512) == "torch"
    )  # plain C: PyTorch's BLAS is faster
    with pytest.raises(ValueError, match="work must be one of prompts 64 rows, prompts 512 rows, head"):
        gemm_probe.choice("decoding", timings(2.0, 2.0, 2.0))


@needs_float
@pytest.mark.parametrize("prompts", ["gptlab", "torch"])
def test_an_intel_cpus_prompts_and_head_run_what_was_chosen(intel, monkeypatch, calls, prompts):
    """Short prompts run what the probe chose for 64 rows, long ones its choice for 512 rows (here
    the other GEMM), the training head's products its choice for the head."""
    other = "torch" if prompts == "gptlab" else "gptlab"
    fake_probe(monkeypatch, intel, timings(2.0, 0.5, 0.5) if prompts == "gptlab" else timings(0.5, 2.0, 2.0))
    layer = linear.Linear(96, 70)
    for tokens, takes in ((64, prompts), (300, other)):
        x = torch.randn(1, tokens, 96)  # a prompt
        with torch.no_grad():
            y = layer(x)
        assert set(calls) == ({"gl_sgemm_nt"} if takes == "gptlab" else set()), tokens
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias).detach())
        calls.clear()
    a, b, out = torch.randn(40, 30), torch.randn(30, 20), torch.empty(40, 20)
    gemm.mm(a, b, out)  # the training head's products
    assert set(calls) == (set() if prompts == "gptlab" else {"gl_sgemm"})
    torch.testing.assert_close(out, a @ b)


@needs_float
def test_an_intel_cpus_bf16_prompts_run_gptlabs_gemm_whatever_its_probe_chose(intel, monkeypatch, calls):
    """The probe times fp32 products. A bf16 model's prompts on a CPU without bf16 GEMMs run
    gptlab's GEMM even where PyTorch's won every probe (its side would widen the weight and convert
    x and y too): the product widened, rounded once; PyTorch's only under GPTLAB_GEMM=torch."""
    fake_probe(monkeypatch, intel, timings(0.5, 0.5, 0.5))
    monkeypatch.setattr(linear, "bf16_matmul_is_fast", lambda: False)
    layer = linear.Linear(96, 70).bfloat16()
    x = torch.randn(1, 300, 96).bfloat16()
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).detach()  # (1, 300, 70)
    for choice, runs in (("auto", {"gl_sgemm_nt"}), ("gptlab", {"gl_sgemm_nt"}), ("torch", set())):
        monkeypatch.setenv("GPTLAB_GEMM", choice)
        with torch.no_grad():
            y = layer(x)
        assert set(calls) == runs and gemm.bf16_prompt_gemm_choice() == ("torch" if choice == "torch" else "gptlab")
        assert y.dtype is torch.bfloat16
        torch.testing.assert_close(y.float(), want, rtol=2**-8, atol=1e-5)  # rounded once: half a bf16 ulp
        calls.clear()
    assert gemm.prompt_gemm_choice(300) == "torch" and intel == [1]  # the probe ran once, and chose PyTorch's


@needs_float
def test_the_probe_times_gptlabs_gemm_against_pytorchs(calls, monkeypatch):
    events = []
    monkeypatch.setattr(kernels, "wait_for_huge_pages", lambda timeout=10.0: events.append("wait") or True)
    monkeypatch.setattr(gemm_probe, "ROUNDS", 1)
    result = gemm.measure_gemms()
    assert list(result) == ["prompts 64 rows", "prompts 512 rows", "head"] and events == ["wait"]
    assert all(set(t) == {"gptlab", "torch"} and min(t.values()) > 0 for t in result.values())
    # gptlab's side runs gptlab's GEMM: the four layers per prompt and the head's three products,
    # once to warm up and once timed; PyTorch's side none of it
    assert calls == {"gl_sgemm_nt": 2 * 2 * len(gemm_probe.LAYERS), "gl_sgemm": 2 * 3}
    assert "ms against" in gemm_probe.describe(result)


@needs_float
def test_an_intel_cpus_bf16_products_keep_onednn_unless_forced(intel, monkeypatch):
    """The probe times fp32 products; Intel's bf16 CPUs multiply bf16 natively in oneDNN (AMX on
    the newer), never timed against gl_gemm_bf16: that runs there only when asked for."""
    monkeypatch.setattr(kernels._library(), "lib", types.SimpleNamespace(gl_has_gemm_bf16=lambda: 1))
    monkeypatch.setattr(gemm_probe, "measure", lambda *gemms: pytest.fail("probed for an answer it does not need"))
    assert not gemm.gemm_bf16_runs()
    fake_probe(monkeypatch, intel, timings(2.0, 2.0, 2.0))
    assert gemm.gemm_choice() == "gptlab" and not gemm.gemm_bf16_runs()
    monkeypatch.setenv("GPTLAB_GEMM", "gptlab")
    assert gemm.gemm_bf16_runs()
    monkeypatch.delenv("GPTLAB_GEMM")
    with monkeypatch.context() as tracing:  # inside torch.compile's trace nothing is timed (it runs PyTorch's)
        tracing.setattr(torch.compiler, "is_compiling", lambda: True)
        assert gemm.gemm_choice() == gemm.prompt_gemm_choice(64) == gemm.prompt_gemm_choice(512) == "torch"
    monkeypatch.setattr(cpu, "vendor", lambda: "AuthenticAMD")
    assert gemm.gemm_bf16_runs()  # where the CPU has AVX512-BF16 (a stand-in library here says so)


def test_the_head_is_timed_laid_out_as_training_lays_it_out():
    from gptlab import chunked_loss

    assert gemm_probe.E_ROW_PAD == chunked_loss.ROW_PAD
    w, x, e, logits, grad_x, grad_w = gemm_probe.head_operands(50, 24, 8, torch.Generator().manual_seed(0))
    assert e.shape == logits.shape == (50, 24) and e.stride() == logits.stride() == (24 + chunked_loss.ROW_PAD, 1)
    assert (w.shape, x.shape, grad_x.shape, grad_w.shape) == ((50, 8), (24, 8), (24, 8), (50, 8))
    assert 0 < e.min() and e.max() < 1 / 50  # a softmax's values
