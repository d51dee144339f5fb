"""gptlab bench finetune: the README's two fine-tuning recipes, run end to end offline.

- classify: which of tiny-shakespeare's four most frequent speakers says a speech. A classifier
  on --base's body is trained four ways (the head only, the head and the last block, LoRA, every
  weight) for --cls-steps steps each, and scored on a held-out fifth of the speeches against
  the majority-class baseline.
- instruct: four small tasks with exact answers (gptlab.bench.finetune_data). --base is tuned
  for --sft-epochs passes over the training examples with the loss on the responses only
  (packed rows, then padded rows) and on every token; each model, and --base itself, answers
  the held-out prompts greedily. Scored: exact answers, and "format followed" (the answer ends
  with <|endoftext|> within 24 tokens and starts no new "###" section), and the cross-entropy
  of the held-out responses' tokens under each model. Packed against padded:
  the same epochs, so the same examples; steps, seconds and trained tokens per second.
- layouts: the seconds per epoch of packed and padded rows on examples of varied lengths
  (tiny-shakespeare's speeches as responses).

Data and runs go to --work; the figures to bench/results/finetune-*.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gptlab.bench.common import positive, write_results
from gptlab.data import IGNORE

DEFAULT_BASE = "runs/demo/run/latest"  # what `make demo` trains
CLS_MODES = {  # name: (TrainConfig overrides, lr)
    "head": ({"trainable": "head"}, 3e-3),
    "last block": ({"trainable": "last:1"}, 1e-3),
    "LoRA r=8": (
        {
            "lora_rank": 8,
            "lora_alpha": 16.0,
            "lora_targets": "c_attn.q,c_attn.k,c_attn.v,attn.c_proj,mlp.c_fc,mlp.c_proj",
        },
        2e-3,
    ),  # fmt: skip
    "full": ({}, 3e-4),
}
SFT_RUNS = {  # name: (prepared data, layout)
    "masked, packed": ("sft-response", "pack"),
    "masked, padded": ("sft-response", "pad"),
    "unmasked, packed": ("sft-all", "pack"),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=DEFAULT_BASE, help=f"model to fine-tune (default {DEFAULT_BASE}, from make demo)")
    p.add_argument("--work", default="runs/finetune", help="data and runs (default runs/finetune)")
    p.add_argument("--recipes", nargs="+", default=["classify", "instruct", "layouts"],
                   choices=["classify", "instruct", "layouts"])  # fmt: skip
    p.add_argument("--cls-steps", type=positive, default=200)
    p.add_argument("--sft-epochs", type=float, default=4.0)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=positive, default=16)
    p.add_argument("--threads", type=positive, default=2)
    return p.parse_args(argv)


def train_run(base: str, data: Path, out: Path, steps: int, batch_size: int, lr: float, **overrides) -> dict:
    import shutil

    from gptlab.train import TrainConfig, train

    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time the benchmark runs
    cfg = TrainConfig(data_dir=str(data), out_dir=str(out), init_from=base, block_size=128, batch_size=batch_size,
                      max_steps=steps, lr=lr, min_lr=lr / 10, warmup_steps=steps // 10, eval_interval=steps,
                      eval_steps=8, sample_tokens=0, progress=False, precision="float32", **overrides)  # fmt: skip
    t0 = time.perf_counter()
    summary = train(cfg)
    return {**summary, "wall_s": time.perf_counter() - t0}


def classify_recipe(args, work: Path) -> dict:
    from gptlab.bench import finetune_data
    from gptlab.classify_data import evaluate_classifier, prepare_classify
    from gptlab.loading import load_model
    from gptlab.sft import read_records
    from gptlab.tokenizer import get_tokenizer

    files = finetune_data.write("speakers", work / "data")
    prepare_classify(files["train"], work / "speakers")
    test, tok = read_records(files["test"]), get_tokenizer("gpt2")
    rows = {}
    for name, (overrides, lr) in CLS_MODES.items():
        out = work / "runs" / ("cls-" + name.split()[0].lower())
        run = train_run(args.base, work / "speakers", out, args.cls_steps, args.batch_size, lr, **overrides)
        scored = evaluate_classifier(load_model(run["checkpoint"]), tok, test)
        stored = sum(p.numel() for p in _stored(run["checkpoint"]))
        rows[name] = dict(accuracy=scored["accuracy"], train_s=run["seconds"], checkpoint=run["checkpoint"],
                          checkpoint_weights_mib=stored * 4 / 2**20)  # fmt: skip
        print(f"classify  {name:<11} accuracy {scored['accuracy']:.1%}  ({run['seconds']:.0f} s training)")
    baseline = scored["majority_baseline"]
    print(f"classify  majority-class baseline {baseline:.1%} over {scored['examples']} held-out speeches")
    return dict(test_speeches=scored["examples"], labels=scored["labels"], majority_baseline=baseline, modes=rows)


def _stored(checkpoint: str) -> list[torch.Tensor]:
    """The tensors a checkpoint stores for itself: a LoRA run's trained ones, else the model's."""
    from safetensors.torch import load_file

    path = Path(checkpoint)
    name = "lora.safetensors" if (path / "lora.safetensors").is_file() else "model.safetensors"
    return list(load_file(path / name).values())


def instruct_recipe(args, work: Path) -> dict:
    from gptlab.bench import finetune_data
    from gptlab.loading import load_model
    from gptlab.sft import ExampleLoader, prepare_sft, read_records

    files = finetune_data.write("instructions", work / "data")
    for train_on in ("response", "all"):
        prepare_sft(files["train"], work / f"sft-{train_on}", train_on=train_on)
    heldout = read_records(files["heldout"])
    prepare_sft(files["heldout"], work / "sft-heldout", val_fraction=0.5)  # both halves score the responses
    held = [
        ExampleLoader(work / "sft-heldout", split, 25, 128, layout="pad", mode="sequential")
        for split in ("train", "val")
    ]
    base = load_model(args.base)
    rows = {"base (no tuning)": {**score_answers(base, heldout), "response_loss": response_loss(base, held)}}
    print(_answer_line("base (no tuning)", rows["base (no tuning)"]))
    for name, (data, layout) in SFT_RUNS.items():
        out = work / "runs" / ("sft-" + name.replace(", ", "-"))
        loader = ExampleLoader(work / data, "train", args.batch_size, 128, layout=layout)
        steps = max(1, round(args.sft_epochs * len(loader.epoch_rows(0)) / args.batch_size))
        run = train_run(args.base, work / data, out, steps, args.batch_size, args.sft_lr, sft_layout=layout)
        trained = int(sum((loader.batch(k)[1] != IGNORE).sum() for k in range(8))) / 8  # per batch
        step_s = run["seconds"] / run["steps_run"]
        tuned = load_model(run["checkpoint"])
        rows[name] = dict(**score_answers(tuned, heldout), response_loss=response_loss(tuned, held), steps=steps,
                          train_s=run["seconds"], step_s=step_s, trained_tokens_per_s=trained / step_s)  # fmt: skip
        print(
            _answer_line(name, rows[name])
            + f"  {steps} steps, {run['seconds']:.0f} s, {trained / step_s:,.0f} trained tok/s"
        )
    return dict(heldout_prompts=len(heldout), epochs=args.sft_epochs, runs=rows)


def layout_speed(args, work: Path, steps: int = 6) -> dict:
    """Packed against padded rows on examples of varied lengths (tiny-shakespeare's speeches as
    responses, 20-130 tokens): seconds per training step (forward and backward, --base's weights)
    and per epoch of the examples."""
    import json

    from gptlab.bench import finetune_data
    from gptlab.loading import load_model
    from gptlab.sft import ExampleLoader, prepare_sft
    from gptlab.train.evaluation import forward_loss

    text = Path(finetune_data.CORPUS).read_text(encoding="utf-8")
    records = [{"instruction": f"Speak as {who}.", "output": speech} for who, speech in finetune_data.speeches(text)]
    (work / "data").mkdir(parents=True, exist_ok=True)
    (work / "data" / "speeches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2000]))
    prepare_sft(work / "data" / "speeches.jsonl", work / "sft-speeches")
    model = load_model(args.base).train()
    out = {}
    for layout in ("pack", "pad"):
        loader = ExampleLoader(work / "sft-speeches", "train", args.batch_size, 128, layout=layout)
        times = []
        for k in range(steps + 1):
            t0 = time.perf_counter()
            forward_loss(model, loader.batch(k), "cpu")[1].backward()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times[1:])[len(times[1:]) // 2]  # median, the first (warm-up) step left out
        epoch_s = len(loader.epoch_rows(0)) / args.batch_size * step_s
        out[layout] = dict(step_s=step_s, rows_per_epoch=len(loader.epoch_rows(0)), epoch_s=epoch_s)
        print(
            f"instruct  varied lengths, {layout}: {step_s:.3f} s/step, {len(loader.epoch_rows(0))} rows, epoch {epoch_s:.0f} s"
        )
    return out


@torch.no_grad()
def score_answers(model, records: list[dict], max_new_tokens: int = 24) -> dict:
    """Greedy answers to Alpaca records under the default template: exact and format-following rates."""
    from gptlab.generation import generate
    from gptlab.sft import Template
    from gptlab.tokenizer import get_tokenizer

    tok, template = get_tokenizer("gpt2"), Template()
    prompts = [tok.encode(template.prompt_for(r["instruction"], r.get("input", ""))) for r in records]
    exact = followed = 0
    for s in range(0, len(prompts), 32):
        batch = prompts[s : s + 32]
        out = generate(model, batch, max_new_tokens, temperature=0.0, eos_id=tok.eot_token)
        for prompt, row, record in zip(batch, out, records[s : s + 32], strict=True):
            new = row[len(prompt) :]
            ended = bool(new) and new[-1] == tok.eot_token
            answer = tok.decode(new[:-1] if ended else new)
            followed += ended and "###" not in answer
            exact += ended and answer.strip() == record["output"]
    return dict(exact=exact / len(records), format_followed=followed / len(records))


@torch.no_grad()
def response_loss(model, loaders) -> float:
    """Mean cross-entropy over the held-out responses' tokens (and their <|endoftext|>)."""
    total = count = 0.0
    for loader in loaders:
        examples = len(loader.examples)
        for k in range(-(-examples // loader.batch_size)):
            x, y, _ = loader.batch(k)  # y is IGNORE on the rows of the last batch that wrap around
            logits, _ = model(x)
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += int((y != IGNORE).sum())
    return total / count


def _answer_line(name: str, row: dict) -> str:
    return (f"instruct  {name:<17} exact {row['exact']:.1%}  format followed {row['format_followed']:.1%}  "
            f"held-out response loss {row['response_loss']:.3f}")  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = Path(args.work)
    results = {"config": vars(args)}
    if "classify" in args.recipes:
        results["classify"] = classify_recipe(args, work)
    if "instruct" in args.recipes:
        results["instruct"] = instruct_recipe(args, work)
    if "layouts" in args.recipes:
        results["layouts_varied_lengths"] = layout_speed(args, work)
    write_results("finetune", results)
