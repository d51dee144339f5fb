"""Classification data: `text`/`label` records -> token files, batches, and scoring.

`prepare_classify` reads JSON/JSONL/CSV records with `text` and `label` into, per split,
{split}.bin (token ids back to back), {split}.offsets.bin and {split}.labels.bin (int64), with
the label names in the manifest (`"kind": "classify"`). `ClassifyLoader` gives (x, labels,
{"attention_mask"}) batches, right-padded, texts longer than block_size cut to their start.
`evaluate_classifier` gives accuracy and a confusion matrix.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gptlab.atomic import atomic_write, atomic_write_text
from gptlab.classifier import GPTForSequenceClassification, pad_rows
from gptlab.data import IGNORE, MANIFEST, CountedLoader, epoch_permutation, resolve_inputs, token_dtype
from gptlab.tokenizer import get_tokenizer


def prepare_classify(inputs, out_dir, *, tokenizer: str = "gpt2", labels: list[str] | None = None,
                     val_fraction: float = 0.1, seed: int = 0) -> dict:  # fmt: skip
    """Tokenize `text`/`label` records into out_dir (see the module docstring); returns the manifest.

    Label names are `labels` in that order, else the records' labels sorted."""
    from gptlab.sft import located_records, split_mask

    located, tok = located_records(inputs), get_tokenizer(tokenizer)
    records = [r for r, _ in located]
    for r, where in located:  # a missing label was the label "None", an empty CSV cell ""
        if r.get("label") is None or not str(r["label"]).strip():
            raise ValueError(f"{where}: its `label` is missing or empty, got {r!r}")
    names = list(labels) if labels else sorted({str(r["label"]) for r in records})
    if len(set(names)) != len(names):
        raise ValueError(f"labels name each label once, got {names}")
    if len(names) < 2:  # one label is learned at once: loss 0, nothing to classify
        raise ValueError(f"classification needs at least 2 labels, got {names}")
    index = {name: i for i, name in enumerate(names)}
    ids, ys = [], []
    for r, where in located:
        if not isinstance(r.get("text"), str) or str(r["label"]) not in index:
            raise ValueError(f"{where}: needs a string `text` and a `label` among {names}, got {r!r}")
        ids.append(tok.encode(r["text"]) or [tok.eot_token])
        ys.append(index[str(r["label"])])
    is_val = split_mask(len(records), val_fraction, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype, counts = token_dtype(tok.n_vocab), {}
    for split, chosen in (("train", ~is_val), ("val", is_val)):
        rows = [r for r, c in zip(ids, chosen, strict=True) if c]
        tokens = np.concatenate([np.asarray(r, dtype=dtype) for r in rows])
        arrays = {".bin": tokens, ".offsets.bin": np.cumsum([0] + [len(r) for r in rows], dtype=np.int64),
                  ".labels.bin": np.asarray([y for y, c in zip(ys, chosen, strict=True) if c], dtype=np.int64)}  # fmt: skip
        for suffix, array in arrays.items():
            atomic_write(out_dir / f"{split}{suffix}", lambda tmp, a=array: a.tofile(tmp))
        counts[split] = dict(tokens=int(len(tokens)), examples=len(rows),
                             per_label=np.bincount(arrays[".labels.bin"], minlength=len(names)).tolist())  # fmt: skip
    manifest = {"kind": "classify", "tokenizer": tok.name, "vocab_size": tok.n_vocab, "dtype": dtype.name,
                "labels": names, "val_fraction": val_fraction, "seed": seed,
                "tokens": {s: c["tokens"] for s, c in counts.items()},
                "examples": {s: c["examples"] for s, c in counts.items()},
                "per_label": {s: c["per_label"] for s, c in counts.items()},
                "sources": [str(p) for p in resolve_inputs(inputs)]}  # fmt: skip
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


class ClassifyLoader(CountedLoader):
    """(x, labels, {"attention_mask"}) batches: B texts right-padded to the longest (at most
    block_size), their label ids (B,). mode "random" reshuffles each epoch, seeded by (seed,
    epoch); "sequential" goes in order, wrapping. The state is the batch counter."""

    def __init__(self, data_dir, split, batch_size, block_size, *, dtype="uint16", mode="random", seed=0,
                 rank=0, world_size=1, pad_id=50256):  # fmt: skip
        data_dir = Path(data_dir)
        try:
            self.tokens = np.memmap(data_dir / f"{split}.bin", dtype=np.dtype(dtype), mode="r")
            self.offsets = np.fromfile(data_dir / f"{split}.offsets.bin", dtype=np.int64)
            self.labels = np.fromfile(data_dir / f"{split}.labels.bin", dtype=np.int64)
        except OSError as e:
            raise ValueError(
                f"{data_dir}: not a prepared classification split {split!r} ({getattr(e, 'strerror', None) or e})"
            ) from e
        if len(self.labels) != len(self.offsets) - 1:
            raise ValueError(f"{data_dir}: {split}.labels.bin and .offsets.bin disagree")
        self.batch_size, self.block_size, self.mode, self.seed = batch_size, block_size, mode, seed
        self.rank, self.world_size, self.pad_id = rank, world_size, pad_id
        self._orders: dict[int, np.ndarray] = {}  # epoch -> its order (mode "random")
        self.batch_index = 0

    def units(self) -> int:
        return len(self)

    def __len__(self) -> int:
        return len(self.labels)

    def indices(self, k: int) -> np.ndarray:
        """This rank's example indices in batch k."""
        n, flat = len(self), self.positions(k)
        if self.mode == "sequential":
            return flat % n
        for e in np.unique(flat // n):
            if e not in self._orders:
                self._orders[e] = epoch_permutation(self.seed, int(e), n)
        return np.asarray([self._orders[f // n][f % n] for f in flat])

    def batch(self, k: int):
        """x (B, T), label ids (B,) and the attention mask. Sequential batches (validation) label the
        rows that wrapped around to examples already given IGNORE (-100): the loss and the accuracy
        leave them out, so a pass scores each example once (they counted the first ones twice)."""
        chosen = self.indices(k)
        rows = [self.tokens[self.offsets[i] : self.offsets[i + 1]][: self.block_size].tolist() for i in chosen]
        x, mask = pad_rows(rows, self.pad_id)
        labels = self.labels[chosen].copy()
        labels[self.wrapped(k)] = IGNORE
        return x, torch.from_numpy(labels), {"attention_mask": mask}


@torch.no_grad()
def evaluate_classifier(model: GPTForSequenceClassification, tok, records: list[dict], batch_size: int = 16) -> dict:
    """Accuracy and confusion matrix (rows: true label, columns: predicted) over text/label records."""
    names = model.label_names()
    index = {n: i for i, n in enumerate(names)}
    bad = [r for r in records if str(r.get("label")) not in index or not isinstance(r.get("text"), str)]
    if bad:
        raise ValueError(f"records need a string `text` and a `label` among {names}; got {bad[0]!r}")
    truth = [index[str(r["label"])] for r in records]
    preds = []
    for s in range(0, len(records), batch_size):
        probs = model.classify(tok, [r["text"] for r in records[s : s + batch_size]])
        preds += probs.argmax(-1).tolist()
    confusion = np.zeros((len(names), len(names)), dtype=np.int64)
    for t, p in zip(truth, preds, strict=True):
        confusion[t, p] += 1
    majority = max(np.bincount(truth, minlength=len(names))) / len(truth)
    return dict(labels=names, examples=len(truth), accuracy=float(np.trace(confusion) / len(truth)),
                majority_baseline=float(majority), confusion=confusion.tolist())  # fmt: skip
