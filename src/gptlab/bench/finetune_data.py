"""The fine-tuning recipes' data, made offline from tiny-shakespeare and a seed.

    python -m gptlab.bench.finetune_data speakers --out data/finetune
    python -m gptlab.bench.finetune_data instructions --out data/finetune

speakers: every speech (one turn: the lines under a `NAME:` heading) of tiny-shakespeare's four
most frequent speakers, as {"text", "label"} records: speakers-train.jsonl, and a seeded random
fifth in speakers-test.jsonl.

instructions: Alpaca records of four small tasks with one exact answer each (adding two numbers,
repeating a word three times, wrapping a word in brackets, reversing a list of words), in
instructions-train.jsonl. Words come from tiny-shakespeare; instructions-heldout.jsonl uses
words and pairs of numbers that no training record uses, so the recipe scores prompts never seen.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
from pathlib import Path

from gptlab.bench.common import CORPUS

TASKS = ("add", "repeat", "brackets", "reverse")


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) for each `NAME:` block of the play text, the speech's lines joined by spaces."""
    out = []
    for block in text.split("\n\n"):
        head, _, body = block.strip("\n").partition("\n")
        if re.fullmatch(r"[A-Z][A-Za-z ]*:", head) and body.strip():
            out.append((head[:-1], " ".join(line.strip() for line in body.splitlines())))
    return out


def speaker_records(text: str, n_speakers: int = 4) -> list[dict]:
    pairs = speeches(text)
    top = [name for name, _ in collections.Counter(s for s, _ in pairs).most_common(n_speakers)]
    return [{"text": speech, "label": speaker} for speaker, speech in pairs if speaker in top]


def words(text: str, n: int = 3000) -> list[str]:
    """The n most frequent lower-case words of 3-8 letters."""
    counts = collections.Counter(w for w in re.findall(r"[a-z]+", text.lower()) if 3 <= len(w) <= 8)
    return [w for w, _ in counts.most_common(n)]


def held_out_sum(a: int, b: int) -> bool:
    """A fixed fifth of the (a, b) pairs: only held-out records add them."""
    return (7 * a + b) % 5 == 0


def instruction(task: str, rng: random.Random, vocab: list[str], heldout: bool) -> dict:
    if task == "add":
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        while held_out_sum(a, b) != heldout:
            a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        return {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
    if task == "repeat":
        w = rng.choice(vocab)
        return {"instruction": "Repeat the word three times.", "input": w, "output": " ".join([w] * 3)}
    if task == "brackets":
        w = rng.choice(vocab)
        return {"instruction": "Put the word in square brackets.", "input": w, "output": f"[{w}]"}
    ws = rng.sample(vocab, 3)
    return {"instruction": "Reverse the order of the words.", "input": " ".join(ws), "output": " ".join(ws[::-1])}


def instruction_records(text: str, n_train: int = 4000, n_heldout: int = 200, seed: int = 0) -> list[dict]:
    """Training records, then held-out ones whose words and numbers training never uses."""
    rng = random.Random(seed)
    vocab = words(text)
    rng.shuffle(vocab)
    cut = len(vocab) * 4 // 5
    out = []
    for split, n, pool in (("train", n_train, vocab[:cut]), ("heldout", n_heldout, vocab[cut:])):
        for i in range(n):
            out.append({**instruction(TASKS[i % len(TASKS)], rng, pool, split == "heldout"), "split": split})
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{path}: {len(records)} records")


def write(kind: str, out: str | Path, corpus: str | Path = CORPUS, seed: int = 0) -> dict[str, Path]:
    """Write the recipe's files into `out`; returns {part: path}."""
    text, out = Path(corpus).read_text(encoding="utf-8"), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "speakers":
        records = speaker_records(text)
        random.Random(seed).shuffle(records)
        n_test = len(records) // 5
        parts = {"train": records[n_test:], "test": records[:n_test]}
    else:
        records = instruction_records(text, seed=seed)
        parts = {s: [{k: v for k, v in r.items() if k != "split"} for r in records if r["split"] == s]
                 for s in ("train", "heldout")}  # fmt: skip
    paths = {}
    for part, rows in parts.items():
        paths[part] = out / f"{kind}-{part}.jsonl"
        write_jsonl(paths[part], rows)
    return paths


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m gptlab.bench.finetune_data", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("speakers", "instructions"))
    p.add_argument("--out", required=True, help="directory for the JSONL files")
    p.add_argument("--corpus", default=str(CORPUS), help="tiny-shakespeare (default: ../shared/data/...)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write(args.kind, args.out, args.corpus, args.seed)


if __name__ == "__main__":
    main()
