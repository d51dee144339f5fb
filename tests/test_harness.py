"""gptlab's lm-eval backend (`--model gptlab`, gptlab.harness) against lm-eval's own `--model hf`
on the same weights, over the four kinds of request (tests/lmeval_tasks, local JSON, offline):
rolling perplexity, multiple choice, a target's loglikelihood, generate_until with stops."""

import json
from types import SimpleNamespace

import pytest
import torch

import gptlab.harness  # noqa: F401  (registers --model gptlab)
from gptlab.cli import main
from gptlab.config import GPTConfig
from gptlab.generation import generate_text
from gptlab.model import GPT
from lmeval_data import SHAKESPEARE, TASKS, assert_same, evaluate

pytestmark = pytest.mark.usefixtures("one_thread")
ALL = ["tiny_rolling", "tiny_choice", "tiny_target", "tiny_until"]


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=64, n_layer=2, n_head=2, n_embd=64)).eval()
    model.save_pretrained(tmp_path / "model")
    return model, str(tmp_path / "model")


def test_model_gptlab_equals_model_hf(lmeval_workdir, saved):
    _, path = saved
    args = f"pretrained={path},dtype=float32,max_length=64"
    ours = evaluate("gptlab", args, ALL, batch_size=4, responses=["tiny_until"])
    hf = evaluate("hf", args, ALL, batch_size=4, responses=["tiny_until"])
    # measured: word perplexity 34,654,645.9 against 34,654,642.7 (9e-8 relative; fp32 both
    # ways), accuracies equal; the generated texts equal. The continuation's span one position
    # early, overlapping rolling windows, or no <|endoftext|> before a window fail here.
    assert_same(ours, hf)
    assert any(r[0] for r in hf["tiny_until/responses"])  # something was generated


def test_generate_until_is_gptlabs_greedy_text_cut_at_the_stop(saved):
    model, path = saved
    lm = gptlab.harness.GptlabLM(pretrained=path, dtype="float32")
    context = "ROMEO:\n"
    free = generate_text(model, lm.tok, context, 24, temperature=0)
    stop = free[5:7]  # a string that occurs in the greedy continuation
    req = SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 24, "do_sample": False}))
    (text,) = lm.generate_until([req], disable_tqdm=True)
    assert text == free[: free.index(stop)]


def test_generation_kwargs_are_read_as_lm_eval_reads_them(saved):
    """generate_until read only until, max_gen_toks, do_sample, temperature and seed: a task's
    max_new_tokens (lm-eval's alias) fell back to 256 tokens, top_k/top_p were dropped, and a
    temperature without do_sample decoded greedily where lm-eval's backends sample."""
    model, path = saved
    lm = gptlab.harness.GptlabLM(pretrained=path, dtype="float32")
    context = "ROMEO:\n"

    def generate(**gen_kwargs):
        (text,) = lm.generate_until([SimpleNamespace(args=(context, gen_kwargs))], disable_tqdm=True)
        return text

    greedy = generate_text(model, lm.tok, context, 5, temperature=0)
    assert generate(until=[], max_new_tokens=5) == greedy
    assert generate(until=[], max_tokens=5, do_sample=True, temperature=1.0, top_k=1) == greedy  # top_k kept
    sampled = generate_text(model, lm.tok, context, 5, temperature=1.5, seed=3)
    assert sampled != greedy
    assert generate(until=[], max_gen_toks=5, temperature=1.5, seed=3) == sampled  # no do_sample: sampled
    assert generate(until=[], max_gen_toks=5, num_beams=1) == greedy
    with pytest.raises(ValueError, match="generation_kwargs num_beams not supported"):
        generate(until=[], max_gen_toks=5, num_beams=4)


def test_gptlab_eval_harness_prints_lm_evals_table_and_writes_its_results(lmeval_workdir, saved, capsys):
    _, path = saved
    out = lmeval_workdir / "results.json"
    code = main(["eval", "--model", path, "--harness", "tiny_choice,tiny_rolling,tiny_target", "--include-path",
                 str(TASKS), "--limit", "6", "--batch-size", "4", "--json", str(out), "--no-progress"])  # fmt: skip
    assert code in (0, None)
    printed = capsys.readouterr()
    assert "|tiny_choice |" in printed.out  # lm-eval's own table
    # --no-progress: lm-eval's bars and the backend's drew all the same, and then (tiny_target's
    # perplexity) the bar of lm-eval's bootstrap, which imports tqdm as it runs
    assert "it/s]" not in printed.err
    import lm_eval.api.task
    import tqdm as tqdm_package
    from tqdm import tqdm

    assert lm_eval.api.task.tqdm is tqdm_package.tqdm is tqdm  # given back
    result = json.loads(out.read_text())
    assert result["n-samples"]["tiny_choice"]["effective"] == 6
    direct = evaluate(gptlab.harness.GptlabLM(pretrained=path, batch_size=4), None, ["tiny_choice"])
    assert 0 <= result["results"]["tiny_choice"]["acc,none"] <= 1 and "tiny_choice/acc" in direct


def test_harness_applies_the_adapter_and_refuses_what_it_would_not_use(lmeval_workdir, saved, tmp_path, capsys):
    """--adapter with --harness was dropped (the base model's numbers, said nowhere); --max-length 0
    ran the default; --data was ignored; a classifier failed inside forward with a TypeError."""
    import copy

    from gptlab.classifier import from_language_model
    from gptlab.lora import LoRASettings, apply_lora, lora_layers, save_adapter

    model, path = saved
    adapted = apply_lora(copy.deepcopy(model), LoRASettings(rank=4, alpha=8, targets=("c_attn.q", "mlp.c_fc")))
    with torch.no_grad():
        for layer in lora_layers(adapted).values():
            for b in layer.lora_B.values():
                b.normal_(0, 0.5)
    save_adapter(adapted, tmp_path / "adapter")
    run = ["eval", "--model", path, "--harness", "tiny_rolling", "--include-path", str(TASKS), "--no-progress"]
    perplexity = {}
    for name, extra in (("base", []), ("adapted", ["--adapter", str(tmp_path / "adapter")])):
        assert main([*run, *extra, "--json", str(tmp_path / f"{name}.json")]) in (0, None)
        perplexity[name] = json.loads((tmp_path / f"{name}.json").read_text())["results"]["tiny_rolling"]
    direct = evaluate(
        gptlab.harness.GptlabLM(pretrained=path, adapter=str(tmp_path / "adapter")), None, ["tiny_rolling"]
    )
    assert perplexity["adapted"]["word_perplexity,none"] == pytest.approx(
        direct["tiny_rolling/word_perplexity"], rel=1e-6
    )
    assert perplexity["adapted"] != perplexity["base"]
    from_language_model(model, ["a", "b"]).save_pretrained(tmp_path / "classifier")
    for extra, message in [(["--max-length", "0"], "max_length must be in [1, 64], got 0"),
                           (["--data", "x.txt"], "--data does not apply to --harness"),
                           (["--model", str(tmp_path / "classifier")], "is a classifier")]:  # fmt: skip
        assert main([*run, *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["eval", "--model", str(tmp_path / "classifier"), "--task", "perplexity", "--data", "x.txt"]) == 2
    assert "is a classifier: --task perplexity" in capsys.readouterr().err


def test_a_gpt_object_takes_the_dtype_as_a_spec_does(saved):
    """With a GPT object as `pretrained`, dtype=bfloat16 was dropped: the fp32 model's numbers."""
    import copy

    model, path = saved
    requests = [(None, [464, 3290, 318], [257, 1332]), (None, [40], [716])]

    def scores(**model_args):
        return gptlab.harness.GptlabLM(**model_args)._loglikelihood_tokens(requests, disable_tqdm=True)

    lm = gptlab.harness.GptlabLM(pretrained=copy.deepcopy(model), dtype="bfloat16", device="cpu")
    assert lm.model.transformer.wte.weight.dtype == torch.bfloat16
    by_spec = scores(pretrained=path, dtype="bfloat16")
    assert lm._loglikelihood_tokens(requests, disable_tqdm=True) == by_spec
    assert scores(pretrained=model) != by_spec  # auto: as it is, fp32


def test_a_gpt_object_stays_on_its_device_unless_one_is_given(saved):
    """device defaulted to "cpu": a caller's CUDA model was moved to the CPU in place, unsaid.
    Here the meta device stands in for a GPU."""
    import copy

    model, _ = saved
    lm = gptlab.harness.GptlabLM(pretrained=copy.deepcopy(model).to("meta"))
    assert lm._device.type == lm.model.transformer.wte.weight.device.type == "meta"


def test_a_batch_size_below_one_or_auto_is_refused(saved):
    """batch_size=-1 in model_args scored nothing (every result None, a crash later in lm-eval),
    0 failed inside range(), and `auto` (lm-eval's CLI) was int()'s message."""
    model, _ = saved
    for bad in (0, -1, "auto", "auto:4", True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            gptlab.harness.GptlabLM(pretrained=model, batch_size=bad)
    assert gptlab.harness.GptlabLM(pretrained=model, batch_size="3").batch_size == 3  # model_args' strings


def test_a_model_arg_it_would_not_use_is_refused(saved):
    """Unknown model_args were swallowed by **kwargs: `peft=DIR` (lm-eval's `hf` name for a LoRA
    adapter) scored the base model, and a typo (`max_lenght=32`) ran the default, both unsaid.
    What lm-eval itself passes (max_batch_size, trust_remote_code) is still taken."""
    _, path = saved
    extra = {"batch_size": 2, "max_batch_size": 64, "device": None}
    for args, unused in (("peft=adapter", "peft"), ("max_lenght=32,quantise=int8", "max_lenght, quantise")):
        with pytest.raises(ValueError, match=f"model_args {unused} not supported by --model gptlab"):
            gptlab.harness.GptlabLM.create_from_arg_string(f"pretrained={path},{args}", extra)
    lm = gptlab.harness.GptlabLM.create_from_arg_string(f"pretrained={path},trust_remote_code=True", extra)
    assert lm.batch_size == 2


def test_an_unknown_harness_task_is_a_clear_error(lmeval_workdir, saved, capsys):
    _, path = saved
    assert main(["eval", "--model", path, "--harness", "tiny_choice,no_such_task", "--include-path", str(TASKS)]) == 2
    assert "no task no_such_task" in capsys.readouterr().err


def test_bench_harness_runs_both_backends_on_the_same_tasks(lmeval_workdir, saved, capsys):
    """gptlab bench harness on a tiny model: hf, gptlab and gptlab-int8 rows, the same accuracy
    and perplexity for hf and gptlab (fp32 both), speedups and int8's change recorded."""
    from gptlab.bench.harness import main as bench

    _, path = saved
    out = lmeval_workdir / "results"
    args = ["--model", path, "--data", str(SHAKESPEARE), "--choices", "8", "--docs", "2", "--batch-size", "4",
            "--threads", "1", "--out", str(out)]  # fmt: skip
    assert bench(args) == 0
    (result,) = (json.loads(p.read_text()) for p in out.glob("harness-*.json"))
    rows = result["rows"]
    assert set(rows) == {"hf", "gptlab", "gptlab-int8"}
    assert rows["gptlab"]["bench_choice"]["metric"] == rows["hf"]["bench_choice"]["metric"]
    assert rows["gptlab"]["bench_rolling"]["metric"] == pytest.approx(rows["hf"]["bench_rolling"]["metric"], rel=1e-4)
    assert rows["hf"]["bench_choice"]["requests"] == 32 and rows["hf"]["bench_rolling"]["requests"] == 2
    assert result["bench_choice_speedup"] > 0 and "int8_accuracy_change_points" in result
    assert "gptlab-int8" in capsys.readouterr().out


def test_an_own_bpe_with_its_own_bos_is_scored_as_lm_evals_hf_backend_scores_it(tmp_path):
    """lm-eval's hf backend starts an empty context and each rolling window with the tokenizer's
    bos_token_id; a directory whose BPE names <s> (0) as bos and </s> (2) as eos was prefixed with
    </s> here, another loglikelihood than hf's. Both backends now agree on the same weights."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    from conftest import s_bpe_dir

    directory = s_bpe_dir(tmp_path / "m", layout="pair")
    ref_tok = GPT2TokenizerFast.from_pretrained(directory)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(ref_tok), n_positions=64, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(directory)
    requests = [("", "the quick brown"), ("die", " Brücke")]
    scores = {}
    for name in ("hf", "gptlab"):
        lm = get_model(name).create_from_arg_string(f"pretrained={directory},dtype=float32,batch_size=2,device=cpu")
        assert lm.prefix_token_id == ref_tok.bos_token_id == 0
        pairs = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)])
        rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("Über die Brücke",), 0)])
        scores[name] = [p[0] for p in pairs] + rolling
    assert scores["gptlab"] == pytest.approx(scores["hf"], abs=1e-4)
