"""gptlab.patching: batched activation patching against a loop of single patches, attribution
patching against the metric's directional derivative, ablation."""

import json

import pytest
import torch

from conftest import tiny_model
from gptlab.patching import ablate, activation_patching, activation_patching_loop, attribution_patching, logit_diff

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def setup():
    model = tiny_model(n_layer=3, n_head=4, n_embd=32)
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(0, model.config.vocab_size, (1, 6), generator=g)
    corrupt = clean.clone()
    corrupt[0, [1, 3]] = torch.randint(0, model.config.vocab_size, (2,), generator=g)  # two tokens differ
    return model, clean, corrupt, logit_diff(7, 11)


@pytest.mark.parametrize("over", ["layer-pos", "layer-head"])
def test_the_batched_grid_equals_a_loop_of_single_patches(setup, over):
    model, clean, corrupt, metric = setup
    result = activation_patching(model, clean, corrupt, metric, over=over)
    loop = activation_patching_loop(model, clean, corrupt, metric, over=over)
    assert result["grid"].shape == (3, 6 if over == "layer-pos" else 4)
    torch.testing.assert_close(result["grid"], loop, rtol=0, atol=1e-5)  # measured: 1e-7 apart
    if over == "layer-pos":  # layer 0, positions the prompts share: nothing to patch
        torch.testing.assert_close(
            result["grid"][0, [0, 2, 4, 5]], torch.full((4,), result["corrupt"]), atol=1e-5, rtol=0
        )
        assert abs(result["grid"][0, 1] - result["corrupt"]) > 1e-4
    assert result["clean"] != result["corrupt"]


@pytest.mark.parametrize("over", ["layer-pos", "layer-head"])
def test_attribution_is_the_metrics_derivative_towards_the_clean_activation(setup, over):
    """Each cell: d/d alpha of the metric with the activation moved alpha of the way from
    corrupted to clean, at alpha 0 (central differences, alpha 1e-2; measured 1e-5 apart)."""
    model, clean, corrupt, metric = setup
    attribution = attribution_patching(model, clean, corrupt, metric, over=over)
    _, cache_clean = model.run_with_cache(clean)
    _, cache_corrupt = model.run_with_cache(corrupt)
    name_of = lambda layer: f"blocks.{layer}.{'hook_resid_pre' if over == 'layer-pos' else 'attn.hook_z'}"
    for layer, unit in [(0, 1), (1, 3), (2, 2)]:
        name = name_of(layer)
        step = torch.zeros_like(cache_clean[name])
        index = (slice(None), unit) if over == "layer-pos" else (slice(None), slice(None), unit)
        step[index] = (cache_clean[name] - cache_corrupt[name])[index]

        def moved(alpha, name=name, step=step):
            hook = lambda x, _: x + alpha * step
            with torch.no_grad():
                return float(metric(model.run_with_hooks(corrupt, fwd_hooks=[(name, hook)]))[0])

        derivative = (moved(1e-2) - moved(-1e-2)) / 2e-2
        assert attribution[layer, unit].item() == pytest.approx(derivative, rel=1e-3, abs=1e-4), (layer, unit)
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())


def test_a_model_in_training_is_patched_without_dropout_and_left_training():
    """A model in training (a loop's, a fresh GPT with dropout) was patched and ablated through its
    dropout: another grid on every call, and attribution's clean activations dropped out too."""
    model = tiny_model(n_layer=3, n_head=4, n_embd=32, dropout=0.5).eval()
    clean = torch.tensor([[5, 9, 2, 7, 1, 3]])
    corrupt = torch.tensor([[5, 8, 2, 6, 1, 3]])
    metric = logit_diff(7, 11)
    calls = {
        "activation": lambda: activation_patching(model, clean, corrupt, metric)["grid"],
        "attribution": lambda: attribution_patching(model, clean, corrupt, metric, over="layer-head"),
        "ablation": lambda: ablate(model, clean, "blocks.1.hook_mlp_out", how="mean"),
    }
    expected = {name: call() for name, call in calls.items()}
    model.train()
    for name, call in calls.items():
        torch.manual_seed(0)  # dropout's draws, were they made
        torch.testing.assert_close(call(), expected[name], rtol=0, atol=0, msg=name)  # measured: equal
        assert model.training, name


def test_zero_and_mean_ablation(setup):
    model, clean, _, _ = setup
    zeroed = ablate(model, clean, "blocks.1.attn.hook_z", head=2)

    def by_hand(z, _):
        z[:, :, 2] = 0
        return z

    torch.testing.assert_close(zeroed, model.run_with_hooks(clean, fwd_hooks=[("blocks.1.attn.hook_z", by_hand)]))
    _, cache = model.run_with_cache(clean)
    mean = cache["blocks.1.hook_mlp_out"].mean(dim=(0, 1))  # (C,)
    meaned = ablate(model, clean, "blocks.1.hook_mlp_out", how="mean")
    replaced = model.run_with_hooks(clean, fwd_hooks=[("blocks.1.hook_mlp_out", lambda x, _: mean.expand_as(x))])
    torch.testing.assert_close(meaned, replaced)
    with pytest.raises(ValueError, match="how must be zero or mean"):
        ablate(model, clean, "blocks.1.hook_mlp_out", how="median")
    with pytest.raises(ValueError, match=r"head must be in \[0, 4\)"):  # was torch's IndexError
        ablate(model, clean, "blocks.1.attn.hook_z", head=4)
    with pytest.raises(ValueError, match="blocks.1.hook_mlp_out has no head axis"):  # zeroed channel 2 silently
        ablate(model, clean, "blocks.1.hook_mlp_out", head=2)
    torch.testing.assert_close(ablate(model, clean, "blocks.1.attn.hook_z", head=-2), zeroed)  # head 2 of 4
    pattern = ablate(model, clean, "blocks.1.attn.hook_pattern", head=2)  # (B, nh, T, T): its head axis is 1
    by_hand = model.run_with_hooks(
        clean, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, _: p.index_fill(1, torch.tensor([2]), 0.0))]
    )
    torch.testing.assert_close(pattern, by_hand)  # it zeroed query position 2 of every head
    # an attention point's mean is over the batch alone, per head: it was over the batch and heads
    other = torch.randint(0, model.config.vocab_size, (3, clean.size(1)), generator=torch.Generator().manual_seed(5))
    _, cache = model.run_with_cache(other, names_filter="blocks.1.attn.hook_pattern")
    mean = cache["blocks.1.attn.hook_pattern"].mean(dim=0)  # (nh, T, T)

    def head_2_by_hand(p, _):
        p = p.clone()
        p[:, 2] = mean[2]
        return p

    meaned = ablate(model, clean, "blocks.1.attn.hook_pattern", head=2, how="mean", mean_over=other)
    expected = model.run_with_hooks(clean, fwd_hooks=[("blocks.1.attn.hook_pattern", head_2_by_hand)])
    torch.testing.assert_close(meaned, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="must be as long"):  # was torch's expand error
        ablate(model, clean, "blocks.1.attn.hook_pattern", how="mean", mean_over=other[:, :-1])


def test_prompts_of_different_lengths_are_refused(setup):
    model, clean, _, metric = setup
    with pytest.raises(ValueError, match="same length"):
        activation_patching(model, clean, clean[:, :4], metric)


def test_a_metric_without_a_value_per_row_is_refused_up_front(setup):
    """TransformerLens metrics often end in .mean(): a scalar gives no value per patched run. It
    was an IndexError ("invalid index of a 0-dim tensor") after the whole grid had run."""
    model, clean, corrupt, metric = setup
    calls = []

    def scalar(logits):
        calls.append(logits.size(0))
        return metric(logits).mean()

    for patching in (activation_patching, activation_patching_loop):
        calls.clear()
        with pytest.raises(ValueError, match=r"one value per row, shape \(1,\), got \(\)"):
            patching(model, clean, corrupt, scalar)
        assert calls == [1], patching.__name__  # refused at the first (clean) run, before the grid


def test_gptlab_patch_writes_the_grids_and_checks_its_prompts(tmp_path, capsys):
    from gptlab.cli import main

    clean = "When Mary and John went to the store, John gave a drink to"
    corrupt = "When Mary and John went to the store, Mary gave a drink to"
    out, png = tmp_path / "grid.json", tmp_path / "grid.png"

    def patch(clean=clean, corrupt=corrupt, answers=(" Mary", " John"), *extra):
        return main(["patch", "--model", "preset:gpt2-tiny", "--clean", clean, "--corrupt", corrupt,
                     "--answers", *answers, *extra])  # fmt: skip

    assert patch(clean, corrupt, (" Mary", " John"), "--out", str(png), "--json", str(out)) in (0, None)
    data = json.loads(out.read_text())
    assert data["columns"][9] == " John" and len(data["grid"]) == 2 and len(data["attribution"][0]) == 14
    # layer 0 before the block: patching the one differing position restores the clean run exactly
    assert data["normalized"][0] == pytest.approx([1.0 if p == 9 else 0.0 for p in range(14)], abs=1e-4)
    assert png.stat().st_size > 0 and "patched (layer-pos)" in capsys.readouterr().out
    # <|endoftext|> as an answer is the token, as in the prompts (it was 7 tokens, refused)
    assert patch(clean, corrupt, (" Mary", "<|endoftext|>"), "--json", str(out)) in (0, None)
    assert json.loads(out.read_text())["clean"] != data["clean"]
    assert patch(answers=(" Mary Ann", " John")) == 2
    assert "each answer must be one token" in capsys.readouterr().err
    assert patch(corrupt="When") == 2
    assert "must be as long" in capsys.readouterr().err
    # an empty prompt, one answer twice, and prompts that do not change the answer: clear errors
    # (were a float-tensor error, and grids of zeros printed as results)
    for kwargs, message in [(dict(clean="", corrupt=""), "prompt is empty: give some text with --clean"),
                            (dict(answers=(" Mary", " Mary")), "same token"),
                            (dict(corrupt=clean), "same logit difference")]:  # fmt: skip
        assert patch(**kwargs) == 2
        assert message in capsys.readouterr().err
