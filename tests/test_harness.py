"""gptlab's lm-eval backend (`--model gptlab`, gptlab.harness) against lm-eval's own `--model hf`
on the same weights: a rolling-perplexity and a multiple-choice task (local JSON, offline)."""

import json
from types import SimpleNamespace

import pytest
import torch

import gptlab.harness  # noqa: F401  (registers --model gptlab)
from gptlab.config import GPTConfig
from gptlab.generation import generate_text
from gptlab.model import GPT
from test_serve_lmeval import SHAKESPEARE, evaluate, offline, write_task  # noqa: F401  (offline: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

CHOICE_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()
    model.save_pretrained(tmp_path / "model")
    return model, str(tmp_path / "model")


def write_choice_task(tmp_path, include: str) -> None:
    lines = SHAKESPEARE.read_text().split("\n")[:400]
    with open(tmp_path / "choices.jsonl", "w") as f:
        for i in range(0, 40, 2):
            context, words = " ".join(lines[i : i + 2])[:120], lines[i + 3].split()[:4] or ["nothing"]
            choices = [" " + w for w in words + ["thee", "and", "King"]][:4]
            f.write(json.dumps({"context": context, "choices": choices, "gold": i % 4}) + "\n")
    (tmp_path / "tasks" / "tiny_choice.yaml").write_text(CHOICE_TASK.format(data=tmp_path / "choices.jsonl"))


def test_model_gptlab_equals_model_hf(tmp_path, offline, saved):  # noqa: F811
    _, path = saved
    include = write_task(tmp_path)
    write_choice_task(tmp_path, include)
    tasks = ["tiny_rolling", "tiny_choice"]
    ours = evaluate("gptlab", f"pretrained={path},dtype=float32,max_length=64", include, tasks, batch_size=4)
    hf = evaluate("hf", f"pretrained={path},dtype=float32,max_length=64", include, tasks, batch_size=4)
    # measured: word perplexity 34,654,645.9 against 34,654,642.7 (9e-8 relative; fp32 both ways),
    # accuracy 0.3 both; the continuation's span one position early fails here
    for name, value in hf.items():
        if name.startswith("tiny_choice"):
            assert ours[name] == value, name
        else:
            assert ours[name] == pytest.approx(value, rel=1e-4), name


def test_generate_until_is_gptlabs_greedy_text_cut_at_the_stop(saved):
    model, path = saved
    lm = gptlab.harness.GptlabLM(pretrained=path, dtype="float32")
    context = "ROMEO:\n"
    free = generate_text(model, lm.tok, context, 24, temperature=0)
    stop = free[5:7]  # a string that occurs in the greedy continuation
    req = SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 24, "do_sample": False}))
    (text,) = lm.generate_until([req], disable_tqdm=True)
    assert text == free[: free.index(stop)]
