import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import VARIANTS, tiny_config, tiny_model
from gptlab.config import GPTConfig
from gptlab.data import IGNORE
from gptlab.model import GPT, apply_rope, rope_cos_sin


@pytest.mark.parametrize(
    "name, expected",
    [("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)],
)
def test_openai_parameter_counts(name, expected):
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name(name))
    assert model.num_params() == expected
    assert model.num_params(non_embedding=True) == expected - model.config.block_size * model.config.n_embd


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_breakdown_sums_to_total(variant):
    model = tiny_model(**VARIANTS[variant])
    rows = model.param_breakdown()
    assert sum(r["params"] for r in rows) == model.num_params()
    head = rows[-1]
    assert ("tied" in head["note"]) == model.config.tie_weights


def test_gpt2_initialisation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=1000, block_size=64))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    scaled = 0.02 / math.sqrt(2 * 4)
    assert abs(model.transformer.h[0].attn.c_proj.weight.std().item() - scaled) < 0.001
    assert abs(model.transformer.h[0].mlp.c_proj.weight.std().item() - scaled) < 0.001
    assert model.transformer.h[0].attn.c_attn.bias.abs().max() == 0


@pytest.mark.parametrize(
    "config",
    [GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64), GPTConfig.from_name("gpt2")],
    ids=["small", "gpt2"],
)
def test_initial_loss_near_log_vocab(config):
    torch.manual_seed(0)
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 65))
    with torch.no_grad():
        _, loss = model(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.25


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx = torch.randint(0, 97, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.1:
            break
    assert loss.item() < 0.1


def test_ignore_index():
    model = tiny_model()
    idx = torch.randint(0, 97, (2, 9))
    targets = idx[:, 1:].clone()
    targets[:, :4] = IGNORE
    logits, loss = model(idx[:, :-1], targets)
    expected = F.cross_entropy(logits[:, 4:].reshape(-1, 97), targets[:, 4:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_causality(variant_model):
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    with torch.no_grad():
        a, _ = variant_model(idx)
        b, _ = variant_model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sdpa_and_explicit_paths_agree(variant_model):
    idx = torch.randint(0, 97, (3, 20))
    probs = []
    with torch.no_grad():
        fast, _ = variant_model(idx)
        explicit, _ = variant_model(idx, attn_probs=probs)
    assert (fast - explicit).abs().max() < 1e-5
    assert len(probs) == variant_model.config.n_layer
    torch.testing.assert_close(probs[0].sum(-1), torch.ones(3, 4, 20))


@pytest.mark.parametrize("padded", [False, True])
def test_bf16_decoding_attention_matches_fp32_sdpa(padded):
    """One bf16 query per row against a cache (single_query_attention, the CPU decoding path)
    agrees with fp32 SDPA to bf16 precision, with and without a padding mask."""
    from gptlab.model import single_query_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 300, 16), torch.randn(2, 4, 300, 16)
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, 300, dtype=torch.bool)
        mask[0, ..., :120] = False  # row 0 is left-padded
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (2, 4, 1, 16)
    got = single_query_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(single_query_attention(q, k, v, mask), want, atol=1e-5, rtol=1e-5)


def test_bf16_model_decodes_like_its_full_forward():
    from gptlab.generation import decode_step, new_cache, prefill

    model = tiny_model().to(torch.bfloat16)
    row = [5, 9, 2, 7, 1, 3]
    cache = new_cache(model, 1, 12)
    prefill(model, torch.tensor([row[:-1]]), cache)
    got = decode_step(model, torch.tensor([row[-1]]), cache)  # (1, V), through single_query_attention
    with torch.no_grad():
        want = model(torch.tensor([row]))[0][:, -1]  # (1, V), through SDPA
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)


def test_attention_probs_are_causal():
    model = tiny_model()
    att = model.attention(torch.randint(0, 97, (1, 12)), layer=1, head=2)  # (B, T, T)
    assert att.shape == (1, 12, 12)
    assert att.triu(diagonal=1).abs().max() == 0


def test_rope_matches_complex_rotation():
    torch.manual_seed(0)
    B, nh, T, hs, theta = 2, 3, 7, 8, 10000.0
    x = torch.randn(B, nh, T, hs)
    positions = torch.arange(5, 5 + T).expand(B, T)
    cos, sin = rope_cos_sin(positions, hs, theta, torch.float32)
    got = apply_rope(x, cos, sin)
    # Direct formula: pair i is (x_i, x_{i+hs/2}) as a complex number, rotated by pos * theta^(-2i/hs).
    freqs = theta ** (-torch.arange(0, hs // 2, dtype=torch.float64) * 2 / hs)
    angle = torch.arange(5, 5 + T, dtype=torch.float64)[:, None] * freqs  # (T, hs/2)
    z = torch.complex(x[..., : hs // 2].double(), x[..., hs // 2 :].double()) * torch.polar(
        torch.ones_like(angle), angle
    )
    expected = torch.cat([z.real, z.imag], dim=-1).float()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_rope_model_uses_no_position_table():
    model = tiny_model(pos_embedding="rope")
    assert "wpe" not in model.transformer


def test_rmsnorm_matches_formula():
    model = tiny_model(norm="rmsnorm")
    norm = model.transformer.h[0].ln_1
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 32)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + model.config.layer_norm_eps) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_swiglu_matches_formula():
    model = tiny_model(mlp="swiglu", bias=False)
    mlp = model.transformer.h[0].mlp
    hidden = model.config.mlp_hidden
    w_gate, w_up = mlp.c_fc.weight[:hidden], mlp.c_fc.weight[hidden:]
    x = torch.randn(2, 5, 32)
    expected = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ mlp.c_proj.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_gelu_mlp_matches_formula():
    model = tiny_model()
    mlp = model.transformer.h[0].mlp
    x = torch.randn(2, 5, 32)
    h = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
    gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    torch.testing.assert_close(mlp(x), gelu @ mlp.c_proj.weight.T + mlp.c_proj.bias)


@pytest.mark.parametrize(
    "idx, message",
    [
        (torch.zeros(1, 33, dtype=torch.long), "exceeds the context length"),
        (torch.zeros(1, 0, dtype=torch.long), "T >= 1"),
        (torch.zeros(0, 4, dtype=torch.long), "empty batch, shape \\(0, 4\\)"),  # was min()'s RuntimeError
        (torch.zeros(1, 4), "integer tensor"),
        (torch.full((1, 4), 97), "outside the vocabulary"),
        (torch.full((1, 4), -1), "outside the vocabulary"),
        (torch.tensor([[1, 96, 97, 2]]), "token id 97 outside the vocabulary"),  # among good ids
        (torch.tensor([[3, -1, 2, 96]]), "token id -1 outside the vocabulary"),
        (torch.zeros(4, dtype=torch.long), "shape"),
    ],
    ids=[
        "too-long",
        "empty",
        "empty-batch",
        "float",
        "too-big-id",
        "negative-id",
        "one-id-too-big",
        "one-id-negative",
        "1d",
    ],
)
def test_bad_input_is_a_value_error(model, idx, message):
    with pytest.raises(ValueError, match=message):
        model(idx)


def test_a_position_past_block_size_is_a_value_error(model):
    """Positions given with the ids (left-padded batches) are checked too: one past the table."""
    positions = torch.tensor([[0, 1, 32, 2]])  # block_size 32: position 32 has no embedding
    with pytest.raises(ValueError, match="position 32 exceeds block_size 32"):
        model(torch.zeros(1, 4, dtype=torch.long), positions=positions)


def test_attention_index_errors(model):
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        model.attention(idx, layer=5)
    with pytest.raises(ValueError, match="head 4 out of range"):
        model.attention(idx, layer=0, head=4)


def test_gelu_erf_mlp_is_the_exact_gelu_and_survives_a_native_round_trip(tmp_path):
    from conftest import tiny_model
    from gptlab.checkpoint import save_model
    from gptlab.loading import load_model

    exact, approx = tiny_model(mlp="gelu_erf"), tiny_model()
    x = torch.randn(1, 3, 32) * 3
    mlp_exact, mlp_approx = exact.transformer.h[0].mlp, approx.transformer.h[0].mlp
    with torch.no_grad():
        h = mlp_exact.c_fc(x)
        assert torch.equal(mlp_exact(x), mlp_exact.c_proj(torch.nn.functional.gelu(h)))
        assert not torch.equal(mlp_approx(x), mlp_exact(x))  # same init seed: only the GELU differs
    save_model(exact, tmp_path / "m")
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(load_model(str(tmp_path / "m"))(idx)[0], exact(idx)[0])


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_head_false_returns_what_the_head_reads(variant):
    model = tiny_model(**VARIANTS[variant])
    idx = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        logits, _ = model(idx)
        hidden, _ = model(idx, head=False)  # (2, 9, C)
        assert hidden.shape == (2, 9, model.config.n_embd)
        torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a loss"):
        model(idx, targets=idx, head=False)


def test_models_built_on_meta_skip_random_init_and_never_import_dynamo(tmp_path):
    """meta_device() builds shapes without running torch.nn.init's random initializers on meta
    tensors, whose torch._refs path imports torch._dynamo (~0.8 s of every command that loads a
    model); tensors on a real device are initialized as usual, and the initializers come back."""
    from gptlab.checkpoint import save_model
    from gptlab.meta import meta_device

    save_model(GPT(tiny_config()), tmp_path / "m")
    code = (
        "import sys, torch\n"
        "from gptlab import load_model\n"
        "from gptlab.config import GPTConfig\n"
        "from gptlab.meta import meta_device\n"
        "from gptlab.model import GPT\n"
        "with meta_device():\n"
        "    GPT(GPTConfig.from_name('gpt2'))\n"
        f"load_model({str(tmp_path / 'm')!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    before = torch.nn.init.normal_
    real = torch.zeros(1000)
    with meta_device():
        torch.nn.init.normal_(real)
        built = nn.Linear(4, 3)
    assert real.std() > 0.9 and built.weight.is_meta  # a real tensor still drawn; the layer on meta
    assert torch.nn.init.normal_ is before


def _rows_into_last_mlp(model) -> list[int]:
    """Wrap the last block's c_fc (not a hook: hooks turn the trim off) to record its rows."""
    c_fc = model.transformer.h[-1].mlp.c_fc
    rows, forward = [], c_fc.forward
    c_fc.forward = lambda x: (rows.append(x.shape[:-1].numel()), forward(x))[1]
    return rows


@pytest.mark.parametrize("padded", [False, True])
def test_a_prompts_last_layer_runs_the_last_position_only(variant_model, padded):
    """last_only: the last block computes every position's keys and values but the rest for the last
    position only (as llama.cpp's graphs); logits and cache as the full forward's, hooks see all."""
    from gptlab.generation import new_cache

    model, (B, T) = variant_model, (2, 12)
    idx = torch.randint(0, 97, (B, T))
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[0, :5] = not padded  # row 0 left-padded by 5 when padded
    positions = (key_mask.cumsum(1) - 1).clamp(min=0)  # (B, T)
    rows = _rows_into_last_mlp(model)
    with torch.no_grad():
        full_cache, trim_cache = new_cache(model, B, T), new_cache(model, B, T)
        want, _ = model(idx, kv_cache=full_cache, positions=positions, key_mask=key_mask)  # (B, T, V)
        got, _ = model(idx, kv_cache=trim_cache, positions=positions, key_mask=key_mask, last_only=True)
    assert rows == [B * T, B]  # the full forward's, then the trimmed one's
    torch.testing.assert_close(got[:, -1], want[:, -1], rtol=0, atol=1e-6)  # measured up to 1.2e-7 (the six variants)
    for (k0, v0), (k1, v1) in zip(full_cache.layers, trim_cache.layers, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    seen = []
    model.transformer.h[-1].hook_mlp_out.add_hook(lambda x, hook: seen.append(x.size(1)))
    with torch.no_grad():
        hooked, _ = model(idx, positions=positions, last_only=True, kv_cache=new_cache(model, B, T), key_mask=key_mask)
    assert seen == [T] and rows[-1] == B * T  # a hook on the last block sees every position
    torch.testing.assert_close(hooked[:, -1], want[:, -1], rtol=0, atol=1e-6)


def test_a_torch_hook_on_c_fc_keeps_the_output_it_was_given():
    """The GELU runs in place over c_fc's output in inference; a plain PyTorch forward hook that
    keeps that output (collecting MLP pre-activations) read the GELU's values instead."""
    model = tiny_model()
    mlp = model.transformer.h[0].mlp
    kept = []
    mlp.c_fc.register_forward_hook(lambda module, args, out: kept.append(out))
    x = torch.randn(1, 5, 32)
    with torch.no_grad():
        mlp(x)
        expected = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
    torch.testing.assert_close(kept[0], expected)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_packed_runs_that_reuse_an_id_stay_apart(pos):
    """segments marks runs of equal ids: a later run with an earlier run's id (0, 1, 0) is its own
    example, as its positions restarting say; its queries saw the first run's keys."""
    model = tiny_model(pos_embedding=pos)
    g = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, 97, (1, n), generator=g) for n in (4, 3, 5)]
    segments = torch.tensor([[0] * 4 + [1] * 3 + [0] * 5])
    with torch.no_grad():
        packed, _ = model(torch.cat(examples, dim=1), segments=segments)
        alone = torch.cat([model(x)[0] for x in examples], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos", ["learned", "rope"])
@pytest.mark.parametrize("shape", [(1, 3), (3,)], ids=["one-row", "1d"])
def test_one_row_of_positions_serves_every_row(pos, shape):
    """positions (1, T) or (T,) broadcast over the batch, as the modules read them; the C step
    (2 rows of 3 tokens: it takes them) read B*T positions from the T given: NaN logits (rope)."""
    from gptlab.generation import new_cache

    model = tiny_model(pos_embedding=pos)
    idx = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.no_grad():
        want, _ = model(idx)
        got, _ = model(idx, kv_cache=new_cache(model, 2, 8), positions=torch.arange(3).reshape(shape))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "positions, key_mask, message",
    [
        (torch.arange(8)[None], None, r"positions must be \(B, T\) = \(2, 3\)"),  # C read its first 6
        (torch.zeros(3, 3, dtype=torch.long), None, r"positions must be \(B, T\) = \(2, 3\)"),
        (torch.arange(3.0)[None], None, "positions must be integer"),
        (None, torch.ones(2, 8), "key_mask must be a bool"),  # C read the floats' bytes as bools
        (None, torch.ones(2, 2, dtype=torch.bool), r"key_mask must be a bool \(B, S\) tensor with S >= 3"),
        (None, torch.ones(8, dtype=torch.bool), "key_mask must be a bool"),
    ],
    ids=["positions-too-long", "positions-rows", "positions-float", "mask-float", "mask-short", "mask-1d"],
)
def test_positions_and_key_mask_of_another_shape_are_value_errors(positions, key_mask, message):
    from gptlab.generation import new_cache

    model = tiny_model()
    idx = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(idx, kv_cache=new_cache(model, 2, 8), positions=positions, key_mask=key_mask)


@pytest.mark.parametrize("return_logits", [True, False])
def test_targets_with_last_only_is_a_value_error(model, return_logits):
    """last_only computes the last position alone: a loss over every position has nothing to read
    (was cross_entropy's batch-size error, or an IndexError in the chunked loss)."""
    idx = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="last_only computes the last position only: pass no targets"):
        model(idx, idx, last_only=True, return_logits=return_logits)
