"""lm-evaluation-harness itself against `gptlab serve`: its `local-completions` client scores a
rolling-perplexity task (local JSON, offline) through the server and gets what its `--model hf`
backend gets on the same weights (a `save_pretrained` directory).

lm-eval's client sends each window with echo and max_tokens 1, drops that token's logprob, and
takes one token off its max_length, so its windows at max_length L + 2 are --model hf's at L.
At L + 2 = block_size + 1 its prompts fill the whole context: the server must still give the
one new token (never fed, so it fits)."""

import json
from pathlib import Path

import pytest
import torch

from gptlab.config import GPTConfig
from gptlab.model import GPT
from gptlab.serve.app import create_app
from gptlab.tokenizer import get_tokenizer
from test_serve import running

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 64
SHAKESPEARE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "tinyshakespeare.txt"

TASK = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
should_decontaminate: false
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
metadata:
  version: 1.0
"""


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """lm-eval (and the datasets library under it) offline, caching in tmp_path."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")


def write_task(tmp_path) -> str:
    text = SHAKESPEARE.read_text()
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"text": text[700 * i : 700 * (i + 1)]}) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_rolling.yaml").write_text(TASK.format(data=tmp_path / "docs.jsonl"))
    return str(tasks)


def evaluate(model: str, model_args: str, include_path: str, tasks=("tiny_rolling",), batch_size: int = 1) -> dict:
    """{"task/metric": value} for the tasks' metrics (word/byte perplexity, accuracy)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), batch_size=batch_size,
                          task_manager=TaskManager(include_path=include_path), device="cpu")  # fmt: skip
    wanted = ("word_perplexity", "byte_perplexity", "acc")
    return {f"{task}/{name}": out["results"][task][f"{name},none"] for task in tasks for name in wanted
            if f"{name},none" in out["results"][task]}  # fmt: skip


def test_local_completions_against_gptlab_serve_equals_model_hf(tmp_path, offline):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=BLOCK, n_layer=2, n_head=2, n_embd=64)).eval()
    model.save_pretrained(tmp_path / "model")
    include = write_task(tmp_path)
    hf = evaluate("hf", f"pretrained={tmp_path / 'model'},dtype=float32,max_length={BLOCK - 1}", include)
    with running(create_app(model, get_tokenizer("gpt2"), name="tiny")) as url:
        args = (f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tmp_path / 'model'},"
                f"max_length={BLOCK + 1},num_concurrent=1,max_retries=1,tokenized_requests=True")  # fmt: skip
        served = evaluate("local-completions", args, include)
    # measured 2.3e-7 apart (word perplexity ~2.4e7): the same windows, fp32 both ways
    for name, value in hf.items():
        assert served[name] == pytest.approx(value, rel=1e-4), name
