"""Data: turn text into token files (`prepare`) and read (x, y) batches from them (`TokenLoader`).

`prepare` writes `train.bin` and `val.bin` (uint16 token ids while the vocabulary fits, uint32
otherwise; native little-endian, no header) and `manifest.json` (tokenizer, dtype, counts,
source hashes). Documents are separated by `<|endoftext|>`; the validation split is the last
`val_fraction` of the token stream, so with one input file it is the end of that file. Large
inputs are read in pieces and encoded by worker processes; the pieces are cut where GPT-2's
pre-tokenizer would split anyway, so the ids equal those of encoding the whole text at once.

`TokenLoader` memory-maps a token file and yields batches by a counter: batch k is a pure
function of (seed, k), which makes its whole state one integer and lets every DDP rank take its
own rows of the same global batch.
"""

from __future__ import annotations

import codecs
import csv
import glob
import hashlib
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import numpy as np

from gptlab.atomic import atomic_write, atomic_write_text
from gptlab.tokenizer import ENDOFTEXT, get_tokenizer

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
PIECE_CHARS = 1 << 20  # text handed to one worker task
PARALLEL_MIN_CHARS = 8 << 20  # below this, encoding in-process beats starting workers
IGNORE = -100  # a target every loss leaves out: F.cross_entropy's ignore_index, the C kernels' too
# A piece ends after a newline that sits between two non-space characters, or between the \r and
# \n of a Windows file's \r\n there: GPT-2's pre-tokenizer splits there on its own, so cutting
# there does not change the ids. (Not after \r\n: at the end of a piece \r\n is one pre-token,
# between words \r and \n are two, and a BPE that merged \r\n, unlike GPT-2's, gave other ids.)
_SAFE_CUT = re.compile(r"\S(?:\r(?=\n\S)|\n(?=\S))")


def token_dtype(n_vocab: int) -> np.dtype:
    """uint16 while every id fits, else uint32."""
    return np.dtype(np.uint16) if n_vocab <= 2**16 else np.dtype(np.uint32)


# ---------------------------------------------------------------------------------------------
# prepare: text -> token files


TEXT_SUFFIXES = (".txt", ".md", ".json", ".jsonl", ".csv", ".tsv", ".bin")


def resolve_inputs(spec: str | os.PathLike | list, exclude: str | os.PathLike | None = None) -> list[Path]:
    """Files named by a FILE, a DIR (every file below it, sorted) or a GLOB; several with a list.
    A directory's files under `exclude` (the output directory, when it lies inside) are left out."""
    if isinstance(spec, (list, tuple)):
        return [p for s in spec for p in resolve_inputs(s, exclude)]
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        skip = Path(exclude).resolve() if exclude is not None else None
        if skip is not None and path.resolve() not in skip.parents:  # only an output inside this input
            skip = None
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                       and (skip is None or skip not in p.resolve().parents))  # fmt: skip
        if not files:
            raise ValueError(f"input directory {path} holds no files")
        return files
    matches = sorted(Path(p) for p in glob.glob(str(spec), recursive=True) if Path(p).is_file())
    if not matches:
        raise ValueError(f"input {spec}: no such file, directory or glob match")
    return matches


def _read_pieces(path: Path, piece_chars: int, hasher) -> Iterator[str]:
    """Stream a UTF-8 file as text pieces of about piece_chars, cut at safe places."""
    carry = ""
    with open(path, "rb") as raw:
        decoder = codecs.getincrementaldecoder("utf-8")()
        while True:
            block = raw.read(piece_chars)
            hasher.update(block)
            try:
                text = carry + decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e})") from e
            if not block:
                if text:
                    yield text
                return
            cut = _last_safe_cut(text)
            carry = text[cut:]
            if cut:
                yield text[:cut]


def _last_safe_cut(text: str) -> int:
    """The end of the last safe piece in text (0 if none)."""
    start = max(0, len(text) - PIECE_CHARS // 4)
    while True:
        cuts = [m.end() for m in _SAFE_CUT.finditer(text, start)]
        if cuts:
            return cuts[-1]
        if start == 0:
            return 0
        start = 0


def _documents(inputs: list[Path], piece_chars: int, sources: list[dict]) -> Iterator[tuple[str, bool]]:
    """(text piece, starts_a_new_document) for every piece of every input file; a file of
    {"text": ...} records gives each record's text as a document."""
    for path in inputs:
        hasher = hashlib.sha256()
        texts = _record_texts(path)
        if texts is not None:
            yield from ((text, True) for text in texts if text)
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    hasher.update(block)
        else:
            first = True
            for piece in _read_pieces(path, piece_chars, hasher):
                yield piece, first
                first = False
        sources.append({"path": str(path), "bytes": path.stat().st_size, "sha256": hasher.hexdigest()})


def _record_texts(path: Path) -> Iterator[str] | None:
    """The "text" of every record when path is a .json or .jsonl file whose first record has a
    "text" string (as a `datasets` dataset's "text" column: the JSON around it is no training
    text); None for any other file, which is read as text."""
    if path.suffix not in (".json", ".jsonl"):
        return None
    try:
        _, first = next(record_rows(path), (None, None))
    except ValueError:  # not JSON (or not UTF-8): text
        return None
    if not (isinstance(first, dict) and isinstance(first.get("text"), str)):
        return None
    return _texts_of(path, record_rows(path))


def _texts_of(path: Path, rows) -> Iterator[str]:
    for i, (line, record) in enumerate(rows, start=1):
        if not (isinstance(record, dict) and isinstance(record.get("text"), str)):
            where = f"line {line}" if line else f"record {i}"
            raise ValueError(f'{path}: {where} has no "text" string, as the first record does')
        yield record["text"]


def record_rows(path: Path) -> Iterator[tuple[int | None, object]]:
    """(line number, or None in a JSON list; value) of each record of a .json (a list, or one
    value), .jsonl or .csv (with a header) file, read as it goes: JSONL and CSV line by line, so
    that a first record is read alone (sft.record_format, _record_texts)."""
    try:  # utf-8-sig: a BOM (Excel's "CSV UTF-8") is not the first key
        with open(path, encoding="utf-8-sig", newline="" if path.suffix == ".csv" else None) as f:
            if path.suffix == ".csv":
                reader = csv.DictReader(f)
                yield from ((reader.line_num, row) for row in reader)  # line_num: the row's last line
            elif path.suffix == ".json":
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: not valid JSON ({e})") from e
                yield from ((None, row) for row in (data if isinstance(data, list) else [data]))
            else:
                yield from ((n, _json_line(path, n, line)) for n, line in enumerate(f, start=1) if line.strip())
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def _json_line(path, number: int, line: str):
    """One JSONL line's value; a ValueError naming the file's line when it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {number} is not valid JSON ({e.msg}, column {e.colno})") from None


def _hf_documents(name: str, sources: list[dict]) -> Iterator[tuple[str, bool]]:
    """Documents of a Hugging Face `datasets` dataset (its "text" column, train split)."""
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"input {name}: not a file, and the `datasets` package is not installed") from e
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # not found, no network, ...: and most often a mistyped path
        raise ValueError(f"input {name}: no such file, directory or glob match, nor a `datasets` dataset "
                         f"that loads ({type(e).__name__}: {e})") from e  # fmt: skip
    if "text" not in ds.column_names:
        raise ValueError(f"dataset {name} has no 'text' column (columns: {ds.column_names})")
    sources.append({"dataset": name, "rows": len(ds), "fingerprint": getattr(ds, "_fingerprint", None)})
    for row in ds:
        yield row["text"], True


def _could_be_dataset(spec) -> bool:
    """A string like "user/name" that is no path or glob: try it as a `datasets` name."""
    if not isinstance(spec, str) or any(c in spec for c in "*?[") or spec.startswith((".", "/", "~")):
        return False
    if Path(spec).exists():  # an empty directory: "holds no files", not a Hub look-up
        return False
    if Path(spec).suffix in TEXT_SUFFIXES:  # a mistyped file name, not a dataset: "no such file"
        return False
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


_WORKER_TOKENIZER = None


def _encode_piece(args: tuple[str, str]) -> np.ndarray:
    global _WORKER_TOKENIZER
    tokenizer_name, text = args
    if _WORKER_TOKENIZER is None or _WORKER_TOKENIZER.name != tokenizer_name:
        _WORKER_TOKENIZER = get_tokenizer(tokenizer_name)
    ids = _WORKER_TOKENIZER.encode(text)
    return np.asarray(ids, dtype=token_dtype(_WORKER_TOKENIZER.n_vocab))


def _encoded_pieces(pieces: Iterator[tuple[str, bool]], tokenizer_name: str, workers: int) -> Iterator:
    """(ids, piece_chars, new_doc) in input order, encoded in `workers` processes (1: in-process)."""

    def tasks():
        for text, new_doc in pieces:
            meta.append((len(text), new_doc))
            yield tokenizer_name, text

    meta: deque[tuple[int, bool]] = deque()  # of the pieces handed out and not yet yielded (a record's each)
    if workers <= 1:
        for ids in map(_encode_piece, tasks()):
            yield ids, *meta.popleft()
        return
    # fork: workers only run the tokenizer, and fork needs no `if __name__ == "__main__"` guard.
    method = "fork" if "fork" in get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(workers, mp_context=get_context(method)) as pool:
        # map() submits everything it is given; feed it in windows so memory stays bounded.
        for window in _windows(tasks(), 4 * workers * PIECE_CHARS):
            # small documents (JSONL records) go to a worker many at a time, not one message each
            for ids in pool.map(_encode_piece, window, chunksize=-(-len(window) // (4 * workers))):
                yield ids, *meta.popleft()


def _windows(tasks: Iterator, n_chars: int) -> Iterator[list]:
    """The tasks in lists of about n_chars of text each."""
    window, size = [], 0
    for task in tasks:
        window.append(task)
        size += len(task[1])
        if size >= n_chars:
            yield window
            window, size = [], 0
    if window:
        yield window


def prepare(
    inputs,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str = "gpt2",
    val_fraction: float = 0.1,
    workers: int | None = None,
    piece_chars: int = PIECE_CHARS,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` (see resolve_inputs, or a `datasets` name) into out_dir/{train,val}.bin.

    Returns the manifest. The same inputs always give byte-identical files.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if workers is not None and workers < 1:  # 0 or -3 ran in-process, as if asked for
        raise ValueError(f"workers must be at least 1 (leave it unset to choose by input size), got {workers}")
    tok = get_tokenizer(tokenizer)
    out_dir = Path(out_dir)
    sources: list[dict] = []
    try:
        files = resolve_inputs(inputs, exclude=out_dir)  # not a run before's outputs inside the input
        total_chars = sum(p.stat().st_size for p in files)
        pieces = _documents(files, piece_chars, sources)
    except ValueError:
        if not _could_be_dataset(inputs):
            raise
        total_chars, pieces = None, _hf_documents(str(inputs), sources)
    out_dir.mkdir(parents=True, exist_ok=True)  # once the inputs are found: a mistyped one left an empty out_dir
    if workers is None:
        workers = min(os.cpu_count() or 1, 8) if (total_chars or PARALLEL_MIN_CHARS) >= PARALLEL_MIN_CHARS else 1
    dtype = token_dtype(tok.n_vocab)
    stream_path = out_dir / ".tokens.tmp"
    try:
        n_tokens = _write_stream(
            _encoded_pieces(pieces, tokenizer, workers), stream_path, tok.eot_token, dtype, total_chars, progress
        )
        # An earlier run's manifest would describe the old files while train.bin and val.bin are
        # replaced one after the other: a run stopped in between must leave no manifest at all.
        (out_dir / MANIFEST).unlink(missing_ok=True)
        counts = _split(stream_path, out_dir, n_tokens, val_fraction, dtype)
    finally:
        stream_path.unlink(missing_ok=True)
    manifest = {
        "tokenizer": tok.name,  # a directory's BPE by its absolute path, as loading.tokenizer_name names it
        "vocab_size": tok.n_vocab,
        "dtype": dtype.name,
        "separator": ENDOFTEXT,
        "val_fraction": val_fraction,
        "tokens": counts,
        "sources": sources,
    }
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2))
    log.info(
        "prepared %s: %s train + %s val tokens (%s)", out_dir, f"{counts['train']:,}", f"{counts['val']:,}", dtype.name
    )
    return manifest


def _write_stream(encoded, path: Path, eot: int, dtype: np.dtype, total_chars, progress: bool) -> int:
    """Append every piece's ids to `path`, an <|endoftext|> between documents; returns the count."""
    from tqdm import tqdm

    n_tokens, started, t0 = 0, False, time.perf_counter()
    bar = tqdm(total=total_chars, unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    with open(path, "wb") as f:
        for ids, n_chars, new_doc in encoded:
            if new_doc and started:
                f.write(np.asarray([eot], dtype=dtype).tobytes())
                n_tokens += 1
            started = True
            f.write(ids.tobytes())
            n_tokens += len(ids)
            bar.update(n_chars)
            # drawn with the bar (refresh=False): a redraw per piece cost 54 us a JSONL record, 3x the run
            bar.set_postfix_str(f"{n_tokens / max(time.perf_counter() - t0, 1e-9):,.0f} tok/s", refresh=False)
    bar.close()
    if n_tokens < 2:  # a train and a val split need a token each
        raise ValueError(f"the input holds {n_tokens} token(s); a train and a validation split need at least 2")
    return n_tokens


def _split(stream_path: Path, out_dir: Path, n_tokens: int, val_fraction: float, dtype: np.dtype) -> dict:
    """Copy the token stream into train.bin (the start) and val.bin (the last val_fraction); each
    gets at least one token (a tiny input at a large fraction left train.bin empty)."""
    n_val = min(n_tokens - 1, max(1, round(n_tokens * val_fraction)))
    tokens = np.memmap(stream_path, dtype=dtype, mode="r", shape=(n_tokens,))
    bounds = {"train": (0, n_tokens - n_val), "val": (n_tokens - n_val, n_tokens)}
    for split, (lo, hi) in bounds.items():

        def write(tmp, lo=lo, hi=hi, tokens=tokens):
            with open(tmp, "wb") as f:
                for s in range(lo, hi, 1 << 24):
                    f.write(tokens[s : min(hi, s + (1 << 24))].tobytes())

        atomic_write(out_dir / f"{split}.bin", write)
    del tokens
    return {split: hi - lo for split, (lo, hi) in bounds.items()}


def read_manifest(data_dir: str | os.PathLike) -> dict:
    """The manifest of a prepared data directory; a clear error when it is missing or damaged."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise ValueError(f"data directory {data_dir} does not exist (run `gptlab prepare` first)")
    try:
        return json.loads((data_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{data_dir}: no readable {MANIFEST} ({getattr(e, 'strerror', None) or e}); run `gptlab prepare` first"
        ) from e


# ---------------------------------------------------------------------------------------------
# TokenLoader: memory-mapped (x, y) batches


def open_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    """A token file, memory-mapped read-only. An empty file is an empty array (numpy cannot map
    it); a size that is not whole tokens (a truncated copy, another dtype) is an error naming it."""
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"{path} has {size} bytes, not a whole number of {dtype.name} tokens (truncated?)")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of n examples in one epoch, seeded by (seed, epoch)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).numpy()


class CountedLoader:
    """A loader whose batch k is a pure function of (its settings, k): its whole state is the
    counter. Subclasses define `batch(k)` and set batch_index, mode and seed (and may name more
    settings that a saved state must match in STATE_KEYS)."""

    STATE_KEYS = ("mode", "seed")

    def units(self) -> int:
        """What one sequential pass covers (windows, or examples or rows of examples)."""
        raise NotImplementedError

    def positions(self, k: int) -> np.ndarray:
        """This rank's positions in batch k in the endless stream of epochs (the first pass is
        0 .. units-1), (B,): rank r takes rows r*B ... (r+1)*B of each global batch."""
        first = (k * self.world_size + self.rank) * self.batch_size
        return first + np.arange(self.batch_size)

    def wrapped(self, k: int) -> np.ndarray:
        """Which of this rank's rows in sequential batch k wrapped around to the first units, (B,)
        bool: their targets are IGNORE, so an evaluation pass scores each unit once (the last
        batch counted the first rows twice)."""
        if self.mode != "sequential":
            return np.zeros(self.batch_size, dtype=bool)
        return self.positions(k) >= self.units()

    def distinct_batches(self) -> int:
        """Sequential batches before they wrap around to the first again: more evaluation steps
        than this score the same rows twice."""
        global_batch = self.batch_size * self.world_size
        return max(1, -(-self.units() // global_batch))

    def next_batch(self):
        """The next batch; advances the counter."""
        out = self.batch(self.batch_index)
        self.batch_index += 1
        return out

    def state_dict(self) -> dict:
        return {"batch_index": self.batch_index, **{k: getattr(self, k) for k in self.STATE_KEYS}}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if any(state.get(k, mine[k]) != mine[k] for k in self.STATE_KEYS):
            raise ValueError(f"loader state {state} does not match this loader ({mine})")
        self.batch_index = int(state["batch_index"])


class TokenLoader(CountedLoader):
    """(x, y) int64 batches (B, T) from a token file, y = x shifted by one token.

    mode "random": batch k takes global_batch = B * world_size windows at offsets drawn from a
    generator seeded with (seed, k). mode "sequential": batch k takes the consecutive windows
    k * global_batch ... (wrapping around). Rank r gets rows r*B ... (r+1)*B of the global batch,
    so ranks read disjoint rows and together read what one process with B * world_size reads.
    The state is the batch counter (`state_dict()` / `load_state_dict()`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        batch_size: int,
        block_size: int,
        *,
        dtype: str | np.dtype = "uint16",
        mode: str = "random",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if mode not in ("random", "sequential"):
            raise ValueError(f"loader mode must be 'random' or 'sequential', got {mode!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"token file {self.path} does not exist")
        self.tokens = open_tokens(self.path, np.dtype(dtype))
        self.batch_size, self.block_size = batch_size, block_size
        if len(self.tokens) < block_size + 1:
            raise ValueError(
                f"{self.path} has {len(self.tokens)} tokens; block_size {block_size} needs at least {block_size + 1}"
            )
        self.mode, self.seed, self.rank, self.world_size = mode, seed, rank, world_size
        self.batch_index = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def units(self) -> int:
        return (len(self.tokens) - 1) // self.block_size  # back-to-back windows

    def offsets(self, k: int) -> np.ndarray:
        """Start offsets of this rank's rows in batch k, (B,)."""
        import torch

        n, T = len(self.tokens), self.block_size
        if self.mode == "random":  # any start 0 .. n - T - 1
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
            starts = torch.randint(n - T, (self.global_batch,), generator=g).numpy()
            return starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return (self.positions(k) % self.units()) * T  # back-to-back windows; (n - 1) // T of them fit

    def batch(self, k: int):
        """Batch k as (x, y), each an int64 tensor (B, T); y is IGNORE on the rows of a sequential
        batch that wrapped around (`wrapped`)."""
        import torch

        T = self.block_size
        windows = np.stack([self.tokens[s : s + T + 1] for s in self.offsets(k)]).astype(np.int64)  # (B, T+1)
        x, y = windows[:, :-1], windows[:, 1:].copy()  # (B, T), (B, T)
        y[self.wrapped(k)] = IGNORE
        return torch.from_numpy(x), torch.from_numpy(y)
