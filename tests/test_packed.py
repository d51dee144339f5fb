"""Prepacked (oneDNN) linear layers: same outputs as nn.Linear, exact round trips, inference only."""

import pytest
import torch

from conftest import VARIANTS, tiny_model
from gptlab.generation import decode_step, generate, left_pad, new_cache, prefill
from gptlab.packed import PackedLinear, can_pack, is_packed, maybe_pack, pack_linears, unpack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")


def packed_copy(seed=0, **overrides):
    return pack_linears(tiny_model(seed, **overrides))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_forward_matches_linear(variant):
    plain, packed = tiny_model(**VARIANTS[variant]), packed_copy(**VARIANTS[variant])
    assert is_packed(packed) and not is_packed(plain)
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())  # the head too
    idx = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(idx)[0], plain(idx)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_packed_cached_decoding_matches_full_forward(pos):
    """Left-padded batch through the packed model's KV cache vs each row alone, unpacked, no cache."""
    plain, packed = tiny_model(pos_embedding=pos), packed_copy(pos_embedding=pos)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (4, 9)]
    idx, positions, key_mask = left_pad(rows)
    cache = new_cache(packed, 2, 24)
    logits = prefill(packed, idx, cache, positions=positions, key_mask=key_mask)
    positions = positions[:, -1]  # (B,) each row's last position
    with torch.no_grad():
        for _ in range(8):
            reference = torch.cat([plain(torch.tensor([r]))[0][:, -1] for r in rows])  # (B, V)
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
            token = logits.argmax(-1)  # (B,)
            rows = [r + [int(t)] for r, t in zip(rows, token, strict=True)]
            positions = positions + 1
            key_mask = torch.cat([key_mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
            logits = decode_step(packed, token, cache, positions=positions, key_mask=key_mask)


def test_packed_greedy_generation_equals_plain():
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
    assert generate(packed_copy(), prompts, 12, temperature=0) == generate(tiny_model(), prompts, 12, temperature=0)


@pytest.mark.parametrize("variant", ["gpt2", "nobias-untied"])
def test_unpack_restores_the_exact_weights_and_the_tie(variant):
    plain = tiny_model(**VARIANTS[variant])
    model = unpack_linears(packed_copy(**VARIANTS[variant]))
    assert not is_packed(model)
    before, after = plain.state_dict(), model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    tied = model.lm_head.weight is model.transformer.wte.weight
    assert tied == plain.config.tie_weights


def test_packed_state_dict_and_save_keep_every_weight(tmp_path):
    from gptlab.checkpoint import load_model, save_model

    plain, packed = tiny_model(), packed_copy()
    state = packed.state_dict()
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    save_model(packed, tmp_path / "ckpt", tokenizer="bytes")
    loaded = load_model(str(tmp_path / "ckpt"))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_packed_model_refuses_to_train():
    model = packed_copy().requires_grad_(True)  # the biases and norms would want gradients
    with pytest.raises(RuntimeError, match="inference"):
        model(torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]]))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def test_what_cannot_be_packed_is_said_and_left_alone():
    half = tiny_model().to(torch.float16)
    ok, why = can_pack(half)
    assert not ok and "float16" in why
    with pytest.raises(ValueError, match="float16"):
        pack_linears(half)
    assert maybe_pack(half) is half and not is_packed(half)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 in oneDNN here")
def test_packed_bf16_matches_bf16_linear():
    plain = tiny_model().to(torch.bfloat16)
    packed = pack_linears(tiny_model().to(torch.bfloat16))
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.packed.dtype == torch.bfloat16
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(idx)[0].float(), plain(idx)[0].float(), atol=2e-2, rtol=2e-2)


def test_compiled_decode_step_on_a_packed_model():
    from gptlab.generation import compile_decode

    model, prompts = packed_copy(pos_embedding="rope"), [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
    step = compile_decode(model)
    compiled = generate(model, prompts, 8, temperature=0, compiled_step=step)
    assert compiled == generate(tiny_model(pos_embedding="rope"), prompts, 8, temperature=0)


def test_packed_and_quantized_models_count_the_parameters_they_stand_for():
    from gptlab.quantize import quantize_model

    plain = tiny_model()
    for model in (packed_copy(), quantize_model(tiny_model(), "int8"), quantize_model(tiny_model(), "int4", 32)):
        assert model.num_params() == plain.num_params()
        assert model.num_params(non_embedding=True) == plain.num_params(non_embedding=True)
        assert model.param_breakdown() == plain.param_breakdown()


def test_packed_model_loads_state_dicts_copies_and_names_dtype_mistakes():
    import copy

    model, other = packed_copy(), tiny_model(seed=1)
    model.load_state_dict(other.state_dict())
    idx = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], other(idx)[0], atol=1e-5, rtol=1e-5)
        twin = copy.deepcopy(model)
        assert is_packed(twin) and torch.equal(twin(idx)[0], model(idx)[0])
    bad = {k: v[:, :-1] if k == "lm_head.weight" else v for k, v in other.state_dict().items()}
    with pytest.raises(RuntimeError, match="size mismatch for lm_head.weight"):
        model.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Missing key.*c_fc.weight"):
        model.load_state_dict({k: v for k, v in other.state_dict().items() if not k.endswith("c_fc.weight")})
    model.to(torch.bfloat16)  # converts the dense tensors, not the packed ones
    with torch.no_grad(), pytest.raises(ValueError, match="unpack_linears"):
        model(idx)
