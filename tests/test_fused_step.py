"""The whole-model decoding step in C (gptlab.fused_step, gl_decode_step): the same logits as the
modules compute, taken by every default decoding path, and out of the way whenever it cannot be
exact (hooks, rotary positions, autograd, a changed model)."""

import contextlib
import copy
import dataclasses
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.nn as nn

from conftest import VARIANTS, tiny_model
from gptlab import fused_step, gemm, kernels, ops
from gptlab.generation import decode_step, generate, left_pad, new_cache, prefill
from gptlab.quantize import quantize_model

FLOAT_OK, INT_OK, WHY = kernels.available()
pytestmark = [  # every test on every kernel variant this CPU runs
    pytest.mark.usefixtures("kernel_variant"),
    pytest.mark.skipif(not FLOAT_OK, reason=f"gptlab's kernels are not built here: {WHY}"),
]
needs_int = pytest.mark.skipif(not INT_OK, reason=f"gptlab's int8/int4 kernels are not built here: {WHY}")

SUPPORTED = {**VARIANTS, "gelu_erf": dict(mlp="gelu_erf")}
PROMPTS = [[5, 6, 7, 8], [9, 10]]  # two rows, the second left-padded: per-row positions and a key mask


@pytest.fixture
def steps(monkeypatch):
    """Counts forwards in C: steps["fused"], through the model's forward (fused_step.step) or before
    it (fused_step.decode, whose declined steps go on to the forward), and steps["declined"]."""
    counts = Counter()
    real_step, real_decode = fused_step.step, fused_step.decode

    def counting_step(*args):
        out = real_step(*args)
        counts["fused" if out is not None else "declined"] += 1
        return out

    def counting_decode(*args):
        out = real_decode(*args)
        counts["fused"] += out is not None
        counts["early"] += out is not None
        return out

    monkeypatch.setattr(fused_step, "step", counting_step)
    monkeypatch.setattr(fused_step, "decode", counting_decode)
    return counts


def with_norms_shaken(model, seed: int = 0):
    """The model with random norm gains and biases (a fresh model's are ones and zeros, which
    would hide a norm step that drops one of them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.5 * torch.randn(m.bias.shape, generator=g))
    return model


@contextlib.contextmanager
def fused_or_modules(fused: bool):
    """Within the block, forwards take the C step (fused=True) or always the modules, with no grad."""
    applies = fused_step.applies
    fused_step.applies = applies if fused else (lambda *args: False)
    try:
        with torch.no_grad():
            yield
    finally:
        fused_step.applies = applies


def decode_logits(model, n: int = 6, prompts=PROMPTS, fused: bool = True, early: bool = True) -> torch.Tensor:
    """fp32 logits (n + 1, B, V) of the prompts' last tokens (8 tokens in all: one fused call)
    and of n greedy decoding steps after them, fused or through the modules; with early=False,
    the steps go through the model's forward even where fused_step.decode would take them. The
    steps of prompts that need no padding give no positions (the slots')."""
    idx, positions, mask = left_pad(prompts)
    decode = fused_step.decode if early else (lambda *args: None)
    with fused_or_modules(fused), mock.patch.object(fused_step, "decode", decode):
        cache = new_cache(model, len(prompts), idx.size(1) + n)
        key_mask = None
        if mask is not None:
            key_mask = torch.ones(len(prompts), cache.max_len, dtype=torch.bool)
            key_mask[:, : idx.size(1)] = mask
        logits = prefill(model, idx, cache, positions=positions, key_mask=key_mask)
        pos, out = None if mask is None else positions[:, -1] + 1, [logits.float()]
        for _ in range(n):
            logits = decode_step(model, logits.argmax(-1), cache, positions=pos, key_mask=key_mask)
            out.append(logits.float())
            pos = None if pos is None else pos + 1
    return torch.stack(out)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("variant", list(SUPPORTED))
def test_fp32_step_matches_the_modules(variant, steps):
    model = with_norms_shaken(tiny_model(**SUPPORTED[variant]))
    fused = decode_logits(model)
    assert steps["fused"] == 7 and not steps["declined"]
    plain = decode_logits(model, fused=False)
    assert steps["fused"] == 7  # the module path was taken
    # measured: <= 2.2e-7 of the largest logit (fp32 norms and GELU summed in another order);
    # the other GELU (erf for tanh) is 3.8e-6 away, the first norm without its bias 2.8e-2;
    # rotary angles with the sign of sin flipped 1.8e-3, the pairs' halves swapped 1.8e-3, keys
    # not rotated 3.8e-3
    assert relative(fused, plain) <= 1e-6
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("variant", ["gpt2", "swiglu", "rmsnorm"])
def test_bf16_step_rounds_where_the_modules_round(variant, steps):
    model = with_norms_shaken(tiny_model(**SUPPORTED[variant])).to(torch.bfloat16)
    long_prompts = [[5, 6, 7, 8, 9], [9, 10]]  # 10 tokens: the prompt runs the modules in both
    fused, plain = decode_logits(model, prompts=long_prompts), decode_logits(model, prompts=long_prompts, fused=False)
    assert steps["fused"] == 6
    # One-token steps: each op's output rounded to bf16 where PyTorch's bf16 op rounds it, and
    # the same C attention: measured identical here (0.0). At GPT-2's size an fp32 sum in another
    # order can land on the other side of a rounding boundary (~1e-2 of the largest logit over 12
    # layers). Skipping the rounding of the residual stream: 5.6e-3 here; of the norms' outputs
    # 2.8e-3; of SwiGLU's silu 3.1e-3.
    assert relative(fused, plain) <= 1e-3
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("variant", ["gpt2", "swiglu", "rmsnorm", "rope", "llama"])
def test_bf16_prompt_is_as_close_to_fp32_as_the_modules(variant, steps):
    """An 8-token prompt: the modules' SDPA rounds inside attention where the C step keeps fp32,
    so the two differ by a bf16 step or so; each is as far from fp32 arithmetic as the other.
    (So do rotary models' one-token steps: the modules attend in bf16 there, the C step in fp32.)"""
    model = with_norms_shaken(tiny_model(**SUPPORTED[variant])).to(torch.bfloat16)
    fused, plain = decode_logits(model), decode_logits(model, fused=False)
    assert steps["fused"] == 7
    exact = decode_logits(model.float(), fused=False)  # the same bf16 weights, fp32 arithmetic
    # measured (prompt, then six steps), of the largest logit from fp32: fused 3.7e-3, 3.0e-3,
    # 2.8e-3, 4.3e-3, 4.3e-3 (gpt2, swiglu, rmsnorm, rope, llama), modules 3.3e-3, 3.0e-3,
    # 2.5e-3, 4.3e-3, 5.6e-3; a rounding left out shows in
    # test_bf16_step_rounds_where_the_modules_round, not here (it can land closer to fp32)
    assert relative(fused, exact) <= 1.5 * relative(plain, exact)


@needs_int
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_step_matches_the_modules(mode, steps):
    model = with_norms_shaken(tiny_model(n_embd=128, n_head=4))  # int4's kernel takes inputs in chunks of 128
    quantize_model(model, mode, group_size=32)
    fused, plain = decode_logits(model), decode_logits(model, fused=False)
    assert steps["fused"] == 7
    # The same kernels on the same int8-quantized activations: measured 4.5e-7 (int8) and 2.6e-7
    # (int4) of the largest logit at each step. An activation a hair apart (C's GELU or norm
    # against PyTorch's, in the last bits) can round to the neighbouring int8 level: then that step
    # and those after differ by about as much as each differs from fp32 activations (measured
    # 7.3e-3 at step 5 of 7 on the portable variant; at GPT-2's size it is common).
    per_step = [relative(f, p) for f, p in zip(fused, plain, strict=True)]
    assert sorted(per_step)[len(per_step) // 2] <= 2e-6 and max(per_step) <= 2e-2
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@needs_int
@pytest.mark.parametrize("mode", ["int4", "int8-no-vnni"])
@pytest.mark.parametrize("rows", [12, 20])  # tiles of x in the int4 kernel; from 16 on, rows of x in its lanes
def test_quantized_steps_of_many_rows_match_the_modules(rows, mode, steps, monkeypatch):
    """An int4 model's decoding steps take C up to INT_STEP_ROWS rows (its norms and GELU over the
    threads from 9 rows on), and an int8 model's where its modules run gptlab's int8 kernel at every
    row count (no AVX-512 VNNI: here fbgemm_int8_is_exact patched false before quantizing, as on the
    Zen 3); their prompts, and an int8 model's steps of more than MAX_ROWS with VNNI, do not."""
    with monkeypatch.context() as patch:
        if mode == "int8-no-vnni":
            patch.setattr(ops, "fbgemm_int8_is_exact", lambda: False)
        model = with_norms_shaken(tiny_model(n_embd=128, n_head=4))
        quantize_model(model, mode[:4], group_size=32)
        g = torch.Generator().manual_seed(rows)
        prompts = [torch.randint(1, 64, (1 + r % 5,), generator=g).tolist() for r in range(rows)]  # left-padded
        fused = decode_logits(model, n=4, prompts=prompts)
        plain = decode_logits(model, n=4, prompts=prompts, fused=False)
        assert steps["fused"] == 4  # the steps, not the prompt of rows x 5 tokens
        # As test_quantized_step_matches_the_modules: measured at most 4.4e-7 (int4, 12 rows) and
        # 5.6e-7 (int4, 20) of the largest logit, int8 3.7e-7, on every variant.
        per_step = [relative(f, p) for f, p in zip(fused, plain, strict=True)]
        assert sorted(per_step)[len(per_step) // 2] <= 2e-6 and max(per_step) <= 2e-2
        assert torch.equal(fused.argmax(-1), plain.argmax(-1))
        decode_logits(model, n=2, prompts=[[1, 2]] * (fused_step.INT_STEP_ROWS + 1))
    int8 = quantize_model(with_norms_shaken(tiny_model(n_embd=128, n_head=4)), "int8")
    decode_logits(int8, n=2, prompts=[[1, 2]] * rows)
    assert steps["fused"] == (4 if ops.fbgemm_int8_is_exact() else 6)


@pytest.mark.parametrize(
    "dtype, rows",
    [(torch.float32, 12), (torch.float32, 16), (torch.float32, 24), (torch.bfloat16, 12), (torch.bfloat16, 16)],
)
def test_float_steps_of_many_rows_match_the_modules(rows, dtype, steps, monkeypatch):
    """An fp32 or bf16 model's decoding steps take C up to FLOAT_STEP_ROWS rows where gptlab's GEMM
    runs prompts (the modules would run gptlab's kernels on those rows too: the float kernel, then
    for fp32 gl_sgemm_nt, from 17 rows on avx512; its norms and GELU over the threads from 9 rows
    on); past it, and where PyTorch's GEMM runs prompts, the modules."""
    model = with_norms_shaken(tiny_model()).to(dtype)
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(1, 64, (1 + r % 5,), generator=g).tolist() for r in range(rows)]  # left-padded
    fused, plain = decode_logits(model, n=4, prompts=prompts), decode_logits(model, n=4, prompts=prompts, fused=False)
    in_c = gemm.prompt_gemm_choice(rows) == "gptlab"  # not on the portable variant
    assert steps["fused"] == (4 if in_c else 0)  # the steps, not the prompt of rows x 5 tokens
    # As test_fp32_step_matches_the_modules and test_bf16_step_rounds_where_the_modules_round:
    # measured at most 2.3e-7 (fp32) and 0.0 (bf16) of the largest logit, on every variant.
    assert relative(fused, plain) <= (1e-6 if dtype is torch.float32 else 1e-3)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    decode_logits(model, n=2, prompts=[[1, 2]] * (fused_step.FLOAT_STEP_ROWS[dtype] + 1))
    monkeypatch.setenv("GPTLAB_GEMM", "torch")  # as an Intel CPU whose probe chose MKL
    decode_logits(model, n=2, prompts=[[1, 2]] * rows)
    assert steps["fused"] == (4 if in_c else 0)


def test_a_bf16_cache_of_fp32_activations_matches_the_modules(steps):
    """model.kv_cache_dtype = bf16 (a quantized model's default): keys and values rounded into the
    cache, the query and the sums fp32, in C as in the modules and in PyTorch's own attention."""
    model = with_norms_shaken(tiny_model())
    exact = decode_logits(model, fused=False)  # the fp32 cache
    model.kv_cache_dtype = torch.bfloat16
    fused, plain = decode_logits(model), decode_logits(model, fused=False)
    assert steps["fused"] == 7
    # PyTorch's attention (write_kv's rounding, then SDPA over the upcast keys) after gptlab's own
    # linear layers: MKL's fp32 sums can round a value to the neighbouring bf16 (Intel Xeon 6/207: one
    # value one bf16 step apart, the logits 1.6e-5 apart), which is not the attention's doing
    no_c_attention = dict(decode_attention_applies=lambda *a: False, prompt_attention_applies=lambda *a: False)
    with mock.patch.multiple(ops, **no_c_attention):
        torch_attention = decode_logits(model, fused=False)
    # measured: 1.7e-7 and 1.3-1.7e-7 of the largest logit from the modules' and PyTorch's, 2.3e-4
    # from the fp32 cache's (the rounding is real); with the query rounded to bf16 in C as well,
    # 2.2e-6 and 1.6e-5; keys truncated instead of rounded to nearest: fails as well
    assert relative(fused, plain) <= 1e-6 and relative(fused, torch_attention) <= 1e-6
    assert 1e-5 <= relative(fused, exact) <= 1e-2
    assert new_cache(model, 1, 4).layers[0][0].dtype == torch.bfloat16


def test_a_padding_query_sees_its_own_slot(steps):
    """As GPT._attention_mask: a query whose own slot is masked (a padding token fed to keep a
    batch in step) still sees that slot, so its softmax stays finite."""
    model = tiny_model()
    out = []
    for fused in (True, False):
        with fused_or_modules(fused):
            cache = new_cache(model, 2, 8)
            key_mask = torch.ones(2, 8, dtype=torch.bool)
            prefill(model, torch.tensor([[1, 2], [3, 4]]), cache, key_mask=key_mask)
            key_mask[1, 2] = False  # row 1's new token is padding
            out.append(model(torch.tensor([[5], [0]]), kv_cache=cache, key_mask=key_mask)[0])
    assert steps["fused"] == 2
    assert torch.isfinite(out[0]).all() and relative(out[0], out[1]) <= 1e-6


def feed_three(model, fused: bool) -> torch.Tensor:
    """fp32 logits (2, 4, V): rows feed 3 tokens each over a cache with holes in key_mask (a
    speculative verification after rolled-back proposals), logits for every position, then one step."""
    with fused_or_modules(fused):
        cache = new_cache(model, 2, 12)
        key_mask = torch.ones(2, 12, dtype=torch.bool)
        prefill(model, torch.tensor([[1, 2, 3, 4, 5], [5, 6, 7, 8, 9]]), cache, key_mask=key_mask)  # the modules
        key_mask[0, 2] = key_mask[1, 3] = False  # slots rolled back, in one row each
        positions = torch.tensor([[4, 5, 6], [4, 5, 6]])
        three, _ = model(torch.tensor([[9, 10, 11], [12, 13, 14]]), kv_cache=cache, positions=positions,
                         key_mask=key_mask)  # fmt: skip
        cache.advance(3)
        one, _ = model(torch.tensor([[15], [16]]), kv_cache=cache, positions=positions[:, -1:] + 1, key_mask=key_mask)
    return torch.cat([three, one], dim=1).float()  # (2, 4, V)


def test_several_tokens_per_row_attend_causally(steps):
    model = with_norms_shaken(tiny_model())
    fused, plain = feed_three(model, True), feed_three(model, False)
    assert steps["fused"] == 2 and fused.shape == (2, 4, 97)
    # measured: 8.3e-8 of the largest logit; the mask read with the wrong row stride 5.5e-3 away,
    # the mask ignored (rolled-back slots visible) 7.9e-1, the head on each row's first token 1.25
    assert relative(fused, plain) <= 1e-6
    bf16 = model.to(torch.bfloat16)
    fused, plain, exact = (
        feed_three(bf16, True),
        feed_three(bf16, False),
        feed_three(copy.deepcopy(bf16).float(), False),
    )
    # as for a prompt (SDPA rounds inside attention): measured fused 3.25e-3, modules 3.25e-3 from fp32
    assert relative(fused, exact) <= 1.5 * relative(plain, exact)


def test_default_paths_take_it(tmp_path, steps):
    model = tiny_model()
    model.save_pretrained(tmp_path / "hf")
    generate(type(model).from_pretrained(str(tmp_path / "hf")), [[1, 2, 3]], 4, temperature=0)
    assert steps["fused"] == 4  # the prompt and each decoding step: one C call each
    generate(type(model).from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16), [[1, 2, 3]], 4)
    assert steps["fused"] == 8
    generate(model, [list(range(1, kernels.MAX_ROWS + 2))], 2)  # a prompt for the GEMMs, then one step
    assert steps["fused"] == 9


@needs_int
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_default_path_takes_it(mode, steps):
    model = quantize_model(tiny_model(n_embd=128, n_head=4), mode, group_size=32)
    generate(model, [[1, 2, 3]], 4, temperature=0.8, top_k=5, seed=0)
    assert steps["fused"] == 4


def test_decoding_steps_skip_the_forward_with_its_logits(steps):
    """generate's steps after the prompt go to C before the model's forward (fused_step.decode),
    with the bits the forward's own C call gives: one row at the slots' positions, and a
    left-padded batch at its own positions under a key mask."""
    model = with_norms_shaken(tiny_model())
    for prompts in ([[5, 6, 7]], PROMPTS):
        early, forward = decode_logits(model, 5, prompts), decode_logits(model, 5, prompts, early=False)
        assert torch.equal(early, forward)  # measured: the same bits
        assert relative(early, decode_logits(model, 5, prompts, fused=False)) <= 1e-6  # measured 0.9-1.8e-7
    assert steps["early"] == 2 * 5  # every step: the prompt's C call checked the model's plan


@pytest.mark.parametrize(
    "tokens, positions, message",
    [
        ([97], None, "token id 97 outside the vocabulary"),
        ([-1], None, "token id -1 outside the vocabulary"),
        ([3], [32], "position 32 exceeds block_size 32"),
        ([3], [-1], "position -1 is negative"),
    ],
    ids=["id-past-vocabulary", "negative-id", "position-past-table", "negative-position"],
)
def test_a_step_out_of_range_is_a_value_error(tokens, positions, message, steps):
    """C checks a step's ids and positions (fused_step.decode skips the model's checks): out of
    range, it declines and the model's forward raises, the cache where it was."""
    model = tiny_model()  # vocabulary 97, block_size 32
    with torch.no_grad():
        cache = new_cache(model, 1, 8)
        prefill(model, torch.tensor([[1, 2, 3]]), cache)
        decode_step(model, torch.tensor([4]), cache)
        assert steps["early"] == 1
        with pytest.raises(ValueError, match=message):
            decode_step(
                model, torch.tensor(tokens), cache, positions=None if positions is None else torch.tensor(positions)
            )
    assert cache.pos == 4 and steps["early"] == 1


def test_decode_step_records_no_autograd():
    """decode_step runs without autograd whatever the grad mode: in C once a step ran there, else
    through the modules with no graph."""
    model = tiny_model()
    cache = new_cache(model, 1, 8)
    with torch.no_grad():
        prefill(model, torch.tensor([[1, 2]]), cache)
    for token in (3, 4):
        assert not decode_step(model, torch.tensor([token]), cache).requires_grad


def test_declines_what_it_cannot_run(steps):
    model = tiny_model()
    with kernels.use_kernels(False):
        generate(model, [[1, 2]], 3, temperature=0)
    generate(model, [[1, 2]] * (fused_step.FLOAT_STEP_ROWS[torch.float32] + 1), 3, temperature=0)  # the GEMMs
    assert steps["fused"] == 0
    generate(tiny_model().half(), [[1, 2]], 3, temperature=0)  # fp16: the modules (PyTorch's kernels)
    wide_heads = tiny_model(n_embd=288, n_head=1)  # head size 288, past the C attention's 256
    with kernels.use_kernels(False):
        plain = generate(wide_heads, [[1, 2]], 3, temperature=0)
    assert generate(wide_heads, [[1, 2]], 3, temperature=0) == plain  # and not a MemoryError from C
    int8_weight_only = quantize_model(tiny_model(), "int8", activations="float")
    generate(int8_weight_only, [[1, 2]], 3, temperature=0)  # a layer without gptlab's kernel
    odd = tiny_model(n_inner=64)
    odd.config = dataclasses.replace(odd.config, n_inner=96)  # a config that misdescribes the layers
    generate(odd, [[1, 2]], 3, temperature=0)  # C would size its buffers by the config
    assert steps["fused"] == 0 and steps["declined"] == 12


def test_hooks_still_run(steps):
    model = tiny_model()
    seen = []
    handle = model.transformer.h[1].mlp.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    generate(model, [[1, 2, 3]], 4, temperature=0)
    assert len(seen) == 4 and steps["declined"] == 4  # the prompt and three decoding steps, all through the modules
    handle.remove()
    generate(model, [[1, 2, 3]], 4, temperature=0)
    assert steps["fused"] == 4


def test_a_hook_registered_while_decoding_runs_at_the_next_step(steps):
    model = tiny_model()
    seen = []
    with torch.no_grad():
        cache = new_cache(model, 1, 8)
        prefill(model, torch.tensor([[1, 2, 3]]), cache)
        handle = model.transformer.wte.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        decode_step(model, torch.tensor([4]), cache)
        handle.remove()
        decode_step(model, torch.tensor([5]), cache)
    assert seen == [(1, 1, 32)] and steps["declined"] == 1 and steps["fused"] == 2


def test_steps_trust_the_plan_checked_at_their_prompt(steps):
    """One-token steps over a cache reuse the plan its prompt checked (a full check costs ~0.4 ms
    a step); a module swapped meanwhile is seen from the next prompt on."""
    model = tiny_model()
    swapped = nn.Linear(32, 128)
    with torch.no_grad():
        cache = new_cache(model, 1, 8)
        prefill(model, torch.tensor([[1, 2, 3]]), cache)
        first = cache.checked_plan
        model.transformer.h[0].mlp.c_fc = swapped
        decode_step(model, torch.tensor([4]), cache)
        assert cache.checked_plan is first  # trusted
        cache = new_cache(model, 1, 8)
        logits = prefill(model, torch.tensor([[1, 2, 3]]), cache)
    assert cache.checked_plan is not first and cache.checked_plan.current()
    with fused_or_modules(False):
        plain = prefill(model, torch.tensor([[1, 2, 3]]), new_cache(model, 1, 8))
    assert relative(logits, plain) <= 1e-6  # measured 2.2e-7 (avx2), 2.7e-7 (portable): the new layer read
    assert steps["fused"] == 3


def test_autograd_is_never_bypassed():
    model = tiny_model()
    cache = new_cache(model, 1, 8)
    prefill(model, torch.tensor([[1, 2]]), cache)
    logits, _ = model(torch.tensor([[3]]), kv_cache=cache)  # grad mode: the modules, with a graph
    assert logits.requires_grad


def test_changed_models_are_described_again(steps):
    """Training in place, reassigned data and swapped modules all reach the next generation."""
    torch.manual_seed(0)
    model = tiny_model().to(torch.bfloat16)
    decode_logits(model)  # describes the model
    with torch.no_grad():
        for block in model.transformer.h:
            block.ln_2.weight.mul_(3.0)  # in place: read as it is
            block.attn.c_proj.bias.add_(0.5)
    assert relative(decode_logits(model), decode_logits(model, fused=False)) <= 1e-3
    # fp32 from here: measured 2.5e-6 of the largest logit (the scaled norms amplify the rounding)
    model.float()  # .data reassigned, now fp32
    assert relative(decode_logits(model), decode_logits(model, fused=False)) <= 1e-5
    model.transformer.h[0].mlp.c_fc = nn.Linear(32, 128)  # a swapped module
    assert relative(decode_logits(model), decode_logits(model, fused=False)) <= 1e-5
    if INT_OK:
        model = tiny_model(n_embd=128, n_head=4)
        decode_logits(model)
        quantize_model(model, "int4", group_size=32)  # every linear layer swapped
        fused, plain = decode_logits(model), decode_logits(model, fused=False)
        assert relative(fused, plain) <= 2e-6
    assert steps["declined"] == 0


def test_a_new_cache_is_bound_afresh(steps):
    """Each layer's keys and values are looked up again when any cache tensor changes: here the
    keys stay and only the values are new (a stale value pointer would write freed memory)."""
    model = tiny_model()
    with torch.no_grad():
        first = new_cache(model, 1, 8)
        prefill(model, torch.tensor([[1, 2]]), first)
        second = new_cache(model, 1, 8)
        second.layers = [(k, v.clone()) for k, v in first.layers]
        second.pos = first.pos
        decode_step(model, torch.tensor([3]), second)
    assert steps["fused"] == 2
    for (k1, v1), (k2, v2) in zip(first.layers, second.layers, strict=True):
        assert k2 is k1 and v2[:, :, 2].abs().sum() > 0 and torch.equal(v1[:, :, 2], torch.zeros_like(v1[:, :, 2]))


def test_a_cache_whose_layers_change_in_place_is_bound_afresh(steps):
    """The pointers remembered on a cache hold while its `layers` hold the same (k, v) pairs: a pair
    replaced in the same list is looked up again at the next step (not written through the old one)."""
    model = tiny_model()
    with torch.no_grad():
        cache = new_cache(model, 1, 8)
        prefill(model, torch.tensor([[1, 2]]), cache)
        decode_step(model, torch.tensor([3]), cache)  # slot 2; the pointers are remembered
        old_k, old_v = cache.layers[1]
        cache.layers[1] = (old_k.clone(), old_v.clone())
        decode_step(model, torch.tensor([4]), cache)  # slot 3
    assert steps["fused"] == 3
    new_k, new_v = cache.layers[1]
    assert new_k[:, :, 3].abs().sum() > 0 and new_v[:, :, 3].abs().sum() > 0
    assert not old_k[:, :, 3].any() and not old_v[:, :, 3].any()


def test_the_servers_batches_take_it(steps):
    """`gptlab serve`'s scheduler: rows joining a right-aligned shared cache, then one step for all."""
    from gptlab.serve.scheduler import BatchCache

    model = with_norms_shaken(tiny_model())
    out = []
    for fused in (True, False):
        with fused_or_modules(fused):
            batch = BatchCache(model, 4, 32)
            batch.prefill([1, 2, 3, 4], 1, False)
            batch.prefill([5, 6], 2, False)  # two samples of a shorter prompt, left of it padding
            out.append(batch.step(torch.tensor([7, 8, 9])).float())  # (3, V)
    assert steps["fused"] == 3
    assert relative(out[0], out[1]) <= 1e-6  # measured 2.1e-7


def test_a_model_made_in_inference_mode():
    """Inference tensors have no version counter; the plan reads only their pointers."""
    with torch.inference_mode():
        model = tiny_model().to(torch.bfloat16)
        inside = generate(model, [[1, 2, 3]], 6, temperature=0)
    assert generate(model, [[1, 2, 3]], 6, temperature=0) == inside


def test_threads_decode_with_one_model_and_their_own_caches(steps):
    import threading

    model = tiny_model()
    prompts = [[[i + 1, i + 2, i + 3]] for i in range(4)]
    alone = [generate(model, p, 24, temperature=0) for p in prompts]
    together = [None] * len(prompts)

    def run(i):
        for _ in range(5):
            out = generate(model, prompts[i], 24, temperature=0)
            together[i] = out if together[i] in (None, out) else "differs"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone and steps["fused"] == 4 * 24 + 4 * 5 * 24
