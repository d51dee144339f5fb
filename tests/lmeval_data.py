"""What the lm-eval tests share: the data of the tasks in tests/lmeval_tasks (written into the
working directory, where the tasks' data_files point), and running lm-eval on them offline."""

import json
from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parent / "lmeval_tasks"
SHAKESPEARE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"


def write_data(directory: Path) -> None:
    """docs.jsonl, choices.jsonl, targets.jsonl and prompts.jsonl from tiny-shakespeare."""
    text = SHAKESPEARE.read_text()
    lines = [line for line in text.split("\n")[:600] if line.strip()]
    docs = [{"text": text[700 * i : 700 * (i + 1)]} for i in range(8)]
    choices, targets, prompts = [], [], []
    for i in range(20):
        context, words = " ".join(lines[2 * i : 2 * i + 2])[:120], lines[2 * i + 3].split()[:4] or ["nothing"]
        choices.append({"context": context, "choices": [" " + w for w in words + ["thee", "and", "King"]][:4],
                        "gold": i % 4})  # fmt: skip
        targets.append({"context": "" if i % 7 == 0 else context, "target": " " + words[0]})
        prompts.append({"context": context, "answer": " " + words[0]})
    for name, rows in (("docs", docs), ("choices", choices), ("targets", targets), ("prompts", prompts)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def evaluate(model, model_args: str | None, tasks, batch_size: int = 1, responses=()) -> dict:
    """{"task/metric": value} for the tasks' metrics, and {"task/responses": [...]} for the tasks
    named in `responses` (each document's filtered responses, in document order). `model` is a
    name or an lm-eval LM."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), batch_size=batch_size,
                          task_manager=TaskManager(include_path=str(TASKS)), device="cpu",
                          log_samples=bool(responses))  # fmt: skip
    metrics = {}
    for task in tasks:
        for key, value in out["results"][task].items():
            name, _, filt = key.partition(",")
            if filt and "stderr" not in name:
                metrics[f"{task}/{name}"] = value
        if task in responses:
            rows = sorted(out["samples"][task], key=lambda s: s["doc_id"])
            metrics[f"{task}/responses"] = [s["filtered_resps"] for s in rows]
    return metrics


def assert_same(ours: dict, reference: dict) -> None:
    """Accuracies and generated texts exact, perplexities within 1e-4 relative."""
    assert set(ours) == set(reference)
    for name, value in reference.items():
        if "perplexity" in name:
            assert ours[name] == pytest.approx(value, rel=1e-4), name
        else:
            assert ours[name] == value, name
