import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from gptlab import evaluate
from gptlab.checkpoint import save_model
from gptlab.cli import main
from gptlab.config import GPTConfig
from gptlab.model import GPT
from gptlab.tokenizer import get_tokenizer

BYTE = get_tokenizer("byte")


def table_model(table: torch.Tensor) -> GPT:
    """A model whose next-token logits after token x are exactly table[x] (a bigram model).

    One-hot token embeddings, blocks that add nothing, and a head that reads the one-hot back out
    of the final LayerNorm: LN(10 * onehot(x)) = (onehot(x) - 1/d) / s, so with head rows whose
    entries sum to zero, logits = table[x].
    """
    V, d = table.shape[0], 288
    model = GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=1, n_head=4, n_embd=d, tie_weights=False))
    with torch.no_grad():
        for p in model.transformer.h.parameters():
            p.zero_()
        model.transformer.wpe.weight.zero_()
        model.transformer.wte.weight.copy_(10 * torch.eye(V, d))
        s = math.sqrt((1 / d) * (1 - 1 / d) + model.config.layer_norm_eps / 100)
        head = torch.zeros(V, d)
        head[:, :V] = table.T * s
        head[:, V:] = -head[:, :V].sum(1, keepdim=True) / (d - V)
        model.lm_head.weight.copy_(head)
    return model.eval()


def unigram_table(prefs: dict[str, float]) -> torch.Tensor:
    row = torch.zeros(257)
    for ch, logit in prefs.items():
        row[ord(ch)] = logit
    return row.expand(257, 257).clone()


def direct_nll(model, ctx: list[int], cont: list[int]) -> float:
    """-log p(cont | ctx) from one plain forward pass."""
    idx = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits, _ = model(idx[:, :-1])
    logp = F.log_softmax(logits[0, len(ctx) - 1 :], dim=-1)
    return -logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()


def test_table_model_has_the_logits_it_was_built_with():
    torch.manual_seed(0)
    table = torch.randn(257, 257)
    idx = torch.randint(0, 257, (1, 20))
    with torch.no_grad():
        logits, _ = table_model(table)(idx)
    torch.testing.assert_close(logits[0], table[idx[0]], atol=2e-3, rtol=0)


# ----------------------------------------------------------------------------- perplexity


@pytest.mark.parametrize("n, block, stride", [(2, 8, 4), (9, 8, 4), (50, 8, 3), (50, 8, 8), (50, 8, 1), (33, 32, 16)])
def test_sliding_windows_score_every_target_once(n, block, stride):
    scored = []
    for begin, end, score_from in evaluate.sliding_windows(n, block, stride):
        assert end - begin <= block and begin <= score_from < end
        scored += range(score_from + 1, end + 1)  # target indices
        # every scored target sees at least block - stride tokens of context, or all there are
        assert score_from - begin >= min(block - stride, score_from)
    assert scored == list(range(1, n))


def test_perplexity_is_exp_of_the_direct_mean_loss():
    model = tiny_model()  # block_size 32: the text fits one window
    tokens = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, loss = model(tokens[None, :-1], tokens[None, 1:])
    tok = get_tokenizer("byte")
    assert len(evaluate.sliding_windows(30, 32, 8)) == 1  # the text fits one window
    result = evaluate.perplexity(model, tokens, tok, stride=8)
    assert result["tokens"] == 29
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(loss.item()), rel=1e-5)


def test_a_model_in_training_is_scored_without_dropout_and_left_training():
    """A model in train mode (a training loop's, or a fresh GPT) was scored through its dropout:
    each call of perplexity, hellaswag or lambada gave another number."""
    model = tiny_model(vocab_size=257, dropout=0.5).train()
    tokens = torch.randint(0, 257, (80,), generator=torch.Generator().manual_seed(1))
    pairs = [(tokens[:20].tolist(), tokens[20:24].tolist())]

    def scores():
        return evaluate.perplexity(model, tokens, BYTE)["loss"], evaluate.score_continuations(model, pairs)[0]["nll"]

    in_training = scores()
    assert model.training and model.transformer.drop.training  # its own mode, given back
    model.eval()
    assert scores() == in_training


def test_stride_zero_is_refused_not_taken_as_the_default():
    """`gptlab eval --stride 0` ran the default stride (block_size / 2) without a word."""
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"stride must be in \[1, block_size=32\], got 0"):
        evaluate.perplexity(tiny_model(), tokens, get_tokenizer("byte"), stride=0)
    with pytest.raises(ValueError, match="got 0"):
        evaluate.sequence_nll(tiny_model(), tokens, stride=0)
    assert evaluate.perplexity(tiny_model(), tokens, get_tokenizer("byte"))["stride"] == 16  # None: the default


def test_sliding_window_with_stride_one_gives_each_token_the_longest_context():
    model = tiny_model()
    W = model.config.block_size
    tokens = torch.randint(0, 97, (90,), generator=torch.Generator().manual_seed(2))
    expected = 0.0
    with torch.no_grad():
        for j in range(1, len(tokens)):
            ctx = tokens[max(0, j - W) : j]
            logits, _ = model(ctx[None])
            expected -= F.log_softmax(logits[0, -1], -1)[tokens[j]].item()
    nll, count = evaluate.sequence_nll(model, tokens, stride=1, batch_size=16)
    assert count == len(tokens) - 1
    assert nll == pytest.approx(expected, rel=1e-5)


def test_non_overlapping_windows_and_batching():
    model = tiny_model()
    W = model.config.block_size
    tokens = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(3))
    expected = 0.0
    with torch.no_grad():
        for b in range(0, 99, W):
            e = min(b + W, 99)
            logits, _ = model(tokens[None, b:e])
            expected += F.cross_entropy(logits[0], tokens[b + 1 : e + 1], reduction="sum").item()
    one, _ = evaluate.sequence_nll(model, tokens, stride=W, batch_size=1)
    many, _ = evaluate.sequence_nll(model, tokens, stride=W, batch_size=3)
    assert one == pytest.approx(expected, rel=1e-5)
    assert many == pytest.approx(expected, rel=1e-5)


def test_bits_per_byte_uses_the_byte_count():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    tok = get_tokenizer("gpt2")
    text = "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 日本語"
    tokens = tok.encode(text) + [tok.eot_token] + tok.encode(" more")
    result = evaluate.perplexity(model, tokens, tok)
    first = len(tok.decode_bytes(tokens[:1]))
    assert result["bytes"] == len(text.encode()) - first + len(b" more")  # <|endoftext|> counts no bytes
    nll = result["loss"] * result["tokens"]
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / result["bytes"], rel=1e-9)


def test_perplexity_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="at least 2 tokens"):
        evaluate.perplexity(model, [5], BYTE)
    with pytest.raises(ValueError, match="stride"):
        evaluate.perplexity(model, list(range(40)), BYTE, stride=33)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        evaluate.perplexity(model, [5, 200], BYTE)


def test_read_tokens(tmp_path):
    tok = get_tokenizer("gpt2")
    ids = np.array([10, 50256, 300, 7], dtype=np.uint16)
    ids.tofile(tmp_path / "val.bin")
    assert evaluate.read_tokens(tmp_path, tok).tolist() == ids.tolist()  # a directory: its val.bin
    wide = tmp_path / "wide"
    wide.mkdir()
    np.array([1, 2, 3], dtype=np.uint32).tofile(wide / "val.bin")
    (wide / "manifest.json").write_text(json.dumps({"tokenizer": "gpt2", "dtype": "uint32"}))
    assert evaluate.read_tokens(wide / "val.bin", tok).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="holds gpt2 tokens; the model uses the byte tokenizer"):
        evaluate.read_tokens(wide / "val.bin", BYTE)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="multiple of 2"):
        evaluate.read_tokens(tmp_path / "odd.bin", tok)
    np.array([60000], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="outside the gpt2 vocabulary"):
        evaluate.read_tokens(tmp_path / "big.bin", tok)
    (tmp_path / "t.txt").write_text("hello world")
    assert evaluate.read_tokens(tmp_path / "t.txt", tok).tolist() == tok.encode("hello world")


def test_a_text_file_is_scored_as_its_bytes_are(tmp_path):
    """read_text translated newlines: a Windows file's \\r\\n (and a lone \\r) was scored as \\n, so
    its perplexity was neither the file's nor that of its `gptlab prepare`d tokens (which keep
    them), and bits per byte divided by fewer bytes than the file holds."""
    from gptlab.data import prepare

    raw = "First Citizen:\r\nBefore we proceed\rany further, hear me speak.\r\n" * 4
    path = tmp_path / "crlf.txt"
    path.write_bytes(raw.encode())
    assert evaluate.read_tokens(path, BYTE).tolist() == BYTE.encode(raw)
    prepare(str(path), tmp_path / "data", tokenizer="byte", val_fraction=0.5, workers=1, progress=False)
    val = evaluate.read_tokens(tmp_path / "data", BYTE).tolist()
    assert evaluate.read_tokens(path, BYTE).tolist()[-len(val) :] == val


# ----------------------------------------------------------------------------- HellaSwag


def write_hellaswag(path, items):
    """Records in the official hellaswag_val.jsonl layout."""
    with open(path, "w") as f:
        for i, (ctx, endings, label) in enumerate(items):
            record = {
                "ind": i,
                "activity_label": "Test",
                "ctx_a": ctx,
                "ctx_b": "",
                "ctx": ctx,
                "split": "val",
                "split_type": "indomain",
                "label": label,
                "endings": endings,
                "source_id": f"test~{i}",
            }
            f.write(json.dumps(record) + "\n")


# A unigram model: 'a' likely, ' ' next, 'b' next, everything else unlikely. A one-token ending
# " b" has a small summed loss; a long run of 'a' has the smaller mean loss per token.
PREFS = {"a": 5.0, " ": 4.0, "b": 3.0}
ITEMS = [
    ("The cat sat on the", ["aaaa", "zzzz", "qqqq", "xyxy"], 0),  # both methods right
    ("Then", ["b", "aaaaaaaaaa", "zz", "qq"], 1),  # only the mean (acc_norm) is right
    ("Then", ["b", "aaaaaaaaaa", "zz", "qq"], 0),  # only the sum (acc) is right
    ("So", ["zzz", "qqq", "aaaa", "xxx"], 1),  # both wrong
]


def test_hellaswag_scores_follow_their_definitions(tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    write_hellaswag(path, ITEMS)
    model = table_model(unigram_table(PREFS))
    result = evaluate.hellaswag(model, BYTE, evaluate.hellaswag_examples(path), batch_size=3)
    preds = [(e["pred"], e["pred_norm"]) for e in result["per_example"]]
    assert preds == [(0, 0), (0, 1), (0, 1), (2, 2)]
    assert result["acc"] == pytest.approx(2 / 4)  # examples 0 and 2
    assert result["acc_norm"] == pytest.approx(2 / 4)  # examples 0 and 1
    for (ctx, endings, _), ex in zip(ITEMS, result["per_example"], strict=True):
        for ending, s, m in zip(endings, ex["sum_loss"], ex["mean_loss"], strict=True):
            cont = BYTE.encode(" " + ending)
            expected = direct_nll(model, BYTE.encode(ctx), cont)
            assert s == pytest.approx(expected, rel=1e-5)
            assert m == pytest.approx(expected / len(cont), rel=1e-5)


def test_hellaswag_picks_what_the_model_prefers(tmp_path):
    path = tmp_path / "h.jsonl"
    items = [("ctx", ["aaa", "zzz", "qqq", "xxx"], 0), ("ctx", ["zzz", "qqq", "aaa", "xxx"], 2)]
    write_hellaswag(path, items)
    model = table_model(unigram_table(PREFS))
    result = evaluate.hellaswag(model, BYTE, evaluate.hellaswag_examples(path))
    assert result["acc"] == result["acc_norm"] == 1.0
    model = table_model(unigram_table({"z": 6.0, " ": 4.0}))  # now prefers the wrong endings
    result = evaluate.hellaswag(model, BYTE, evaluate.hellaswag_examples(path))
    assert result["acc"] == result["acc_norm"] == 0.0


# ----------------------------------------------------------------------------- LAMBADA


def successor_table(pairs: dict[str, str]) -> torch.Tensor:
    table = torch.zeros(257, 257)
    for a, b in pairs.items():
        table[ord(a), ord(b)] = 8.0
    return table


def test_lambada_accuracy_and_perplexity(tmp_path):
    path = tmp_path / "lambada_test.jsonl"
    texts = ["foo foo bar", "xx cat", "he said zz bat", "qq bar"]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    # greedy continues 'o' -> ' ' -> 'b' -> 'a' -> 'r': only the first " bar" is produced in full;
    # after "qq" the space is not greedy, though the rest of the word is
    model = table_model(successor_table({"o": " ", " ": "b", "b": "a", "a": "r"}))
    examples = evaluate.lambada_examples(path)
    assert [(e["context"], e["target"]) for e in examples] == [
        ("foo foo", " bar"),
        ("xx", " cat"),
        ("he said zz", " bat"),
        ("qq", " bar"),
    ]
    result = evaluate.lambada(model, BYTE, examples, batch_size=3)
    assert result["acc"] == pytest.approx(1 / 4)
    nll = [direct_nll(model, BYTE.encode(e["context"]), BYTE.encode(e["target"])) for e in examples]
    assert result["perplexity"] == pytest.approx(math.exp(sum(nll) / 4), rel=1e-5)
    assert result["token_perplexity"] == pytest.approx(math.exp(sum(nll) / 16), rel=1e-5)
    # a mean loss past ~709 nats (long last words, an untrained model) overflowed math.exp
    assert evaluate._exp(800.0) == math.inf and evaluate._exp(1.0) == math.e


def test_context_longer_than_the_model_is_cropped_from_the_left():
    model = tiny_model()  # block_size 32
    ctx, cont = list(range(1, 60)), [5, 6, 7]
    got = evaluate.score_continuations(model, [(ctx, cont)])[0]
    kept = (ctx + cont)[-33:]
    assert got["nll"] == pytest.approx(direct_nll(model, kept[:-3], cont), rel=1e-5)


# ----------------------------------------------------------------------------- bad files, downloads


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"text": "a b"}', "{not json", '{"text": "c d"}'], r"\.jsonl:2: not valid JSON"),
        (['{"text": "a b"}', "", '{"txt": "c d"}'], r"\.jsonl:3: field 'text' missing"),
        (['{"text": "oneword"}'], r"\.jsonl:1: 'text' needs a context and a last word"),
        (["[1, 2]"], r"\.jsonl:1: expected a JSON object"),
    ],
)
def test_malformed_lambada_lines_name_the_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        evaluate.lambada_examples(path)


def test_malformed_hellaswag_records(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_hellaswag(path, [("ctx", ["a", "b"], 0), ("ctx", ["a", "b"], 5)])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: label 5"):
        evaluate.hellaswag_examples(path)
    path.write_text('{"ctx": "c", "endings": "abc", "label": 0}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: field 'endings' missing or not a list"):
        evaluate.hellaswag_examples(path)


def test_download_goes_to_the_cache_once(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLAB_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "remote.jsonl"
    source.write_text('{"text": "a b"}\n')
    path = evaluate.cached_download(source.as_uri(), "lambada_test.jsonl")  # a file:// URL: no network
    assert path == tmp_path / "cache" / "lambada_test.jsonl" and path.read_text() == source.read_text()
    source.unlink()
    assert evaluate.task_data("lambada", None) == path  # no --data: the cached copy
    with pytest.raises(ValueError, match="could not be downloaded.*--data"):
        evaluate.cached_download((tmp_path / "missing").as_uri(), "other.jsonl")
    assert not (tmp_path / "cache" / "other.jsonl").exists()


# ----------------------------------------------------------------------------- CLI


@pytest.fixture
def byte_model_dir(tmp_path):
    save_model(table_model(unigram_table(PREFS)), tmp_path / "model", tokenizer="byte")
    return tmp_path / "model"


def test_cli_eval_perplexity_writes_json(tmp_path, byte_model_dir, capsys):
    text = tmp_path / "text.txt"
    text.write_text("a banana and a bandana, " * 10)
    out = tmp_path / "ppl.json"
    args = ["eval", "--model", str(byte_model_dir), "--task", "perplexity", "--data", str(text), "--json", str(out)]
    assert main([*args, "--stride", "16", "--no-progress"]) == 0
    result = json.loads(out.read_text())
    expected = evaluate.perplexity(table_model(unigram_table(PREFS)), BYTE.encode(text.read_text()), BYTE, stride=16)
    assert result["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(expected["bits_per_byte"], rel=1e-5)
    assert "perplexity" in capsys.readouterr().out
    # flags the task would ignore are refused (it ran the whole file, saying nothing); a file that
    # is not UTF-8 is named
    for extra, message in [(["--limit", "3"], "--limit does not apply to --task perplexity"),
                           (["--max-length", "8"], "--max-length does not apply"),
                           (["--include-path", str(tmp_path)], "--include-path does not apply")]:  # fmt: skip
        assert main([*args, *extra]) == 2
        assert message in capsys.readouterr().err
    for json_out, message in [("", "--json ''"), (str(tmp_path), "not a file that can be written")]:
        assert main([*args[:-1], json_out]) == 2  # before the evaluation, not after it
        assert message in capsys.readouterr().err
    from gptlab.classify_data import prepare_classify

    (tmp_path / "c.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n' * 4)
    prepare_classify(tmp_path / "c.jsonl", tmp_path / "cls", tokenizer="byte", val_fraction=0.5)
    assert main([*args[:-3], str(tmp_path / "cls"), "--json", str(out)]) == 2  # examples, not running text
    assert "holds classify examples" in capsys.readouterr().err
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert main([*args[:-3], str(tmp_path / "latin1.txt"), "--json", str(out)]) == 2
    assert "latin1.txt: not UTF-8 text" in capsys.readouterr().err


def test_cli_eval_perplexity_on_a_prepared_directory(tmp_path, byte_model_dir):
    from gptlab.data import prepare

    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    prepare(str(text), tmp_path / "data", tokenizer="byte", val_fraction=0.25, workers=1, progress=False)
    val = np.fromfile(tmp_path / "data" / "val.bin", dtype=np.uint16)
    assert evaluate.read_tokens(tmp_path / "data", BYTE).tolist() == val.tolist()
    out = tmp_path / "ppl.json"
    args = ["eval", "--model", str(byte_model_dir), "--task", "perplexity", "--data", str(tmp_path / "data")]
    assert main([*args, "--json", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["tokens"] == len(val) - 1


def test_cli_eval_hellaswag_and_a_bad_line(tmp_path, byte_model_dir, capsys):
    data, out = tmp_path / "h.jsonl", tmp_path / "h.json"
    write_hellaswag(data, ITEMS)
    args = ["eval", "--model", str(byte_model_dir), "--task", "hellaswag", "--data", str(data), "--no-progress"]
    assert main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["acc"], result["acc_norm"], result["examples"]) == (0.5, 0.5, 4)
    assert main([*args, "--json", str(out), "--limit", "1"]) == 0
    assert json.loads(out.read_text())["examples"] == 1
    with open(data, "a") as f:
        f.write("{broken\n")
    assert main([*args, "--json", str(tmp_path / "x.json")]) == 2
    assert "h.jsonl:5: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def strict_json(path):
    """The file's JSON as a strict reader (jq, JavaScript) takes it: no bare NaN or Infinity."""

    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_cli_eval_json_has_no_bare_nan_or_infinity(tmp_path, byte_model_dir):
    """Text of only <|endoftext|> after its first token has no bytes to score: bits per byte is
    NaN, and `--json` wrote it as a bare NaN, which is not JSON (jq and JSON.parse refuse it)."""
    np.array([256] * 5, dtype=np.uint16).tofile(tmp_path / "val.bin")  # the byte tokenizer's <|endoftext|>
    out = tmp_path / "ppl.json"
    args = ["eval", "--model", str(byte_model_dir), "--task", "perplexity", "--data", str(tmp_path / "val.bin")]
    assert main([*args, "--json", str(out), "--no-progress"]) == 0
    result = strict_json(out)
    assert (result["bytes"], result["bits_per_byte"], result["tokens"]) == (0, None, 4)
    assert math.isfinite(result["loss"])


def test_cli_eval_reads_a_hugging_face_models_own_tokenizer(tmp_path):
    """A GPT-2 that ships its own vocab.json and merges.txt was scored on GPT-2's tokens: the same
    perplexity as transformers gives with the model's own tokenizer."""
    from conftest import own_bpe_model_dir

    model, ref_tok = own_bpe_model_dir(tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text("Über die Brücke, it's 42 o'clock\n\nder die das 🙂")
    ids = torch.tensor([ref_tok.encode(text.read_text())])  # (1, T)
    with torch.no_grad():
        expected = model(ids, labels=ids).loss.item()
    out = tmp_path / "ppl.json"
    assert main(["eval", "--model", str(tmp_path / "m"), "--task", "perplexity", "--data", str(text), "--json", str(out), "--no-progress"]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["tokens"] == ids.shape[1] - 1
    assert result["loss"] == pytest.approx(expected, rel=1e-5)
