"""POST /tokenize and /detokenize: tiktoken's ids for GPT-2's tokenizer, both llama.cpp's and
vLLM's spellings, the same reading of special tokens as /v1/completions, and OpenAI-style errors."""

import httpx
import pytest

from conftest import tiny_model
from gptlab.serve.app import create_app
from gptlab.tokenizer import get_tokenizer
from test_serve import running

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT = "Hello world: naïve café, 日本語 <|endoftext|> and 🤖!"


@pytest.fixture(scope="module")
def url():
    model = tiny_model(vocab_size=50257, block_size=64)
    with running(create_app(model, get_tokenizer("gpt2"), name="tiny-gpt2")) as base:
        yield base


def post(url, path, body):
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def test_tokenize_gives_tiktokens_ids_in_either_spelling(url, tiktoken_gpt2):
    want = tiktoken_gpt2.encode(TEXT, allowed_special="all")  # <|endoftext|> is the special token, as in a prompt
    assert 50256 in want
    for body in ({"prompt": TEXT, "model": "tiny-gpt2"}, {"content": TEXT}):
        r = post(url, "/tokenize", body)
        assert r.status_code == 200, r.text
        assert r.json() == {"tokens": want, "count": len(want), "max_model_len": 64}


def test_pieces_spell_the_text_and_split_characters_are_bytes(url, tiktoken_gpt2):
    r = post(url, "/tokenize", {"content": TEXT, "with_pieces": True}).json()
    ids = [t["id"] for t in r["tokens"]]
    assert ids == tiktoken_gpt2.encode(TEXT, allowed_special="all")
    raw = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in (t["piece"] for t in r["tokens"]))
    assert raw.decode() == TEXT
    split = [t for t in r["tokens"] if isinstance(t["piece"], list)]  # 🤖 and 日本語 span several tokens
    assert split and all(bytes(t["piece"]) == tiktoken_gpt2.decode_single_token_bytes(t["id"]) for t in split)


def test_detokenize_inverts_tokenize(url, tiktoken_gpt2):
    ids = tiktoken_gpt2.encode(TEXT, allowed_special="all")
    r = post(url, "/detokenize", {"tokens": ids, "model": "tiny-gpt2"})
    assert r.status_code == 200 and r.json() == {"prompt": TEXT, "content": TEXT}
    assert post(url, "/detokenize", {"tokens": []}).json() == {"prompt": "", "content": ""}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "content": "a"}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special": True}, 400, "add_special"),
        ("/tokenize", {"prompt": "a", "model": "gpt2-xl"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 50257]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt2-xl"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(url, path, body, status, param):
    r = post(url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (
        error["message"] and error["param"] == param and error["type"] in ("invalid_request_error", "not_found_error")
    )


def test_echoed_prompt_offsets_count_characters_not_tokens(url, tiktoken_gpt2):
    """lm-eval splits context from continuation by `text_offset`: each prompt token's start, in
    characters of the echoed text (GPT-2's tokens span several characters; a token that ends
    inside a character, as in 日本語, moves the offset once the character is whole)."""
    text = "The naïve café served 日本語 tea."
    body = {"model": "tiny-gpt2", "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0}
    lp = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    ids = tiktoken_gpt2.encode(text)
    whole = [len(tiktoken_gpt2.decode_bytes(ids[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    assert lp["text_offset"] == whole and lp["text_offset"][:4] == [0, 3, 9, 14]  # "The", " na", "ïve", " caf"
    assert all(
        text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True) if "\ufffd" not in t
    )
