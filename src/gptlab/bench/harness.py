"""gptlab bench harness: lm-evaluation-harness through gptlab's backend against its own `--model hf`.

The same tasks on the same weights, in one process, 2 threads by default:
- bench_choice: multiple choice, --choices documents from the validation end of --data (the last
  tenth, which `make demo` does not train on): two lines of context, then which of four orders
  of the next line's first five words is the real one (a trained model tells; a random one
  cannot);
- bench_rolling: rolling perplexity over --docs excerpts of 2,000 characters.

Each task runs through lm-eval's `simple_evaluate` with `--model hf` (transformers' GPT2LMHeadModel,
read from a `save_pretrained` directory of the model), `--model gptlab` in fp32, and `--model
gptlab` quantized to int8. Requests/s counts lm-eval's requests (one per choice, one per text)
over the seconds spent in the model's methods (task building excluded). Printed: requests/s and
the ratio to hf; accuracy and perplexity, so agreement and int8's accuracy change show too.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from gptlab.bench.common import CORPUS, add_out_argument, positive, write_results

DEFAULT_MODEL = "runs/demo/run/latest"  # what `make demo` trains
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
{body}
metadata:
  version: 1.0
"""
CHOICE = """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true"""
ROLLING = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false"""
METRIC = {"bench_choice": "acc,none", "bench_rolling": "word_perplexity,none"}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gptlab bench harness", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a trained model, any --model spec (default: make demo's)")
    p.add_argument("--data", default=CORPUS, help="text file")
    p.add_argument("--choices", type=positive, default=1000, help="multiple-choice documents (4 requests each)")
    p.add_argument("--docs", type=positive, default=40, help="rolling-perplexity texts")
    p.add_argument("--batch-size", type=positive, default=16)
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)
    return p.parse_args(argv)


def write_tasks(text: str, directory: Path, n_choices: int, n_docs: int, seed: int) -> None:
    """bench_choice and bench_rolling (YAML and JSON lines) from the last tenth of text."""
    val = text[int(len(text) * 0.9) :]
    lines = [line.strip() for line in val.split("\n") if len(set(line.split()[:5])) == 5]  # 5 distinct words
    rng = random.Random(seed)
    docs = []
    for i in range(n_choices):
        j = i % (len(lines) - 2)
        words = lines[j + 2].split()[:5]
        options = [words]
        while len(options) < 4:  # the same words in another order
            shuffled = rng.sample(words, len(words))
            if shuffled not in options:
                options.append(shuffled)
        gold = rng.randrange(4)
        options[0], options[gold] = options[gold], options[0]
        docs.append({"context": f"{lines[j]}\n{lines[j + 1]}\n", "choices": [" " + " ".join(o) for o in options],
                     "gold": gold})  # fmt: skip
    texts = [{"text": val[2000 * i : 2000 * (i + 1)]} for i in range(n_docs)]
    for name, rows, body in (("bench_choice", docs, CHOICE), ("bench_rolling", texts, ROLLING)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (directory / f"{name}.yaml").write_text(TASK.format(name=name, data=data, body=body))


def timed_model(lm) -> list[float]:
    """Wrap lm's request methods so the seconds spent in them add up in the returned list."""
    spent = [0.0]
    for name in ("loglikelihood", "loglikelihood_rolling"):
        method = getattr(lm, name)

        def wrapper(requests, *a, _method=method, **k):
            t0 = time.perf_counter()
            try:
                return _method(requests, *a, **k)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(lm, name, wrapper)
    return spent


def run_task(lm, task: str, manager) -> dict:
    """One task through lm-eval: its metric, requests and requests/s."""
    from lm_eval import simple_evaluate

    spent = timed_model(lm)
    out = simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=False)
    docs = out["n-samples"][task]["effective"]
    requests = docs * 4 if task == "bench_choice" else docs
    return {"metric": float(out["results"][task][METRIC[task]]), "requests": requests,
            "seconds": round(spent[0], 3), "requests_per_s": round(requests / spent[0], 2)}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv or [])
    torch.set_num_threads(args.threads)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import gptlab.harness  # noqa: F401  (registers --model gptlab; needs lm-eval)
    from gptlab.loading import load_model

    model = load_model(args.model, dtype=torch.float32).eval()
    block = model.config.block_size
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_tasks(Path(args.data).read_text(), tmp, args.choices, args.docs, args.seed)
        model.save_pretrained(tmp / "hf")
        manager = TaskManager(include_path=str(tmp))
        backends = {
            "hf": lambda: HFLM(
                pretrained=str(tmp / "hf"), dtype="float32", batch_size=args.batch_size, max_length=block, device="cpu"
            ),  # fmt: skip
            "gptlab": lambda: gptlab.harness.GptlabLM(model, batch_size=args.batch_size, max_length=block),
            "gptlab-int8": lambda: gptlab.harness.GptlabLM(
                load_model(args.model, dtype=torch.float32),
                quantize="int8",
                batch_size=args.batch_size,
                max_length=block,
            ),  # fmt: skip
        }
        for name, make in backends.items():
            lm = make()
            rows[name] = {task: run_task(lm, task, manager) for task in METRIC}
            del lm
    print_table(rows)
    results = {"settings": vars(args), "rows": rows}
    for task in METRIC:
        results[f"{task}_speedup"] = round(
            rows["gptlab"][task]["requests_per_s"] / rows["hf"][task]["requests_per_s"], 2
        )
    results["int8_accuracy_change_points"] = round(
        100 * (rows["gptlab-int8"]["bench_choice"]["metric"] - rows["gptlab"]["bench_choice"]["metric"]), 2
    )
    write_results("harness", results, args.out)
    return 0


def print_table(rows: dict) -> None:
    print(f"{'backend':<12} {'task':<14} {'requests/s':>11} {'vs hf':>6}  metric")
    for name, tasks in rows.items():
        for task, r in tasks.items():
            ratio = r["requests_per_s"] / rows["hf"][task]["requests_per_s"]
            metric = f"acc {r['metric']:.4f}" if task == "bench_choice" else f"word ppl {r['metric']:,.3f}"
            print(f"{name:<12} {task:<14} {r['requests_per_s']:>11,.1f} {ratio:>5.2f}x  {metric}")
