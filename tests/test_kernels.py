"""gptlab's CPU kernels (csrc/kernels.c): each against a reference computed in float64 with the
same arithmetic, and the model's default paths running them."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import VARIANTS, tiny_model
from gptlab import cpu, fused_step, gemm, kernel_build, kernels, linear, ops
from gptlab.generation import generate
from gptlab.quantize import Int4Linear, Int8Linear, quantize_model

FLOAT_OK, INT_OK, WHY = kernels.available()
pytestmark = pytest.mark.usefixtures("kernel_variant")  # every test on every variant this CPU runs
needs_float = pytest.mark.skipif(not FLOAT_OK, reason=f"gptlab's float kernels are not built here: {WHY}")
needs_int = pytest.mark.skipif(not INT_OK, reason=f"gptlab's int8/int4 kernels are not built here: {WHY}")

# (N, K): a tail of output rows that is not a multiple of 4, inputs that are not a multiple of 8 (AVX2 and
# portable vectors) nor 16 (AVX-512).
SHAPES = [(37, 43), (64, 768), (50, 3072)]


@needs_float
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 4, 8, 13, 16])
def test_fp32_kernel_matches_float64(shape, M):
    N, K = shape
    torch.manual_seed(0)
    x, w, b = torch.randn(M, K), torch.randn(N, K), torch.randn(N)
    ref = F.linear(x.double(), w.double(), b.double())
    y = ops.float_linear(x, w, b)
    # measured: <= 3.5e-7 of the largest output (fp32 sums in another order)
    assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.allclose(ops.float_linear(x, w, None), F.linear(x, w), rtol=0, atol=1e-5 * ref.abs().max())


@needs_float
@pytest.mark.parametrize("who", ["gptlab", "torch"])
@pytest.mark.parametrize("bias", [True, False])
def test_prompts_run_the_float_kernel_then_gptlabs_gemm_where_it_is_chosen(who, bias, calls, monkeypatch):
    """An fp32 inference forward of up to MAX_ROWS rows runs the float kernel. Where gemm_choice()
    says gptlab (auto: x86 CPUs not made by Intel), so do up to float_kernel_rows (half the GEMM
    tile's columns), then gl_sgemm_nt (the weights read in place) up to NT_ROWS, and more run
    gl_sgemm; under torch's choice more than MAX_ROWS go to F.linear, as training does."""
    monkeypatch.setenv("GPTLAB_GEMM", who)
    torch.manual_seed(5)
    layer = linear.Linear(96, 70, bias=bias)
    ours = who == "gptlab"
    columns = kernels.gemm_columns()
    assert columns in (8, 16, 32)  # 2 vectors: NEON's, AVX2's or avx512-256's, AVX-512's
    kernel_rows = linear.float_kernel_rows(torch.float32)
    assert kernel_rows == (max(kernels.MAX_ROWS, columns // 2) if ours else kernels.MAX_ROWS)
    expected = {
        kernels.MAX_ROWS: "gl_linear_f32",
        kernels.MAX_ROWS + 1: ("gl_linear_f32" if kernel_rows > kernels.MAX_ROWS else "gl_sgemm_nt") if ours else None,
        kernel_rows: "gl_linear_f32",
        kernel_rows + 1: "gl_sgemm_nt" if ours else None,
        gemm.NT_ROWS: "gl_sgemm_nt" if ours else None,
        gemm.NT_ROWS + 1: "gl_sgemm" if ours else None,
    }
    for rows, kernel in expected.items():
        x = torch.randn(1, rows, 96)  # (B, T, K)
        calls.clear()
        with torch.no_grad():
            y = layer(x)
        assert set(calls) == ({kernel} if kernel else set()), rows
        ref = F.linear(x.double(), layer.weight.double(), layer.bias.double() if bias else None)
        assert y.shape == (1, rows, 70)
        assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()  # measured: ~4e-7
    calls.clear()
    layer(x).sum().backward()  # training: autograd's F.linear
    assert not calls and layer.weight.grad is not None


@needs_float
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("M", [1, 5, 13, 16])
def test_bf16_kernel_is_the_fp32_sum_rounded_once(shape, M):
    N, K = shape
    torch.manual_seed(1)
    x, w, b = torch.randn(M, K).bfloat16(), torch.randn(N, K).bfloat16(), torch.randn(N).bfloat16()
    exact = F.linear(x.double(), w.double(), b.double())  # bf16 inputs are exact in float64
    y = ops.float_linear(x, w, b)
    assert y.dtype == torch.bfloat16
    # One rounding to bf16 (relative 2^-9) plus fp32 summation: within 1 bf16 ulp of the exact value.
    ulp = exact.abs().clamp(min=1e-3) * 2**-7
    assert ((y.double() - exact).abs() <= ulp).all()
    # ...and rounded to nearest even, as torch rounds: only a sum within fp32 noise of a tie may differ.
    rounded = exact.float().bfloat16()
    assert (y != rounded).float().mean() <= 0.01  # measured: 0; truncating instead differs in ~half


def reference_int8(x, layer):
    """The int8 kernel's arithmetic in float64: x quantized per row, integer dot products."""
    amax = x.abs().amax(dim=1, keepdim=True)
    xq = torch.round(x * (127.0 / amax))  # (M, K) in [-127, 127]
    dot = xq.double() @ layer.weight.double().T  # (M, N)
    return (amax.double() / 127) * layer.scales.double() * dot + layer.bias.double()


def reference_int4(x, layer):
    """The int4 kernel's arithmetic in float64: x quantized per row (as int8's), the dequantized weight."""
    amax = x.abs().amax(dim=1, keepdim=True)
    xq = torch.round(x * (127.0 / amax)) * (amax.double() / 127)  # (M, K) dequantized
    return xq @ layer.dequantize().double().T + layer.bias.double()


@needs_int
@pytest.mark.parametrize("shape", [(37, 40), (70, 768), (30, 3072)])
@pytest.mark.parametrize("M", [1, 2, 4, 7, 100])  # 100 rows of 3072: three tiles of x (quantized.c)
def test_int8_kernel_matches_its_arithmetic(shape, M, calls):
    N, K = shape
    torch.manual_seed(2)
    layer = Int8Linear.from_linear(nn.Linear(K, N))
    layer.prepare()
    layer._decode_rows = M  # the kernel even where prompts would go to fbgemm (VNNI: fbgemm_int8_is_exact)
    x = torch.randn(M, K)
    y = layer(x)
    assert calls["gl_linear_i8"] == 1
    ref = reference_int8(x, layer)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # measured: ~2e-7


@needs_int
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("M", [1, 3, 6, 8, 13, 41, 200])  # 41, 200: prompts (spread scales; 200: two tiles of x)
def test_int4_kernel_matches_its_arithmetic(group_size, M, calls):
    N, K = 45, 768
    torch.manual_seed(3)
    layer = Int4Linear.from_linear(nn.Linear(K, N), group_size)
    layer.prepare()
    layer._decode_rows = M  # the kernel even where prompts would dequantize instead (int4_kernel_rows)
    x = torch.randn(M, K) * torch.linspace(0.1, 3, K)  # groups of different scales
    y = layer(x)
    assert calls["gl_linear_i4"] == 1
    ref = reference_int4(x, layer)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # measured: ~3e-7


@needs_int
@pytest.mark.parametrize("group_size", [32, 256])
def test_int4_prompt_path_dequantizes_exactly(calls, group_size):
    torch.manual_seed(4)
    layer = Int4Linear.from_linear(nn.Linear(256, 40), group_size)
    layer.prepare()
    layer._decode_rows = ops.INT4_KERNEL_ROWS  # as the portable and NEON variants have it
    x = torch.randn(ops.INT4_KERNEL_ROWS + 1, 256)  # more rows than the kernel takes
    y = layer(x)
    assert calls["gl_dequantize_i4"] == 1 and calls["gl_linear_i4"] == 0
    assert torch.allclose(y, F.linear(x, layer.dequantize(), layer.bias), rtol=1e-5, atol=1e-5)


@needs_int
@pytest.mark.parametrize("group_size", [32, 256])
def test_int4_dequantizes_to_bf16_as_torch_rounds_its_fp32_weight(group_size):
    """dtype=bf16 (an int4 layer's long prompts on AMX, int4_bf16_linear): the fp32 weight rounded
    to nearest even, bit for bit, on every variant; a wrong dtype or buffer is refused."""
    torch.manual_seed(5)
    layer = Int4Linear.from_linear(nn.Linear(512, 37), group_size)
    args = (layer.weight, layer.scales, layer.zeros, group_size)
    w32 = ops.dequantize_int4(*args)  # (37, 512) fp32
    assert torch.equal(w32, layer.dequantize())
    out = torch.full((37 * 512,), float("nan"), dtype=torch.bfloat16)
    w16 = ops.dequantize_int4(*args, out, torch.bfloat16)
    assert w16.data_ptr() == out.data_ptr() and torch.equal(w16, w32.bfloat16())
    assert not torch.equal(w16.float(), w32)  # really rounded: 2^-8 relative steps, where fp32 has finer
    with pytest.raises(ValueError, match="out must be contiguous torch.bfloat16, not torch.float32"):
        ops.dequantize_int4(*args, torch.empty(37 * 512), torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.bfloat16"):
        ops.dequantize_int4(*args, dtype=torch.float16)


@needs_int
def test_int4_prompts_run_the_kernel_on_x86_simd_and_dequantize_elsewhere(calls):
    """The x86 SIMD variants' int4 kernel beats dequantize + GEMM at any number of rows (the rows
    of x across the lanes); the portable variant dequantizes past INT4_KERNEL_ROWS, and so does
    every variant on a CPU with AMX from INT4_BF16_ROWS (to bf16: test_quantize)."""
    layer = Int4Linear.from_linear(nn.Linear(256, 40), 32)
    layer.prepare()
    layer(torch.randn(513, 256))
    simd = kernel_build.VARIANTS[kernels.variant()][0] in ("GL_AVX2", "GL_AVX512")
    in_kernel = simd and not linear.int4_prompts_in_bf16(513, 40 * 256)
    assert calls["gl_linear_i4"] == in_kernel and calls["gl_dequantize_i4"] == (not in_kernel)


def empty_x_layers() -> dict:
    """One layer of each kind the model's forward runs, 128 inputs (int4's kernel takes whole 128s)."""
    torch.manual_seed(6)
    float_layer = linear.Linear(128, 37)
    return {
        "fp32": float_layer,
        "bf16": linear.Linear(128, 37).to(torch.bfloat16),
        "int8": Int8Linear.from_linear(float_layer, "int8"),
        "int8-weight-only": Int8Linear.from_linear(float_layer, "float"),
        "int4": Int4Linear.from_linear(float_layer, 64),
    }


@needs_int
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int8-weight-only", "int4"])
@pytest.mark.parametrize("shape", [(0, 128), (2, 0, 128)])
def test_no_rows_give_the_empty_result_without_calling_c(kind, shape, calls):
    """x with no rows (a batch of none) gives nn.Linear's empty (..., 0, N) result; C handed M = 0
    segfaulted (the float and int8 kernels) or reported itself out of memory (int4)."""
    layer = empty_x_layers()[kind]
    if kind.startswith("int"):
        layer.prepare()
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    with torch.no_grad():
        y = layer(torch.randn(shape, dtype=dtype))
    assert y.shape == (*shape[:-1], 37) and y.dtype is dtype
    assert not calls


@needs_float
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_layer_of_no_inputs_gives_its_bias(calls):
    """nn.Linear(0, N): x (M, 0) has no elements but M rows, each y = b; the kernels divided by K = 0."""
    layer = linear.Linear(0, 5)
    with torch.no_grad():
        assert torch.equal(layer(torch.randn(3, 0)), layer.bias.expand(3, 5))
        assert torch.equal(layer(torch.randn(200, 0)), layer.bias.expand(200, 5))  # a prompt's row count
    assert not calls


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_is_the_same_with_and_without_kernels(variant, calls):
    model = tiny_model(**VARIANTS[variant])
    prompts = [[5, 6, 7], [8, 9]]
    with kernels.use_kernels(False):
        plain = generate(model, prompts, 12, temperature=0)
    assert not calls
    fast = generate(model, prompts, 12, temperature=0)
    assert calls["gl_decode_step"] > 0  # the whole step in C (gptlab.fused_step)
    assert fast == plain


def test_default_paths_run_the_kernels(tmp_path, calls):
    model = tiny_model()
    model.save_pretrained(tmp_path / "hf")
    loaded = type(model).from_pretrained(str(tmp_path / "hf"))
    assert all(isinstance(m, linear.Linear) for m in loaded.modules() if isinstance(m, nn.Linear))
    generate(loaded, [[1, 2, 3]], 4, temperature=0)
    # the prompt (3 tokens) and 3 decoding steps: each one call running the whole model (gptlab.fused_step)
    assert calls["gl_decode_step"] == 4 and calls["gl_linear_f32"] == 0
    generate(loaded, [list(range(1, 10)), [1, 2]], 2, temperature=0)  # 18 prompt tokens: PyTorch's GEMMs...
    # ...and the linear kernel for the 2 last positions: the last layer's projection and MLP, the head
    assert calls["gl_decode_step"] == 5 and calls["gl_linear_f32"] == 3 + 1
    with torch.no_grad():
        loaded(torch.tensor([[1, 2, 3]]))  # no KV cache: the modules, with the linear kernel
    assert calls["gl_linear_f32"] == 4 + 4 * 2 + 1
    bf16 = type(model).from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16)
    generate(bf16, [[1, 2, 3]], 2, temperature=0)
    assert calls["gl_decode_step"] == 7 and fused_step.plan(bf16, torch.bfloat16).struct.head.kind == fused_step.BF16


def test_training_after_generation_uses_autograd_and_matches_plain_linear(calls):
    model = tiny_model()
    generate(model, [[1, 2, 3]], 3, temperature=0)
    model.train()
    idx = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    before = dict(calls)
    _, loss = model(idx, targets=idx)
    loss.backward()
    # autograd forward: PyTorch's layers; the two blocks' GELUs in C, forward and backward, with SIMD
    new = {name: n - before.get(name, 0) for name, n in calls.items() if n != before.get(name, 0)}
    assert new == ({"gl_gelu_tanh": 2, "gl_gelu_tanh_backward": 2} if kernels.has_simd() else {})
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.no_grad():  # the same numbers through F.linear
        assert model(idx[:1, :1])[0].shape == (1, 1, 97)
    with kernels.use_kernels(False):
        _, loss2 = model(idx, targets=idx)
        loss2.backward()
    # PyTorch's GELU throughout: the same to fp32 rounding (measured: loss equal, gradients <= 7.5e-8 apart)
    torch.testing.assert_close(loss, loss2, rtol=1e-6, atol=0)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


@needs_int
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_generation_runs_the_int_kernels(mode, calls):
    model = tiny_model(n_embd=128, n_head=4)  # int4's kernel takes inputs in chunks of 128
    quantize_model(model, mode, group_size=32)
    out = generate(model, [[1, 2, 3]], 5, temperature=0)
    assert len(out[0]) == 8
    assert calls["gl_decode_step"] == 5  # the whole step in C, every layer through the int kernel:
    plan = fused_step.plan(model, torch.float32)
    kinds = {b.attn.kind for b in plan.blocks} | {b.mlp_proj.kind for b in plan.blocks} | {plan.struct.head.kind}
    assert kinds == {fused_step.I8 if mode == "int8" else fused_step.I4}
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # no KV cache: the modules, each layer's own int kernel
    assert calls[f"gl_linear_{mode[:2].replace('in', 'i')}{mode[3:]}"] > 0


@needs_float
@pytest.mark.parametrize(
    "dtype, cache", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float32, torch.bfloat16)]
)  # the last: a quantized model's bf16 cache of fp32 activations
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("hs", [24, 64, 128])  # 24: not a multiple of 16 (masked loads), and known only at run time
def test_decode_attention_writes_the_cache_and_matches_sdpa(dtype, cache, padded, hs):
    B, nh, max_len, pos = 3, 4, 16, 9  # 10 keys: two groups of four, then two one by one
    torch.manual_seed(5)
    k_cache, v_cache = torch.randn(B, nh, max_len, hs).to(cache), torch.randn(B, nh, max_len, hs).to(cache)
    before = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(B, 1, 3 * nh * hs).to(dtype)
    mask = None
    if padded:  # row 1 has its first 4 slots as padding
        mask = torch.ones(B, 1, 1, pos + 1, dtype=torch.bool)
        mask[1, ..., :4] = False
    out = ops.decode_attention(qkv, (k_cache, v_cache), pos, mask, nh)
    q, k, v = qkv.float().view(B, 1, 3, nh, hs).unbind(2)  # each (B, 1, nh, hs)
    # the new key and value rounded into the cache as torch rounds (bit for bit)
    assert torch.equal(k_cache[:, :, pos], k[:, 0].to(cache)) and torch.equal(v_cache[:, :, pos], v[:, 0].to(cache))
    assert torch.equal(k_cache[:, :, :pos], before[0][:, :, :pos]) and torch.equal(
        k_cache[:, :, pos + 1 :], before[0][:, :, pos + 1 :]
    )
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache[:, :, : pos + 1].float(), v_cache[:, :, : pos + 1].float(), attn_mask=mask
    )  # (B, nh, 1, hs)
    ref = ref.transpose(1, 2).reshape(B, 1, nh * hs)
    # measured: 4e-7 with fp32 activations, either cache (the query unrounded); bf16: one rounding of the output
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and (out.float() - ref).abs().max() <= tol * ref.abs().max()


@needs_float
@needs_float
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [None, 0, 37])
def test_prompt_attention_is_causal_sdpa(dtype, cached):
    """gl_attend_prompt: q a strided view of c_attn's output; k and v views of it too (no cache),
    or a cache's first S = cached + T slots (the cached ones visible to every query), against
    float64 SDPA with the causal mask; bf16 read as it is (no fp32 copies), computed in fp32 and
    rounded once: the same bits as the fp32 attention of its fp32 copies, rounded by torch."""
    B, T, nh, hs = 2, 101, 3, 40  # T: 48 + 48 + 5 queries; hs: a vector tail on every variant
    torch.manual_seed(9)
    qkv = torch.randn(B, T, 3 * nh * hs).to(dtype)
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in qkv.split(nh * hs, dim=2))  # (B, nh, T, hs)
    S = T + (cached or 0)
    if cached is not None:
        k_cache, v_cache = torch.randn(B, nh, 160, hs).to(dtype), torch.randn(B, nh, 160, hs).to(dtype)
        k_cache[:, :, cached:S], v_cache[:, :, cached:S] = k, v
        k, v = k_cache[:, :, :S], v_cache[:, :, :S].contiguous()  # strides of their own
    with torch.no_grad():
        y = ops.prompt_attention(q, k, v)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert y.shape == (B, nh, T, hs) and y.dtype == dtype
    if dtype is torch.float32:
        assert (y.double() - ref).abs().max() <= 2e-6  # measured <= 5.4e-7
    else:  # one rounding to bf16 of an fp32 result: half an ulp plus fp32's error
        assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 2e-6).all()
        with torch.no_grad():
            y32 = ops.prompt_attention(q.float(), k.float(), v.float())
        assert torch.equal(y, y32.to(dtype))


@needs_float
@pytest.mark.parametrize("arch", list(VARIANTS))
def test_prompts_attend_in_c_where_the_attention_is_plain_causal(calls, kernel_variant, arch):
    """The model's prompts (several queries, inference, no mask, no dropout) attend in C where the
    kernels have SIMD, to PyTorch's result, on every architecture variant (rotary q and k come
    rotated, not as views of c_attn's output); padded batches (a mask) and autograd keep SDPA."""
    model = tiny_model(**VARIANTS[arch])
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with kernels.use_kernels(False), torch.no_grad():
        ref = model(idx)[0]
    with torch.no_grad():
        got = model(idx)[0]
    simd = kernel_variant != "portable"
    assert calls["gl_attend_prompt"] == 2 * simd  # one per layer
    assert (got - ref).abs().max() <= 1e-6  # measured 1.2e-7 (sums in another order)
    generate(model, [list(range(1, 20)), [1, 2]], 1, temperature=0)  # padded: a mask
    model(idx)[0].sum().backward()  # autograd
    assert calls["gl_attend_prompt"] == 2 * simd
    model.train()  # dropout 0 in tiny configs: still C under no_grad
    with torch.no_grad():
        model(idx)
    assert calls["gl_attend_prompt"] == 4 * simd


@needs_float
def test_the_gelu_overwrites_c_fc_output_only_where_no_hook_sees_it(kernel_variant):
    """The MLP's GELU runs in place on c_fc's fresh output, unless a hook on hook_pre holds it."""
    model = tiny_model()
    idx = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        logits = model(idx)[0]
        seen = []
        model.transformer.h[0].mlp.hook_pre.add_hook(lambda act, hook: seen.append(act))
        assert torch.equal(model(idx)[0], logits)
    # still c_fc's output: the GELU leaves nothing under its minimum, -0.17
    assert len(seen) == 1 and seen[0].min() < -0.2  # measured -0.29


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch_including_ties(dtype):
    torch.manual_seed(6)
    logits = torch.randn(10, 50257)
    logits[1, 7] = logits[1, 40000] = logits[1].max() + 1  # a tie in two blocks: the first index wins
    logits[2, 3000] = logits[2, 3001] = logits[2].max() + 1  # a tie within one block
    logits[3, 9] = float("nan")  # NaN counts as the largest, as in torch: the first NaN
    logits[4, 45000], logits[4, 50256], logits[4, 100] = float("nan"), float("nan"), 1e30  # after the largest
    logits[5, 20000], logits[5, 30000] = float("inf"), float("inf")  # infinities, no NaN
    logits[6, 20000], logits[6, 20001] = float("inf"), float("nan")
    logits[7] = float("-inf")
    logits[8, 50256] = 100.0  # in the last, partial block, past the last whole vector
    logits[9, :] = 0.0
    logits = logits.to(dtype)
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    for width in (1, 5, 17, 1024, 1031):  # rows shorter than a vector, a block, a block and a tail
        short = logits[:, -width:].contiguous()
        assert torch.equal(ops.argmax(short), short.argmax(dim=-1)), width


@needs_float
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_kernel_is_torchs_tanh_gelu(dtype):
    """gl_gelu_tanh, prompts' MLP activations: PyTorch's tanh GELU to fp32 rounding; for bf16 the
    fp32 value rounded once, as PyTorch's bf16 GELU, so within a bf16 ulp of it and mostly equal."""
    torch.manual_seed(7)
    x = (torch.randn(3, 4099) * 4).to(dtype)  # past a 4,096-value chunk and any vector width
    x[0, :5] = torch.tensor([0.0, -0.0, 30.0, -30.0, float("inf")])
    y = torch.empty_like(x)
    lib = kernels._library().lib
    kernels.check(lib.gl_gelu_tanh(x.data_ptr(), y.data_ptr(), x.numel(), int(dtype is torch.bfloat16), 2))
    ref = F.gelu(x, approximate="tanh")
    assert torch.equal(y[0, :5], ref[0, :5])
    exact = F.gelu(x.double(), approximate="tanh")[:, 5:]
    if dtype is torch.float32:  # measured: <= 1.6e-7 of max(|gelu|, 1), PyTorch's own 1.5e-7
        assert ((y[:, 5:].double() - exact).abs() / exact.abs().clamp(min=1)).max() <= 4e-7
    else:
        y, ref = y[:, 5:].float(), ref[:, 5:].float()
        diff = (y - ref).abs()
        # within one bf16 ulp; where x < -5 both differences of 1 + tanh(u) ~ 0 keep fp32's absolute
        # error (measured <= 2.4e-7), which a tiny result's ulp is smaller than
        assert (diff <= (ref.abs() * 2**-8).clamp(min=1e-6)).all()
        assert (diff == 0).float().mean() >= 0.95  # measured 0.979 equal


@needs_float
def test_gelu_runs_the_kernel_for_the_tanh_form_only(calls, kernel_variant):
    """ops.gelu: C for the tanh form where the kernels have SIMD (portable C is slower than
    PyTorch's), in inference and under autograd in fp32 (forward and backward); the exact GELU,
    and bf16 under autograd, stay PyTorch's."""
    torch.manual_seed(8)
    x = torch.randn(4, 100)
    simd = kernel_variant != "portable"
    with torch.no_grad():
        assert torch.allclose(ops.gelu(x, "tanh"), F.gelu(x, approximate="tanh"), rtol=0, atol=1e-6)
        xb = x.bfloat16()
        assert torch.allclose(ops.gelu(xb, "tanh").float(), F.gelu(xb, approximate="tanh").float(), rtol=2**-8)
        assert calls["gl_gelu_tanh"] == 2 * simd
        assert torch.equal(ops.gelu(x, "none"), F.gelu(x))
        assert torch.equal(ops.gelu(x.t(), "tanh"), F.gelu(x.t(), approximate="tanh"))  # not contiguous
    xg = x.clone().requires_grad_()
    ops.gelu(xg, "tanh").sum().backward()
    assert calls["gl_gelu_tanh"] == 3 * simd and calls["gl_gelu_tanh_backward"] == simd
    xr = x.clone().requires_grad_()
    F.gelu(xr, approximate="tanh").sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, rtol=0, atol=1e-6)
    ops.gelu(xb.clone().requires_grad_(), "tanh").sum().backward()  # bf16 under autograd: PyTorch's
    assert calls["gl_gelu_tanh"] == 3 * simd and calls["gl_gelu_tanh_backward"] == simd
    with torch.no_grad():
        tiny_model(mlp="gelu")(torch.tensor([[1, 2, 3]]))
    assert calls["gl_gelu_tanh"] == 5 * simd  # and one per block of the tiny model


@needs_float
def test_the_gelu_gradient_is_the_tanh_gelus_derivative(kernel_variant):
    """gl_gelu_tanh_backward: dy times the derivative of the tanh GELU, against float64 autograd
    (measured <= 1.02e-6 of max(|dy|, 1) on every variant, as PyTorch's fp32 backward: 1 + tanh
    cancels where x ~ -4); the forward as without autograd. Past a 4,096-value chunk and any
    vector width, with the tails of tanh."""
    torch.manual_seed(9)  # the portable variant: PyTorch's GELU, held to the same bound
    x = (torch.randn(3, 4099) * 4).requires_grad_()
    with torch.no_grad():
        x[0, :4] = torch.tensor([0.0, 30.0, -30.0, 1e-3])
    dy = torch.randn(3, 4099)
    y = ops.gelu(x, "tanh")
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(F.gelu(x64, approximate="tanh"), x64, dy.double())
    assert ((dx.double() - want).abs() / dy.double().abs().clamp(min=1)).max() <= 2e-6
    with torch.no_grad():
        assert torch.equal(y, ops.gelu(x.detach(), "tanh"))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("path", ["slabs", "whole", "gl_sgemm_nt", "gl_sgemm_bf16_ab"])
def test_bf16_linear_in_fp32_is_the_product_rounded_once(monkeypatch, calls, bias, path):
    """bf16 layers on CPUs without bf16 GEMMs: the product in fp32, of the weight converted whole
    or slab by slab of rows (here 16 rows a slab: 70 rows are five slabs, the last partial), or
    for prompts (here from 16 rows) with the weight and x widened as gl_sgemm_nt reads them (up to
    NT_ROWS rows) or as gl_sgemm_bf16_ab packs them, rounded to bf16 once."""
    torch.manual_seed(0)
    monkeypatch.setattr(linear, "SLAB_BYTES", 16 * 4 * 96)
    monkeypatch.setattr(linear, "WHOLE_BYTES", 70 * 96 * 4 if path == "whole" else 0)
    monkeypatch.setattr(linear, "PROMPT_GEMM_ROWS", 16 if path.startswith("gl_") else 10**9)
    monkeypatch.setattr(gemm, "NT_ROWS", 18 if path == "gl_sgemm_nt" else 17)
    monkeypatch.setenv("GPTLAB_GEMM", "gptlab")
    x = torch.randn(2, 9, 96).bfloat16()
    w = (torch.randn(70, 96) * 0.1).bfloat16()
    b = torch.randn(70).bfloat16() if bias else None
    got = linear.bf16_linear_in_fp32(x, w, b)
    assert set(calls) == ({path} if path.startswith("gl_") else set())
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)  # (2, 9, 70)
    assert got.shape == (2, 9, 70) and got.dtype == torch.bfloat16
    err = ((got.double() - exact).abs() / (exact.abs() + 1e-3)).max()
    assert err <= 2**-8 + 1e-5, err  # half a bf16 ulp (8 significant bits) plus fp32's sums; measured 3.87e-3


@needs_float
def test_weights_move_to_huge_pages_behind_the_first_step_not_before_it(monkeypatch):
    """kernels.stream hands a weight of 4 MiB or more to a background thread that calls
    gl_huge_pages on it (Linux copies the pages: 0.84 s for GPT-2, which the first token waited
    for); a smaller weight, or one already handed over, is not handed over again."""
    import threading
    import time

    calls, done = [], threading.Event()

    def slow(address, nbytes):
        time.sleep(0.3)
        calls.append((address, nbytes))
        done.set()
        return 0

    monkeypatch.setattr(kernels._library().lib, "gl_huge_pages", slow)
    big, small = torch.empty(1 << 20), torch.empty(1 << 19)  # 4 MiB and 2 MiB of fp32
    started = time.perf_counter()
    assert kernels.stream(big) == big.data_ptr() and kernels.stream(small) == small.data_ptr()
    assert kernels.stream(big) == big.data_ptr()
    assert time.perf_counter() - started < 0.2  # not waiting for the move (measured ~0.1 ms)
    assert done.wait(10) and calls == [(big.data_ptr(), big.nbytes)]
    time.sleep(0.4)
    assert len(calls) == 1
    done.clear()
    memory = big.untyped_storage()  # a weight freed and another made where it was: handed over again
    del big
    again = torch.empty(0).set_(memory)
    assert kernels.stream(again) == again.data_ptr() and done.wait(10)
    assert calls[1] == (again.data_ptr(), again.nbytes) == calls[0]


@needs_float
def test_huge_pages_can_be_waited_for(monkeypatch):
    """wait_for_huge_pages returns once the thread has moved every weight handed to it, or False
    at its timeout while one is still being moved."""
    import threading

    release = threading.Event()
    monkeypatch.setattr(kernels._library().lib, "gl_huge_pages", lambda address, nbytes: release.wait(10) and 0)
    weight = torch.empty(1 << 20)  # 4 MiB
    kernels.stream(weight)
    assert not kernels.wait_for_huge_pages(timeout=0.2)
    release.set()
    assert kernels.wait_for_huge_pages(timeout=10)


@pytest.mark.parametrize(("native_ms", "fp32_ms", "expected"), [(1, 2, True), (3, 2, False)])
def test_bf16_matmul_choice_is_timed_after_the_huge_pages_where_the_cpu_has_bf16(
    monkeypatch, native_ms, fp32_ms, expected
):
    """bf16_matmul_is_fast: on a CPU without bf16 instructions, False without timing; else the
    faster of PyTorch's bf16 GEMM and the fp32 one, timed after the huge-page thread is done (timed
    while it copied a model's pages, the fp32 product took 8x its time: the wrong choice, 4x slower
    bf16 prompts) and alternating, best of 3 after a warm-up round."""
    from types import SimpleNamespace

    clock, events = SimpleNamespace(now=0.0), []

    def fake_linear(x, w, bias=None):
        native = x.dtype is torch.bfloat16
        done = events.count("native" if native else "fp32")
        events.append("native" if native else "fp32")
        wins = native == expected
        # Counted, the warm-up (the loser fast) or a slow moment (the winner 50x) would turn the choice.
        factor = 0.02 if done == 0 and not wins else 50 if done == 2 and wins else 1
        clock.now += (native_ms if native else fp32_ms) * factor / 1000
        return torch.zeros(x.size(0), w.size(0), dtype=x.dtype)

    monkeypatch.setattr(linear, "F", SimpleNamespace(linear=fake_linear))
    monkeypatch.setattr(linear, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(kernels, "wait_for_huge_pages", lambda timeout=10.0: events.append("wait") or True)
    linear.bf16_matmul_is_fast.cache_clear()
    try:
        monkeypatch.setattr(cpu, "may_have_native_bf16", lambda: False)
        assert linear.bf16_matmul_is_fast() is False and events == []
        linear.bf16_matmul_is_fast.cache_clear()
        monkeypatch.setattr(cpu, "may_have_native_bf16", lambda: True)
        assert linear.bf16_matmul_is_fast() is expected
        assert events[0] == "wait" and events.count("native") == events.count("fp32") == 4
    finally:
        linear.bf16_matmul_is_fast.cache_clear()


def _forwards(model) -> list[torch.Tensor]:
    """Logits of a 21-token prompt (the prompts' kernels), then of a 13-token prompt and 4 one-token
    steps over a KV cache (the fused decoding step), 2 rows each."""
    from gptlab.kv_cache import KVCache

    prompt = torch.randint(0, model.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model, 2, 40)
    outs = [model(prompt)[0]]
    for t0, t1 in [(0, 13), *((t, t + 1) for t in range(13, 17))]:
        outs.append(model(prompt[:, t0:t1], kv_cache=cache)[0])  # (2, t1 - t0, V)
        cache.advance(t1 - t0)
    return outs


@needs_float
@pytest.mark.parametrize("mode", ["fp32", "bf16", "int8", "int4"])
def test_the_kernels_give_the_same_bits_on_any_number_of_threads(kernel_variant, mode, monkeypatch):
    """CI has 2 cores; users have 1 or 16. Each kernel splits its rows (and the prompts' GEMM its
    columns) among the threads, and no sum is split, so every output is the same bits on 1, 3 and 5
    threads as on 2: a thread's share computed twice or not at all, or a tail lost, shows. The
    portable variant leaves long prompts' products to PyTorch, whose sums depend on the threads
    (measured: 1.5e-7 of a logit). On an Intel CPU auto times gptlab's GEMM against MKL for each
    thread count (gemm.prompt_gemm_choice) and may take MKL for some: this test is about
    gptlab's kernels, so it asks for them (an Intel CPU's flags on this AMD host took MKL at 3
    threads only, and the logits differed)."""
    if kernel_variant != "portable":
        monkeypatch.setenv("GPTLAB_GEMM", "gptlab")
    model = tiny_model(0)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    elif mode in ("int8", "int4"):
        model = quantize_model(model, mode, **({"group_size": 32} if mode == "int4" else {}))
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(2)
            want = _forwards(model)
            for threads in (1, 3, 5):
                torch.set_num_threads(threads)
                for got, ref in zip(_forwards(model), want, strict=True):
                    if kernel_variant == "portable" and mode == "fp32":
                        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
                    else:
                        assert torch.equal(got, ref), f"{threads} threads"
    finally:
        torch.set_num_threads(before)
