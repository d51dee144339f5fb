"""int8 / int4 quantization: primitives, quantized linear layers, whole models, files, the CLI."""

import copy
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import tiny_config, tiny_model
from gptlab import kernels, ops
from gptlab import linear as linear_layer
from gptlab.checkpoint import load_native, save_model
from gptlab.cli import main
from gptlab.generation import generate
from gptlab.loading import load_model
from gptlab.model import GPT
from gptlab.quantize import (
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    dequantize_model,
    load_quantized,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
    save_quantized,
    set_kernels,
    unpack_int4,
    weight_bytes,
)

SCHEMES = {
    "int8-wo": dict(mode="int8", activations="float"),
    "int8-dyn": dict(mode="int8", activations="int8"),
    "int4": dict(mode="int4"),
}


def random_matrix(rows, cols, seed=0):
    """Rows of very different magnitudes, an outlier, and an all-zero row (the edge cases of scales)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows)[:, None]
    w[0, 3] = 40.0
    w[1] = 0.0
    return w


def test_int8_error_is_at_most_half_a_step():
    w = random_matrix(48, 96)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16
    assert int(q.abs().max()) <= 127
    err = (dequantize_int8(q, scales) - w).abs()  # (N, K)
    assert (err <= scales.float()[:, None] / 2 * (1 + 1e-6)).all()
    assert (scales.float() <= w.abs().amax(1) / 127 * (1 + 2**-6) + 2e-8).all()  # scales are not wasteful
    assert (dequantize_int8(q, scales)[1] == 0).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(group_size):
    w = random_matrix(40, 256, seed=1)
    q, scales, zeros = quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (40, 256 // group_size)
    err = (dequantize_int4(q, scales, zeros) - w).abs().view(40, -1, group_size)  # (N, G, g)
    # Half a step, plus the bfloat16 rounding of the zero point (2^-9 relative).
    bound = scales.float() / 2 * (1 + 1e-5) + zeros.float().abs() * 2**-8 + 1e-7  # (N, G)
    assert (err <= bound[..., None]).all()
    # 16 levels over each group's range: the step is 1/15 of it, so the error is far below int8's.
    span = w.view(40, -1, group_size).amax(-1) - w.view(40, -1, group_size).amin(-1)
    assert (scales.float() <= span / 15 * (1 + 2**-6) + 2e-8).all()


def test_int4_packing_round_trips_exactly():
    q = torch.randint(0, 16, (33, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.shape == (33, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    every_byte = torch.arange(256, dtype=torch.uint8).view(8, 32)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)
    assert torch.equal(packed[0, 0], q[0, 0] | (q[0, 1] << 4))  # even column in the low nibble


def test_packing_bad_input():
    with pytest.raises(ValueError, match="even number of columns"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((2, 2), 16, dtype=torch.uint8))


def make_quantized(linear, name):
    if name == "int4":
        return Int4Linear.from_linear(linear, 32)
    return Int8Linear.from_linear(linear, "int8" if name == "int8-dyn" else "float")


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("out_features", [96, 97])  # 97: not a multiple of 16, as GPT-2's 50257-row head
def test_quantized_linear_equals_dequantized_matmul(name, out_features):
    torch.manual_seed(0)
    linear = nn.Linear(64, out_features)
    x = torch.randn(3, 5, 64)  # (B, T, K)
    qlinear = make_quantized(linear, name)
    qlinear.prepare()
    weight = qlinear.dequantize()  # (N, K)
    # The plain path is dequantized_weight @ x: fp32 rounding only.
    set_kernels(qlinear, False)
    torch.testing.assert_close(qlinear(x), F.linear(x, weight, linear.bias), rtol=1e-5, atol=1e-6)
    set_kernels(qlinear, True)
    y = qlinear(x)  # (B, T, N)
    assert y.shape == (3, 5, out_features) and y.dtype == torch.float32
    if name == "int8-dyn":
        # Activations quantized per row to 256 levels: each input is off by at most half a level.
        step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / 255  # (B, T, 1)
        ref = F.linear(x, weight, linear.bias)
        bound = step / 2 * weight.abs().sum(1) + 1e-4  # (B, T, N)
        assert ((y - ref).abs() <= bound).all()
        assert (y - ref).abs().max() > 0  # really the int8 x int8 kernel, not the float path
    else:
        # The packed kernels take bf16 activations and write bf16 outputs (2^-9 relative rounding).
        ref = F.linear(x.bfloat16().float(), weight)  # (B, T, N)
        assert ((y - linear.bias.detach() - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_copy_of_a_quantized_model_runs_on_its_own_buffers(mode, how):
    """copy.deepcopy, or pickling (torch.save(model)), copies the buffers; the kernels bound to them
    by their data pointers (decoding, the fused step, prompts) must be the copy's own, not the
    original's: the copy computes what the original does, bit for bit, and with the original's
    weights zeroed, it decodes and reads prompts as before."""
    model = quantize_model(tiny_model(n_embd=128, n_head=4), mode)
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    prompt = torch.randint(0, 97, (1, 20))

    def run(m):  # a short prompt (the decoding kernels), a long one (the prompt path), greedy decoding (the fused step)
        return [m(prompt[:, :3])[0], m(prompt)[0], generate(m, prompt[:, :3], 6, temperature=0)]

    with torch.no_grad():
        original, before = run(model), run(twin)
        for layer in model.modules():
            if isinstance(layer, QuantizedLinear):
                layer.weight.zero_()
        after = run(twin)
    assert all(torch.equal(a, b) for a, b in zip(original, before, strict=True))  # the same kernels, bound
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.skipif(
    not kernels.available()[1], reason=f"gptlab's int kernels are not built here: {kernels.available()[2]}"
)
def test_long_int4_prompts_on_amx_multiply_in_bf16(monkeypatch, kernel_variant):
    """From INT4_BF16_ROWS rows where the CPU has AMX (taken as so here, on any CPU), an int4 layer
    multiplies x and its dequantized weight rounded to bf16 (fp32 sums, a bf16 result) and adds
    the fp32 bias: within the result's bf16 rounding of F.linear of the same bf16 operands. Fewer
    rows run as they did without that path: the int4 kernel (x quantized to int8) up to
    int4_kernel_rows (every row count on x86 SIMD), more dequantized for the GEMM (the portable
    variant past 128 rows: the emulated CPU without AVX found this test assuming the first)."""
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(nn.Linear(256, 96), 64)
    monkeypatch.setattr(linear_layer, "int4_prompts_in_bf16", lambda rows, weights: rows >= linear_layer.INT4_BF16_ROWS)
    layer.prepare()
    w = layer.dequantize()  # (N, K) fp32
    for rows in (linear_layer.INT4_BF16_ROWS, 300):
        x = torch.randn(rows, 256)
        with torch.no_grad():
            y = layer(x)
        ref = F.linear(x.bfloat16().float(), w.bfloat16().float())  # (rows, N)
        assert ((y - layer.bias - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
        assert not torch.equal(y, layer._decode(x))  # not the int4 kernel's product
    x = torch.randn(linear_layer.INT4_BF16_ROWS - 1, 256)
    with torch.no_grad():
        y = layer(x)
        if x.size(0) <= ops.int4_kernel_rows():
            assert torch.equal(y, layer._decode(x))
        monkeypatch.setattr(linear_layer, "int4_prompts_in_bf16", lambda rows, weights: False)
        layer.prepare()
        assert torch.equal(y, layer(x))


def test_int4_prompts_take_bf16_only_on_amx_where_bf16_is_fast(monkeypatch):
    """From INT4_BF16_ROWS rows, for layers of up to INT4_BF16_MAX_WEIGHTS weights (its buffers stay
    alive), on CPUs with AMX-BF16 whose bf16 GEMM was measured fast."""
    rows, most = linear_layer.INT4_BF16_ROWS, linear_layer.INT4_BF16_MAX_WEIGHTS
    features = {"avx2", "fma", "avx512f", "avx512bf16"}
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset(features))
    monkeypatch.setattr(linear_layer, "bf16_matmul_is_fast", lambda: True)
    assert not linear_layer.int4_prompts_in_bf16(4096, 1024)  # AVX512-BF16 without AMX: the int4 kernel
    features.add("amxbf16")
    assert linear_layer.int4_prompts_in_bf16(rows, most) and not linear_layer.int4_prompts_in_bf16(rows - 1, most)
    assert not linear_layer.int4_prompts_in_bf16(rows, most + 1)  # GPT-2's head: its buffers would stay
    monkeypatch.setattr(linear_layer, "bf16_matmul_is_fast", lambda: False)  # oneDNN held below AMX
    assert not linear_layer.int4_prompts_in_bf16(4096, 1024)


def test_quantized_linear_works_on_the_meta_device_shapes_and_repr():
    with torch.device("meta"):
        m = Int4Linear(128, 48, bias=False, group_size=64)
    assert m.weight.shape == (48, 64) and m.scales.shape == (48, 2) and m.bias is None
    assert "group_size=64" in repr(m)


@pytest.fixture(scope="module")
def trained_tiny_model():
    """A tiny model trained for a moment to follow a fixed permutation of its vocabulary
    (token t is followed by perm[t]), so its greedy choices are confident, as a trained model's."""
    model = tiny_model(seed=3, n_embd=64).train()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(97, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add barrier waits (25x slower on a busy machine)
    try:
        train_steps(model, opt, perm, g, 80)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def train_steps(model, opt, perm, g, steps):
    for _ in range(steps):
        seq = [torch.randint(0, 97, (16,), generator=g)]
        for _ in range(32):
            seq.append(perm[seq[-1]])
        seq = torch.stack(seq, dim=1)  # (16, 33)
        _, loss = model(seq[:, :-1], targets=seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_tiny_model_generates_like_its_dequantized_reference(name, trained_tiny_model):
    model = trained_tiny_model
    scheme = dict(SCHEMES[name])
    qmodel = quantize_model(copy.deepcopy(model), scheme.pop("mode"), group_size=32, **scheme)
    assert not any(isinstance(m, nn.Linear) for m in qmodel.modules())  # the head too
    assert isinstance(qmodel.transformer.wte, QuantizedEmbedding)
    reference = dequantize_model(qmodel)
    prompt = torch.tensor([[5, 17, 42, 8], [1, 2, 3, 4]])
    out = generate(qmodel, prompt, 12, temperature=0)
    assert out.shape == (2, 16)
    assert torch.equal(out, generate(reference, prompt, 12, temperature=0))
    logits, ref_logits = qmodel(out)[0], reference(out)[0]
    cos = F.cosine_similarity(logits.flatten(), ref_logits.flatten(), dim=0)
    assert cos > 0.999
    # ...and quantization changed the model only a little.
    float_logits = model(out)[0]
    assert F.cosine_similarity(logits.flatten(), float_logits.flatten(), dim=0) > (0.99 if name != "int4" else 0.95)


@pytest.mark.parametrize("out", ["hf", "m.gguf", "m.bin"])
def test_exporting_a_quantized_model_asks_for_its_float_original(tmp_path, capsys, out):
    """The formats hold float weights: a gptlab int8 model was refused as having "tensors GPT-2
    does not" (its scales) with the advice to "export a float model"; gguf now also points at
    llama.cpp's own types."""
    save_quantized(quantize_model(tiny_model(n_embd=64), "int8"), tmp_path / "q")
    assert main(["export", "--model", str(tmp_path / "q"), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert "quantized by gptlab (int8)" in err and "export the float model it was quantized from" in err
    assert ("--outtype q8_0 or q4_0" in err) == out.endswith(".gguf")
    assert not (tmp_path / out).exists()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_save_and_load_round_trip(tmp_path, name):
    scheme = dict(SCHEMES[name])
    qmodel = quantize_model(tiny_model(n_embd=64), scheme.pop("mode"), group_size=32, **scheme)
    save_quantized(qmodel, tmp_path / "q")
    loaded = load_model(str(tmp_path / "q"))  # gptlab.load_model routes to load_quantized
    assert loaded.quantization == qmodel.quantization
    assert isinstance(loaded.transformer.wte, QuantizedEmbedding)
    for name_, m in loaded.named_modules():
        if isinstance(m, QuantizedLinear):
            assert torch.equal(m.weight, qmodel.get_submodule(name_).weight)
    idx = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    torch.testing.assert_close(loaded(idx)[0], qmodel(idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_moved_or_converted_quantized_model_rebinds_its_kernels(tmp_path, mode, tied):
    """share_memory() moved the buffers and the kernels read the old ones (greedy tokens all 0);
    .to(bfloat16) converted the scales under them, or failed on a tied model's fp32 embedding; a
    bf16 model quantized, saved and loaded failed the same way. Now the kernels are bound again,
    the stored scheme keeps its dtypes, and the embedding's rows follow the model's dtype."""
    model = quantize_model(tiny_model(n_embd=64, tie_weights=tied), mode, group_size=32)
    idx = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ref = model(idx)[0]
        model.share_memory()
        assert torch.equal(model(idx)[0], ref)
        model.to(torch.bfloat16)
        bf16 = model(idx)[0]
        assert bf16.dtype is torch.bfloat16
        # measured cosine 0.99992-0.99998 (bf16 norms and activations); stale kernels give noise or zeros
        assert F.cosine_similarity(bf16.float().flatten(), ref.flatten(), dim=0) > 0.999
        save_quantized(model, tmp_path / "q")
        torch.testing.assert_close(load_model(str(tmp_path / "q"))(idx)[0], bf16, rtol=0, atol=0)
        model.cpu().share_memory()  # a move keeps the bf16 rows (it reset them to fp32: mixed dtype)
        assert torch.equal(model(idx)[0], bf16)
    # off the CPU (here the meta device, as .cuda() would) and back: the kernels are bound again
    model.to("meta").to_empty(device="cpu")
    assert all(m._decode is not None or m._kernel_weights is not None
               for m in model.modules() if isinstance(m, QuantizedLinear))  # fmt: skip


def test_loading_a_quantized_model_in_a_dtype_converts_its_float_rest(tmp_path):
    """load_model(dtype=...) (every command's --dtype) was ignored for a quantized directory: one
    quantized from fp16 ran in fp16 under generate's default --dtype float32."""
    model = quantize_model(tiny_model(n_embd=64).half(), "int4", group_size=32)
    save_quantized(model, tmp_path / "q")
    idx = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        assert load_model(str(tmp_path / "q"))(idx)[0].dtype is torch.float16  # None: as stored
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(str(tmp_path / "q"), dtype=dtype)
            assert loaded.transformer.ln_f.weight.dtype is dtype and loaded(idx)[0].dtype is dtype
            assert loaded.lm_head.scales.dtype is torch.bfloat16 and loaded.quantization == model.quantization


def test_quantized_models_keep_a_bf16_kv_cache(tmp_path):
    """A quantized model with fp32 activations caches its keys and values in bf16 by default, also
    after a round trip through its files; model.kv_cache_dtype overrides it, for any model."""
    from gptlab.generation import new_cache
    from gptlab.kv_cache import cache_dtype

    model = tiny_model(n_embd=64)
    assert cache_dtype(model) is torch.float32 and cache_dtype(copy.deepcopy(model).bfloat16()) is torch.bfloat16
    qmodel = quantize_model(copy.deepcopy(model), "int4", group_size=32)
    save_quantized(qmodel, tmp_path / "q")
    for m in (qmodel, load_model(str(tmp_path / "q"))):
        assert {t.dtype for kv in new_cache(m, 2, 5).layers for t in kv} == {torch.bfloat16}
    qmodel.kv_cache_dtype = torch.float32
    assert new_cache(qmodel, 1, 5).layers[0][0].dtype is torch.float32
    model.kv_cache_dtype = torch.bfloat16
    assert new_cache(model, 1, 5).layers[-1][1].dtype is torch.bfloat16
    model.kv_cache_dtype = torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be a floating-point"):
        new_cache(model, 1, 5)


def test_loading_never_builds_the_float_weights(tmp_path, monkeypatch):
    import gptlab.quantize as quantize

    built_on = []

    class SpyGPT(quantize.GPT):
        def __init__(self, config):
            super().__init__(config)
            built_on.append(self.lm_head.weight.device.type)

    save_quantized(quantize_model(tiny_model(n_embd=64), "int4", group_size=32), tmp_path / "q")
    monkeypatch.setattr(quantize, "GPT", SpyGPT)
    loaded = load_quantized(tmp_path / "q")
    assert built_on == ["meta"]
    floats = [t for t in loaded.state_dict().values() if t.is_floating_point() and t.dtype != torch.bfloat16]
    assert max(t.numel() for t in floats) < 97 * 64  # only biases, norms and the position table are float


def test_untied_model_keeps_a_float_embedding(tmp_path):
    model = tiny_model(n_embd=64, bias=False, tie_weights=False, pos_embedding="rope", norm="rmsnorm", mlp="swiglu")
    qmodel = quantize_model(copy.deepcopy(model), "int4", group_size=32)
    assert isinstance(qmodel.transformer.wte, nn.Embedding) and isinstance(qmodel.lm_head, Int4Linear)
    save_quantized(qmodel, tmp_path / "q")
    loaded = load_quantized(tmp_path / "q")
    idx = torch.tensor([[7, 8, 9]])
    torch.testing.assert_close(loaded(idx)[0], qmodel(idx)[0], rtol=0, atol=0)


def test_quantized_checkpoint_is_small(tmp_path):
    model = tiny_model(n_embd=128, n_layer=2, vocab_size=512)
    save_model(model, tmp_path / "fp32")
    fp32 = (tmp_path / "fp32" / "model.safetensors").stat().st_size
    for mode, limit in (("int8", 0.30), ("int4", 0.18)):
        save_quantized(quantize_model(copy.deepcopy(model), mode, 64), tmp_path / mode)
        assert (tmp_path / mode / "model.safetensors").stat().st_size < limit * fp32


def test_bad_inputs(tmp_path):
    model = tiny_model()  # n_embd 32
    with pytest.raises(ValueError, match="unknown quantization mode"):
        quantize_model(model, "int3")
    with pytest.raises(ValueError, match="does not divide the input dimension 32"):
        quantize_model(model, "int4", group_size=64)
    with pytest.raises(ValueError, match="group size must be one of"):
        quantize_model(model, "int4", group_size=48)
    with pytest.raises(ValueError, match="activations"):
        quantize_model(model, "int8", activations="fp8")
    assert isinstance(model.lm_head, nn.Linear)  # a refused call changed nothing
    with pytest.raises(ValueError, match="not quantized"):
        save_quantized(model, tmp_path / "x")
    save_model(model, tmp_path / "float")
    with pytest.raises(ValueError, match="float model, not a quantized one"):
        load_quantized(tmp_path / "float")
    qmodel = quantize_model(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(qmodel, "int4", group_size=32)
    save_quantized(qmodel, tmp_path / "q")
    with pytest.raises(ValueError, match="int8 quantized model"):
        load_native(tmp_path / "q")
    # int4 codes stored as int8 instead of uint8 loaded and ran with logits 1.44 off: refused
    save_quantized(quantize_model(tiny_model(), "int4", group_size=32), tmp_path / "q4")
    weights = load_file(tmp_path / "q4" / "model.safetensors")
    save_file({k: v.view(torch.int8) if v.dtype == torch.uint8 else v for k, v in weights.items()}, tmp_path / "q4" / "model.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match="is torch.int8, the model expects torch.uint8"):
        load_model(str(tmp_path / "q4"))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_scales_stored_in_another_float_dtype_are_refused(tmp_path, mode):
    """int8 scales stored as fp16 loaded and the kernels read their bits as bf16 (logits ~1e-25);
    int4's were a RuntimeError from the kernel. Quantized buffers must have the kernels' dtypes."""
    save_quantized(quantize_model(tiny_model(), mode, group_size=32), tmp_path / "q")
    weights = load_file(tmp_path / "q" / "model.safetensors")
    save_file({k: v.half() if k.endswith(".scales") else v for k, v in weights.items()}, tmp_path / "q" / "model.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match=r"scales is torch.float16, the model expects torch.bfloat16"):
        load_model(str(tmp_path / "q"))


def test_a_group_size_that_is_not_an_int_is_refused(tmp_path):
    """64.0 == 64 passed the check and failed later as a TypeError from torch (shapes need ints),
    from quantize_model and from a gptlab.json whose group_size was written as 32.0."""
    with pytest.raises(ValueError, match="group size must be one of"):
        quantize_model(tiny_model(), "int4", group_size=32.0)
    save_quantized(quantize_model(tiny_model(), "int4", group_size=32), tmp_path / "q")
    meta = json.loads((tmp_path / "q" / "gptlab.json").read_text())
    meta["quantization"]["group_size"] = 32.0
    (tmp_path / "q" / "gptlab.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="group size must be one of .*got 32.0"):
        load_model(str(tmp_path / "q"))


@pytest.mark.parametrize(
    ("mode", "extra", "named"),
    [("int8", {"activation": "int8"}, "'activation'"), ("int4", {"activations": "int8"}, "'activations'"),
     ("int4", {"bits": 3, "symmetric": True}, "'bits', 'symmetric'")],
)  # fmt: skip
def test_unknown_keys_of_the_quantization_record_are_refused(tmp_path, mode, extra, named):
    """A misspelt key (int8's "activation": "int8" loaded weight-only kernels) or one a newer version
    writes (int4 with int8 activations) loaded silently as another scheme."""
    save_quantized(quantize_model(tiny_model(), mode, group_size=32), tmp_path / "q")
    meta = json.loads((tmp_path / "q" / "gptlab.json").read_text())
    meta["quantization"].update(extra)
    (tmp_path / "q" / "gptlab.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"unknown key.* {named} in its {mode} quantization record"):
        load_model(str(tmp_path / "q"))


def test_cli_quantize(tmp_path, capsys):
    save_model(tiny_model(n_embd=64), tmp_path / "float")
    out = tmp_path / "q4"
    args = ["quantize", "--model", str(tmp_path / "float"), "--mode", "int4", "--group-size", "32", "--out", str(out)]
    assert main(args) == 0
    assert "int4: wrote" in capsys.readouterr().out
    assert load_model(str(out)).quantization == {"mode": "int4", "group_size": 32}
    assert main(args[:5] + ["--out", str(tmp_path / "q64")]) == 0  # no --group-size: 64
    assert load_model(str(tmp_path / "q64")).quantization == {"mode": "int4", "group_size": 64}
    assert (
        main(
            [
                "quantize",
                "--model",
                str(tmp_path / "float"),
                "--mode",
                "int4",
                "--group-size",
                "128",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "does not divide" in capsys.readouterr().err
    assert main(["quantize", "--model", str(out), "--mode", "int8", "--out", str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cli_quantize_gives_its_size_as_a_share_of_the_weights_it_read(tmp_path, capsys, dtype):
    """A bf16 source's share was reported as of "the fp32 weights", with the bf16 weights' bytes:
    gpt2-tiny's int4 copy is 28.4% of its bf16 weights, 14.4% of its fp32 ones."""
    save_model(tiny_model(n_embd=64), tmp_path / "float")
    source = load_model(str(tmp_path / "float"), dtype=getattr(torch, dtype))
    argv = [
        "quantize",
        "--model",
        str(tmp_path / "float"),
        "--dtype",
        dtype,
        "--mode",
        "int4",
        "--out",
        str(tmp_path / "q"),
    ]
    assert main(argv) == 0
    share = (tmp_path / "q" / "model.safetensors").stat().st_size / weight_bytes(source)
    assert f" MiB, {share:.1%} of the {dtype} weights)\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("mode", "flag", "message"),
    [
        ("int8", ["--group-size", "32"], "--group-size applies to --mode int4 only"),  # was ignored, even 7
        ("int8", ["--group-size", "7"], "--group-size applies to --mode int4 only"),
        ("int4", ["--activations", "float"], "--activations applies to --mode int8 only"),
    ],
)
def test_cli_quantize_refuses_the_other_modes_flag(tmp_path, capsys, mode, flag, message):
    save_model(tiny_model(n_embd=64), tmp_path / "float")
    argv = ["quantize", "--model", str(tmp_path / "float"), "--mode", mode, *flag, "--out", str(tmp_path / "q")]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"gptlab quantize: error: {message}\n"
    assert not (tmp_path / "q").exists()


SHAKESPEARE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"


def training_text() -> bytes:
    """tiny-shakespeare where the checkout has it beside it, else English prose that every Python
    installs (pydoc's topic texts, ~800 KB), so that the test never skips."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_bytes()
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode()


@pytest.fixture(scope="session")
def shakespeare_model(tmp_path_factory):
    """A byte-level model trained for 250 steps on tiny-shakespeare (loss 5.55 -> ~2.7; ~15 s on a
    busy 2-core CPU), saved once per test session, and held-out text it was not trained on."""
    text = training_text()
    split = int(len(text) * 0.9)
    data = torch.tensor(list(text[:split]), dtype=torch.long)
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=257, block_size=64, n_embd=64))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add barrier waits on a busy machine
    try:
        for _ in range(250):
            starts = torch.randint(len(data) - 65, (16,), generator=g)
            windows = torch.stack([data[i : i + 65] for i in starts])  # (16, 65)
            _, loss = model(windows[:, :-1], targets=windows[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    root = tmp_path_factory.mktemp("shakespeare")
    save_model(model.eval(), root / "byte", tokenizer="byte")
    (root / "held_out.txt").write_bytes(text[split : split + 16_000])
    return root


def test_bench_quantize_perplexity_rows(tmp_path, shakespeare_model):
    from gptlab.bench.quantize import main as bench_main

    args = [
        "--no-random",
        "--model",
        str(shakespeare_model / "byte"),
        "--data",
        str(shakespeare_model / "held_out.txt"),
    ]
    args += ["--val-fraction", "0.5", "--decode-tokens", "256", "--threads", "1", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        assert bench_main(args) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(next(tmp_path.glob("quantize-*.json")).read_text())
    rows = result["perplexity"]
    assert set(rows) >= {"fp32", "int8", "int8-wo", "int4-g32", "int4-g64"} and "int4-g128" not in rows
    print(
        "\n"
        + ", ".join(
            f"{k} {rows[k]['rise_pct']:+.3f}% / {rows[k]['decode_rise_pct']:+.3f}%" for k in rows if k.startswith("int")
        )
    )
    assert rows["fp32"]["perplexity"] < 20  # trained (measured 14.7); uniform over 257 bytes is 257
    # Issue 6's bounds: int8 within 1%, int4 within 5% of the float model's perplexity. Measured
    # (whole windows / one token at a time): int8 +0.08% / +0.19%, int8-wo +0.08% / +0.16%,
    # int4-g32 +0.40% / +0.64%, int4-g64 -0.04% / +0.05%. An int8 quantizer that zeroes weights: +1000s%.
    for name in ("int8", "int8-wo"):
        assert abs(rows[name]["rise_pct"]) <= 1 and abs(rows[name]["decode_rise_pct"]) <= 1, name
    for name in ("int4-g32", "int4-g64"):
        assert abs(rows[name]["rise_pct"]) <= 5 and abs(rows[name]["decode_rise_pct"]) <= 5, name


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_refuses_to_train_and_its_dequantized_reference_trains(mode):
    model = quantize_model(tiny_model(n_embd=128), mode, group_size=32)
    idx = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    model.train()
    with pytest.raises(RuntimeError, match="quantized layers are for inference.*dequantize_model"):
        model(idx, targets=idx)
    with torch.no_grad():  # evaluation in train mode, without autograd, still runs
        assert model(idx)[0].shape == (2, 8, 97)
    reference = dequantize_model(model).train()
    _, loss = reference(idx, targets=idx)
    loss.backward()
    assert all(p.grad is not None for p in reference.parameters())


@pytest.mark.parametrize("merged", [False, True])
def test_saving_a_quantized_model_with_adapters_or_merged_float_layers_is_refused(tmp_path, merged):
    """save_quantized wrote a directory that did not load: a quantized model carrying LoRA adapters
    stored them under its layers' names ('missing tensors ...c_attn.weight'), and one whose adapters
    were merged (gptlab.lora.merge makes the layers float) stored fp32 weights under the int8 record
    ('is torch.float32, the model expects torch.int8'). Both are refused before anything is written."""
    from gptlab.lora import LoRASettings, apply_lora, merge

    model = apply_lora(quantize_model(tiny_model(), "int8"), LoRASettings(rank=2, targets=("c_attn.q", "mlp.c_fc")))
    message = "carries LoRA adapters"
    if merged:
        model, message = merge(model), "transformer.h.0.attn.c_attn, .* are float"
    with pytest.raises(ValueError, match=message):
        save_quantized(model, tmp_path / "q")
    assert not (tmp_path / "q").exists()


def test_bench_quantize_skips_a_group_size_that_does_not_divide_the_mlp_width(tmp_path, capsys):
    """A group size was checked against n_embd only: a model whose MLP width it does not divide (a
    Llama-style n_embd 256 has a SwiGLU width of 704; here n_inner 192) stopped the bench at
    int4-g128 with quantize_model's ValueError, after every earlier row, and nothing was written."""
    from gptlab.bench.quantize import main as bench_main

    save_model(tiny_model(vocab_size=257, n_embd=128, n_inner=192), tmp_path / "m", tokenizer="byte")
    (tmp_path / "text.txt").write_text("to be or not to be, that is the question. " * 40)
    args = ["--no-random", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "text.txt"),
            "--decode-tokens", "8", "--threads", "1", "--out", str(tmp_path / "out")]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert bench_main(args) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(next((tmp_path / "out").glob("quantize-*.json")).read_text())["perplexity"]
    assert {"int8", "int8-wo", "int4-g32", "int4-g64"} <= set(rows) and "int4-g128" not in rows
    skipped = "int4-g128 skipped: group size 128 does not divide transformer.h.0.mlp.c_proj's 192 inputs"
    assert skipped in capsys.readouterr().out


@pytest.mark.parametrize("tie_weights", [True, False])
def test_quantize_model_refuses_a_classifier(tie_weights):
    """quantize_model on a classifier was an AttributeError (no lm_head) or, untied, quantized its
    score head into a model save_quantized wrote and load_quantized read back as a language model;
    gptlab quantize refused it already, the API now does too, changing nothing."""
    from gptlab.classifier import from_language_model

    model = from_language_model(tiny_model(tie_weights=tie_weights), ["neg", "pos"], pad_token_id=0)
    with pytest.raises(ValueError, match="a classifier .*2 labels.*language models"):
        quantize_model(model, "int8")
    assert isinstance(model.score, nn.Linear) and not getattr(model, "quantization", None)


def test_bench_quantize_compares_with_the_fp32_model(tmp_path, monkeypatch, capsys):
    """Its "fp32" row was the model as stored: a bf16 model's bf16 perplexity (the schemes then ran
    with bf16 activations too), and a quantized one's int8 perplexity, before quantize_model refused
    it ("already quantized") after every random-model row. The model is read in fp32, and a
    quantized one is refused before anything runs."""
    from gptlab.bench import quantize as bench
    from gptlab.evaluate import perplexity
    from gptlab.tokenizer import get_tokenizer

    save_model(tiny_model(vocab_size=257, n_embd=64).to(torch.bfloat16), tmp_path / "bf16", tokenizer="byte")
    text = "to be or not to be, that is the question. " * 40
    (tmp_path / "text.txt").write_text(text)
    args = ["--no-random", "--model", str(tmp_path / "bf16"), "--data", str(tmp_path / "text.txt"),
            "--decode-tokens", "8", "--threads", "1", "--out", str(tmp_path / "out")]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        assert bench.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(next((tmp_path / "out").glob("quantize-*.json")).read_text())["perplexity"]
    tok = get_tokenizer("byte")
    val = tok.encode(text)[int(0.9 * len(text)) :]
    fp32 = perplexity(load_model(str(tmp_path / "bf16"), dtype=torch.float32), val, tok, stride=32, batch_size=8)
    assert rows["fp32"]["perplexity"] == round(fp32["perplexity"], 4)  # bf16's is 0.025 higher

    save_quantized(quantize_model(tiny_model(n_embd=64), "int8"), tmp_path / "q")
    monkeypatch.setattr(bench, "random_gpt2_rows", None)  # nothing runs before the check
    assert main(["bench", "quantize", "--model", str(tmp_path / "q"), "--out", ""]) == 2
    assert f"--model {tmp_path / 'q'} is quantized (int8): give the float model" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_compiled_decoding_of_a_quantized_model(mode):
    """`gptlab generate --compile` of an int4 model whose layers run gptlab's kernels (inputs in
    whole chunks of 128) failed in torch.compile ('torch.* op returned non-Tensor': the layer
    dequantized itself through ctypes); compiled graphs now dequantize in torch, and decode the
    greedy tokens of the dequantized reference."""
    from gptlab.generation import compile_decode

    model = quantize_model(tiny_model(n_embd=128, n_layer=1), mode, group_size=32)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
    tokens = generate(model, prompts, 6, temperature=0, compiled_step=compile_decode(model))
    assert tokens == generate(dequantize_model(model), prompts, 6, temperature=0)


@pytest.mark.parametrize("carries", ["int8", "int4", "adapters"])
def test_save_model_refuses_what_load_native_cannot_read(tmp_path, carries):
    """checkpoint.save_model of a quantized model wrote its codes and scales under a float model's
    gptlab.json, and of a model with LoRA adapters their tensors under the layers' names: neither
    loaded ('missing tensors ...'), and `gptlab bench serve --model INT8_DIR --mode fp32` died in
    its server. Each is refused before anything is written, naming what to call instead."""
    from gptlab.lora import LoRASettings, apply_lora

    if carries == "adapters":
        model, message = apply_lora(tiny_model(), LoRASettings(rank=2)), "carries LoRA adapters.*save_adapter"
    else:
        model, message = quantize_model(tiny_model(), carries, 32), f"quantized \\({carries}\\).*save_quantized"
    with pytest.raises(ValueError, match=message):
        save_model(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()
