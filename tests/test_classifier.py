"""gptlab.classifier: GPT2ForSequenceClassification's logits both ways (transformers writes a
random one, gptlab reads it; gptlab writes, transformers reads), pooling at the last real token
with right and left padding, which parameters train, and the classification data."""

import json

import numpy as np
import pytest
import torch

from gptlab.classifier import GPTForSequenceClassification, from_language_model, set_trainable
from gptlab.classify_data import ClassifyLoader, evaluate_classifier, prepare_classify
from gptlab.config import GPTConfig
from gptlab.hf import load_pretrained, save_pretrained
from gptlab.model import GPT

pytestmark = pytest.mark.usefixtures("one_thread")
PAD = 50256
LABELS = ["neg", "neutral", "pos"]


def hf_classifier(directory):
    """A random GPT2ForSequenceClassification written by transformers itself, norms off their init."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=32, n_layer=2, n_head=2, n_embd=32, pad_token_id=PAD,
                        id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})  # fmt: skip
    model = GPT2ForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return model


def rows(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50000, (n,), generator=g) for n in lengths]


def test_reads_transformers_classifier_with_its_logits_right_padded(tmp_path):
    hf = hf_classifier(tmp_path)
    ours = load_pretrained(tmp_path)
    assert isinstance(ours, GPTForSequenceClassification)
    assert ours.config.labels == LABELS and ours.config.pad_token_id == PAD
    seqs = rows([7, 4, 1])
    x = torch.full((3, 7), PAD)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
    with torch.no_grad():
        want = hf(input_ids=x).logits  # transformers pools at the last non-pad token
        got = ours(x)[0]
    assert got.shape == (3, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)  # measured 6e-8


def test_writes_a_classifier_transformers_reads(tmp_path):
    from transformers import GPT2ForSequenceClassification

    torch.manual_seed(2)
    config = GPTConfig(vocab_size=50257, block_size=32, n_layer=2, n_head=2, n_embd=32, num_labels=3, labels=LABELS,
                       pad_token_id=PAD)  # fmt: skip
    ours = GPTForSequenceClassification(config).eval()
    save_pretrained(ours, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["GPT2ForSequenceClassification"] and saved["id2label"]["2"] == "pos"
    hf = GPT2ForSequenceClassification.from_pretrained(tmp_path).eval()
    assert hf.config.pad_token_id == PAD and hf.config.num_labels == 3
    x = torch.stack([torch.cat([s, torch.full((7 - len(s),), PAD)]) for s in rows([7, 3])])
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(input_ids=x).logits, atol=1e-5, rtol=0)


def test_left_padding_pools_the_last_token_and_equals_the_unpadded_text(tmp_path):
    hf_classifier(tmp_path)
    ours = load_pretrained(tmp_path)
    seqs = rows([6, 2, 4], seed=3)
    right = torch.full((3, 6), PAD)
    left = torch.full((3, 6), PAD)
    for i, s in enumerate(seqs):
        right[i, : len(s)] = s
        left[i, 6 - len(s) :] = s
    with torch.no_grad():
        alone = torch.cat([ours(s[None])[0] for s in seqs])
        torch.testing.assert_close(ours(right)[0], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(left, attention_mask=left != PAD)[0], alone, atol=1e-5, rtol=0)
        # and through transformers, with the positions counted from each row's first token
        from transformers import GPT2ForSequenceClassification

        hf = GPT2ForSequenceClassification.from_pretrained(tmp_path).eval()
        mask = (left != PAD).long()
        want = hf(input_ids=left, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        torch.testing.assert_close(ours(left, attention_mask=mask)[0], want, atol=1e-5, rtol=0)


def test_an_explicit_mask_wins_over_pad_ids_inside_the_text(tmp_path):
    """pad_token_id is <|endoftext|> by default; a text that holds one still pools at its end."""
    hf_classifier(tmp_path)
    ours = load_pretrained(tmp_path)
    s = rows([5])[0]
    s[-1] = PAD
    x = torch.cat([s, torch.full((2,), PAD)])[None]
    with torch.no_grad():
        by_mask = ours(x, attention_mask=torch.tensor([[1] * 5 + [0, 0]]))[0]
        torch.testing.assert_close(by_mask, ours(s[None], attention_mask=torch.ones(1, 5))[0])


def test_from_language_model_shares_the_body_and_trains_what_it_is_told():
    torch.manual_seed(0)
    lm = GPT(GPTConfig(vocab_size=300, block_size=16, n_layer=3, n_head=2, n_embd=16)).train()
    clf = from_language_model(lm, ["a", "b"], pad_token_id=0)
    assert clf.transformer is lm.transformer and clf.score.weight.shape == (2, 16)
    x = torch.randint(1, 300, (4, 9))
    y = torch.tensor([0, 1, 1, 0])
    for spec, expected in [("head", {"score", "transformer.ln_f"}),
                           ("last:1", {"score", "transformer.ln_f", "transformer.h.2"})]:  # fmt: skip
        for p in clf.parameters():
            p.requires_grad_(True)
        set_trainable(clf, spec)
        clf.zero_grad()
        clf(x, y)[1].backward()
        got = {n.rsplit(".", 1)[0] for n, p in clf.named_parameters() if p.grad is not None}
        got = {g if not g.startswith("transformer.h.") else ".".join(g.split(".")[:3]) for g in got}
        assert got == expected, spec
    with pytest.raises(ValueError, match="trainable last:9: the model has 3 blocks"):
        set_trainable(clf, "last:9")


def test_loss_is_cross_entropy_of_the_pooled_logits():
    torch.manual_seed(0)
    clf = GPTForSequenceClassification(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=16,
                                                 num_labels=4, pad_token_id=0))  # fmt: skip
    x = torch.randint(1, 100, (3, 5))
    x[1, 3:] = 0
    y = torch.tensor([3, 0, 2])
    logits, loss = clf(x, y)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, y))
    with pytest.raises(ValueError, match="label ids"):
        clf(x, torch.zeros(3, 5, dtype=torch.long))


def write_records(path, n=40):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            label = LABELS[i % 3]
            f.write(
                json.dumps({"text": f"{label} " + " ".join(rng.choice(["x", "y", "z"], 3 + i % 5)), "label": label})
                + "\n"
            )


def test_prepared_data_loads_as_labelled_right_padded_batches(tmp_path):
    write_records(tmp_path / "d.jsonl")
    m = prepare_classify(tmp_path / "d.jsonl", tmp_path / "out", labels=LABELS, val_fraction=0.25)
    assert m["kind"] == "classify" and m["labels"] == LABELS
    assert m["examples"] == {"train": 30, "val": 10}
    loader = ClassifyLoader(tmp_path / "out", "train", 4, 8, mode="random", seed=3)
    x, y, extra = loader.batch(5)
    mask = extra["attention_mask"]
    from gptlab.tokenizer import get_tokenizer

    tok = get_tokenizer("gpt2")
    for row, label, m_row in zip(x, y, mask, strict=True):
        text = tok.decode(row[m_row].tolist())
        assert text.split()[0] == LABELS[int(label)]  # the label goes with its own text
        assert not m_row[int(m_row.sum()) :].any()  # right-padded
    assert torch.equal(loader.batch(5)[0], x)  # batch k is a pure function of k
    seen = np.concatenate([loader.indices(k) for k in range(30 // 4 * 2)])
    assert sorted(seen[:28].tolist()) == sorted(set(seen[:28].tolist()))  # an epoch repeats nothing


def test_evaluate_classifier_counts_a_confusion_matrix(tmp_path):
    torch.manual_seed(0)
    clf = GPTForSequenceClassification(GPTConfig(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16,
                                                 num_labels=3, labels=LABELS, pad_token_id=PAD)).eval()  # fmt: skip
    from gptlab.sft import read_records
    from gptlab.tokenizer import get_tokenizer

    write_records(tmp_path / "d.jsonl", n=12)
    records = read_records(tmp_path / "d.jsonl")
    result = evaluate_classifier(clf, get_tokenizer("gpt2"), records, batch_size=5)
    confusion = np.asarray(result["confusion"])
    tok = get_tokenizer("gpt2")
    preds = clf.classify(tok, [r["text"] for r in records]).argmax(-1)
    truth = torch.tensor([LABELS.index(r["label"]) for r in records])
    assert confusion.sum() == 12 and confusion.sum(1).tolist() == [4, 4, 4]
    assert result["accuracy"] == pytest.approx(float((preds == truth).float().mean()))
    assert confusion[0].tolist() == [int(((truth == 0) & (preds == k)).sum()) for k in range(3)]


def lm_base(directory):
    """A small random GPT-2 over GPT-2's vocabulary, saved natively (a --base to fine-tune)."""
    from gptlab.checkpoint import save_model

    torch.manual_seed(0)
    save_model(GPT(GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=32)), directory)
    return str(directory)


def cls_config(tmp_path, out, max_steps, resume=False, **overrides):
    from gptlab.train import TrainConfig

    settings = {"eval_interval": 3, "eval_steps": 2, **overrides}
    return TrainConfig(data_dir=str(tmp_path / "data"), out_dir=str(out), init_from=lm_base(tmp_path / "base"),
                       block_size=32, batch_size=4, max_steps=max_steps, lr=3e-3, warmup_steps=0, schedule="constant",
                       progress=False, precision="float32", resume=resume, **settings)  # fmt: skip


def test_lora_classifier_trains_resumes_loads_and_exports(tmp_path, capsys):
    """LoRA with a new score head: the checkpoint holds adapters + head; resume is exact;
    load_model rebuilds it; export --merge gives transformers' GPT2ForSequenceClassification
    the same logits; classify and eval --task classify print what the model computes."""
    from transformers import GPT2ForSequenceClassification

    from gptlab.cli import main
    from gptlab.loading import load_model
    from gptlab.tokenizer import get_tokenizer
    from gptlab.train import Trainer

    write_records(tmp_path / "d.jsonl")
    prepare_classify(tmp_path / "d.jsonl", tmp_path / "data", labels=LABELS, val_fraction=0.25)
    lora = dict(lora_rank=4, lora_alpha=8.0, lora_targets="c_attn.q,c_attn.v,mlp.c_fc")

    def run(out, steps, resume=False):
        trainer = Trainer(cls_config(tmp_path, out, steps, resume, **lora))
        summary = trainer.run()
        return trainer, summary

    straight, summary = run(tmp_path / "a", 6)
    trained = {n for n, p in straight.raw_model.named_parameters() if p.requires_grad}
    assert "score.weight" in trained and all(".lora_" in n for n in trained - {"score.weight"})
    run(tmp_path / "b", 3)
    resumed, _ = run(tmp_path / "b", 6, resume=True)
    for (name, p), q in zip(straight.raw_model.named_parameters(), resumed.raw_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert "val_accuracy" in summary and 0 <= summary["val_accuracy"] <= 1

    ckpt = summary["checkpoint"]
    loaded = load_model(ckpt)
    x = torch.randint(0, 50000, (3, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = straight.raw_model.eval()(x)[0]
        torch.testing.assert_close(loaded(x)[0], want, atol=1e-6, rtol=0)

    assert main(["export", "--model", ckpt, "--merge", "--out", str(tmp_path / "hf")]) == 0
    hf = GPT2ForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, want, atol=1e-5, rtol=0)

    tok = get_tokenizer("gpt2")
    text = "pos x y z"
    assert main(["classify", "--model", ckpt, "--text", text, "--json", str(tmp_path / "c.json")]) == 0
    got = json.loads((tmp_path / "c.json").read_text())
    assert got["labels"] == LABELS
    assert main(["classify", "--model", ckpt, "--text", text, "--json", ""]) == 2  # wrote nothing, exit 0
    torch.testing.assert_close(torch.tensor(got["probabilities"]), loaded.classify(tok, [text])[0], atol=1e-6, rtol=0)
    assert main(["eval", "--task", "classify", "--model", ckpt, "--data", str(tmp_path / "d.jsonl"),
                 "--json", str(tmp_path / "e.json")]) == 0  # fmt: skip
    result = json.loads((tmp_path / "e.json").read_text())
    from gptlab.sft import read_records

    expected = evaluate_classifier(loaded, tok, read_records(tmp_path / "d.jsonl"))
    assert result["accuracy"] == expected["accuracy"] and result["confusion"] == expected["confusion"]
    assert "confusion (rows: true label" in capsys.readouterr().out


def test_head_only_classifier_saves_natively_and_a_language_model_is_refused(tmp_path):
    from gptlab.cli import main
    from gptlab.loading import load_model
    from gptlab.train import train

    write_records(tmp_path / "d.jsonl")
    prepare_classify(tmp_path / "d.jsonl", tmp_path / "data", labels=LABELS, val_fraction=0.25)
    summary = train(cls_config(tmp_path, tmp_path / "run", 3, trainable="head"))
    base, tuned = load_model(str(tmp_path / "base")), load_model(summary["checkpoint"])
    assert isinstance(tuned, GPTForSequenceClassification) and tuned.config.labels == LABELS
    assert torch.equal(tuned.transformer.h[0].attn.c_attn.weight, base.transformer.h[0].attn.c_attn.weight)
    assert not torch.equal(tuned.transformer.ln_f.weight, base.transformer.ln_f.weight)  # the head trains
    assert main(["classify", "--model", str(tmp_path / "base"), "--text", "hi"]) == 2  # a clear error, exit 2
    assert main(["export", "--model", summary["checkpoint"], "--out", str(tmp_path / "m.gguf")]) == 2
    # the README's export of a head-trained classifier: no --merge (it has no adapter to fold in)
    assert main(["export", "--model", summary["checkpoint"], "--merge", "--out", str(tmp_path / "hf")]) == 2
    assert main(["export", "--model", summary["checkpoint"], "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "GPT2ForSequenceClassification"
    ]
    # quantize holds language models: a classifier is refused (it was an AttributeError on lm_head)
    assert main(["quantize", "--model", summary["checkpoint"], "--mode", "int8", "--out", str(tmp_path / "q")]) == 2
    assert not (tmp_path / "q").exists()


def test_classifier_adapters_in_peft_format_both_ways(tmp_path):
    """SEQ_CLS adapters: gptlab's (body adapters + the score head as modules_to_save) load in PEFT
    on GPT2ForSequenceClassification with gptlab's logits, and PEFT's load in gptlab with PEFT's."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import GPT2ForSequenceClassification

    from gptlab.loading import load_model
    from gptlab.lora import LoRASettings, apply_lora, lora_layers, save_adapter

    hf_classifier(tmp_path / "base")
    x = torch.randint(0, 50000, (2, 6), generator=torch.Generator().manual_seed(5))
    ours = apply_lora(load_pretrained(tmp_path / "base"), LoRASettings(rank=2, targets=("c_attn.q", "mlp.c_fc")))
    with torch.no_grad():
        for layer in lora_layers(ours).values():
            for b in layer.lora_B.values():
                b.normal_(0, 0.2)
        ours.score.weight.normal_(0, 0.5)  # a trained head differs from the base's
        want = ours(x)[0]
    save_adapter(ours, tmp_path / "ours")
    hf = GPT2ForSequenceClassification.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        got = PeftModel.from_pretrained(hf, tmp_path / "ours").eval()(input_ids=x).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    torch.manual_seed(3)
    theirs = get_peft_model(GPT2ForSequenceClassification.from_pretrained(tmp_path / "base"),
                            LoraConfig(r=2, target_modules=["c_attn", "c_proj"], task_type="SEQ_CLS",
                                       fan_in_fan_out=True))  # fmt: skip
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.normal_(0, 0.2)
        want = theirs.eval()(input_ids=x).logits
    theirs.save_pretrained(tmp_path / "theirs")
    with torch.no_grad():
        got = load_model(str(tmp_path / "base"), adapter=str(tmp_path / "theirs"))(x)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_record_without_a_label_is_refused_not_given_one(tmp_path):
    """A JSONL record with no `label` became a label named "None", a CSV row's empty cell one
    named "": both are refused, naming the record (counted from 1)."""
    (tmp_path / "a.jsonl").write_text('{"text": "hi", "label": "a"}\n{"text": "bye"}\n')
    with pytest.raises(ValueError, match="record 2: its `label` is missing or empty"):
        prepare_classify(tmp_path / "a.jsonl", tmp_path / "a")
    (tmp_path / "b.csv").write_text("text,label\nhello,a\nbye, \n")
    with pytest.raises(ValueError, match="record 2: its `label` is missing or empty"):
        prepare_classify(tmp_path / "b.csv", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_one_label_or_a_label_named_twice_is_refused(tmp_path):
    """Records of one label trained to loss 0 (nothing to tell apart); --labels pos,pos,neg made a
    label set with "pos" twice. Both are refused before anything is written."""
    (tmp_path / "a.jsonl").write_text('{"text": "hi", "label": "pos"}\n{"text": "bye", "label": "pos"}\n')
    with pytest.raises(ValueError, match=r"at least 2 labels, got \['pos'\]"):
        prepare_classify(tmp_path / "a.jsonl", tmp_path / "a")
    with pytest.raises(ValueError, match="name each label once"):
        prepare_classify(tmp_path / "a.jsonl", tmp_path / "a", labels=["pos", "pos", "neg"])
    assert not (tmp_path / "a").exists()


def test_a_text_longer_than_the_context_is_cut_with_a_warning(caplog):
    """Its first block_size tokens are classified, as transformers truncates; it was silent."""
    from gptlab.tokenizer import get_tokenizer

    torch.manual_seed(0)
    lm = GPT(GPTConfig(vocab_size=257, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    clf = from_language_model(lm, ["a", "b"], pad_token_id=256).eval()
    byte = get_tokenizer("byte")
    with caplog.at_level("WARNING", logger="gptlab.classifier"), torch.no_grad():
        long, start = clf.classify(byte, ["x" * 40 + "tail", "x" * 16])
    assert torch.equal(long, start)  # the same 16 tokens
    assert "text 0 is 44 tokens: its first 16 (block_size) are classified" in caplog.text
    assert "text 1" not in caplog.text


def test_a_byte_tokenized_classifier_pads_with_the_byte_tokenizers_end(tmp_path):
    """The loader padded with GPT-2's 50256 and the new classifier took it as pad_token_id: a byte
    model (257 tokens) failed at its first batch ("token id 50256 outside the vocabulary")."""
    from gptlab.loading import load_model
    from gptlab.tokenizer import get_tokenizer
    from gptlab.train import TrainConfig, train

    write_records(tmp_path / "d.jsonl", n=12)
    prepare_classify(tmp_path / "d.jsonl", tmp_path / "data", tokenizer="byte", labels=LABELS, val_fraction=0.25)
    summary = train(TrainConfig(data_dir=str(tmp_path / "data"), out_dir=str(tmp_path / "r"), n_layer=1, n_head=2,
                                n_embd=16, block_size=32, batch_size=4, max_steps=1, eval_interval=1, eval_steps=1,
                                progress=False, precision="float32"))  # fmt: skip
    clf = load_model(summary["checkpoint"])
    assert clf.config.pad_token_id == 256
    assert clf.classify(get_tokenizer("byte"), ["pos x", "neg y y y"]).shape == (2, 3)  # rows of two lengths


def test_a_csv_with_a_byte_order_mark_is_read_as_records(tmp_path):
    """Excel's "CSV UTF-8" starts with a BOM: the first header read "\\ufefftext", so `prepare`
    took the file for plain text and wrote its bytes as tokens, saying nothing."""
    from gptlab.cli import main

    (tmp_path / "a.csv").write_bytes(
        "text,label\nhello there,pos\nbad day,neg\ngood,pos\nawful,neg\n".encode("utf-8-sig")
    )
    assert main(["prepare", "--input", str(tmp_path / "a.csv"), "--out", str(tmp_path / "d")]) == 0
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["kind"] == "classify" and manifest["labels"] == ["neg", "pos"]


def test_validation_scores_each_example_once(tmp_path):
    """10 validation texts in batches of 4: the third batch wrapped around to texts 0 and 1, and
    val_accuracy and val_loss were means over batches that counted those twice."""
    import torch.nn.functional as F

    from gptlab.train import Trainer

    write_records(tmp_path / "d.jsonl")
    prepare_classify(tmp_path / "d.jsonl", tmp_path / "data", labels=LABELS, val_fraction=0.25)
    trainer = Trainer(cls_config(tmp_path, tmp_path / "run", 1, eval_interval=1, eval_steps=20))
    summary = trainer.run()
    assert trainer.val_loader.distinct_batches() == 3 and len(trainer.val_loader) == 10
    whole = ClassifyLoader(tmp_path / "data", "val", 10, 32, mode="sequential", pad_id=PAD)
    x, labels, extra = whole.batch(0)
    with torch.no_grad():
        logits, _ = trainer.raw_model.eval()(x, attention_mask=extra["attention_mask"])
    assert summary["val_accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).float().mean()), abs=1e-6)
    assert summary["val_loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), abs=1e-5)


def test_the_auto_precision_probe_times_a_classifier():
    """precision=auto (the default) times one forward + backward on a CPU with bf16 before a run:
    it passed a language model's (B, T) next-token targets, so training a classifier there (the
    README's recipe, LoRA or not) failed with "classification targets must be label ids of shape
    (8,), got (8, 16)" wherever no timing of that shape was cached yet."""
    from gptlab.train import precision

    torch.manual_seed(0)
    model = GPTForSequenceClassification(GPTConfig(vocab_size=97, block_size=16, n_layer=1, n_head=2, n_embd=16,
                                                   num_labels=3, pad_token_id=96)).train()  # fmt: skip
    timings = precision.probe(model, torch.device("cpu"), 2, 8)
    assert set(timings) == {"float32", "bfloat16"} and all(0 < t < float("inf") for t in timings.values())
    assert model.training and all(p.grad is None for p in model.parameters())
