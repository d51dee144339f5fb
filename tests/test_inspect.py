import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import VARIANTS, tiny_model
from gptlab import inspect as gi
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.config import PRESETS, GPTConfig
from gptlab.model import GPT
from gptlab.tokenizer import get_tokenizer

BYTE = get_tokenizer("byte")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- info


def _linear_weights(model: GPT) -> int:
    """Weights of every nn.Linear as the forward pass uses them (a tied head counted as a matmul)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("name", list(PRESETS))
def test_info_totals_match_every_preset(name):
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name(name))
    info = gi.model_info(model)
    assert sum(r["params"] for r in info["components"]) == info["total"] == model.num_params()
    assert sum(r["share"] for r in info["components"]) == pytest.approx(1.0)
    assert info["flops"]["matmul_params"] == _linear_weights(model)
    assert info["weights"]["fp32"] == 4 * model.num_params()
    assert info["weights"]["bf16"] == 2 * model.num_params()
    # below fp32; not always below bf16: an untied model's fp32 embedding stays fp32 (llama-tiny)
    assert info["weights"]["int4"] < info["weights"]["int8"] < info["weights"]["fp32"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_info_totals_match_every_variant(variant):
    model = tiny_model(**VARIANTS[variant])
    info = gi.model_info(model)
    assert sum(r["params"] for r in info["components"]) == info["total"] == model.num_params()
    assert info["flops"]["matmul_params"] == _linear_weights(model)
    head = info["components"][-1]
    assert head["params"] == (0 if model.config.tie_weights else model.lm_head.weight.numel())


def test_info_of_a_classifier_counts_its_score_head(tmp_path, capsys):
    """A classifier has a (num_labels, n_embd) score and no lm_head: gptlab info built a language
    model from its config (a tied 97 x 32 head counted in the FLOPs, the score left out of the
    total), and model_info counted a vocabulary-sized head matmul it never runs."""
    from gptlab.classifier import from_language_model

    model = from_language_model(tiny_model(), ["a", "b", "c"])
    info = gi.model_info(model)
    assert info["total"] == model.num_params() == tiny_model().num_params() + 3 * 32
    assert info["flops"]["matmul_params"] == _linear_weights(model)  # the blocks' and the score's
    assert info["components"][-1] == dict(component="classification head (score)", params=3 * 32, note="", share=pytest.approx(96 / info["total"]))  # fmt: skip
    save_model(model, tmp_path / "cls", tokenizer="byte")
    assert main(["info", str(tmp_path / "cls"), "--json", str(tmp_path / "i.json")]) == 0
    written = json.loads((tmp_path / "i.json").read_text())
    assert written["total"] == info["total"] and written["flops"] == info["flops"]


def test_gpt2_info():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name("gpt2"))
    info = gi.model_info(model)
    assert info["total"] == 124_439_808
    assert info["kv_cache"]["fp32"]["per_token"] == 2 * 12 * 768 * 4  # 73,728 bytes
    assert info["kv_cache"]["bf16"]["full_context"] == 2 * 12 * 768 * 2 * 1024


def test_flops_by_hand_for_gpt2_tiny():
    # gpt2-tiny: L=2, n_embd C=64, vocab V=50257, context T=128.
    # matmul weights per block: c_attn 3C*C + attn c_proj C*C + c_fc 4C*C + mlp c_proj 4C*C = 12*64*64 = 49,152
    # N = 2 * 49,152 + head 50,257 * 64 = 98,304 + 3,216,448 = 3,314,752
    # forward = 2N + 4*L*T*C = 6,629,504 + 4*2*128*64 (= 65,536) = 6,695,040; training = 3x = 20,085,120
    flops = gi.flops_per_token(GPTConfig.from_name("gpt2-tiny"))
    assert flops["matmul_params"] == 3_314_752
    assert flops["forward"] == 6_695_040
    assert flops["train"] == 20_085_120
    assert gi.flops_per_token(GPTConfig.from_name("gpt2-tiny"), context=64)["forward"] == 6_629_504 + 32_768


def test_int8_and_int4_weight_bytes_by_hand():
    # vocab 97, C=32, L=2, tied, learned positions (block 32): matrices per block 12*32*32 = 12,288; head 97*32
    model = tiny_model()
    n_mat = 2 * 12_288 + 97 * 32  # 27,680
    rows = 2 * (96 + 32 + 128 + 32) + 97  # output channels: 673
    groups = 2 * (96 + 32 + 128 + 32 * 2) + 97  # int4 groups of 64 inputs (mlp c_proj has 128 inputs: 2 groups)
    rest = model.num_params() - n_mat
    weights = gi.weight_memory(model)
    assert weights["int8"] == n_mat + 2 * rows + 4 * rest
    assert weights["int4"] == n_mat // 2 + 4 * groups + 4 * rest


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_bytes_are_what_quantize_keeps(tied, mode):
    """info counted the parameters quantize leaves float at bf16; quantize keeps them as the
    model has them, fp32: an untied llama-tiny's int4 file was 14.1 MiB where info said 7.9."""
    from gptlab.quantize import quantize_model

    weights = gi.weight_memory(tiny_model(tie_weights=tied, n_embd=64))[mode]
    kept = {(t.data_ptr(), t.numel()): t.numel() * t.element_size()  # a tied tensor once
            for t in quantize_model(tiny_model(tie_weights=tied, n_embd=64), mode).state_dict().values()}  # fmt: skip
    assert weights == sum(kept.values())


# ----------------------------------------------------------------------------- attention


def _attention_by_hand(model: GPT, idx: torch.Tensor, layer: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs)) with a causal mask, from ln_1's output captured in a normal forward."""
    block = model.transformer.h[layer]
    with gi.capture_outputs({"ln_1": block.ln_1}) as out, torch.no_grad():
        model(idx)
        q, k, _ = block.attn.c_attn(out["ln_1"]).split(model.config.n_embd, dim=2)
    B, T, C = q.shape
    q = q.view(B, T, model.config.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
    k = k.view(B, T, model.config.n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, nh, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return F.softmax(scores, dim=-1)


def test_attention_rows_are_causal_sum_to_one_and_match_the_forward_pass():
    model = tiny_model()
    idx = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(0))
    att = model.attention(idx)  # (L, B, nh, T, T)
    torch.testing.assert_close(att.sum(-1), torch.ones(2, 2, 4, 14))
    assert att.triu(diagonal=1).abs().max() == 0
    probs = []
    with torch.no_grad():
        model(idx, attn_probs=probs)
    torch.testing.assert_close(att, torch.stack(probs), rtol=0, atol=0)
    for layer in range(2):
        torch.testing.assert_close(model.attention(idx, layer=layer), _attention_by_hand(model, idx, layer))
    torch.testing.assert_close(model.attention(idx, layer=-1, head=3), att[1, :, 3])


# ----------------------------------------------------------------------------- lens, trace, next


def test_logit_lens_reads_each_residual_stream(variant_model):
    idx = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    lens = gi.logit_lens(variant_model, idx, top=3)
    L = variant_model.config.n_layer
    assert lens["layers"] == ["embed"] + [f"block {i}" for i in range(L)]
    assert torch.tensor(lens["top_ids"]).shape == (L + 1, 9, 3)
    with torch.no_grad():
        logits, _ = variant_model(idx)
        t = variant_model.transformer
        x = t.wte(idx) + (t.wpe(torch.arange(9)) if "wpe" in t else 0)
        embed_logits = variant_model.lm_head(t.ln_f(x))
    for row, reference in ((L, logits), (0, embed_logits)):
        probs, ids = F.softmax(reference[0], -1).topk(3)
        assert lens["top_ids"][row] == ids.tolist()
        torch.testing.assert_close(torch.tensor(lens["top_probs"][row]), probs)
    assert all(not b._forward_hooks for b in variant_model.transformer.h)  # hooks removed


def test_trace_shapes_and_residual_changes(variant_model):
    idx = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    result = gi.trace(variant_model, BYTE, idx, top=4)
    cfg = variant_model.config
    shapes = {s["stage"]: s["shape"] for s in result["stages"]}
    assert shapes["token embedding wte[ids]"] == [1, 7, cfg.n_embd]
    assert shapes["block 0: c_attn -> q, k, v fused"] == [1, 7, 3 * cfg.n_embd]
    assert shapes["block 0: mlp c_fc"] == [1, 7, (2 if cfg.mlp == "swiglu" else 1) * cfg.mlp_hidden]
    assert shapes[f"block {cfg.n_layer - 1} output"] == [1, 7, cfg.n_embd]
    assert result["logits_shape"] == [1, 7, cfg.vocab_size]
    blocks = result["blocks"]
    assert [b["layer"] for b in blocks] == list(range(cfg.n_layer))
    for a, b in zip(blocks, blocks[1:], strict=False):
        assert b["resid_in"] == pytest.approx(a["resid_out"])
    # the change a block makes is exactly its attention plus MLP contribution
    block = variant_model.transformer.h[0]
    with gi.capture_outputs({"attn": block.attn, "mlp": block.mlp, "in": variant_model.transformer.drop}) as out:
        with torch.no_grad():
            variant_model(idx)
    assert blocks[0]["resid_in"] == pytest.approx(out["in"][0].norm(dim=-1).mean().item(), rel=1e-5)
    assert blocks[0]["change"] == pytest.approx((out["attn"] + out["mlp"])[0].norm(dim=-1).mean().item(), rel=1e-4)
    expected = gi.next_tokens(variant_model, BYTE, idx, top=4)
    assert [t["id"] for t in result["next"]] == [t["id"] for t in expected]


def test_next_tokens_are_the_top_of_the_softmax():
    model = tiny_model()
    idx = torch.tensor([[3, 1, 4, 1, 5]])
    tokens = gi.next_tokens(model, BYTE, idx, top=10)
    with torch.no_grad():
        probs = F.softmax(model(idx)[0][0, -1], -1)
    top = probs.topk(10)
    assert [t["id"] for t in tokens] == top.indices.tolist()
    assert [t["prob"] for t in tokens] == pytest.approx(top.values.tolist())


def test_token_labels():
    tok = get_tokenizer("gpt2")
    assert gi.token_label(tok, tok.encode(" love")[0]) == " love"
    assert gi.token_label(tok, tok.encode("\n")[0]) == "\\n"
    partial = tok.encode("語")[0]  # a piece of a 3-byte character
    assert gi.token_label(tok, partial).startswith("\\x")
    assert gi.token_label(BYTE, 27) == "\\x1b"


def test_every_gpt2_token_has_its_own_label():
    """A literal backslash is doubled, and U+0080..U+00FF is not written as the byte of a split
    character: the tokens `\\` `n` read as a newline, U+00A0 (1849) as the lone byte 0xa0 (254)."""
    tok = get_tokenizer("gpt2")
    labels = [gi.token_label(tok, i) for i in range(tok.n_vocab)]
    assert len(set(labels)) == tok.n_vocab
    assert [gi.token_label(tok, i) for i in tok.encode("\\n")] == ["\\\\", "n"]  # not "\\" "n"
    assert [labels[i] for i in (198, 6852, 254, 1849, 255, 3907)] == [
        "\\n", "\\" * 4, "\\xa0", "\\u00a0", "\\xad", "\\u00ad"]  # fmt: skip


def test_the_cli_shows_a_backslash_doubled(capsys):
    assert main(["trace", "--model", "gpt2-tiny", "--prompt", "a\\n\n"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines[1:5]] == ["'a'", "'\\\\'", "'n'", "'\\n'"]


def test_bad_prompts_and_indices():
    model = tiny_model()
    with pytest.raises(ValueError, match="prompt is empty"):
        gi.encode_prompt(BYTE, "", 32)
    with pytest.raises(ValueError, match="40 tokens, longer than the model's context of 32"):
        gi.encode_prompt(BYTE, "x" * 40, 32)
    one = torch.tensor([[1]])
    for top in (0, -1):  # trace crashed in topk on -1 and printed no tokens for 0
        for read, args in ((gi.next_tokens, (model, BYTE, one)), (gi.logit_lens, (model, one)), (gi.trace, (model, BYTE, one))):  # fmt: skip
            with pytest.raises(ValueError, match="top must be at least 1"):
                read(*args, top=top)
    with pytest.raises(ValueError, match="one sequence at a time: idx has 2 rows"):  # row 1 was ignored
        gi.next_tokens(model, BYTE, torch.tensor([[1], [2]]))


# ----------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=4, n_embd=32))
    path = tmp_path_factory.mktemp("m") / "byte-model"
    save_model(model, path, tokenizer="byte")
    return str(path)


def _assert_png(path):
    """A PNG of a real figure: an RGB(A) image of some size, not blank (a figure with nothing drawn is white)."""
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    rgb = image[..., :3]
    drawn = (rgb.min(axis=-1) < 0.9).mean()  # measured 0.04 (a pale logit lens) to 0.58 (attention heatmaps)
    assert drawn > 0.02, f"only {drawn:.1%} of the image is drawn"
    assert len({tuple(p) for p in (rgb[::7, ::7] * 255).astype(int).reshape(-1, 3)}) > 20  # colours, not one fill
    return image


def _pixels_of(image, cmap: str, value: float) -> int:
    """How many pixels have the colour that colormap `cmap` gives `value` (within antialiasing)."""
    import matplotlib
    import numpy as np

    colour = np.array(matplotlib.colormaps[cmap](value)[:3])
    return int((np.abs(image[..., :3] - colour).max(axis=-1) < 0.02).sum())


@pytest.mark.parametrize("heads", [1, 4])
def test_attention_plot_draws_the_probabilities(tmp_path, heads):
    # The identity over 4 tokens: 4 cells at probability 1 (yellow), 12 at 0 (dark purple), per head.
    probs = torch.eye(4) if heads == 1 else torch.eye(4).repeat(heads, 1, 1)
    gi.plot_attention(probs, list("abcd"), tmp_path / "a.png", title="identity")
    image = _assert_png(tmp_path / "a.png")
    ones, zeros = _pixels_of(image, "viridis", 1.0), _pixels_of(image, "viridis", 0.0)
    assert zeros > 0.15 * image.shape[0] * image.shape[1]  # the heatmaps fill the figure
    assert ones / zeros == pytest.approx(4 / 12, rel=0.05)  # measured 0.333 for 1 and 4 heads


def test_logit_lens_plot_colours_the_top_probability(tmp_path):
    # 2 layers x 3 positions; one cell at top-1 probability 1, five at 0.
    lens = dict(
        top_probs=[[[1.0], [0.0], [0.0]], [[0.0], [0.0], [0.0]]],
        top_ids=[[[65], [66], [67]], [[65], [66], [67]]],
        input_ids=[72, 105, 33],
        layers=["embed", "block 0"],
    )
    gi.plot_logit_lens(lens, BYTE, tmp_path / "l.png", title="lens")
    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "l.png")
    ones, zeros = _pixels_of(image, "Blues", 1.0), _pixels_of(image, "Blues", 0.0)
    print(f"\nlens plot: {ones} pixels at p=1, {zeros} at p=0")
    assert zeros > 0.15 * image.shape[0] * image.shape[1]
    assert ones / zeros == pytest.approx(1 / 5, rel=0.1)  # labels cover part of each cell


def test_plots_draw_dollar_signs_as_text(tmp_path, monkeypatch):
    """A token such as "$$", or prices in a prompt, is text: matplotlib read two `$` as mathtext,
    so the plots failed ("ParseException: Expected end of text") or drew the title as maths."""
    import matplotlib.text

    gpt2 = get_tokenizer("gpt2")
    figures, save = [], gi._save_figure
    monkeypatch.setattr(gi, "_save_figure", lambda fig, path: (figures.append(fig), save(fig, path)))
    title = "from $5 to $10 $$"
    gi.plot_attention(torch.eye(3).repeat(2, 1, 1), ["$$", " $", "5"], tmp_path / "a.png", title=title)
    dollars = gpt2.encode("$$")[0]  # one token
    lens = dict(top_probs=[[[0.9], [0.1]]], top_ids=[[[dollars], [dollars]]], input_ids=[dollars, dollars], layers=["embed"])  # fmt: skip
    gi.plot_logit_lens(lens, gpt2, tmp_path / "l.png", title=title)
    gi.plot_patching(torch.eye(2), torch.eye(2), ["$$", "$1"], tmp_path / "p.png", title=title)
    for name in ("a.png", "l.png", "p.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_SIGNATURE)
    texts = [t for fig in figures for t in fig.findobj(matplotlib.text.Text) if "$" in t.get_text()]
    assert len(texts) >= 3 * 2 and not any(t.get_parse_math() for t in texts)  # labels and titles, as written


def test_plots_of_long_prompts_stay_drawable(tmp_path, monkeypatch):
    """Figures grew with the prompt: GPT-2's 12 heads over 300 tokens asked for a 36,600-pixel
    square (~5 GB; longer prompts were killed for memory), and a lens or patching grid passed
    matplotlib's 65,536-pixel limit. They are capped, with every k-th token labelled in order."""
    figures = []

    def measure(fig, path):  # before drawing: an oversized figure is not rendered
        figures.append(fig)
        width, height = fig.get_size_inches()
        assert max(width, height) <= (40 if len(figures) == 1 else 160)  # 4,800 and 19,200 pixels at 120 dpi

    monkeypatch.setattr(gi, "_save_figure", measure)
    T = 300
    labels = [f"t{i}" for i in range(T)]
    gi.plot_attention(torch.full((4, T, T), 1 / T), labels, tmp_path / "a.png", title="4 heads")
    lens = dict(top_probs=[[[0.5]] * 600] * 3, top_ids=[[[65]] * 600] * 3, input_ids=[66] * 600, layers=["embed", "block 0", "block 1"])  # fmt: skip
    gi.plot_logit_lens(lens, BYTE, tmp_path / "l.png", title="lens")
    gi.plot_patching(torch.zeros(2, 600), torch.zeros(2, 600), labels * 2, tmp_path / "p.png", title="patch")
    ax = figures[0].axes[0]
    ticks = [int(t) for t in ax.get_xticks()]
    step = ticks[1]
    assert 1 < step < T / 10 and ticks == list(range(0, T, step))  # thinned, not dropped
    assert [t.get_text() for t in ax.get_xticklabels()] == labels[::step]  # each tick its own token
    assert [t.get_text() for t in ax.get_yticklabels()] == labels[::step]


def test_cli_attention_writes_png(tmp_path, model_dir, capsys):
    grid, one = tmp_path / "grid.png", tmp_path / "one.png"
    assert main(["attention", "--model", model_dir, "--prompt", "Hello there", "--layer", "1", "--out", str(grid)]) == 0
    assert (
        main(
            ["attention", "--model", model_dir, "--prompt", "Hi you", "--layer", "0", "--head", "2", "--out", str(one)]
        )
        == 0
    )
    big, small = _assert_png(grid), _assert_png(one)
    assert big.shape[0] > small.shape[0]  # a 2x2 grid of heads is taller than one head
    out = capsys.readouterr().out
    assert "layer 1, all 4 heads" in out and "layer 0, head 2" in out


def test_cli_lens_trace_next_info_write_files(tmp_path, model_dir, capsys):
    png, lens_json, trace_json, next_json, info_json = (
        tmp_path / n for n in ("l.png", "l.json", "t.json", "n.json", "i.json")
    )
    common = ["--model", model_dir, "--prompt", "To be, or not"]
    assert main(["lens", *common, "--out", str(png), "--json", str(lens_json)]) == 0
    _assert_png(png)
    assert len(json.loads(lens_json.read_text())["top_ids"]) == 3
    assert main(["trace", *common, "--json", str(trace_json)]) == 0
    assert json.loads(trace_json.read_text())["logits_shape"] == [1, 13, 257]
    assert main(["next", *common, "--top", "7", "--json", str(next_json)]) == 0
    assert len(json.loads(next_json.read_text())["next"]) == 7
    assert main(["info", "--model", model_dir, "--json", str(info_json)]) == 0
    assert json.loads(info_json.read_text())["total"] == 257 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32
    out = capsys.readouterr().out
    assert "1. tokenize: 13 tokens" in out and "block 1" in out and "FLOPs per token" in out


@pytest.mark.parametrize("command", ["trace", "attention", "lens", "next", "patch"])
def test_cli_refuses_a_classifier_in_one_line(tmp_path, model_dir, capsys, command):
    """A sequence classifier has no next-token head: each command failed with a traceback inside
    the model (no attribute lm_head, forward() got attn_probs, an IndexError on its label logits)."""
    from gptlab.classifier import from_language_model
    from gptlab.loading import load_model

    save_model(from_language_model(load_model(model_dir), ["neg", "pos"]), tmp_path / "cls", tokenizer="byte")
    prompt = ["--clean", "ab", "--corrupt", "ac", "--answers", "x", "y"] if command == "patch" else ["--prompt", "ab"]
    extra = ["--layer", "0", "--out", str(tmp_path / "a.png")] if command == "attention" else []
    assert main([command, "--model", str(tmp_path / "cls"), *prompt, *extra]) == 2
    assert "is a sequence classifier (labels neg, pos), not a language model" in capsys.readouterr().err


def test_cli_reads_endoftext_in_a_prompt_as_the_token(tmp_path, model_dir, capsys):
    """<|endoftext|> in --prompt is token 256 of the byte tokenizer (50256 of GPT-2's), as in the
    explorer's /api/next and /api/lens: the commands read it as 13 characters of text."""
    from gptlab.loading import load_model

    assert main(["trace", "--model", model_dir, "--prompt", "<|endoftext|>ab", "--json", str(tmp_path / "t.json")]) == 0
    assert [t["id"] for t in json.loads((tmp_path / "t.json").read_text())["tokens"]] == [256, 97, 98]
    assert main(["next", "--model", model_dir, "--prompt", "<|endoftext|>ab", "--json", str(tmp_path / "n.json")]) == 0
    expected = gi.next_tokens(load_model(model_dir), BYTE, torch.tensor([[256, 97, 98]]))
    written = json.loads((tmp_path / "n.json").read_text())["next"]
    assert [t["id"] for t in written] == [t["id"] for t in expected]
    assert [t["prob"] for t in written] == pytest.approx([t["prob"] for t in expected])


def test_logits_that_overflow_are_an_error_not_nan(tmp_path, capsys):
    """Embeddings past float16's 65,504 make every logit NaN: next crashed ("cannot convert
    float NaN to integer"), lens and trace wrote NaN into their JSON (not JSON), patch called the
    prompts equal. In float32 the same model reads fine."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=16, n_layer=2, n_head=2, n_embd=16))
    with torch.no_grad():
        model.transformer.wte.weight.add_(1e5)  # inf in float16
    save_model(model, tmp_path / "m", tokenizer="byte")
    common = ["--model", str(tmp_path / "m"), "--prompt", "abc", "--dtype"]
    assert main(["next", *common, "float32"]) == 0
    for command in ("next", "lens", "trace"):
        assert main([command, *common, "float16", "--json", str(tmp_path / "out.json")]) == 2
        assert "logits are not finite (NaN or inf)" in capsys.readouterr().err
        assert not (tmp_path / "out.json").exists()
    patch = ["patch", "--model", str(tmp_path / "m"), "--clean", "ab", "--corrupt", "ac", "--answers", "x", "y"]
    assert main([*patch, "--dtype", "float16"]) == 2
    assert "the metric is NaN or inf in 1 of 1 rows" in capsys.readouterr().err


def test_info_counts_a_quantized_checkpoint_like_its_float_model(tmp_path, model_dir, capsys):
    from gptlab.loading import load_model
    from gptlab.quantize import quantize_model, save_quantized

    model = load_model(model_dir)
    save_quantized(quantize_model(load_model(model_dir), "int8"), tmp_path / "q8", tokenizer="byte")
    assert main(["info", str(tmp_path / "q8"), "--json", str(tmp_path / "q.json")]) == 0
    assert json.loads((tmp_path / "q.json").read_text())["total"] == model.num_params()


def test_info_of_a_quantized_directory_names_its_scheme_and_sizes_its_int4_groups(tmp_path, model_dir, capsys):
    """A quantized directory's info said nothing of its scheme, and its int4 row assumed groups of
    64: a directory of 32-wide groups was larger than info's figure."""
    from gptlab.quantize import quantize_model, save_quantized

    model = GPT(GPTConfig(vocab_size=257, block_size=64, n_layer=2, n_head=4, n_embd=64))  # 2 groups of 32 a row
    save_quantized(quantize_model(model, "int4", 32), tmp_path / "q4", tokenizer="byte")
    assert main(["info", str(tmp_path / "q4"), "--json", str(tmp_path / "q.json")]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("quantized: int4 (group size 32)")
    info = json.loads((tmp_path / "q.json").read_text())
    assert info["quantization"] == {"mode": "int4", "group_size": 32}
    data = (tmp_path / "q4" / "model.safetensors").read_bytes()
    stored = len(data) - 8 - int.from_bytes(data[:8], "little")  # the tensors, past safetensors' header
    assert info["weights"]["int4"] == pytest.approx(stored, rel=0.02), stored
    assert main(["info", str(model_dir)]) == 0
    assert "\nquantized: " not in capsys.readouterr().out


def test_info_gpt2_prints_the_total(capsys):
    assert main(["info", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "284,812,800" in out and "72.0 MiB at 1024 tokens" in out


def test_info_names_the_variant_switches(capsys):
    """A Llama-style model's info said nothing of RoPE, RMSNorm, SwiGLU, biases or the head: it
    read as a GPT-2 of that shape. A GPT-2 gets no variant line."""
    assert main(["info", "llama-tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "variant: RoPE positions (theta 10000), RMSNorm, SwiGLU MLP, no biases, untied head"
    assert main(["info", "gpt2-tiny"]) == 0
    assert "variant" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["attention", "--prompt", "Hello", "--layer", "2"], "layer 2 out of range: the model has 2 layers"),
        (
            ["attention", "--prompt", "Hello", "--layer", "0", "--head", "4"],
            "head 4 out of range: the model has 4 heads",
        ),
        (["attention", "--prompt", "", "--layer", "0"], "prompt is empty"),
        (["trace", "--prompt", ""], "prompt is empty"),
        (["lens", "--prompt", ""], "prompt is empty"),
        (["next", "--prompt", ""], "prompt is empty"),
        (["next", "--prompt", "x" * 65], "65 tokens, longer than the model's context of 64"),
        (["trace", "--prompt", "hi", "--top", "-1"], "top must be at least 1"),
        (["info", "--context", "65"], "context must be in [1, 64]"),  # FLOPs and a KV cache it never holds
        (["info", "--context", "0"], "context must be in [1, 64]"),
        (["info", "gpt2-tiny"], "two models"),  # the positional one was ignored
        # an empty --out or --json (an unset shell variable) wrote nothing and exited 0
        (["lens", "--prompt", "hi", "--out", ""], "cannot write ."),
        (["lens", "--prompt", "hi", "--json", ""], "cannot write ."),
        (["next", "--prompt", "hi", "--json", ""], "cannot write ."),
        (["trace", "--prompt", "hi", "--json", ""], "cannot write ."),
        (["info", "--json", ""], "cannot write ."),
    ],
)
def test_cli_bad_input(tmp_path, model_dir, capsys, argv, message):
    out = tmp_path / "never.png"
    assert (
        main([argv[0], "--model", model_dir, *argv[1:], *(["--out", str(out)] if argv[0] == "attention" else [])]) == 2
    )
    assert message in capsys.readouterr().err
    assert not out.exists()
