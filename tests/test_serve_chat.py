"""gptlab serve's /v1/chat/completions through the official `openai` client: the conversation is
rendered as `gptlab prepare` renders a chat record for fine-tuning (its tokens are the training
example's up to the assistant's reply), and the reply equals `generate` on those tokens; it
stops where the model starts a user turn or ends its own, streams as OpenAI's chat chunks, and
bad requests get OpenAI-style 400s and 404s.

Servers run on free ports on 127.0.0.1; the models are tiny (byte-level, and GPT-2's BPE where
token boundaries matter)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import uvicorn

from conftest import tiny_model
from gptlab.checkpoint import save_model
from gptlab.generation import generate
from gptlab.serve.app import create_app
from gptlab.sft import Template, encode_example
from gptlab.tokenizer import get_tokenizer
from test_serve import EOS, NAME, running, serve_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for tiny models

CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a tiny model?"},
    {"role": "assistant", "content": "A model with few weights."},
    {"role": "user", "content": "And a big one?"},
]


@pytest.fixture(scope="module")
def model():
    return serve_model()


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("byte")


@pytest.fixture(scope="module")
def url(model, tok):
    with running(create_app(model, tok, name=NAME, max_batch=8, max_queue=16)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def trained_prompt(tok, messages, template=None) -> list[int]:
    """The tokens a model fine-tuned on `messages` + a reply saw before that reply: the training
    example's (sft.encode_example of Template.render) up to its last trained-on run."""
    record = {"messages": [*messages, {"role": "assistant", "content": "reply"}]}
    ids, mask = encode_example(tok, (template or Template()).render(record))
    return ids[: max(i for i in range(1, len(mask)) if mask[i] and not mask[i - 1])]


def sampled(model, prompt, max_tokens, n=1, **sampling) -> list[list[int]]:
    """generate's new tokens per sample, up to (without) <|endoftext|>."""
    rows = generate(model, [prompt], max_tokens, num_samples=n, eos_id=EOS, **sampling)
    return [[t for t in row[len(prompt) :] if t != EOS] for row in rows]


def served(template: Template, model, tok):
    return running(create_app(model, tok, name=NAME, max_batch=4, max_queue=4, template=template))


def chat_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_reply_equals_generate_on_the_trained_rendering(client, model, tok):
    """n seeded samples, each equal to generate's on the conversation's training tokens, which
    usage counts; streamed, each choice's deltas (role first) join to the same text."""
    prompt = trained_prompt(tok, CHAT)
    kwargs = dict(model=NAME, messages=CHAT, max_tokens=40, n=2, temperature=0.9, top_p=0.95, seed=7)
    out = client.chat.completions.create(**kwargs, extra_body={"top_k": 40})
    expected = sampled(model, prompt, 40, 2, temperature=0.9, top_p=0.95, top_k=40, seed=7)
    assert all(len(row) == 40 for row in expected)  # ends at max_tokens; no template stop in the way
    assert [c.message.content for c in out.choices] == [tok.decode(row) for row in expected]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in out.choices)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 80
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body={"top_k": 40}))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    for j in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == j]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == out.choices[j].message.content
        assert [c.finish_reason for c in mine][-1] == "length" and all(c.finish_reason is None for c in mine[:-1])
    greedy = client.chat.completions.create(model=NAME, messages=CHAT[1:2], max_completion_tokens=12, temperature=0)
    assert greedy.choices[0].message.content == tok.decode(sampled(model, trained_prompt(tok, CHAT[1:2]), 12, temperature=0)[0])  # fmt: skip


def test_prompt_tokens_are_the_training_examples_with_bpe_and_a_template_file(tmp_path):
    """With GPT-2's BPE, encoding the rendered text whole merges across the parts ("\\n\\n" then
    "###" differ from the training example's tokens); the server encodes part by part, as
    `gptlab prepare` does, with the template file `gptlab prepare --template` takes."""
    model, tok = tiny_model(1, vocab_size=50257, block_size=128), get_tokenizer("gpt2")
    path = tmp_path / "template.json"
    path.write_text(json.dumps({"user": "<|user|>\n{content}\n", "assistant": "<|bot|>\n{content}\n\n"}))
    template = Template.load(path)
    messages = [{"role": "user", "content": "Hello  there\n\n"}, {"role": "assistant", "content": "Hi."}, CHAT[3]]
    prompt = trained_prompt(tok, messages, template)
    text = "".join(part for part, _ in template.chat_prompt(messages))
    assert tok.decode(prompt) == text and tok.encode(text) != prompt  # the test can tell the two apart
    with served(template, model, tok) as base:
        out = chat_client(base).chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].message.content == tok.decode(sampled(model, prompt, 8, temperature=0)[0])


def first_new_pair(text: str, start: int) -> int:
    """The first k >= start where text[k - 1 : k + 1] is two printable ASCII characters, neither
    of which occurs before k - 1."""
    for k in range(start, len(text)):
        pair = text[k - 1 : k + 1]
        if pair.isascii() and pair.isprintable() and not set(pair) & set(text[: k - 1]):
            return k
    raise AssertionError(f"no fresh pair in {text!r}")


def test_reply_stops_where_the_model_starts_a_user_turn(model, tok):
    """A system-only conversation has no user head in its prompt, so a template can make any
    character of the reply the user head c (its assistant tail t, the character before): the
    reply ends before "t" + c, the tail not returned; and before c alone where no tail precedes it."""
    messages = [{"role": "system", "content": "Talk."}]
    prompt = trained_prompt(tok, messages)
    text = tok.decode(sampled(model, prompt, 60, temperature=1.0, seed=3)[0])
    k = first_new_pair(text, 4)
    tail, user = text[k - 1], text[k]
    for template, cut in [
        (Template(user=user + "{content}\n", assistant="### Assistant:\n{content}" + tail), k - 1),
        (Template(user=user + "{content}\n", assistant="### Assistant:\n{content}\0"), k),  # no tail before it
    ]:
        with served(template, model, tok) as base:
            client = chat_client(base)
            kwargs = dict(model=NAME, messages=messages, max_tokens=60, temperature=1.0, seed=3)
            out = client.chat.completions.create(**kwargs)
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert out.choices[0].message.content == text[:cut] and out.choices[0].finish_reason == "stop"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:cut]


def test_reply_ending_its_turn_leaves_the_assistant_tail_out(model, tok):
    """The model ends its turn with the assistant tail and <|endoftext|> (as it was trained to):
    the content is the message alone, so sent back it renders as in training."""
    messages = [{"role": "system", "content": "Talk."}]
    prompt = trained_prompt(tok, messages)
    for seed in range(300):
        [row] = generate(model, [prompt], 300, eos_id=EOS, temperature=1.0, seed=seed)
        reply = row[len(prompt) :]
        if reply[-1] == EOS and len(reply) > 2 and chr(reply[-2]).isascii() and chr(reply[-2]).isalnum():
            break
    else:
        raise AssertionError("no seed ends its reply with <|endoftext|> after a letter")
    text = tok.decode(reply[:-1])
    template = Template(user="<USER>{content}\n", assistant="### Assistant:\n{content}" + text[-1])
    with served(template, model, tok) as base:
        client = chat_client(base)
        kwargs = dict(model=NAME, messages=messages, max_tokens=300, temperature=1.0, seed=seed)
        out = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert out.choices[0].message.content == text[:-1] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(reply)  # the tail and <|endoftext|> are counted
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:-1]


def test_stop_strings_max_tokens_and_usage(client, url, model, tok):
    """The request's stop strings end the reply too; without max_tokens the reply may fill the
    context; include_usage adds OpenAI's usage-only last chunk; the raw stream ends with [DONE]."""
    prompt = trained_prompt(tok, CHAT[1:2])
    whole = tok.decode(sampled(model, prompt, 40, temperature=1.0, seed=5)[0])
    cut = first_new_pair(whole, 6) - 1
    out = client.chat.completions.create(model=NAME, messages=CHAT[1:2], temperature=1.0, seed=5, max_tokens=40,
                                         stop=["\x00never", whole[cut : cut + 2]])  # fmt: skip
    assert out.choices[0].message.content == whole[:cut] and out.choices[0].finish_reason == "stop"
    full = client.chat.completions.create(
        model=NAME, messages=CHAT[1:2], temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.usage.completion_tokens == model.config.block_size + 1 - len(prompt)
    assert full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT[1:2], temperature=0, max_tokens=5,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == len(prompt) and all(c.usage is None for c in chunks[:-1])
    body = dict(model=NAME, messages=CHAT[1:2], max_tokens=3, stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_logprobs_in_chats_shape(client, model, tok):
    """logprobs: true, top_logprobs: k -> per generated token {token, logprob, bytes,
    top_logprobs: the k most likely}, the model's own log-probabilities."""
    prompt = trained_prompt(tok, CHAT[1:2])
    out = client.chat.completions.create(model=NAME, messages=CHAT[1:2], max_tokens=6, temperature=0.8, seed=1,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    [new] = sampled(model, prompt, 6, temperature=0.8, seed=1)
    ids = prompt + new
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0][0], dim=-1)  # (T, V)
    content = out.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in new]
    assert [e.bytes for e in content] == [list(tok.decode_bytes([t])) for t in new]
    for i, (entry, token) in enumerate(zip(content, new, strict=True)):
        at = len(prompt) - 1 + i
        assert entry.logprob == pytest.approx(logp[at, token].item(), abs=1e-4)
        best = logp[at].topk(3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert [t.bytes for t in entry.top_logprobs] == [list(tok.decode_bytes([t])) for t in best.indices.tolist()]
    plain = client.chat.completions.create(model=NAME, messages=CHAT[1:2], max_tokens=2)
    assert plain.choices[0].logprobs is None


def post(url, body):
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = {
    "unknown model": (dict(model="nope", messages=HI), 404, "model"),
    "no messages": (dict(model=NAME, messages=[]), 400, "messages"),
    "messages missing": (dict(model=NAME), 400, "messages"),
    "unknown role": (dict(model=NAME, messages=[{"role": "tool", "content": "x"}]), 400, "messages"),
    "content a number": (dict(model=NAME, messages=[{"role": "user", "content": 5}]), 400, "messages"),
    "content null": (dict(model=NAME, messages=[{"role": "assistant", "content": None}]), 400, "messages"),
    "image part": (
        dict(model=NAME, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages",
    ),  # fmt: skip
    "text part without text": (
        dict(model=NAME, messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages",
    ),  # fmt: skip
    "conversation too long": (dict(model=NAME, messages=[{"role": "user", "content": "x" * 600}]), 400, "messages"),
    "max_tokens past the context": (dict(model=NAME, messages=HI, max_tokens=600), 400, "max_tokens"),
    "max_completion_tokens past the context": (
        dict(model=NAME, messages=HI, max_completion_tokens=600),
        400,
        "max_completion_tokens",
    ),  # fmt: skip
    "max_tokens zero": (dict(model=NAME, messages=HI, max_tokens=0), 400, "max_tokens"),
    "max_tokens disagreeing": (
        dict(model=NAME, messages=HI, max_tokens=3, max_completion_tokens=4),
        400,
        "max_completion_tokens",
    ),  # fmt: skip
    "top_logprobs without logprobs": (dict(model=NAME, messages=HI, top_logprobs=2), 400, "top_logprobs"),
    "top_logprobs 21": (dict(model=NAME, messages=HI, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "tools": (dict(model=NAME, messages=HI, tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "json mode": (dict(model=NAME, messages=HI, response_format={"type": "json_object"}), 400, "response_format"),
    "negative temperature": (dict(model=NAME, messages=HI, temperature=-1), 400, "temperature"),
    "n above batch": (dict(model=NAME, messages=HI, n=64), 400, "n"),
    "unsupported penalty": (dict(model=NAME, messages=HI, frequency_penalty=1), 400, "frequency_penalty"),
    "stream_options without stream": (
        dict(model=NAME, messages=HI, stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(url, client, case):
    body, status, param = BAD_REQUESTS[case]
    r = post(url, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    if param.startswith("max_") and error["code"] == "context_length_exceeded":  # the field the client sent
        assert f"reduce {param} to" in error["message"], error
    out = client.chat.completions.create(model=NAME, messages=HI, max_tokens=2)  # still serving
    assert out.usage.completion_tokens >= 1


def test_text_parts_and_roles(client, model, tok):
    """Text parts are taken (joined by newlines); OpenAI's `developer` role is the system role;
    null takes a field's default."""
    parts = [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]  # fmt: skip
    plain = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "a\nb"}]
    a = client.chat.completions.create(model=NAME, messages=parts, max_tokens=8, temperature=0, n=None, stream=None)
    b = client.chat.completions.create(model=NAME, messages=plain, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == len(trained_prompt(tok, plain))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=plain)
    with pytest.raises(openai.BadRequestError, match="text parts"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])  # fmt: skip


def test_serve_command_takes_a_chat_template(tmp_path, model, monkeypatch, capsys):
    """`gptlab serve --template FILE` renders chats with that file (uvicorn stubbed); a bad file is
    a one-line error before the model loads."""
    from gptlab.cli import main

    save_model(model, tmp_path / "m", tokenizer="byte")
    (tmp_path / "t.json").write_text(json.dumps({"user": "U: {content}\n"}))
    (tmp_path / "bad.json").write_text(json.dumps({"user": "no content here"}))
    served_app = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served_app.update(app=app))
    assert main(["serve", "--model", str(tmp_path / "m"), "--template", str(tmp_path / "t.json"), "--port", "0"]) == 0
    state = served_app["app"].state.gptlab
    try:
        assert state.template == Template.load(tmp_path / "t.json") and state.template.user == "U: {content}\n"
    finally:
        state.scheduler.close()
    assert main(["serve", "--model", str(tmp_path / "m"), "--template", str(tmp_path / "bad.json"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "must hold {content} once" in err and "Traceback" not in err


def test_a_lone_surrogate_in_a_message_is_read_as_tiktoken_reads_it(url, client, tok):
    """JSON may escape half a surrogate pair ("\\ud83d": a client that cut an emoji in two); the
    byte tokenizer reads it as U+FFFD, as tiktoken's GPT-2 does (it failed as a 500, a
    UnicodeEncodeError), and a whole escaped pair as its character."""
    body = '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud83d b\\ud83d\\ude00"}]}'
    r = httpx.post(f"{url}/v1/chat/completions", content=body % NAME, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    same = [{"role": "user", "content": "a\ufffd b\U0001f600"}]
    assert r.json()["usage"]["prompt_tokens"] == len(trained_prompt(tok, same))
    assert tok.encode("a\ud83d b\ud83d\ude00") == tok.encode("a\ufffd b\U0001f600")
    gpt2 = get_tokenizer("gpt2")
    assert gpt2.encode("a\ud83d b\ud83d\ude00") == gpt2.encode("a\ufffd b\U0001f600")  # tiktoken's reading
