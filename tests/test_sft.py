"""gptlab.sft: instruction records -> tokens and a loss mask; packed rows that equal examples run
one by one; the masked loss is cross-entropy over the response tokens only; `gptlab prepare`."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gptlab.cli import main
from gptlab.config import GPTConfig
from gptlab.model import GPT, segment_positions
from gptlab.sft import IGNORE, ExampleLoader, Examples, Template, encode_example, prepare_sft, render_example
from gptlab.tokenizer import get_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = get_tokenizer("gpt2")


def alpaca(n=24, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(v) for v in rng.integers(0, 99, 2))
        rec = {"instruction": "Add the numbers.", "input": f"{a} + {b}", "output": str(a + b) + " done" * (i % 4)}
        if i % 3 == 0:
            rec = {"instruction": f"Say {a} twice.", "output": f"{a} {a}"}  # no input: the other prompt
        out.append(rec)
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_mask_covers_the_response_and_the_end_only():
    rec = {"instruction": "Add the numbers.", "input": "2 + 3", "output": "5"}
    ids, mask = encode_example(TOK, Template().render(rec))
    prompt = Template().prompt_for("Add the numbers.", "2 + 3")
    n_prompt = len(TOK.encode(prompt))
    assert TOK.decode(ids[:n_prompt]) == prompt and prompt.endswith("### Response:\n")
    assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
    assert TOK.decode(ids[n_prompt:]) == "5<|endoftext|>"
    all_ids, all_mask = encode_example(TOK, Template().render(rec), train_on="all")
    assert all_ids == ids and all(all_mask)


def test_chat_trains_on_assistant_turns_only():
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                        {"role": "assistant", "content": "Farewell."}]}  # fmt: skip
    ids, mask = encode_example(TOK, Template().render(rec))
    trained = [TOK.decode([i for i, m in zip(ids, mask, strict=True) if m])]
    assert trained == ["Hello!\n\nFarewell.\n\n<|endoftext|>"]
    with pytest.raises(ValueError, match="role"):
        Template().render({"messages": [{"role": "robot", "content": "x"}]})


def test_a_template_file_overrides_the_prompt(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"prompt_no_input": "Q: {instruction}\nA: "}))
    t = Template.load(tmp_path / "t.json")
    assert t.render({"instruction": "why", "output": "because"}) == [("Q: why\nA: ", False), ("because", True)]
    (tmp_path / "bad.json").write_text(json.dumps({"nonsense": 1}))
    with pytest.raises(ValueError, match="keys must be among"):
        Template.load(tmp_path / "bad.json")
    # a field the records do not have, and a value that is not text (KeyError, AttributeError before)
    for bad, message in [({"prompt_no_input": "{instruction} {foo}"}, "may use instruction, not foo"),
                         ({"assistant": 5}, "must be a string")]:  # fmt: skip
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            Template.load(tmp_path / "bad.json")


def test_masked_loss_is_cross_entropy_over_the_response_tokens(tmp_path):
    """The loss the trainer takes from a padded batch equals a direct cross-entropy over exactly
    the tokens whose mask is set (each predicted from the token before it)."""
    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca()), tmp_path / "d", val_fraction=0.25)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=64, n_layer=1, n_head=2, n_embd=16))
    loader = ExampleLoader(tmp_path / "d", "train", 4, 64, layout="pad", seed=1)
    x, y, extra = loader.batch(0)
    _, loss = model(x, y, return_logits=False, **extra)
    examples = Examples(tmp_path / "d", "train")
    logits, _ = model(x)
    picked_logits, picked_targets = [], []
    for r, (i,) in enumerate(loader.rows(0)):
        ids, mask = examples[i]
        for t in range(len(ids) - 1):
            if mask[t + 1]:  # the response token t + 1, predicted at position t
                picked_logits.append(logits[r, t])
                picked_targets.append(int(ids[t + 1]))
    want = F.cross_entropy(torch.stack(picked_logits), torch.tensor(picked_targets))
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=0)  # measured 5e-7
    assert int((y != IGNORE).sum()) == len(picked_targets)


def test_packed_rows_equal_each_example_alone(tmp_path):
    """With segments, an example packed after others gets the logits it gets in its own row:
    positions restart and attention stays inside it; the packed loss is the token-weighted mean."""
    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca()), tmp_path / "d", val_fraction=0.25)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=160, n_layer=2, n_head=2, n_embd=16)).eval()
    packed = ExampleLoader(tmp_path / "d", "train", 2, 160, layout="pack", seed=1)
    x, y, extra = packed.batch(0)
    rows = packed.rows(0)
    assert max(len(r) for r in rows) > 1  # several examples share a row
    seg = extra["segments"]
    with torch.no_grad():
        logits, _ = model(x, segments=seg)
        _, loss = model(x, y, segments=seg, return_logits=False)
        examples = Examples(tmp_path / "d", "train")
        total, count = 0.0, 0
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                ids, mask = examples[i]
                n = len(ids) - 1
                alone, _ = model(torch.from_numpy(ids[:-1])[None])
                torch.testing.assert_close(logits[r, at : at + n], alone[0], atol=1e-5, rtol=0)  # measured 2e-6
                targets = torch.where(torch.from_numpy(mask[1:]), torch.from_numpy(ids[1:]), IGNORE)
                total += float(F.cross_entropy(alone[0], targets, ignore_index=IGNORE, reduction="sum"))
                count += int((targets != IGNORE).sum())
                at += n
    assert float(loss) == pytest.approx(total / count, abs=1e-5)


def test_segment_positions_restart_at_each_example():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 2, 3, 3, 3, 3, 0]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 0, 0, 1, 2, 3, 0]]


def test_loader_batches_are_pure_functions_of_k_and_cover_each_epoch(tmp_path):
    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca(40)), tmp_path / "d", val_fraction=0.25)
    for layout in ("pack", "pad"):
        a = ExampleLoader(tmp_path / "d", "train", 3, 64, layout=layout, seed=5)
        b = ExampleLoader(tmp_path / "d", "train", 3, 64, layout=layout, seed=5)
        for k in (0, 7, 3):
            assert all(torch.equal(u, v) for u, v in zip(a.batch(k)[:2], b.batch(k)[:2], strict=True))
        epoch = a.epoch_rows(0)
        assert sorted(int(i) for row in epoch for i in row) == list(range(30))  # every example once
        assert all(a.lengths[row].sum() <= 64 for row in epoch)


def test_a_block_size_that_cuts_off_every_response_is_refused(tmp_path, caplog):
    """Examples whose trained tokens all lie past block_size trained on nothing (loss 0.0, exit 0):
    refused when every example of a split is cut so, a warning counting them when some are."""
    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca(40)), tmp_path / "d", val_fraction=0.25)
    examples = Examples(tmp_path / "d", "train")
    full = examples.trained(10_000)
    assert full.tolist() == [int(examples[i][1][1:].sum()) for i in range(len(examples))]  # every trained target
    prompt = min(int(np.argmax(examples[i][1])) for i in range(len(examples)))  # the shortest prompt
    for layout in ("pack", "pad"):
        with pytest.raises(ValueError, match=f"30 of 30 train examples have no trained-on token within block_size {prompt - 1}"):  # fmt: skip
            ExampleLoader(tmp_path / "d", "train", 2, prompt - 1, layout=layout)
    with caplog.at_level("WARNING", logger="gptlab.sft"):
        ExampleLoader(tmp_path / "d", "train", 2, prompt)  # the shortest prompt's first response token fits
    assert "have no trained-on token within block_size" in caplog.text


def test_rank_rows_together_are_the_global_batch(tmp_path):
    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca(40)), tmp_path / "d", val_fraction=0.25)
    one = ExampleLoader(tmp_path / "d", "train", 4, 64, seed=2)
    ranks = [ExampleLoader(tmp_path / "d", "train", 2, 64, seed=2, rank=r, world_size=2) for r in range(2)]
    for k in range(5):
        got = [row.tolist() for r in ranks for row in r.rows(k)]
        assert got == [row.tolist() for row in one.rows(k)]


def test_prepare_command_writes_and_shows_marked_examples(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", alpaca())
    assert main(["prepare", "--input", str(src), "--out", str(tmp_path / "d"), "--show", "1"]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["kind"] == "sft" and manifest["train_on"] == "response"
    first = Examples(tmp_path / "d", "train")[0]
    trained = TOK.decode(first[0][first[1]].tolist())
    assert f"[[{trained}]]" in out and "### Response:\n[[" in out
    assert render_example(tmp_path / "d", 0).count("[[") == 1
    main(["prepare", "--input", str(src), "--out", str(tmp_path / "all"), "--train-on", "all"])
    assert json.loads((tmp_path / "all" / "manifest.json").read_text())["trained_tokens"] == manifest["tokens"]
    assert main(["prepare", "--out", str(tmp_path / "d"), "--show", "1"]) == 0  # a directory prepared before
    assert f"[[{trained}]]" in capsys.readouterr().out
    (tmp_path / "t.txt").write_text("plain text, not instructions")
    main(["prepare", "--input", str(tmp_path / "t.txt"), "--out", str(tmp_path / "text"), "--no-progress"])
    capsys.readouterr()
    assert main(["prepare", "--out", str(tmp_path / "text"), "--show", "1"]) == 2  # was "no train.mask.bin"
    assert "holds text data" in capsys.readouterr().err


def test_prepare_refuses_an_out_under_a_file_before_tokenizing(tmp_path, capsys, monkeypatch):
    """`gptlab prepare --out FILE/d` of instruction records failed only after tokenizing them all."""
    from gptlab import sft

    (tmp_path / "afile").write_text("kept")
    monkeypatch.setattr(sft, "encode_example", lambda *a, **k: pytest.fail("tokenized the records"))
    src = write_jsonl(tmp_path / "a.jsonl", alpaca())
    assert main(["prepare", "--input", str(src), "--out", str(tmp_path / "afile" / "d")]) == 2
    assert f"{tmp_path}/afile is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, data, message",
    [(["--labels", "a,b"], "text", "--labels is for classify data; this input is text"),
     (["--train-on", "all"], "text", "--train-on is for sft data; this input is text"),
     (["--seed", "3"], "text", "--seed is for sft or classify data; this input is text"),
     (["--template", "alpaca"], "classify", "--template is for sft data; this input is classify"),
     (["--labels", "x,y"], "sft", "--labels is for classify data; this input is sft")],
)  # fmt: skip
def test_prepare_refuses_an_option_its_data_does_not_use(tmp_path, capsys, flags, data, message):
    """--labels on a text file (or --template on text/label records, ...) was silently ignored: the
    directory held plain text tokens, not the classification set the user asked for."""
    if data == "text":
        src = tmp_path / "t.txt"
        src.write_text("plain text, not records")
    elif data == "classify":
        src = write_jsonl(tmp_path / "c.jsonl", [{"text": f"t{i}", "label": "ab"[i % 2]} for i in range(8)])
    else:
        src = write_jsonl(tmp_path / "a.jsonl", alpaca())
    assert main(["prepare", "--input", str(src), "--out", str(tmp_path / "d"), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "d").exists()


def test_bad_records_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="record 2: record needs string fields output"):  # counted from 1
        prepare_sft(write_jsonl(tmp_path / "a.jsonl", [alpaca()[0], {"instruction": "x"}]), tmp_path / "d")
    (tmp_path / "b.jsonl").write_text('{"instruction": "x", "output": "y"}\n\nnot json\n')
    with pytest.raises(ValueError, match="b.jsonl: line 3 is not valid JSON"):  # the file's line, not the record's
        prepare_sft(tmp_path / "b.jsonl", tmp_path / "d")


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_sft_training_learns_the_responses_and_resumes_exactly(tmp_path, layout):
    """gptlab train on an SFT directory: the response loss falls, and a run cut at step 4 and
    resumed equals the straight run bit for bit (the loader's state is its batch counter)."""
    from gptlab.train import TrainConfig, train

    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca(40)), tmp_path / "d", val_fraction=0.25)
    common = dict(data_dir=str(tmp_path / "d"), model="gpt2-tiny", block_size=128, batch_size=4, lr=3e-3, sft_layout=layout,
                  warmup_steps=0, schedule="constant", eval_interval=4, eval_steps=2, progress=False, sample_tokens=0,
                  precision="float32")  # fmt: skip
    straight = train(TrainConfig(out_dir=str(tmp_path / "a"), max_steps=8, **common))
    train(TrainConfig(out_dir=str(tmp_path / "b"), max_steps=4, **common))
    resumed = train(TrainConfig(out_dir=str(tmp_path / "b"), max_steps=8, resume=True, **common))
    assert resumed["train_loss"] == straight["train_loss"] and resumed["val_loss"] == straight["val_loss"]
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in records if "val_loss" in r]
    assert evals[-1] < evals[0]
    # tokens counts the rows as run: a padded batch is as long as its longest example (it counted
    # batch_size x block_size, overstating tok/s), a packed one block_size
    loader = ExampleLoader(tmp_path / "d", "train", 4, 128, layout=layout, seed=TrainConfig().seed)
    assert straight["tokens"] == resumed["tokens"] == sum(loader.batch(k)[0].numel() for k in range(8))
    assert (straight["tokens"] < 8 * 4 * 128) == (layout == "pad")


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_byte_tokenized_examples_are_padded_with_the_byte_tokenizers_end(tmp_path, layout):
    """Rows were padded with GPT-2's <|endoftext|> (50256) whatever the data's tokenizer: a byte
    model (257 tokens) stopped at its first batch with "token id 50256 outside the vocabulary"."""
    from gptlab.train import TrainConfig, train

    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca(12)), tmp_path / "d", tokenizer="byte", val_fraction=0.25)
    summary = train(TrainConfig(data_dir=str(tmp_path / "d"), out_dir=str(tmp_path / "r"), n_layer=1, n_head=2,
                                n_embd=16, block_size=256, batch_size=4, max_steps=1, sft_layout=layout,
                                eval_interval=1, eval_steps=1, progress=False, sample_tokens=0, precision="float32"))  # fmt: skip
    assert summary["val_loss"] > 0


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_validation_loss_scores_each_response_token_once(tmp_path, layout):
    """10 validation examples in batches of 4 (pad): the last batch wrapped around to examples 0
    and 1, and val_loss was a mean over batches, so those counted twice; it is a mean over the
    response tokens of one pass."""
    from gptlab.train import TrainConfig, Trainer

    prepare_sft(write_jsonl(tmp_path / "a.jsonl", alpaca(40)), tmp_path / "d", val_fraction=0.25)
    trainer = Trainer(TrainConfig(data_dir=str(tmp_path / "d"), out_dir=str(tmp_path / "r"), n_layer=1, n_head=2,
                                  n_embd=16, block_size=64, batch_size=4, max_steps=1, sft_layout=layout,
                                  eval_interval=1, eval_steps=100, progress=False, sample_tokens=0,
                                  precision="float32"))  # fmt: skip
    summary = trainer.run()
    rows = trainer.val_loader.units()
    assert rows % 4 != 0  # the last batch wraps around
    whole = ExampleLoader(tmp_path / "d", "val", rows, 64, layout=layout, mode="sequential")
    x, y, extra = whole.batch(0)
    with torch.no_grad():
        _, loss = trainer.raw_model.eval()(x, y, **extra)
    assert summary["val_loss"] == pytest.approx(float(loss), abs=1e-5)  # measured: 1.3e-6 apart


def test_the_record_format_is_judged_from_the_first_record_alone(tmp_path, monkeypatch):
    """record_format parsed the whole first file to read its first record: every line of a JSONL
    pretraining dump (gigabytes) into memory before tokenizing began."""
    from gptlab import data, sft

    write_jsonl(tmp_path / "a.jsonl", alpaca(200))
    parsed, parse = [], data._json_line
    monkeypatch.setattr(data, "_json_line", lambda *a: parsed.append(a[1]) or parse(*a))
    assert sft.record_format(tmp_path / "a.jsonl") == "sft" and parsed == [1]
    (tmp_path / "b.csv").write_text("text,label\nhi,pos\nho,neg\n")
    assert sft.record_format(tmp_path / "b.csv") == "classify"
    (tmp_path / "c.jsonl").write_text("\n[1, 2]\n")
    with pytest.raises(ValueError, match="c.jsonl line 2, record 1 is not an object"):
        sft.record_format(tmp_path / "c.jsonl")


def test_bad_records_name_their_file_and_line(tmp_path):
    """The errors said "record 32" (counted across the inputs, blank lines skipped) or "the input
    holds no records", naming no file: they name the file and its line."""
    from gptlab.classify_data import prepare_classify

    good = write_jsonl(tmp_path / "good.jsonl", alpaca(3))
    (tmp_path / "bad.jsonl").write_text('{"instruction": "x", "output": "y"}\n\n{"instruction": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 3, record 5: record needs string fields output"):
        prepare_sft([good, tmp_path / "bad.jsonl"], tmp_path / "d")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no records"):
        prepare_sft(tmp_path / "empty.jsonl", tmp_path / "d")
    (tmp_path / "latin.jsonl").write_bytes('{"instruction": "caf\xe9", "output": "y"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="latin.jsonl: not UTF-8 text"):  # it was a bare UnicodeDecodeError
        prepare_sft(tmp_path / "latin.jsonl", tmp_path / "d")
    (tmp_path / "c.csv").write_text('text,label\nhello,a\n"two\nlines",b\nbye,\n')
    with pytest.raises(ValueError, match=r"c.csv line 5, record 3: its `label` is missing"):
        prepare_classify(tmp_path / "c.csv", tmp_path / "c")
