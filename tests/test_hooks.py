"""gptlab.hooks: TransformerLens's hook points on gptlab's GPT, against TransformerLens 4's
TransformerBridge booted on gptlab's Hugging Face export of the same random weights."""

import pytest
import torch

from conftest import VARIANTS, tiny_model
from gptlab import fused_step, kernels
from gptlab.config import GPTConfig
from gptlab.kv_cache import KVCache
from gptlab.model import GPT

pytestmark = pytest.mark.usefixtures("one_thread")
GPT2_POINTS = {"hook_embed", "hook_pos_embed", "ln_final.hook_scale", "ln_final.hook_normalized"} | {
    f"blocks.{i}.{name}"
    for i in range(2)
    for name in (
        "hook_resid_pre",
        "ln1.hook_scale",
        "ln1.hook_normalized",
        "attn.hook_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.hook_attn_scores",
        "attn.hook_pattern",
        "attn.hook_z",
        "hook_attn_out",
        "hook_resid_mid",
        "ln2.hook_scale",
        "ln2.hook_normalized",
        "mlp.hook_pre",
        "mlp.hook_post",
        "hook_mlp_out",
        "hook_resid_post",
    )  # fmt: skip
}


@pytest.fixture(scope="module", autouse=True)
def offline():
    """The Bridge boots from local directories only: no Hub lookups."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(gptlab's model, TransformerBridge on its HF export), the same random weights."""
    from transformer_lens.model_bridge import TransformerBridge

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)  # init's ones and zeros would hide a misplaced gain or bias
    path = tmp_path_factory.mktemp("hooks") / "model"
    model.save_pretrained(path)
    bridge = TransformerBridge.boot_transformers(str(path), device="cpu")  # no compatibility mode
    return model, bridge


def test_every_hook_point_equals_transformer_bridges(pair):
    model, bridge = pair
    idx = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(1))
    logits, cache = model.run_with_cache(idx)
    theirs_logits, theirs = bridge.run_with_cache(idx)
    assert set(cache) == GPT2_POINTS  # every point fired; the rotary ones do not exist in GPT-2
    # measured: at most 4.8e-7 apart (the residual stream), logits 2.4e-7
    torch.testing.assert_close(logits, theirs_logits, rtol=0, atol=1e-5)
    for name, ours in cache.items():
        other = theirs[name]
        assert ours.shape == other.shape, name
        if name.endswith("hook_attn_scores"):  # masked: -inf here, the dtype's minimum there
            assert torch.equal(torch.isinf(ours), other == torch.finfo(other.dtype).min), name
            ours, other = ours.masked_fill(torch.isinf(ours), 0), other.masked_fill(torch.isinf(ours), 0)
        torch.testing.assert_close(ours, other, rtol=0, atol=1e-5, msg=name)


def test_a_head_ablation_gives_transformer_bridges_logits(pair):
    model, bridge = pair
    idx = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(2))

    def ablate(z, hook):
        z[:, :, 1] = 0.0  # (batch, pos, head, d_head): head 1 of layer 0
        return z

    ours = model.run_with_hooks(idx, fwd_hooks=[("blocks.0.attn.hook_z", ablate)])
    theirs = bridge.run_with_hooks(idx, fwd_hooks=[("blocks.0.attn.hook_z", ablate)])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (ours - model(idx)[0]).abs().max() > 1e-3  # the ablation changed something


@pytest.mark.parametrize("stop", [0, 1, -1, -2])
def test_stop_at_layer_returns_transformer_bridges_residual_stream(pair, stop):
    """stop_at_layer=L returns the residual stream entering block L, as the Bridge does (a
    negative L counts from the end): it returned None, and refused negative L. Block L's points
    are neither cached nor run, an edit before them is in the residual returned."""
    model, bridge = pair
    idx = torch.randint(0, 50257, (2, 7), generator=torch.Generator().manual_seed(4))
    ours, cache = model.run_with_cache(idx, stop_at_layer=stop)
    theirs, their_cache = bridge.run_with_cache(idx, stop_at_layer=stop)
    assert ours.shape == theirs.shape == (2, 7, 64)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert set(cache) == set(their_cache) & GPT2_POINTS

    def shift(x, hook):
        return x + 0.5

    edit = [(lambda name: name.endswith(("hook_resid_pre", "hook_embed")), shift)]
    ours = model.run_with_hooks(idx, fwd_hooks=edit, stop_at_layer=stop)
    theirs = bridge.run_with_hooks(idx, fwd_hooks=edit, stop_at_layer=stop)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    layer = stop % model.config.n_layer
    unedited = cache[f"blocks.{layer - 1}.hook_resid_post"] if layer else cache["hook_embed"] + cache["hook_pos_embed"]
    assert (ours - unedited).abs().max() > 0.1  # the edits before the stop were made


def test_stop_at_layer_n_layer_is_the_residual_after_the_last_block(pair):
    """As TransformerLens documents it (HookedTransformer's "the last residual stream computed"),
    stop_at_layer=n_layer runs every block, its hooks included, but not the final norm or the
    head. It was refused, as was any negative L; one past either end still is."""
    model, _ = pair
    idx = torch.randint(0, 50257, (1, 6), generator=torch.Generator().manual_seed(5))
    _, full = model.run_with_cache(idx)
    resid, cache = model.run_with_cache(idx, stop_at_layer=2)
    assert torch.equal(resid, full["blocks.1.hook_resid_post"])
    assert set(cache) == {n for n in full if not n.startswith("ln_final.")}

    def double(x, hook):
        return 2 * x

    doubled = model.run_with_hooks(idx, fwd_hooks=[("blocks.1.hook_resid_post", double)], stop_at_layer=2)
    torch.testing.assert_close(doubled, 2 * resid, rtol=0, atol=1e-6)  # unhooked patterns: the fused attention
    for bad in (3, -3, 1.5, "1"):
        with pytest.raises(ValueError, match=r"stop_at_layer must be an integer in \[-2, 2\] \(2 blocks\)"):
            model.run_with_cache(idx, stop_at_layer=bad)


def test_an_edit_at_every_point_gives_transformer_bridges_logits(pair):
    """A hook that returns a changed tensor changes the logits as it does in the Bridge, at every
    point but hook_resid_mid: there the Bridge's point is an alias of ln2.hook_in, so its edit
    reaches the MLP's input and not the residual stream (gptlab's, as HookedTransformer's, both)."""
    model, bridge = pair
    idx = torch.randint(0, 50257, (2, 7), generator=torch.Generator().manual_seed(4))
    plain = model(idx)[0]

    def scale(x, hook):
        return x * (1 + 0.5 * torch.rand(x.shape, generator=torch.Generator().manual_seed(5)))

    for name in model.hook_points():
        ours = model.run_with_hooks(idx, fwd_hooks=[(name, scale)])
        theirs = bridge.run_with_hooks(idx, fwd_hooks=[(name, scale)])
        assert (ours - plain).abs().max() > 1e-6, name  # the edit reached the logits
        if name.endswith("hook_resid_mid"):  # the Bridge's edit is gptlab's made to ln_2's input alone
            ln_2 = model.transformer.h[int(name.split(".")[1])].ln_2
            handle = ln_2.register_forward_pre_hook(lambda module, args: (scale(args[0], None),))
            try:
                mlp_input_only = model(idx)[0]
            finally:
                handle.remove()
            assert (ours - theirs).abs().max() > 1e-3, name
            torch.testing.assert_close(mlp_input_only, theirs, rtol=0, atol=1e-5, msg=name)
            continue
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=name)  # measured: 3.6e-7


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_every_point_may_be_edited_in_place_with_autograd_on(variant):
    """A hook that zeroes a slice in place (README's head ablation) works at every point, as a
    returned copy with the same edit does: on q, k, v (views of one split) and SwiGLU's gate and
    up (of one chunk) it raised "a view ... is being modified inplace" under autograd. The
    gradient still reaches the weights through an edited point."""
    model = tiny_model(**VARIANTS[variant])
    idx = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))

    def in_place(x, hook):
        x[..., 0] = 0.0

    def copied(x, hook):
        x = x.clone()
        x[..., 0] = 0.0
        return x

    for name in model.hook_points():
        if name.endswith(("hook_scale", "hook_attn_scores", "hook_pattern")):
            continue  # the last axis of a divisor (1 wide) and of attention rows: zeroing is no edit to compare
        ours = model.run_with_hooks(idx, fwd_hooks=[(name, in_place)])
        ref = model.run_with_hooks(idx, fwd_hooks=[(name, copied)])
        torch.testing.assert_close(ours, ref, rtol=0, atol=0, msg=name)
    model.zero_grad()
    model.run_with_hooks(idx, fwd_hooks=[("blocks.0.attn.hook_q", in_place)]).sum().backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_cached_values_are_the_models_own(variant):
    """Caching every point gives the model's own logits (to float rounding: scores, patterns and
    normalized values exist only on the step-by-step paths; measured 6e-8), and the last residual
    stream through ln_f and the head gives them again; caching the residual stream only changes
    no bit. Rotary models also show q and k after rotation, SwiGLU its up projection."""
    model = tiny_model(**VARIANTS[variant])
    idx = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        logits, cache = model.run_with_cache(idx)
        torch.testing.assert_close(logits, model(idx)[0], rtol=0, atol=1e-6)
        resid, _ = model.run_with_cache(idx, names_filter=lambda n: "resid" in n)
        assert torch.equal(resid, model(idx)[0])
        assert set(cache) == set(model.hook_points())  # each point runs (GPT-2 had hook_rot_q that never did)
        last = cache[f"blocks.{model.config.n_layer - 1}.hook_resid_post"]
        torch.testing.assert_close(model.lm_head(model.transformer.ln_f(last)), logits, rtol=0, atol=1e-6)
    if variant == "llama":
        assert {"blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k", "blocks.0.mlp.hook_pre_linear"} <= set(cache)
        assert not torch.equal(cache["blocks.0.attn.hook_rot_q"], cache["blocks.0.attn.hook_q"])


def test_names_filter_stop_at_layer_and_the_context_manager():
    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (1, 5))
    _, cache = model.run_with_cache(idx, names_filter=lambda n: n.endswith("hook_pattern"))
    assert set(cache) == {f"blocks.{i}.attn.hook_pattern" for i in range(model.config.n_layer)}
    assert torch.allclose(cache["blocks.0.attn.hook_pattern"].sum(-1), torch.ones(1))  # rows of probabilities
    resid, cache = model.run_with_cache(idx, names_filter="blocks.0.hook_resid_post", stop_at_layer=1)
    assert set(cache) == {"blocks.0.hook_resid_post"} and torch.equal(resid, cache["blocks.0.hook_resid_post"])
    seen = []
    with model.hooks([("hook_embed", lambda x, hook: seen.append(hook.name))]):
        model(idx)
    model(idx)
    assert seen == ["hook_embed"]  # removed when the block ends
    with pytest.raises(ValueError, match="no hook point blocks.0.hook_nothing"):
        model.run_with_cache(idx, names_filter=["blocks.0.hook_nothing"])
    # a layer the model lacks names the ones it has and the nearest points (was "e.g." four
    # points of block 0, in no useful order)
    with pytest.raises(ValueError, match=r"blocks 0-1; did you mean blocks.1.hook_resid_pre"):
        model.run_with_cache(idx, names_filter="blocks.5.hook_resid_pre")
    for run in (model.run_with_hooks, model.run_with_cache):  # the loss was computed and dropped
        with pytest.raises(ValueError, match="return logits only; for the loss"):
            run(idx, targets=idx)


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_hook_points_are_listed_in_the_order_a_forward_reaches_them(variant):
    """hook_points() promises forward order: the order a cache of every point fills in (the
    embeddings first, each block from hook_resid_pre, ln_final last). hook_resid_pre came after
    the MLP's points, and the embeddings last."""
    model = tiny_model(**VARIANTS[variant])
    fired = []
    with torch.no_grad(), model.hooks([(lambda n: True, lambda x, hook: fired.append(hook.name))]):
        model(torch.randint(0, model.config.vocab_size, (1, 5)))
    assert list(model.hook_points()) == fired


@pytest.mark.skipif(not kernels.available()[0], reason=f"gptlab's kernels are not built here: {kernels.available()[2]}")
def test_an_unhooked_model_still_decodes_in_c_and_a_hooked_one_does_not():
    model = tiny_model()
    assert not isinstance(fused_step.plan(model, torch.float32), fused_step.NoPlan)  # hook points keep the plan
    cache = KVCache(model.config, 1, 16)
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert fused_step.applies(model, idx, cache)
        assert fused_step.step(model, idx, torch.arange(3)[None], torch.float32, None, cache, None, True) is not None
        with model.hooks([("blocks.0.hook_resid_pre", lambda x, hook: None)]):
            assert fused_step.step(model, idx, torch.arange(3)[None], torch.float32, None, cache, None, True) is None


GENERATION_POINTS = ["blocks.0.hook_resid_pre", "blocks.1.attn.hook_q", "blocks.1.attn.hook_pattern",
                     "blocks.0.attn.hook_attn_scores", "blocks.1.hook_resid_post", "ln_final.hook_normalized"]  # fmt: skip


# The final norm alone: the last block's output was trimmed to the last position of the prompt
# (a hook in that block was what kept every position), so its cache was 4 rows short, misaligned.
@pytest.mark.parametrize("names", [GENERATION_POINTS, ["ln_final.hook_normalized"]], ids=["points", "final-norm"])
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_generation_caches_equal_a_full_forward_over_each_row(variant, names):
    """Two left-padded prompts of different lengths, decoded over the KV cache with hooks: each
    row's activations (prompt and every returned token) equal a forward over that row alone
    (measured: 4.8e-7 apart)."""
    from gptlab.generation import generate

    model = tiny_model(**VARIANTS[variant])
    prompts = [[5, 9, 2, 7, 1], [3, 8]]
    out, caches = generate(model, prompts, 6, temperature=0, cache_names=names)
    assert len(caches) == 2
    for row, cache in zip(out, caches, strict=True):
        assert len(row) == len(prompts[out.index(row)]) + 6
        _, full = model.run_with_cache(torch.tensor([row]), names_filter=names)
        for name in names:
            ours, ref = cache[name], full[name][0]
            assert ours.shape == ref.shape, name
            if name.endswith("hook_attn_scores"):
                assert torch.equal(torch.isinf(ours), torch.isinf(ref)), name
                ours, ref = ours.masked_fill(torch.isinf(ours), 0), ref.masked_fill(torch.isinf(ref), 0)
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="block_size"):
        generate(model, prompts, model.config.block_size, temperature=0, cache_names=names)


def test_bench_hooks_runs_both_sides_and_their_grids_agree(tmp_path, capsys):
    from gptlab.bench.hooks import main as bench

    assert (
        bench(["--preset", "gpt2-tiny", "--tokens", "16", "--repeats", "1", "--threads", "1", "--out", str(tmp_path)])
        == 0
    )
    (path,) = tmp_path.glob("hooks-*.json")
    rows = __import__("json").loads(path.read_text())["rows"]
    assert rows["run_with_cache"]["gptlab_points"] == 38 and rows["run_with_cache"]["speedup"] > 0
    assert rows["patching_grid"]["tokens"] == 20 and rows["patching_grid"]["cells"] == 40
    assert rows["patching_grid"]["max_abs_difference"] < 1e-4  # the same grid both ways
    assert "patching_grid" in capsys.readouterr().out


def test_a_cache_streamed_to_a_safetensors_file_equals_run_with_cache(tmp_path):
    from safetensors import safe_open

    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (2, 9))
    names = lambda n: "resid" in n or n.endswith("hook_pattern")  # noqa: E731
    path = tmp_path / "cache.safetensors"
    logits = model.cache_to_file(idx, path, names_filter=names)
    ref_logits, ref = model.run_with_cache(idx, names_filter=names)
    assert torch.equal(logits, ref_logits)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(ref)
        for name in ref:
            assert torch.equal(f.get_tensor(name), ref[name]), name
    assert [p.name for p in tmp_path.iterdir()] == ["cache.safetensors"]  # no temporary left behind
    # stop_at_layer as run_with_cache takes it (a TypeError from forward), into a directory to make
    # (a FileNotFoundError on a temporary name)
    deep = tmp_path / "new" / "dir" / "c.safetensors"
    resid = model.cache_to_file(idx, deep, names_filter=names, stop_at_layer=1)
    ref_resid, ref = model.run_with_cache(idx, names_filter=names, stop_at_layer=1)
    assert torch.equal(resid, ref_resid)
    with safe_open(str(deep), framework="pt") as f:
        assert set(f.keys()) == set(ref) and "blocks.1.hook_resid_mid" not in ref and "blocks.0.hook_resid_post" in ref


def test_a_name_listed_twice_is_one_point(tmp_path):
    """A names list that repeats a name selects that point once: cache_to_file wrote it twice,
    a file safetensors refused ("invalid offset"), and a hook given the list ran twice."""
    from safetensors.torch import load_file

    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    names = ["hook_embed", "blocks.0.hook_resid_post", "hook_embed"]
    path = tmp_path / "cache.safetensors"
    model.cache_to_file(idx, path, names_filter=names)
    _, ref = model.run_with_cache(idx, names_filter=names)
    saved = load_file(str(path))
    assert set(saved) == set(ref) == {"hook_embed", "blocks.0.hook_resid_post"}
    assert all(torch.equal(saved[name], ref[name]) for name in ref)
    calls = []
    model.run_with_hooks(idx, fwd_hooks=[(["hook_embed", "hook_embed"], lambda x, hook: calls.append(hook.name))])
    assert calls == ["hook_embed"]


def test_hooks_fire_only_in_the_thread_that_registered_them():
    import threading

    model = tiny_model()
    idx = torch.randint(0, model.config.vocab_size, (1, 4))
    seen = []
    with model.hooks([("hook_embed", lambda x, hook: seen.append(threading.get_ident()))]):
        worker = threading.Thread(target=lambda: model(idx))
        worker.start()
        worker.join()
        model(idx)
    assert seen == [threading.get_ident()]  # the other thread's forward did not call it


def test_processed_weights_equal_transformer_bridges_compatibility_mode(tmp_path):
    """Folding LayerNorm, centring the writing weights and the unembedding, folding value biases
    (hooks.process_weights, only when asked) against the Bridge's enable_compatibility_mode on the
    same weights: every hook point within 1e-5 (measured: logits 3.6e-7 apart), and the same
    function as the unprocessed model up to a constant per position."""
    from transformer_lens.model_bridge import TransformerBridge

    from gptlab.hooks import process_weights

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "model")
    bridge = TransformerBridge.boot_transformers(str(tmp_path / "model"), device="cpu")
    bridge.enable_compatibility_mode(disable_warnings=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    processed = process_weights(model)
    idx = torch.randint(0, 50257, (2, 9), generator=torch.Generator().manual_seed(3))
    logits, cache = processed.run_with_cache(idx)
    theirs_logits, theirs = bridge.run_with_cache(idx)
    torch.testing.assert_close(logits, theirs_logits, rtol=0, atol=1e-5)
    for name, ours in cache.items():
        other = theirs[name]
        assert ours.shape == other.shape, name
        if name.endswith("hook_attn_scores"):  # masked: -inf here, -inf or the dtype's minimum there
            visible = torch.isfinite(ours)
            ours, other = ours[visible], other[visible]
        torch.testing.assert_close(ours, other, rtol=0, atol=1e-5, msg=name)
    with torch.no_grad():
        plain = model(idx)[0]
    centred = lambda x: x - x.mean(-1, keepdim=True)  # noqa: E731
    torch.testing.assert_close(centred(logits), centred(plain), rtol=0, atol=1e-5)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # a copy was processed


def test_process_weights_refuses_a_quantized_model():
    """process_weights of a quantized model was a RuntimeError from torch ('Only Tensors of floating
    point and complex dtype can require gradients': it copied the int8 head into a float one)."""
    from gptlab.hooks import process_weights
    from gptlab.quantize import dequantize_model, quantize_model

    model = quantize_model(tiny_model(), "int8")
    with pytest.raises(ValueError, match=r"quantized \(int8\).*dequantize_model"):
        process_weights(model)
    process_weights(dequantize_model(model))  # what the message asks for
