"""Instruction tuning data (SFT): records -> tokens plus a loss mask, and batches of them.

`prepare_sft` reads Alpaca records (`instruction`, `input`, `output`) or chat records
(`messages`, each with `role` and `content`) from JSON or JSONL files, renders each through a
Template (Alpaca's by default), and writes, per split:

    {split}.bin          every example's token ids back to back, each ending with <|endoftext|>
    {split}.mask.bin     uint8 per token: 1 where the loss trains the model to predict it
    {split}.offsets.bin  int64 (n + 1,): example i is tokens[offsets[i]:offsets[i + 1]]

and manifest.json with `"kind": "sft"`. By default only the response (Alpaca) or the assistant
turns (chat) are trained on, and the closing <|endoftext|> with them, so the model learns where
to stop; `train_on="all"` trains on every token.

`ExampleLoader` turns the examples into (x, y, extra) batches, y = IGNORE (-100) where nothing is trained:
layout "pack" fills each row with whole examples and passes `segments` so that attention and
positions stay inside each example (GPT.forward); layout "pad" gives every example its own row.
Batch k is a pure function of (seed, k), as with gptlab.data.TokenLoader, so resuming is exact.
"""

from __future__ import annotations

import json
import logging
import os
import string
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from gptlab.atomic import atomic_write, atomic_write_text
from gptlab.data import (
    IGNORE,
    MANIFEST,
    CountedLoader,
    epoch_permutation,
    read_manifest,
    record_rows,
    resolve_inputs,
    token_dtype,
)
from gptlab.tokenizer import get_tokenizer

log = logging.getLogger(__name__)

LAYOUTS = ("pack", "pad")
TRAIN_ON = ("response", "all")


@dataclass(frozen=True)
class Template:
    """How a record becomes text. Alpaca's prompts (with and without an input) and one header per
    chat role; `{content}` marks where a message goes, and what follows it in an assistant turn
    is trained on with the message."""

    prompt: str = (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    )
    prompt_no_input: str = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:\n"
    )
    system: str = "{content}\n\n"
    user: str = "### User:\n{content}\n\n"
    assistant: str = "### Assistant:\n{content}\n\n"

    @classmethod
    def load(cls, spec: str | os.PathLike | None) -> Template:
        """The default template, or one from a JSON file whose keys override the defaults."""
        if spec is None or spec == "alpaca":
            return cls()
        try:
            data = json.loads(Path(spec).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"template {spec}: not a readable JSON file ({e})") from e
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ValueError(f"template {spec}: keys must be among {', '.join(sorted(known))}")
        if not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"template {spec}: every value must be a string")
        for role in ("system", "user", "assistant"):
            if role in data and data[role].count("{content}") != 1:
                raise ValueError(f"template {spec}: {role} must hold {{content}} once")
        fields_of = {"prompt": {"instruction", "input"}, "prompt_no_input": {"instruction"}}
        for key, allowed in fields_of.items():  # an unknown {field} failed as a KeyError at the first record
            used = {name for _, name, _, _ in string.Formatter().parse(data.get(key, "")) if name is not None}
            if used - allowed:
                raise ValueError(f"template {spec}: {key} may use {', '.join(sorted(allowed))}, not {', '.join(sorted(used - allowed))}")  # fmt: skip
        return cls(**data)

    def prompt_for(self, instruction: str, input: str = "") -> str:
        """The untrained part of an Alpaca example: instruction (and input) in the prompt."""
        if input:
            return self.prompt.format(instruction=instruction, input=input)
        return self.prompt_no_input.format(instruction=instruction)

    def render(self, record: dict) -> list[tuple[str, bool]]:
        """[(text, is_response), ...] for one Alpaca or chat record, in order."""
        if "messages" in record:
            return self._chat(record["messages"])
        missing = [k for k in ("instruction", "output") if not isinstance(record.get(k), str)]
        if missing:
            raise ValueError(f"record needs string fields {', '.join(missing)} (Alpaca) or `messages` (chat)")
        return [(self.prompt_for(record["instruction"], record.get("input") or ""), False), (record["output"], True)]

    def chat_prompt(self, messages) -> list[tuple[str, bool]]:
        """A conversation rendered as `render` renders a chat record, then the assistant's head:
        what a model fine-tuned on such records is given to answer (gptlab serve's chat API)."""
        return [*self._chat(messages), (self.turn("assistant")[0], False)]

    def turn(self, role: str) -> tuple[str, str]:
        """(head, tail): what the template puts before and after a message of `role`."""
        head, tail = getattr(self, role).split("{content}")
        return head, tail

    def _chat(self, messages) -> list[tuple[str, bool]]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("`messages` must be a non-empty list")
        parts = []
        for m in messages:
            role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
            if role not in ("system", "user", "assistant") or not isinstance(content, str):
                raise ValueError(f"a message needs role system/user/assistant and string content, got {m!r}")
            head, tail = self.turn(role)
            if role == "assistant":
                parts += [(head, False), (content + tail, True)]
            else:
                parts.append((head + content + tail, False))
        return parts


def read_records(inputs) -> list[dict]:
    """Every record of the JSON (a list), JSONL or CSV (with a header) files named by inputs, in order."""
    return [record for record, _ in located_records(inputs)]


def located_records(inputs) -> list[tuple[dict, str]]:
    """read_records' records, each with where it is for error messages: "FILE line N, record I"
    (JSONL, CSV) or "FILE, record I" (a JSON list), records counted from 1 across the inputs."""
    located, files = [], resolve_inputs(inputs)
    for path in files:
        for line, row in record_rows(path):
            where = f"{path}{f' line {line}' if line else ''}, record {len(located) + 1}"
            if not isinstance(row, dict):
                raise ValueError(f"{where} is not an object")
            located.append((row, where))
    if not located:
        raise ValueError(f"{', '.join(map(str, files))}: no records (an empty file?)")
    return located


def record_format(inputs) -> str | None:
    """What records the inputs hold, when every one is a .json/.jsonl/.csv file: "sft" (Alpaca or
    chat) or "classify" (text and label), judged by the first record; else None (plain text)."""
    try:
        files = resolve_inputs(inputs)
    except ValueError:
        return None
    if not files or any(p.suffix not in (".json", ".jsonl", ".csv") for p in files):
        return None
    _, first = next(record_rows(files[0]), (None, None))  # not the whole file: a pretraining dump may be GBs
    if not isinstance(first, dict):
        read_records(files[0])  # its error names the file and line (no records, or not an object)
    if "messages" in first or "instruction" in first:
        return "sft"
    return "classify" if "text" in first and "label" in first else None


def split_mask(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """(n,) bool, True for the seeded random val_fraction of n examples (at least one) that
    validate."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ValueError(f"{n} record(s): too few to split off a validation set")
    is_val = np.zeros(n, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    return is_val


def encode_example(
    tok, parts: list[tuple[str, bool]], train_on: str = "response", *, end: bool = True
) -> tuple[list[int], list[int]]:
    """(ids, mask) of one rendered example, <|endoftext|> appended (end=False: not, for a
    prompt to continue); mask 1 on trained tokens.

    Each part is encoded on its own, so the mask's edges fall on token boundaries."""
    ids, mask = [], []
    for text, is_response in parts:
        piece = tok.encode(text)
        ids += piece
        mask += [int(is_response or train_on == "all")] * len(piece)
    if end:
        ids.append(tok.eot_token)
        mask.append(1)  # the end: the model learns to stop
    return ids, mask


def prepare_sft(
    inputs,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str = "gpt2",
    template: str | os.PathLike | None = None,
    train_on: str = "response",
    val_fraction: float = 0.1,
    seed: int = 0,
) -> dict:
    """Tokenize instruction records into out_dir (see the module docstring); returns the manifest.

    The validation split is a seeded random val_fraction of the examples (at least one), each
    split keeping the input order."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    located, tmpl, tok = located_records(inputs), Template.load(template), get_tokenizer(tokenizer)
    examples = []
    for record, where in located:
        try:
            examples.append(encode_example(tok, tmpl.render(record), train_on))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    is_val = split_mask(len(examples), val_fraction, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.n_vocab)
    stats = {}
    for split, chosen in (("train", ~is_val), ("val", is_val)):
        stats[split] = _write_split(out_dir, split, [e for e, c in zip(examples, chosen, strict=True) if c], dtype)
    manifest = {
        "kind": "sft", "tokenizer": tok.name, "vocab_size": tok.n_vocab, "dtype": dtype.name,
        "template": str(template or "alpaca"), "train_on": train_on, "val_fraction": val_fraction, "seed": seed,
        "tokens": {s: v["tokens"] for s, v in stats.items()}, "examples": {s: v["examples"] for s, v in stats.items()},
        "trained_tokens": {s: v["trained"] for s, v in stats.items()},
        "max_example_tokens": max(v["longest"] for v in stats.values()),
        "sources": [str(p) for p in resolve_inputs(inputs)],
    }  # fmt: skip
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


def _write_split(out_dir: Path, split: str, examples: list, dtype) -> dict:
    ids = np.concatenate([np.asarray(e[0], dtype=dtype) for e in examples])
    mask = np.concatenate([np.asarray(e[1], dtype=np.uint8) for e in examples])
    offsets = np.cumsum([0] + [len(e[0]) for e in examples], dtype=np.int64)
    for suffix, array in ((".bin", ids), (".mask.bin", mask), (".offsets.bin", offsets)):
        atomic_write(out_dir / f"{split}{suffix}", lambda tmp, a=array: a.tofile(tmp))
    return dict(tokens=int(len(ids)), examples=len(examples), trained=int(mask.sum()),
                longest=int(np.diff(offsets).max()))  # fmt: skip


class Examples:
    """One split of a prepared SFT directory: example i as (ids, mask) numpy arrays."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train", dtype: str = "uint16"):
        data_dir = Path(data_dir)
        try:
            self.tokens = np.memmap(data_dir / f"{split}.bin", dtype=np.dtype(dtype), mode="r")
            self.mask = np.memmap(data_dir / f"{split}.mask.bin", dtype=np.uint8, mode="r")
            self.offsets = np.fromfile(data_dir / f"{split}.offsets.bin", dtype=np.int64)
        except OSError as e:
            raise ValueError(f"{data_dir}: not a prepared SFT split {split!r} ({e})") from e
        if len(self.mask) != len(self.tokens) or self.offsets[-1] != len(self.tokens):
            raise ValueError(f"{data_dir}: {split}.bin, .mask.bin and .offsets.bin disagree in length")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return np.asarray(self.tokens[lo:hi], dtype=np.int64), np.asarray(self.mask[lo:hi], dtype=bool)

    def lengths(self, block_size: int) -> np.ndarray:
        """Positions each example fills in a row: its tokens less one (the last is only a
        target), at most block_size (longer examples are cut)."""
        return np.minimum(np.diff(self.offsets) - 1, block_size)

    def trained(self, block_size: int) -> np.ndarray:
        """Trained-on targets each example keeps in a row of block_size (those of its
        positions 1..length): 0 where the cut falls before its response."""
        cumulative = np.concatenate([[0], np.cumsum(self.mask, dtype=np.int64)])  # (N + 1,)
        start = self.offsets[:-1] + 1
        return cumulative[start + self.lengths(block_size)] - cumulative[start]


def pack_rows(lengths: np.ndarray, order: np.ndarray, block_size: int) -> list[np.ndarray]:
    """Example indices per row, taking examples in `order` and starting a new row when the next
    one does not fit (first fit in order: rows keep the shuffled order's randomness)."""
    rows, current, used = [], [], 0
    for i in order:
        n = int(lengths[i])
        if current and used + n > block_size:
            rows.append(np.asarray(current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(np.asarray(current))
    return rows


class ExampleLoader(CountedLoader):
    """(x, y, extra) batches (B, T) of SFT examples; y is IGNORE (-100) where no loss is taken.

    mode "random" reshuffles the examples every epoch (seeded by (seed, epoch)); "sequential"
    keeps their order (validation). layout "pack": several examples per row, extra holds
    `segments` (B, T) for GPT.forward; "pad": one example per row, right-padded to the batch's
    longest (T <= block_size), extra empty.
    Ranks take their own rows of each global batch; the state is the batch counter.
    """

    STATE_KEYS = ("mode", "seed", "layout")

    def __init__(self, data_dir, split, batch_size, block_size, *, dtype="uint16", layout="pad",
                 mode="random", seed=0, rank=0, world_size=1, pad_id=50256):  # fmt: skip
        if layout not in LAYOUTS:
            raise ValueError(f"sft_layout must be one of {LAYOUTS}, got {layout!r}")
        if mode not in ("random", "sequential"):
            raise ValueError(f"loader mode must be 'random' or 'sequential', got {mode!r}")
        self.examples = Examples(data_dir, split, dtype)
        self.batch_size, self.block_size, self.layout, self.mode = batch_size, block_size, layout, mode
        self.seed, self.rank, self.world_size, self.pad_id = seed, rank, world_size, pad_id
        self.lengths = self.examples.lengths(block_size)
        _check_trained(self.examples, split, block_size)
        self._epochs: list[list[np.ndarray]] = []  # rows of each epoch computed so far
        self.batch_index = 0

    def units(self) -> int:
        return len(self.epoch_rows(0))  # rows of examples (several per row when packed)

    def epoch_rows(self, e: int) -> list[np.ndarray]:
        """Example indices of each row of epoch e (computed once per epoch)."""
        while len(self._epochs) <= e:
            n = len(self.examples)
            order = epoch_permutation(self.seed, len(self._epochs), n) if self.mode == "random" else np.arange(n)
            if self.layout == "pack":
                self._epochs.append(pack_rows(self.lengths, order, self.block_size))
            else:
                self._epochs.append([np.asarray([i]) for i in order])
        return self._epochs[e]

    def rows(self, k: int) -> list[np.ndarray]:
        """Example indices of each of this rank's rows in batch k."""
        G = self.batch_size * self.world_size
        first, out, e = k * G, [], 0
        if self.mode == "sequential":  # one pass, wrapping around
            rows = self.epoch_rows(0)
            return [rows[p % len(rows)] for p in self.positions(k)]
        while first >= len(self.epoch_rows(e)):
            first -= len(self.epoch_rows(e))
            e += 1
        while len(out) < G:
            rows = self.epoch_rows(e)
            out += rows[first : first + G - len(out)]
            first, e = 0, e + 1
        return out[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def batch(self, k: int):
        """Batch k: x, y int64 (B, T) and a dict of extra forward arguments (see the class)."""
        import torch

        rows = self.rows(k)
        B, T = self.batch_size, self.block_size
        if self.layout == "pad":  # to the longest row of this batch, not to block_size
            T = max(int(self.lengths[row].sum()) for row in rows)
        x = np.full((B, T), self.pad_id, dtype=np.int64)
        y = np.full((B, T), IGNORE, dtype=np.int64)
        seg = np.zeros((B, T), dtype=np.int64)  # 0: padding after the examples
        for r, row in enumerate(rows):
            at = 0
            for s, i in enumerate(row, start=1):
                ids, mask = self.examples[i]
                n = int(self.lengths[i])
                x[r, at : at + n] = ids[:n]
                y[r, at : at + n] = np.where(mask[1 : n + 1], ids[1 : n + 1], IGNORE)
                seg[r, at : at + n] = s
                at += n
        y[self.wrapped(k)] = IGNORE  # a sequential pass scores each example once
        extra = {"segments": torch.from_numpy(seg)} if self.layout == "pack" else {}
        return torch.from_numpy(x), torch.from_numpy(y), extra


def _check_trained(examples: Examples, split: str, block_size: int) -> None:
    """Refuse a split whose examples all lose their trained tokens to the block_size cut (the
    run would train on nothing: loss 0); warn when some do."""
    empty = int((examples.trained(block_size) == 0).sum())
    if not empty:
        return
    longest = int(np.diff(examples.offsets).max())
    message = (f"{empty} of {len(examples)} {split} examples have no trained-on token within block_size "
               f"{block_size} (the longest is {longest} tokens): raise block_size or shorten the prompts")  # fmt: skip
    if empty == len(examples):
        raise ValueError(message)
    log.warning(message)


def render_example(data_dir, index: int = 0, split: str = "train", *, color: bool = False) -> str:
    """Example `index` as text with the trained-on tokens marked: [[...]] around each trained
    run (or green with color=True). Wrong masks are the most common silent SFT bug: look."""
    manifest = read_manifest(data_dir)
    examples = Examples(data_dir, split, manifest["dtype"])
    if not 0 <= index < len(examples):
        raise ValueError(f"example {index} out of range: {split} has {len(examples)} examples")
    tok = get_tokenizer(manifest["tokenizer"])
    ids, mask = examples[index]
    start, end = ("\x1b[32m", "\x1b[0m") if color else ("[[", "]]")
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tok.decode(ids[i:j].tolist())
        out.append(f"{start}{text}{end}" if mask[i] else text)
        i = j
    n = int(mask.sum())
    return f"{split} example {index}: {len(ids)} tokens, {n} trained on (marked)\n" + "".join(out)
