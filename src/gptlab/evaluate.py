"""Standard numbers for a language model: perplexity (and bits per byte), HellaSwag, LAMBADA.

- Perplexity uses the sliding-window method for fixed-length models (Hugging Face's "Perplexity of
  fixed-length models"): windows of `block_size` tokens advance by `stride`, and each window scores
  only the tokens no earlier window scored, so every token is predicted with at least
  `block_size - stride` tokens of context (except at the very start).
- HellaSwag uses the completion-loss method behind the GPT-2 HellaSwag numbers (build-nanogpt's
  hellaswag.py): each ending, with a leading space, is scored by the loss of its tokens after the
  context; `acc` picks the ending with the lowest summed loss, `acc_norm` the lowest mean loss.
- LAMBADA (OpenAI's jsonl, as lm-eval's `lambada_openai`): the target is the last word with its
  leading space; a hit needs greedy decoding to produce every one of its tokens; perplexity is
  per word, exp of the mean negative log-likelihood of the last word.

When no data file is given, the public files are downloaded once to a cache directory.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from gptlab.atomic import atomic_write
from gptlab.chunked_loss import token_logprobs
from gptlab.generation import evaluating
from gptlab.model import GPT
from gptlab.tokenizer import Tokenizer

log = logging.getLogger(__name__)

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
LAMBADA_URL = "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl"


# ----------------------------------------------------------------------------- perplexity


def sliding_windows(n_tokens: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over a token sequence as (begin, end, score_from).

    The model reads tokens[begin:end] and predicts tokens[begin+1:end+1]; only the predictions at
    input positions >= score_from are new, so across all windows each of the n_tokens - 1 targets
    is scored exactly once.
    """
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {n_tokens}")
    if not 1 <= stride <= block_size:
        raise ValueError(f"stride must be in [1, block_size={block_size}], got {stride}")
    windows, begin, scored_to = [], 0, 0
    while True:
        end = min(begin + block_size, n_tokens - 1)
        windows.append((begin, end, max(scored_to, begin)))
        scored_to = end
        if end == n_tokens - 1:
            return windows
        begin += stride


def _batches(windows: list, batch_size: int) -> Iterator[list]:
    """Consecutive windows of equal length, batch_size at a time (only the last may be shorter)."""
    for _, same_length in itertools.groupby(windows, key=lambda w: w[1] - w[0]):
        same_length = list(same_length)
        for i in range(0, len(same_length), batch_size):
            yield same_length[i : i + batch_size]


def default_stride(block_size: int) -> int:
    """The windows' stride when none is given: half a window, so each scores with block_size / 2 of context."""
    return max(block_size // 2, 1)


@torch.no_grad()
def sequence_nll(
    model: GPT, tokens: torch.Tensor, *, stride: int | None = None, batch_size: int = 4, progress: bool = False
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of tokens[1:] given what precedes, and their count.

    The head runs only on the positions a window scores, and their log-probabilities come from
    chunked_loss.token_logprobs, never as (B, T, V) logits: on the demo model's 50,257-token head,
    a window's logits and their log-softmax were 26 MB each, allocated and freed per batch. A model
    in training is scored without dropout (`evaluating`) and left in its mode."""
    from tqdm import tqdm

    block_size = model.config.block_size
    windows = sliding_windows(len(tokens), block_size, default_stride(block_size) if stride is None else stride)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with evaluating(model), tqdm(total=len(windows), unit="window", desc="perplexity", disable=not progress) as bar:
        for batch in _batches(windows, batch_size):
            x = torch.stack([tokens[b:e] for b, e, _ in batch]).to(device)  # (B, T)
            hidden, _ = model(x, head=False)  # (B, T, C)
            rows = torch.cat([h[f - b :] for h, (b, _, f) in zip(hidden, batch, strict=True)])  # (n, C) scored
            targets = torch.cat([tokens[f + 1 : e + 1] for b, e, f in batch]).to(device)  # (n,)
            logprob, _ = token_logprobs(rows, model.lm_head, targets)  # (n,)
            total -= logprob.double().sum().item()
            count += targets.numel()
            bar.update(len(batch))
    assert count == len(tokens) - 1
    return total, count


def _exp(nats: float) -> float:
    """A perplexity from a mean loss in nats: inf past float's range (math.exp overflowed at ~709)."""
    return math.exp(nats) if nats < 709 else math.inf


def perplexity(
    model: GPT,
    tokens: list[int] | np.ndarray | torch.Tensor,
    tokenizer: Tokenizer,
    *,
    stride: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
) -> dict:
    """Loss (nats/token), perplexity and bits per byte of a token sequence.

    Every token but the first is scored. Bits per byte divides the summed loss in bits by the UTF-8
    byte length of the scored tokens (end-of-text separators count as no bytes), so it compares
    models with different tokenizers.
    """
    tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))  # (N,)
    if tokens.numel() and int(tokens.max()) >= model.config.vocab_size:
        raise ValueError(f"token id {int(tokens.max())} is outside the model's vocabulary of {model.config.vocab_size}")
    stride = default_stride(model.config.block_size) if stride is None else stride  # 0 is refused, not the default
    nll, count = sequence_nll(model, tokens, stride=stride, batch_size=batch_size, progress=progress)
    targets = tokens[1:].tolist()
    n_bytes = len(tokenizer.decode_bytes([t for t in targets if t != tokenizer.eot_token]))
    loss = nll / count
    return {
        "tokens": count,
        "bytes": n_bytes,
        "loss": loss,
        "perplexity": _exp(loss),
        "bits_per_byte": nll / math.log(2) / n_bytes if n_bytes else float("nan"),
        "stride": stride,
        "block_size": model.config.block_size,
    }


def read_tokens(path: str | os.PathLike, tokenizer: Tokenizer) -> np.ndarray:
    """Tokens of a text file, or of a prepared token file (`val.bin`, or a directory holding one).

    A token file (as `gptlab prepare` writes) is uint16 when the vocabulary fits, else uint32, unless
    the manifest.json beside it names another dtype or a different tokenizer.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "val.bin").is_file():
            raise ValueError(
                f"{path}: a directory without val.bin (give a text file, a val.bin or a prepared directory)"
            )
        path = path / "val.bin"
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix != ".bin":
        try:
            text = path.read_bytes().decode("utf-8")  # not read_text: its newline translation turned \r\n into \n
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e})") from e
        return np.asarray(tokenizer.encode(text), dtype=np.int64)
    dtype = _token_dtype(path, tokenizer)
    if path.stat().st_size % np.dtype(dtype).itemsize:
        raise ValueError(f"{path}: size is not a multiple of {np.dtype(dtype).itemsize} bytes ({dtype} tokens)")
    tokens = np.fromfile(path, dtype=dtype).astype(np.int64)
    if tokens.size and tokens.max() >= tokenizer.n_vocab:
        raise ValueError(
            f"{path}: token id {tokens.max()} is outside the {tokenizer.name} vocabulary ({tokenizer.n_vocab})"
        )
    return tokens


def _token_dtype(path: Path, tokenizer: Tokenizer) -> str:
    """The dtype `gptlab prepare` recorded in manifest.json beside the file, else the vocabulary's."""
    manifest = path.parent / "manifest.json"
    if manifest.is_file():
        try:
            meta = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{manifest}: not readable ({getattr(e, 'strerror', None) or e})") from e
        if meta.get("kind") in ("sft", "classify"):  # examples back to back, no separator: no running text
            raise ValueError(f"{path.parent} holds {meta['kind']} examples; perplexity reads text or a directory "
                             "`gptlab prepare` made from text")  # fmt: skip
        if meta.get("tokenizer") not in (None, tokenizer.name):
            raise ValueError(f"{path} holds {meta['tokenizer']} tokens; the model uses the {tokenizer.name} tokenizer")
        if meta.get("dtype") in ("uint16", "uint32"):
            return meta["dtype"]
    return "uint16" if tokenizer.n_vocab <= 2**16 else "uint32"


# ----------------------------------------------------------------------------- continuation scoring


@torch.no_grad()
def score_continuations(
    model: GPT,
    pairs: list[tuple[list[int], list[int]]],
    *,
    batch_size: int = 16,
    progress: bool = False,
    desc: str = "scoring",
) -> list[dict]:
    """For each (context ids, continuation ids): the continuation's summed NLL (nats), its token
    count, and whether greedy decoding reproduces all of it. Contexts are cropped from the left to
    fit the model's context; rows are batched by length, right-padded (causal attention never
    looks at the padding that follows a row). The head runs only on the positions that predict a
    continuation (chunked_loss.token_logprobs), never on a batch's (B, T, V) logits. A model in
    training is scored without dropout (`evaluating`) and left in its mode."""
    from tqdm import tqdm

    block_size = model.config.block_size
    device = next(model.parameters()).device
    rows = []
    for ctx, cont in pairs:
        if not cont:
            raise ValueError("a continuation has no tokens")
        if len(cont) > block_size:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit the context of {block_size}")
        rows.append((list(ctx) + list(cont))[-(block_size + 1) :])
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))  # longest first: little padding
    results: list[dict] = [{}] * len(rows)
    with evaluating(model), tqdm(total=len(rows), unit="row", desc=desc, disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = len(rows[chunk[0]]) - 1
            x = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                x[r, : len(rows[i]) - 1] = torch.tensor(rows[i][:-1])
            hidden, _ = model(x.to(device), head=False)  # (B, T, C)
            spans = [(len(rows[i]) - 1, len(pairs[i][1])) for i in chunk]  # (n, k): n - k.. predict the continuation
            picked = torch.cat([hidden[r, n - k : n] for r, (n, k) in enumerate(spans)])  # (sum k, C)
            targets = torch.tensor([t for i, (_, k) in zip(chunk, spans, strict=True) for t in rows[i][-k:]])
            logprob, greedy = token_logprobs(picked, model.lm_head, targets.to(device))  # (sum k,) each
            start = 0
            for i, (_, k) in zip(chunk, spans, strict=True):  # row i's k entries follow the rows before it
                results[i] = {
                    "nll": -logprob[start : start + k].double().sum().item(),
                    "tokens": k,
                    "greedy": bool(greedy[start : start + k].all()),
                }
                start += k
            bar.update(len(chunk))
    return results


# ----------------------------------------------------------------------------- jsonl tasks


def read_jsonl(path: str | os.PathLike, required: dict[str, type]) -> list[dict]:
    """Records of a JSON-lines file; a bad line raises ValueError naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit in a string
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from e
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        for key, kind in required.items():
            value = record.get(key)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):  # true is no label
                raise ValueError(f"{path}:{lineno}: field {key!r} missing or not a {kind.__name__}")
        record["_line"] = lineno
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def hellaswag_examples(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """HellaSwag records (official jsonl: ctx, endings, label), checked."""
    records = read_jsonl(path, {"ctx": str, "endings": list, "label": int})[:limit]
    for r in records:
        if len(r["endings"]) < 2 or not all(isinstance(e, str) and e for e in r["endings"]):
            raise ValueError(f"{path}:{r['_line']}: 'endings' must be a list of at least two non-empty strings")
        if not 0 <= r["label"] < len(r["endings"]):
            raise ValueError(
                f"{path}:{r['_line']}: label {r['label']} is not an index into {len(r['endings'])} endings"
            )
    return records


def hellaswag(
    model: GPT, tokenizer: Tokenizer, examples: list[dict], *, batch_size: int = 16, progress: bool = False
) -> dict:
    """acc (lowest summed ending loss) and acc_norm (lowest mean per-token ending loss)."""
    pairs, spans = [], []
    for ex in examples:
        ctx = tokenizer.encode(ex["ctx"]) or [tokenizer.eot_token]
        spans.append((len(pairs), len(ex["endings"])))
        pairs += [(ctx, tokenizer.encode(" " + ending)) for ending in ex["endings"]]
    scores = score_continuations(model, pairs, batch_size=batch_size, progress=progress, desc="hellaswag")
    correct = correct_norm = 0
    per_example = []
    for ex, (first, n) in zip(examples, spans, strict=True):
        rows = scores[first : first + n]
        sum_loss = [s["nll"] for s in rows]
        mean_loss = [s["nll"] / s["tokens"] for s in rows]
        pred, pred_norm = int(np.argmin(sum_loss)), int(np.argmin(mean_loss))
        correct += pred == ex["label"]
        correct_norm += pred_norm == ex["label"]
        per_example.append(
            dict(label=ex["label"], pred=pred, pred_norm=pred_norm, sum_loss=sum_loss, mean_loss=mean_loss)
        )
    return {
        "examples": len(examples),
        "acc": correct / len(examples),
        "acc_norm": correct_norm / len(examples),
        "per_example": per_example,
    }


def lambada_examples(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """LAMBADA records ({"text": ...}) split into context and last word, checked."""
    records = read_jsonl(path, {"text": str})[:limit]
    for r in records:
        context, sep, word = r["text"].strip().rpartition(" ")
        if not sep or not context or not word:
            raise ValueError(f"{path}:{r['_line']}: 'text' needs a context and a last word separated by a space")
        r["context"], r["target"] = context, " " + word
    return records


def lambada(
    model: GPT, tokenizer: Tokenizer, examples: list[dict], *, batch_size: int = 16, progress: bool = False
) -> dict:
    """Last-word accuracy (greedy reproduces every token of the word) and per-word perplexity."""
    pairs = [(tokenizer.encode(ex["context"]), tokenizer.encode(ex["target"])) for ex in examples]
    scores = score_continuations(model, pairs, batch_size=batch_size, progress=progress, desc="lambada")
    nll = sum(s["nll"] for s in scores)
    n_tokens = sum(s["tokens"] for s in scores)
    return {
        "examples": len(examples),
        "acc": sum(s["greedy"] for s in scores) / len(examples),
        "perplexity": _exp(nll / len(examples)),
        "token_perplexity": _exp(nll / n_tokens),
        "target_tokens": n_tokens,
    }


# ----------------------------------------------------------------------------- data files


def cache_dir() -> Path:
    """Where downloaded evaluation files live: $GPTLAB_CACHE, else ~/.cache/gptlab."""
    root = os.environ.get("GPTLAB_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptlab"
    return Path(root)


def cached_download(url: str, name: str, *, timeout: float = 60.0) -> Path:
    """The file at `url`, downloaded once to cache_dir()/name (atomically) and reused after."""
    from tqdm import tqdm

    path = cache_dir() / name
    if path.is_file():
        return path

    def fetch(tmp: str) -> None:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=name) as bar:
                while chunk := response.read(1 << 16):
                    bar.update(out.write(chunk))

    log.info("downloading %s to %s", url, path)
    try:
        atomic_write(path, fetch)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ValueError(f"no data file given and {url} could not be downloaded ({e}); pass --data FILE") from e
    return path


TASK_FILES = {"hellaswag": (HELLASWAG_URL, "hellaswag_val.jsonl"), "lambada": (LAMBADA_URL, "lambada_test.jsonl")}


def task_data(task: str, data: str | None) -> Path:
    """The local file for a task: `data` when given, else the public file from the cache."""
    if data:
        return Path(data)
    if task not in TASK_FILES:
        raise ValueError(f"task {task} needs --data")
    return cached_download(*TASK_FILES[task])
