import json

import pytest

from gptlab.config import PRESETS, GPTConfig


def test_defaults_are_gpt2_small():
    c = GPTConfig()
    assert (c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd) == (50257, 1024, 12, 12, 768)
    assert c.is_gpt2 and c.mlp_hidden == 3072


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_dict_and_json(name):
    c = GPTConfig.from_name(name)
    assert GPTConfig.from_dict(c.to_dict()) == c
    assert GPTConfig.from_json(c.to_json()) == c
    json.loads(c.to_json())


def test_llama_preset_combines_variants():
    c = GPTConfig.from_name("llama-tiny")
    assert (c.pos_embedding, c.norm, c.mlp, c.bias, c.tie_weights) == ("rope", "rmsnorm", "swiglu", False, False)
    assert not c.is_gpt2 and c.not_gpt2 == ["RoPE positions", "RMSNorm", "SwiGLU MLP"]
    # an untied head and the exact GELU export to GPT2LMHeadModel: GPT-2 (is_gpt2 said not)
    assert GPTConfig(tie_weights=False).is_gpt2 and GPTConfig(mlp="gelu_erf").is_gpt2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_embd=100, n_head=12), "n_embd"),
        (dict(n_layer=0), "n_layer"),
        (dict(vocab_size=-5), "vocab_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(norm="batchnorm"), "norm"),
        (dict(mlp="relu"), "mlp"),
        (dict(pos_embedding="alibi"), "pos_embedding"),
        (dict(dropout=1.5), "dropout"),
        (dict(layer_norm_eps=0), "layer_norm_eps"),
        (dict(layer_norm_eps="1e-5"), "layer_norm_eps"),  # a string from a hand-edited config: was a TypeError
        (dict(bias="no"), "bias"),  # was taken as true
        (dict(labels=3, num_labels=3), "labels"),
        (dict(pos_embedding="rope", rope_theta=-1.0), "rope_theta"),  # NaN angles: NaN or wrong logits
        (dict(pos_embedding="rope", rope_theta=float("nan")), "rope_theta"),
        (dict(n_inner=True), "n_inner"),  # was a 1-wide MLP
        (dict(layer_norm_eps=float("inf")), "layer_norm_eps"),  # every norm's output was its bias
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_unknown_preset_and_field():
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        GPTConfig.from_name("gpt5")
    with pytest.raises(ValueError, match="n_embed"):
        GPTConfig.from_dict({"n_embed": 10})
