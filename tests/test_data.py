"""gptlab.data: prepare (text -> token files) and TokenLoader (memory-mapped batches)."""

import hashlib
import json
import random
import sys
import types

import numpy as np
import pytest
import torch

from gptlab import data
from gptlab.data import IGNORE, TokenLoader, prepare, token_dtype
from gptlab.tokenizer import ENDOFTEXT, get_tokenizer


def corpus(n_lines: int, seed: int) -> str:
    """Seeded text with newlines, blank lines and punctuation, like a play."""
    rng = random.Random(seed)
    words = ["thou", "art", "the", "king", "Hark!", "my", "lord,", "O", "ROMEO:", "12", "naïve", "—", "'tis"]
    lines = []
    for _ in range(n_lines):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(0, 9))))
        if rng.random() < 0.2:
            lines.append("")
    return "\n".join(lines) + "\n"


@pytest.fixture
def two_docs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(corpus(300, 1))
    (src / "b.txt").write_text(corpus(200, 2))
    return src


def read_tokens(out, split, dtype="uint16"):
    return np.fromfile(out / f"{split}.bin", dtype=dtype)


def test_prepare_round_trip_and_manifest(two_docs, tmp_path):
    out = tmp_path / "out"
    manifest = prepare(two_docs, out, progress=False)
    tok = get_tokenizer("gpt2")
    train, val = read_tokens(out, "train"), read_tokens(out, "val")
    text = tok.decode(np.concatenate([train, val]).tolist())
    assert text == (two_docs / "a.txt").read_text() + ENDOFTEXT + (two_docs / "b.txt").read_text()
    assert manifest["tokens"] == {"train": len(train), "val": len(val)}
    assert len(val) == round(0.1 * (len(train) + len(val)))
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert [s["sha256"] for s in manifest["sources"]] == [
        __import__("hashlib").sha256((two_docs / n).read_bytes()).hexdigest() for n in ("a.txt", "b.txt")
    ]


def test_prepare_is_deterministic_and_pieces_do_not_change_ids(two_docs, tmp_path):
    prepare(two_docs / "a.txt", tmp_path / "one", progress=False)
    prepare(two_docs / "a.txt", tmp_path / "two", progress=False)
    # Small pieces across two worker processes give the same bytes as one piece in-process.
    prepare(two_docs / "a.txt", tmp_path / "par", workers=2, piece_chars=500, progress=False)
    for name in ("train.bin", "val.bin", "manifest.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "par" / name).read_bytes()
    whole = get_tokenizer("gpt2").encode((two_docs / "a.txt").read_text())
    assert (
        np.concatenate([read_tokens(tmp_path / "one", "train"), read_tokens(tmp_path / "one", "val")]).tolist() == whole
    )


def test_prepare_glob_and_errors(two_docs, tmp_path):
    m = prepare(str(two_docs / "*.txt"), tmp_path / "g", progress=False, tokenizer="byte")
    assert m["vocab_size"] == 257 and len(m["sources"]) == 2
    with pytest.raises(ValueError, match="no such file"):
        prepare(str(tmp_path / "missing*.txt"), tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="val_fraction"):
        prepare(two_docs, tmp_path / "x", val_fraction=1.5, progress=False)
    with pytest.raises(ValueError, match="workers must be at least 1"):  # was run in-process, unsaid
        prepare(two_docs, tmp_path / "x", workers=0, progress=False)
    assert not (tmp_path / "x").exists()  # a mistyped input left an empty output directory behind


def test_prepare_into_its_input_directory_twice_reads_the_same_files(two_docs, capsys):
    """--out inside the --input directory: the second run tokenized its own outputs as well
    (54,313 tokens instead of 18,000). Both the library and the command leave them out."""
    from gptlab.cli import main

    first = prepare(two_docs, two_docs / "prep", progress=False, tokenizer="byte")
    assert prepare(two_docs, two_docs / "prep", progress=False, tokenizer="byte") == first
    (two_docs / "prep").rename(two_docs.parent / "prep")
    # the input inside the output (--input data/raw --out data): nothing is left out
    inner = prepare(two_docs, two_docs.parent, progress=False, tokenizer="byte")
    assert inner["tokens"] == first["tokens"] and "dataset" not in json.dumps(inner)
    argv = ["prepare", "--input", str(two_docs), "--out", str(two_docs / "cli"), "--tokenizer", "byte", "--no-progress"]
    assert main(argv) == 0 and main(argv) == 0
    assert json.loads((two_docs / "cli" / "manifest.json").read_text())["tokens"] == first["tokens"]


def test_a_file_that_is_not_utf8_or_not_there_is_named(two_docs, tmp_path, monkeypatch):
    """A non-UTF-8 file: the error names it (it named only the byte) and no temporary file stays;
    a mistyped file name is "no such file", not a failed Hub download of a dataset by that name."""
    (two_docs / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt: not UTF-8 text"):
        prepare(two_docs, tmp_path / "out", progress=False)
    assert list((tmp_path / "out").iterdir()) == []
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="nope.txt: no such file"):
        prepare("nope.txt", tmp_path / "x", progress=False)


class BigVocab:
    """A tokenizer whose ids do not fit in uint16 (byte ids + 70,000)."""

    name, n_vocab, eot_token = "big", 70_257, 70_256

    def encode(self, text, allowed_special=()):
        return [b + 70_000 for b in text.encode()]


def test_uint32_for_a_large_vocabulary(two_docs, tmp_path, monkeypatch):
    assert token_dtype(50257) == np.uint16 and token_dtype(70_000) == np.uint32
    monkeypatch.setattr(data, "get_tokenizer", lambda name: BigVocab())
    monkeypatch.setattr(data, "_WORKER_TOKENIZER", None)  # not the gpt2 one an earlier in-process run cached
    m = prepare(two_docs / "b.txt", tmp_path / "big", progress=False)
    assert m["dtype"] == "uint32"
    ids = np.concatenate([read_tokens(tmp_path / "big", s, "uint32") for s in ("train", "val")])
    assert bytes((ids - 70_000).astype(np.uint8).tolist()) == (two_docs / "b.txt").read_bytes()
    x, y = TokenLoader(tmp_path / "big" / "train.bin", 2, 8, dtype="uint32").next_batch()
    assert int(x.min()) >= 70_000


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)  # token i at offset i: offsets are readable
    return path


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_loader_shapes_and_shift(token_file, mode):
    loader = TokenLoader(token_file, 4, 16, mode=mode, seed=3)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # y is x shifted by one token
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # each row is a contiguous window


def test_ranks_read_disjoint_rows_of_the_global_batch(token_file):
    for mode in ("random", "sequential"):
        whole = TokenLoader(token_file, 4, 16, mode=mode, seed=5)
        ranks = [TokenLoader(token_file, 2, 16, mode=mode, seed=5, rank=r, world_size=2) for r in range(2)]
        for k in range(3):
            parts = [r.batch(k)[0] for r in ranks]
            assert torch.equal(torch.cat(parts), whole.batch(k)[0])
            if mode == "sequential":
                assert not set(parts[0][:, 0].tolist()) & set(parts[1][:, 0].tolist())
    seq = TokenLoader(token_file, 4, 16, mode="sequential")
    starts = torch.cat([seq.batch(k)[0][:, 0] for k in range(3)]).tolist()
    assert starts == [16 * i for i in range(12)]  # back-to-back windows


def test_loader_state_round_trip(token_file):
    a = TokenLoader(token_file, 3, 8, seed=11)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch()[0] for _ in range(3)]
    b = TokenLoader(token_file, 3, 8, seed=11)
    b.load_state_dict(json.loads(json.dumps(state)))  # survives JSON, as in a checkpoint
    assert all(torch.equal(e, b.next_batch()[0]) for e in expected)
    with pytest.raises(ValueError, match="does not match"):
        TokenLoader(token_file, 3, 8, seed=12).load_state_dict(state)


def test_loader_errors(token_file, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        TokenLoader(tmp_path / "nope.bin", 2, 8)
    with pytest.raises(ValueError, match="needs at least"):
        TokenLoader(token_file, 2, 1000)
    # numpy's own errors named no file ("cannot mmap an empty file", "Size of available data ...")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.bin has 0 tokens; block_size 8 needs at least 9"):
        TokenLoader(tmp_path / "empty.bin", 2, 8)
    (tmp_path / "cut.bin").write_bytes(token_file.read_bytes()[:-1])
    with pytest.raises(ValueError, match="cut.bin has 1999 bytes, not a whole number of uint16 tokens"):
        TokenLoader(tmp_path / "cut.bin", 2, 8)
    # training's check of the files passes an empty one on to the loader's message
    from gptlab.train.setup import check_tokens

    (tmp_path / "train.bin").write_bytes(b"")
    (tmp_path / "val.bin").write_bytes(token_file.read_bytes())
    manifest = {"dtype": "uint16", "tokenizer": "gpt2", "vocab_size": 50257, "tokens": {"train": 0, "val": 1000}}
    check_tokens(tmp_path, manifest, 50257)


def test_a_sequential_pass_ends_where_the_batches_wrap_around(token_file):
    """distinct_batches: the evaluation's cap (eval_steps 100,000 on 14 batches scored them again
    and again for minutes): 999 // 8 = 124 windows in batches of 2 rows are 62 batches, then the first again."""
    loader = TokenLoader(token_file, 2, 8, mode="sequential")
    assert loader.distinct_batches() == 62
    assert torch.equal(loader.batch(62)[0], loader.batch(0)[0]) and not torch.equal(
        loader.batch(61)[0], loader.batch(0)[0]
    )


@pytest.mark.parametrize("world_size", [1, 3])
def test_rows_that_wrap_around_have_no_targets(token_file, world_size):
    """124 windows in sequential batches of 3 (or 3 ranks of 1 row): batch 41's last two rows are
    windows 0 and 1 again; their targets are IGNORE, so that an evaluation pass scores each once."""
    loaders = [TokenLoader(token_file, 3 // world_size, 8, mode="sequential", rank=r, world_size=world_size)
               for r in range(world_size)]  # fmt: skip

    def global_batch(k):
        return [torch.cat(t) for t in zip(*(loader.batch(k) for loader in loaders), strict=True)]

    x, y = global_batch(41)
    assert torch.equal(x[1:], global_batch(0)[0][:2])  # wrapped around
    assert (y[1:] == IGNORE).all() and not (y[0] == IGNORE).any()
    assert torch.equal(x[0, 1:], y[0, :-1])  # x itself keeps the tokens
    assert not (global_batch(40)[1] == IGNORE).any()
    random = TokenLoader(token_file, 3, 8, seed=1)  # training batches never wrap: every target counts
    assert not any((random.batch(k)[1] == IGNORE).any() for k in range(50))


def test_a_tiny_input_keeps_a_token_in_each_split(tmp_path):
    """2 tokens at val_fraction 0.9 gave val.bin both and train.bin none, which training then
    failed to memory-map ("cannot mmap an empty file"); 1 token was "no text to tokenize"."""
    (tmp_path / "two.txt").write_text("hello world")
    m = prepare(tmp_path / "two.txt", tmp_path / "out", val_fraction=0.9, progress=False)
    assert m["tokens"] == {"train": 1, "val": 1}
    assert read_tokens(tmp_path / "out", "train").tolist() == [31373]  # "hello"
    (tmp_path / "one.txt").write_text("hello")
    with pytest.raises(ValueError, match="holds 1 token"):
        prepare(tmp_path / "one.txt", tmp_path / "one", progress=False)


def test_json_records_of_text_are_documents_not_json(tmp_path):
    """A JSONL of {"text": ...} records (the usual pretraining dump) was tokenized as JSON: braces,
    keys, quotes and \\n escapes became training text. Each record's text is a document now, as a
    `datasets` dataset's "text" column is; other JSON stays text."""
    docs = ["First line.\nSecond line.", "", "Zweite Geschichte: naïve 🙂", "Third <|endoftext|> literal"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n\n" for i, d in enumerate(docs)))
    (tmp_path / "more.json").write_text(json.dumps([{"text": "a list"}, {"text": "of records"}]))
    tok = get_tokenizer("gpt2")
    want = [t for d in [*docs[:1], *docs[2:], "a list", "of records"] for t in [tok.eot_token, *tok.encode(d)]][1:]
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        m = prepare([tmp_path / "docs.jsonl", tmp_path / "more.json"], out, workers=workers, progress=False)
        assert np.concatenate([read_tokens(out, "train"), read_tokens(out, "val")]).tolist() == want
        assert len(m["sources"]) == 2 and m["sources"][0]["sha256"]
    (tmp_path / "other.jsonl").write_text('{"title": "x"}\n')  # no "text": the file is text
    m = prepare(tmp_path / "other.jsonl", tmp_path / "other", progress=False, tokenizer="byte")
    assert m["tokens"]["train"] + m["tokens"]["val"] == len('{"title": "x"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
    with pytest.raises(ValueError, match='bad.jsonl: line 2 has no "text"'):
        prepare(tmp_path / "bad.jsonl", tmp_path / "bad", progress=False)


def test_a_rerun_stopped_while_writing_leaves_no_stale_manifest(two_docs, tmp_path, monkeypatch):
    """prepare again into the same --out, stopped after the new train.bin but before val.bin and
    manifest.json: the old manifest described the old files beside a new train.bin."""
    out = tmp_path / "out"
    prepare(two_docs / "a.txt", out, progress=False)
    real = data.atomic_write

    def stop_at_val(path, write):
        if path.name == "val.bin":
            raise KeyboardInterrupt
        real(path, write)

    monkeypatch.setattr(data, "atomic_write", stop_at_val)
    with pytest.raises(KeyboardInterrupt):
        prepare(two_docs / "b.txt", out, progress=False)
    with pytest.raises(ValueError, match="no readable manifest.json"):
        data.read_manifest(out)
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]  # no temporary file left


def test_a_mistyped_directory_is_named_as_a_path_not_only_as_a_dataset(tmp_path, monkeypatch):
    """A name like data/raww (no such directory) is tried as a `datasets` name; its failure said
    only "Couldn't reach 'data/raww' on the Hub", not that no such file or directory exists."""

    def offline(name, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(
        sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline)
    )  # no Hub, installed or not
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"input data/raww: no such file, directory or glob match, .*Couldn't reach"):
        prepare("data/raww", tmp_path / "out", progress=False)
    (tmp_path / "data" / "raw").mkdir(parents=True)  # there, but empty: not looked up as a dataset
    with pytest.raises(ValueError, match="input directory data/raw holds no files"):
        prepare("data/raw", tmp_path / "out", progress=False)


def test_a_windows_file_is_read_in_pieces_with_the_same_ids(tmp_path):
    """A CRLF file had no place to cut (the cut needed a non-space right before \\n), so it was read
    whole into one piece: all of a large corpus in memory, one worker, no progress until the end."""
    text = corpus(300, 3).replace("\n", "\r\n")
    (tmp_path / "win.txt").write_bytes(text.encode())
    pieces = list(data._read_pieces(tmp_path / "win.txt", 500, hashlib.sha256()))
    assert len(pieces) > 10 and "".join(pieces) == text
    prepare(tmp_path / "win.txt", tmp_path / "out", workers=2, piece_chars=500, progress=False)
    ids = np.concatenate([read_tokens(tmp_path / "out", "train"), read_tokens(tmp_path / "out", "val")])
    assert ids.tolist() == get_tokenizer("gpt2").encode(text)


def test_prepare_with_a_models_own_tokenizer_names_it_as_the_model_does(tmp_path, monkeypatch):
    """--tokenizer DIR (a Hugging Face model's own BPE) was recorded as typed ("m"), which training
    from that model compared with the directory's absolute path and refused."""
    from conftest import OWN_BPE_TEXT, own_bpe_model_dir
    from gptlab.loading import tokenizer_name
    from gptlab.train.setup import check_tokenizer
    from gptlab.train_config import TrainConfig

    own_bpe_model_dir(tmp_path / "m")
    (tmp_path / "de.txt").write_text("\n".join(OWN_BPE_TEXT))
    monkeypatch.chdir(tmp_path)
    manifest = prepare("de.txt", "data", tokenizer="m", val_fraction=0.1)
    assert manifest["tokenizer"] == tokenizer_name("m") == str((tmp_path / "m").resolve())
    check_tokenizer(TrainConfig(init_from="m", data_dir="data"), manifest)
    assert data.read_manifest("data")["vocab_size"] == get_tokenizer("m").n_vocab


def test_pieces_do_not_change_the_ids_of_a_bpe_that_merges_crlf(tmp_path):
    """Pieces were cut after a Windows \\r\\n, which ends a piece as one pre-token but is two
    between words: a model's own BPE with a \\r\\n token (GPT-2's has none) got other ids."""
    from conftest import OWN_BPE_TEXT, own_bpe_dir

    directory = own_bpe_dir(tmp_path / "m")
    tok = get_tokenizer(str(directory))
    assert len(tok.encode("\r\n")) == 1
    text = "".join(OWN_BPE_TEXT * 3)  # "... o'clock\r\nhello ..."
    (tmp_path / "crlf.txt").write_bytes(text.encode())
    prepare(tmp_path / "crlf.txt", tmp_path / "small", tokenizer=str(directory), piece_chars=64, progress=False)
    tokens = np.concatenate([read_tokens(tmp_path / "small", "train"), read_tokens(tmp_path / "small", "val")])
    assert tokens.tolist() == tok.encode(text)
