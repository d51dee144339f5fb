"""lm-evaluation-harness itself against `gptlab serve`: its `local-completions` client scores a
rolling-perplexity, a multiple-choice, a target-loglikelihood and a generate_until task
(tests/lmeval_tasks, local JSON, offline) through the server and gets what its `--model hf` backend gets on the same weights (a `save_pretrained`
directory).

lm-eval's client sends each window with echo and max_tokens 1, drops that token's logprob, and
takes one token off its max_length, so its windows at max_length L + 2 are --model hf's at L.
At L + 2 = block_size + 1 its prompts fill the whole context: the server must still give the
one new token (never fed, so it fits)."""

import pytest
import torch

from gptlab.config import GPTConfig
from gptlab.model import GPT
from gptlab.serve.app import create_app
from gptlab.tokenizer import get_tokenizer
from lmeval_data import assert_same, evaluate
from test_serve import running

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 64


def test_local_completions_against_gptlab_serve_equals_model_hf(lmeval_workdir):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=BLOCK, n_layer=2, n_head=2, n_embd=64)).eval()
    model.save_pretrained(lmeval_workdir / "model")
    tasks = ["tiny_rolling", "tiny_choice", "tiny_target", "tiny_until"]
    hf_args = f"pretrained={lmeval_workdir / 'model'},dtype=float32,max_length={BLOCK - 1}"
    hf = evaluate("hf", hf_args, tasks, responses=["tiny_until"])
    with running(create_app(model, get_tokenizer("gpt2"), name="tiny")) as url:
        args = (f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={lmeval_workdir / 'model'},max_length={BLOCK + 1},num_concurrent=1,max_retries=1,"
                "tokenized_requests=True")  # fmt: skip
        served = evaluate("local-completions", args, tasks, responses=["tiny_until"])
    # measured: word perplexity 2.3e-7 apart (~2.4e7: the same windows, fp32 both ways);
    # accuracies equal, the generated texts equal
    assert_same(served, hf)


def test_generate_until_with_more_than_four_stop_strings(lmeval_workdir):
    """lm-eval's client adds <|endoftext|> to a task's `until`: humaneval's five stop strings
    became six, and the server refused more than four (OpenAI's limit), so such a task failed
    through gptlab serve where `--model hf` runs it."""
    from types import SimpleNamespace

    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from gptlab.generation import generate_text

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50257, block_size=BLOCK, n_layer=2, n_head=2, n_embd=64)).eval()
    model.save_pretrained(lmeval_workdir / "model")
    tok, context = get_tokenizer("gpt2"), "ROMEO:\n"
    free = generate_text(model, tok, context, 12, temperature=0)
    until = ["\nclass", "\ndef", "\n#", "\nif", free[4:6]]  # humaneval's, the last one where greedy text has it
    with running(create_app(model, tok, name="tiny")) as url:
        lm = LocalCompletionsAPI(model="tiny", base_url=f"{url}/v1/completions", tokenizer_backend="huggingface",
                                 tokenizer=str(lmeval_workdir / "model"), max_length=BLOCK + 1, max_retries=1,
                                 tokenized_requests=True)  # fmt: skip
        request = SimpleNamespace(args=(context, {"until": until, "max_gen_toks": 12, "do_sample": False}))
        (text,) = lm.generate_until([request], disable_tqdm=True)
    assert text == free[: free.index(free[4:6])]


def test_local_chat_completions_gets_the_reply_to_the_conversation_as_fine_tuned():
    """lm-eval's `local-chat-completions` client (`--apply_chat_template`: the chat history sent as
    messages, no tokenizer) gets from /v1/chat/completions the reply `generate` gives on the
    conversation rendered as for fine-tuning (gptlab.sft), cut at the task's `until`."""
    import json
    from types import SimpleNamespace

    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    from test_serve import serve_model
    from test_serve_chat import first_new_pair, sampled, trained_prompt

    model, tok = serve_model(), get_tokenizer("byte")
    messages = [{"role": "user", "content": "ROMEO:"}]
    kwargs = {"until": None, "max_gen_toks": 40, "do_sample": True, "temperature": 1.0}  # lm-eval sends seed 1234
    free = tok.decode(sampled(model, trained_prompt(tok, messages), 40, temperature=1.0, seed=1234)[0])
    cut = first_new_pair(free, 6) - 1
    kwargs["until"] = [free[cut : cut + 2]]
    with running(create_app(model, tok, name="tiny")) as url:
        lm = LocalChatCompletion(model="tiny", base_url=f"{url}/v1/chat/completions", tokenizer_backend=None,
                                 tokenized_requests=False, max_retries=1)  # fmt: skip
        request = SimpleNamespace(args=(JsonChatStr(json.dumps(messages)), kwargs))
        (text,) = lm.generate_until([request], disable_tqdm=True)
    assert text == free[:cut] and len(text) >= 5
