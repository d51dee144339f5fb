"""gptlab serve: the scheduler against gptlab.generation, the OpenAI API through the official
`openai` client, every error case, queueing and cancellation, and the explorer's JSON API.

Servers run on free ports on 127.0.0.1 (uvicorn in a thread); the model is a tiny byte-level GPT.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn

from conftest import tiny_model
from gptlab import kernels
from gptlab.checkpoint import save_model
from gptlab.generation import generate
from gptlab.sampling import SamplingParams
from gptlab.serve.app import create_app
from gptlab.serve.scheduler import BatchCache, GenerationRequest, QueueFull, Scheduler
from gptlab.tokenizer import get_tokenizer

NAME = "tiny-byte"
EOS = 256


def serve_model(seed: int = 0):
    """A tiny byte-level model: 2 layers, 32 wide, 257 tokens, 512 positions."""
    return tiny_model(seed, vocab_size=257, block_size=512)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """Run `app` under uvicorn in a thread on a free port; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for tiny models


@pytest.fixture(scope="module")
def model():
    return serve_model()


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("byte")


@pytest.fixture(scope="module")
def url(model, tok):
    with running(create_app(model, tok, name=NAME, max_batch=16, max_queue=32, max_body_bytes=64 * 1024)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(model, prompt_ids, max_tokens, n=1, **sampling):
    """gptlab.generation's new tokens per sample, without the end-of-text token."""
    rows = generate(model, [prompt_ids], max_tokens, num_samples=n, **sampling)
    eos = sampling.get("eos_id")
    return [[t for t in row[len(prompt_ids) :] if t != eos] for row in rows]


def assert_ok_after(client):
    """The server still answers a normal request."""
    out = client.completions.create(model=NAME, prompt="ok", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------
# The scheduler alone


def decode_all(scheduler, cases, spacing: float = 0.0):
    """Each case (prompt, params[, eos_id]) submitted to `scheduler` (started here, closed after),
    the i-th after i * spacing s: per case (each row's tokens, why it ended), and scheduler.load()."""

    async def one(i, prompt, params, eos_id=None):
        if spacing:
            await asyncio.sleep(spacing * i)
        request = GenerationRequest(prompt, params, asyncio.get_running_loop(), asyncio.Queue(), index=i, eos_id=eos_id)
        scheduler.submit(request)
        rows = [[] for _ in range(params.num_samples)]
        while (event := await request.events.get())[0] != "done":
            for j, row in enumerate(event[2]):
                if row is not None:
                    rows[j].append(row[0])
        return rows, event[2]

    async def main():
        scheduler.start()
        try:
            return await asyncio.gather(*(one(i, *c) for i, c in enumerate(cases))), scheduler.load()
        finally:
            scheduler.close()

    return asyncio.run(main())


@pytest.mark.parametrize("kv_cache", [None, torch.bfloat16], ids=["cache-fp32", "cache-bf16"])
@pytest.mark.parametrize("fast", [True, False], ids=["kernels", "torch"])
def test_scheduler_mixed_batch_equals_generate(model, fast, kv_cache, monkeypatch):
    """Requests of different lengths, n, sampling settings and seeds, joining at different times
    in a cache small enough to be shifted both ways, each equal gptlab.generation alone, with
    gptlab's CPU kernels (as `gptlab serve` runs) and with PyTorch's alone; with the model's fp32
    KV cache, and with a bf16 one (a quantized model's default)."""
    monkeypatch.setattr(kernels, "_enabled", fast)  # what kernels.use_kernels(fast) sets
    monkeypatch.setattr(model, "kv_cache_dtype", kv_cache)
    torch.manual_seed(1)
    cases = []
    for i in range(12):
        T = int(torch.randint(1, 40, ()))
        prompt = torch.randint(0, 256, (T,)).tolist()
        params = SamplingParams(
            max_new_tokens=int(torch.randint(1, 80, ())), num_samples=1 + i % 3, temperature=[0, 0.8, 1.0][i % 3],
            top_k=[0, 20][i % 2], top_p=[1.0, 0.9][i % 4 // 2], min_p=[0.0, 0.05][i % 5 // 4],
            repetition_penalty=1.3 if i % 5 == 0 else 1.0, seed=100 + i,
        )  # fmt: skip
        eos_id = None
        # Every 4th request ends at a token its sample 0 produces early (the random model's 256 is
        # rare), so its rows end at different steps.
        if i % 4 == 0:
            free = reference(model, prompt, params.max_new_tokens, params.num_samples, sampling=params)[0]
            eos_id = free[min(2, len(free) - 1)]
        cases.append((prompt, params, eos_id))

    scheduler = Scheduler(model, max_batch=8, max_queue=16, cache_len=model.config.block_size)
    assert scheduler.cache.cache.layers[0][0].dtype == (kv_cache or torch.float32)
    scheduler.cache.cache_len = 120  # a short cache forces shifts (the buffers are larger: harmless)
    outs, load = decode_all(scheduler, cases, spacing=0.003)
    assert load["max_rows"] > 3, "requests were not batched together"
    reasons = set()
    for (prompt, p, eos_id), (rows, reason) in zip(cases, outs, strict=True):
        # generate's rows end at their first eos_id, included: nothing is reported after it
        expected = [r[len(prompt) :] for r in generate(model, [prompt], sampling=p, eos_id=eos_id)]
        assert rows == expected
        reasons.add(reason)
        assert reason == ("stop" if eos_id is not None and all(eos_id in r for r in expected) else "length")
    assert reasons == {"stop", "length"}, "some rows should end at eos before max_new_tokens (tune the cases)"


def test_one_requests_nan_logits_end_that_request_alone():
    """Position 20's embedding is NaN: a row reaching it has NaN logits, at admission (a longer
    prompt) or while decoding. Its error failed every request decoding beside it (and one at
    admission stayed in the batch to do so at the next step). It alone ends with the error now;
    the others, which stop short of position 20, equal generate."""
    model = tiny_model(0, vocab_size=257, block_size=128)
    with torch.no_grad():
        model.transformer.wpe.weight[20] = float("nan")
    short, long = SamplingParams(max_new_tokens=15, temperature=0), SamplingParams(max_new_tokens=60, temperature=0)
    cases = [([1, 2, 3], short), (list(range(30, 40)), long), ([4, 5, 6], short), (list(range(25)), long)]

    outs, load = decode_all(Scheduler(model, max_batch=8, max_queue=8), cases)
    assert load["max_rows"] >= 3  # decoded together
    for (prompt, params), ([tokens], reason) in zip(cases, outs, strict=True):
        if len(prompt) + params.max_new_tokens > 20:  # reaches position 20: mid-decode, or at admission
            assert reason.startswith("error: ") and "logits are not finite" in reason
        else:
            assert reason == "length" and tokens == generate(model, [prompt], sampling=params)[0][len(prompt) :]


def test_scheduler_queue_bound(model):
    scheduler = Scheduler(model, max_batch=2, max_queue=2)  # not started: nothing leaves the queue
    loop = asyncio.new_event_loop()
    try:
        make = lambda: GenerationRequest([1, 2], SamplingParams(max_new_tokens=4), loop, asyncio.Queue())
        scheduler.submit(make())
        scheduler.submit(make())
        with pytest.raises(QueueFull):
            scheduler.submit(make())
        with pytest.raises(ValueError, match="exceeds the batch size"):
            scheduler.submit(
                GenerationRequest([1], SamplingParams(max_new_tokens=4, num_samples=3), loop, asyncio.Queue())
            )
    finally:
        loop.close()


def test_a_request_cancelled_while_it_waits_still_ends():
    """A client that gives up while its request waits in the queue: the request was dropped
    without its "done" event, so its handler awaited events forever (a task per such client,
    and `gptlab serve` then hung at shutdown waiting for it). It ends "cancelled" now, whether
    dropped by the worker or by a submit that finds the queue full."""
    model = tiny_model(0, vocab_size=257, block_size=512)

    async def main():
        scheduler = Scheduler(model, max_batch=1, max_queue=1)
        scheduler.start()
        loop = asyncio.get_running_loop()
        make = lambda: GenerationRequest([1, 2], SamplingParams(max_new_tokens=500), loop, asyncio.Queue())

        async def until(done):
            while not done(scheduler.load()):
                await asyncio.sleep(0.01)

        running, waiting, dropped_by_submit = make(), make(), make()
        try:
            scheduler.submit(running)
            await until(lambda load: load["active"])
            scheduler.submit(waiting)
            waiting.cancel()  # the worker drops it once a row frees
            await until(lambda load: not load["active"] and not load["queued"])
            scheduler.submit(running := make())
            await until(lambda load: load["active"])
            scheduler.submit(dropped_by_submit)
            dropped_by_submit.cancel()
            scheduler.submit(make())  # the queue is full: the cancelled one is dropped to make room
            ends = [await asyncio.wait_for(r.events.get(), 2) for r in (waiting, dropped_by_submit)]
            running.cancel()
            return ends
        finally:
            scheduler.close()

    assert asyncio.run(main()) == [("done", 0, "cancelled")] * 2


# ---------------------------------------------------------------------------------------------
# The OpenAI API through the official client


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == NAME


def test_a_model_named_like_a_hub_repository_can_be_retrieved(model, tok):
    with running(create_app(model, tok, name="org/tiny-byte", max_batch=2, max_queue=2)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.models.retrieve("org/tiny-byte").id == "org/tiny-byte"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/other")


@pytest.mark.parametrize("ends", ["length", "stop"])
def test_completion_equals_generate(client, model, tok, ends):
    """A plain completion equals gptlab.generation with the same seed, ending at max_tokens, or at
    <|endoftext|> (a seed is picked for which generate itself stops early)."""
    ids, max_tokens = tok.encode("Hello there"), 24 if ends == "length" else 300
    for seed in range(200):
        [expected] = reference(model, ids, max_tokens, temperature=0.9, eos_id=EOS, seed=seed)
        if (len(expected) == max_tokens) == (ends == "length"):
            break
    out = client.completions.create(
        model=NAME, prompt="Hello there", max_tokens=max_tokens, temperature=0.9, seed=seed, logprobs=1,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.token_ids == expected
    assert choice.text == tok.decode(expected)
    assert choice.finish_reason == ends
    assert choice.logprobs.tokens[-1] == tok.decode([EOS] if ends == "stop" else expected[-1:])
    assert len(choice.logprobs.tokens) == out.usage.completion_tokens  # every counted token is scored
    assert out.object == "text_completion" and out.model == NAME
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(expected) + (ends == "stop")  # the end-of-text token counts
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_n_samples_and_extras_equal_generate(client, model, tok):
    extras = dict(top_k=20, min_p=0.02, repetition_penalty=1.3, ignore_eos=True, return_token_ids=True)
    out = client.completions.create(
        model=NAME, prompt=["To be", "or not"], max_tokens=30, n=3, temperature=1.1, top_p=0.95, seed=11,
        extra_body=extras,
    )  # fmt: skip
    assert len(out.choices) == 6 and [c.index for c in out.choices] == list(range(6))
    for i, prompt in enumerate(["To be", "or not"]):
        expected = reference(model, tok.encode(prompt), 30, 3, temperature=1.1, top_p=0.95, top_k=20, min_p=0.02,
                             repetition_penalty=1.3, generator=11)  # fmt: skip
        assert [c.token_ids for c in out.choices[3 * i : 3 * i + 3]] == expected
    assert len({tuple(c.token_ids) for c in out.choices}) > 1
    assert out.usage.completion_tokens == 6 * 30


def test_greedy_and_unseeded(client, model, tok):
    a = client.completions.create(model=NAME, prompt="abc", max_tokens=20, temperature=0, extra_body={"return_token_ids": True})  # fmt: skip
    assert a.choices[0].token_ids == reference(model, tok.encode("abc"), 20, temperature=0, eos_id=EOS)[0]
    by_ids = client.completions.create(model=NAME, prompt=tok.encode("abc"), max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == a.choices[0].text  # token-id prompts work as text ones
    b = client.completions.create(model=NAME, prompt="abc", max_tokens=40, n=2, extra_body={"ignore_eos": True})
    c = client.completions.create(model=NAME, prompt="abc", max_tokens=40, n=2, extra_body={"ignore_eos": True})
    assert {x.text for x in b.choices} != {x.text for x in c.choices}, "unseeded requests should differ"


def test_null_fields_take_openai_defaults(url, client):
    """OpenAI's API takes null for every optional field, meaning its default (the openai client
    sends null for an argument given as None); n, stream, echo and prompt were 400s here."""
    body = dict(model=NAME, max_tokens=5, temperature=0)
    expected = post(url, body).json()
    got = post(url, body | dict(n=None, stream=None, echo=None, prompt=None))
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == expected["choices"] and got.json()["usage"] == expected["usage"]
    greedy = dict(model=NAME, prompt="ab", max_tokens=4, temperature=0)
    out = client.completions.create(**greedy, n=None, stream=None, echo=None)
    assert out.choices == client.completions.create(**greedy).choices  # one choice, not streamed, not echoed


def test_null_extras_and_include_usage_take_their_defaults(url):
    """null for gptlab's extras (ignore_eos, return_token_ids, prompt_lookup) and for
    stream_options.include_usage is their default too, as for top_k and OpenAI's own fields:
    they were 400s ("Input should be a valid boolean (got null)")."""
    extras = dict(ignore_eos=None, return_token_ids=None, prompt_lookup=None)
    for path, body in [
        ("/v1/completions", dict(model=NAME, prompt="ab", max_tokens=4, temperature=0)),
        ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "ab"}], max_tokens=4, temperature=0)),
    ]:  # fmt: skip
        expected = httpx.post(f"{url}{path}", json=body, timeout=30).json()
        got = httpx.post(f"{url}{path}", json=body | extras, timeout=30)
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == expected["choices"] and got.json()["usage"] == expected["usage"]
        streamed = httpx.post(f"{url}{path}", json=body | dict(stream=True, stream_options={"include_usage": None}), timeout=30)  # fmt: skip
        assert streamed.status_code == 200, streamed.text
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert chunks and all("usage" not in c for c in chunks), chunks[-1]  # no usage asked for


def test_streaming(client, url, model, tok):
    kwargs = dict(model=NAME, prompt="Once upon", max_tokens=40, temperature=0.8, seed=5)
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    assert len(chunks) > 5
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no usage unless stream_options asks for it
    # include_usage: OpenAI's usage-only last chunk, and usage null on every other one.
    counted = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}))  # fmt: skip
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in counted[:-1])
    # n > 1 streams the samples interleaved, each chunk naming its choice.
    both = client.completions.create(**kwargs, n=2, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kwargs, n=2, stream=True, extra_body={"ignore_eos": True}))
    for j in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == j) == both.choices[j].text
    assert {c.choices[0].index for c in chunks} == {0, 1}
    # The raw stream: server-sent events ending with [DONE]; include_usage adds a usage-only chunk.
    body = dict(kwargs, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"] == [] and json.loads(events[-2])["usage"]["prompt_tokens"] == 9


def test_logprobs_and_echo(client, model, tok):
    prompt = "The cat"
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0.7, seed=2, logprobs=5, echo=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    ids = tok.encode(prompt) + choice.token_ids
    assert choice.text == prompt + tok.decode(choice.token_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0][0], dim=-1)  # (T, V)
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [logp[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for i, top in enumerate(lp.top_logprobs[1:], start=1):
        best = logp[i - 1].topk(5)
        expected = {}
        for t, v in [
            *zip(best.indices.tolist(), best.values.tolist(), strict=True),
            (ids[i], logp[i - 1, ids[i]].item()),
        ]:
            expected.setdefault(tok.decode([t]), v)  # bytes of split characters share one text
        assert top == pytest.approx(expected, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[len(prompt)] == len(prompt)
    # max_tokens=0 with echo scores the prompt alone.
    scored = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[: len(prompt)], abs=1e-5)
    # Streaming carries the same logprobs; logprobs=20 is the most allowed.
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0.7, seed=2,
                                            logprobs=20, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs[len(prompt) :], abs=1e-5)
    assert all(len(t) > 5 for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs)


def test_a_prompt_that_fills_the_context_still_gets_its_scores_and_a_token(client, url, model, tok):
    """lm-eval's local-completions scores a window with echo and max_tokens 1, dropping the new
    token's logprob: a prompt of block_size tokens must still get one new token (its logits come
    from the last prompt position; it is never fed). A prompt only scored (max_tokens 0) may be
    block_size + 1 tokens: its last token is only a target."""
    block = model.config.block_size  # 512 byte tokens
    text = ("To be, or not to be, that is the question: " * 20)[: block + 1]
    ids = tok.encode(text)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:block]]))[0][0], dim=-1)  # (block, V)
    scores = logp[torch.arange(block), torch.tensor(ids[1:])].tolist()  # tokens 1..block
    out = client.completions.create(model=NAME, prompt=ids[:block], max_tokens=1, echo=True, logprobs=1, temperature=0)
    choice, new = out.choices[0], int(logp[-1].argmax())
    assert choice.text == text[:block] + tok.decode([new]) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == block + 1
    assert lp.token_logprobs[1:] == pytest.approx([*scores[: block - 1], logp[-1, new].item()], abs=1e-4)
    assert lp.text_offset == list(range(block + 1))  # one character per byte token
    scored = client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(scores, abs=1e-4)
    plain = client.completions.create(model=NAME, prompt=ids[:block], max_tokens=1, temperature=0)
    assert plain.choices[0].text == tok.decode(reference(model, ids[:block], 1, temperature=0)[0])
    for body in ({"prompt": ids, "max_tokens": 1, "echo": True}, {"prompt": ids[:block], "max_tokens": 2}):
        r = post(url, {"model": NAME, **body})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_stop_strings(client, model, tok):
    base = client.completions.create(model=NAME, prompt="xyz", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    text = base.choices[0].text
    stop = text[10:13]
    cut = text.index(stop)
    out = client.completions.create(model=NAME, prompt="xyz", max_tokens=40, temperature=0, stop=[stop, "\x00never"], extra_body={"ignore_eos": True})  # fmt: skip
    assert out.choices[0].text == text[:cut] and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt="xyz", max_tokens=40, temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_batch_and_match(url, model, tok):
    """Many concurrent clients: decoded in shared steps, each equal to its own gptlab.generate."""
    prompts = [f"prompt {i} " * (1 + i % 5) for i in range(12)]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as aclient:
            calls = [
                aclient.completions.create(
                    model=NAME,
                    prompt=p,
                    max_tokens=48,
                    temperature=[0, 0.9][i % 2],
                    seed=i,
                    extra_body={"return_token_ids": True},
                )  # fmt: skip
                for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*calls)

    steps_before = httpx.get(f"{url}/health").json()["steps"]
    outs = asyncio.run(main())
    health = httpx.get(f"{url}/health").json()
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        expected = reference(model, tok.encode(p), 48, temperature=[0, 0.9][i % 2], eos_id=EOS, generator=i)[0]
        assert out.choices[0].token_ids == expected
    assert health["max_rows"] >= 4
    assert health["steps"] - steps_before < sum(len(o.choices[0].token_ids) for o in outs) / 2


# ---------------------------------------------------------------------------------------------
# Errors: OpenAI's shape and status, and the server keeps serving


def post(url, body=None, content=None, headers=None):
    return httpx.post(f"{url}/v1/completions", json=body, content=content, headers=headers, timeout=30)


USAGE, YES = {"include_usage": True}, {"include_usage": "yes"}
BAD_REQUESTS = {
    "unknown model": (dict(model="nope", prompt="hi"), 404, "model"),
    "prompt too long": (dict(model=NAME, prompt="x" * 600), 400, "prompt"),
    "max_tokens above limit": (dict(model=NAME, prompt="hello", max_tokens=600), 400, "max_tokens"),
    "negative temperature": (dict(model=NAME, prompt="hi", temperature=-1), 400, "temperature"),
    "top_p zero": (dict(model=NAME, prompt="hi", top_p=0), 400, "top_p"),
    "n zero": (dict(model=NAME, prompt="hi", n=0), 400, "n"),
    "n above batch": (dict(model=NAME, prompt="hi", n=64), 400, "n"),
    "logprobs 21": (dict(model=NAME, prompt="hi", logprobs=21), 400, "logprobs"),
    "top_k not a number": (dict(model=NAME, prompt="hi", top_k="many"), 400, "top_k"),
    "top_k negative (0 is off)": (dict(model=NAME, prompt="hi", top_k=-1), 400, "top_k"),
    "min_p above 1": (dict(model=NAME, prompt="hi", min_p=1.5), 400, "min_p"),
    "repetition_penalty zero": (dict(model=NAME, prompt="hi", repetition_penalty=0), 400, "repetition_penalty"),
    "token id out of vocabulary": (dict(model=NAME, prompt=[1, 2, 999]), 400, "prompt"),
    "empty stop string": (dict(model=NAME, prompt="hi", stop=[""]), 400, "stop"),
    "missing model": (dict(prompt="hi"), 400, "model"),
    "seed too large": (dict(model=NAME, prompt="hi", seed=2**64), 400, "seed"),
    "too many prompts": (dict(model=NAME, prompt=["a"] * 33), 400, "prompt"),
    "unsupported penalty": (dict(model=NAME, prompt="hi", presence_penalty=1), 400, "presence_penalty"),
    "best_of below n": (dict(model=NAME, prompt="hi", n=2, best_of=1), 400, "best_of"),
    "best_of above n": (dict(model=NAME, prompt="hi", best_of=3), 400, "best_of"),
    "stream_options without stream": (dict(model=NAME, prompt="hi", stream_options=USAGE), 400, "stream_options"),
    "include_usage not boolean": (dict(model=NAME, prompt="", stream=True, stream_options=YES), 400, "stream_options"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(url, client, case):
    body, status, param = BAD_REQUESTS[case]
    r = post(url, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert_ok_after(client)


def test_bad_request_through_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt="hello", max_tokens=10_000)


def test_malformed_json_and_large_bodies(url, client):
    r = post(url, content=b'{"model": "tiny-byte", "prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert_ok_after(client)
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # was "Input should be a valid dictionary"
        r = post(url, content=b"model=tiny-byte&prompt=hi", headers={"content-type": content_type})
        assert r.status_code == 400 and f"must be JSON (Content-Type: application/json), got {content_type}" in r.text
    for path in ("/v1/completions", "/api/next"):  # was "There was an error parsing the body", code null
        r = httpx.post(f"{url}{path}", content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json" and "not UTF-8" in r.text, path
    # a field of several types names them all: the first alone read "prompt.str: Input should be a valid string"
    r = post(url, {"model": NAME, "prompt": [1.5]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "prompt: must be str or list[str] or list[int]"
    )
    r = post(url, {"model": NAME, "prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}})
    assert r.json()["error"]["message"].startswith("stream_options.include_usage: Input should be a valid boolean")
    r = post(url, {"model": NAME, "prompt": "x" * 100_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert_ok_after(client)

    def chunks():  # no Content-Length: the limit is enforced as the body streams in
        yield b'{"model": "tiny-byte", "prompt": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert_ok_after(client)
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_queue_full_and_disconnect_cancel(tok):
    """One request decoding, one waiting: more get 429. Dropping the decoding client cancels it,
    and the waiting one runs."""
    big = tiny_model(3, vocab_size=257, block_size=512, n_layer=4, n_embd=256)  # ~1 s for 500 tokens
    app = create_app(big, tok, name=NAME, max_batch=1, max_queue=1)
    long = dict(model=NAME, prompt="a", max_tokens=500, stream=True, ignore_eos=True)
    short = dict(model=NAME, prompt="b", max_tokens=5)
    with running(app) as url, httpx.Client(timeout=30) as client, ThreadPoolExecutor(4) as pool:
        health = lambda: httpx.get(f"{url}/health").json()
        with client.stream("POST", f"{url}/v1/completions", json=long) as r1:
            lines = r1.iter_lines()  # kept referenced: a dropped iterator closes the connection
            next(lines)  # the long request is decoding
            futures = [pool.submit(post, url, short) for _ in range(4)]
            deadline = time.monotonic() + 10
            while sum(f.done() for f in futures) < 3:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            rejected = [f.result() for f in futures if f.done()]
            assert [r.status_code for r in rejected] == [429] * 3
            assert rejected[0].json()["error"]["code"] == "rate_limit_exceeded"
            assert (health()["active"], health()["queued"]) == (1, 1)
        # Leaving the block closes the connection: the server cancels the long request.
        [waiting] = [f for f in futures if f not in {g for g in futures if g.done() and g.result().status_code == 429}]
        assert waiting.result().status_code == 200
        h = health()
        assert (h["cancelled"], h["completed"], h["active"], h["queued"]) == (1, 1, 0, 0), h
        assert h["tokens"] < 500, "the cancelled request ran to the end"
        # A non-streaming client that gives up cancels its request too. It hangs up once the
        # request is decoding, seen in /health: a client timeout scaled from a measured time
        # assumed the CPU kept its speed, and a loaded machine's did not.
        body = json.dumps(long | {"stream": False}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            deadline = time.monotonic() + 10
            while not health()["active"]:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        deadline = time.monotonic() + 10
        while (h := health())["active"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert (h["cancelled"], h["completed"]) == (2, 1), h


# ---------------------------------------------------------------------------------------------
# The explorer's JSON API and page


def test_explorer_next_tokens(url, model, tok):
    r = httpx.post(f"{url}/api/next", json={"prompt": "Hello", "top": 10})
    assert r.status_code == 200
    data = r.json()
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([tok.encode("Hello")]))[0][0, -1], dim=-1)
    top = probs.topk(10)
    assert [c["id"] for c in data["candidates"]] == top.indices.tolist()
    assert [c["prob"] for c in data["candidates"]] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert data["prompt_tokens"] == list("Hello")


def test_explorer_tokens_surprisal(url, model, tok):
    data = httpx.post(f"{url}/api/tokens", json={"prompt": "abcd"}).json()["tokens"]
    ids = tok.encode("abcd")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0][0], dim=-1)
    assert [t["id"] for t in data] == ids and data[0]["surprisal"] is None
    for i in range(1, 4):
        assert data[i]["surprisal"] == pytest.approx(-logp[i - 1, ids[i]].item() / math.log(2), abs=1e-4)


def test_explorer_attention(url, model, tok):
    data = httpx.post(f"{url}/api/attention", json={"prompt": "hello", "layer": 1, "head": 2}).json()
    expected = model.attention(torch.tensor([tok.encode("hello")]), 1, 2)[0]
    assert torch.allclose(torch.tensor(data["weights"]), expected, atol=1e-6)
    assert data["tokens"] == list("hello")
    r = httpx.post(f"{url}/api/attention", json={"prompt": "hello", "layer": 9, "head": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "layer"
    info = httpx.get(f"{url}/api/info").json()
    assert (info["n_layer"], info["n_head"]) == (2, 4)


def test_explorer_logit_lens(url, model, tok):
    from gptlab.inspect import logit_lens

    data = httpx.post(f"{url}/api/lens", json={"prompt": "hello", "top": 2}).json()
    lens = logit_lens(model, torch.tensor([tok.encode("hello")]), top=2)
    assert data["tokens"] == list("hello") and data["layers"] == lens["layers"]
    assert [[[c["id"] for c in pos] for pos in layer] for layer in data["top"]] == lens["top_ids"]


def test_explorer_patching(url, model, tok):
    from gptlab.patching import activation_patching, logit_diff, patched_logits

    body = {"clean": "abcdef", "corrupt": "abXdef", "right": "g", "wrong": "h"}
    data = httpx.post(f"{url}/api/patch", json=body).json()
    clean, corrupt = torch.tensor([tok.encode("abcdef")]), torch.tensor([tok.encode("abXdef")])
    ref = activation_patching(model, clean, corrupt, logit_diff(tok.encode("g")[0], tok.encode("h")[0]))
    normalized = (ref["grid"] - ref["corrupt"]) / (ref["clean"] - ref["corrupt"])
    assert data["columns"] == list("abcdef")
    torch.testing.assert_close(torch.tensor(data["grid"]), normalized, rtol=0, atol=1e-4)
    # <|endoftext|> as an answer is that token, as in the prompts (it was 13 byte tokens, refused)
    eot = httpx.post(f"{url}/api/patch", json={**body, "wrong": "<|endoftext|>"}).json()
    ref = activation_patching(model, clean, corrupt, logit_diff(tok.encode("g")[0], EOS))
    assert eot["clean"] == pytest.approx(ref["clean"], abs=1e-5)
    # the same logit difference both ways: no scale for the grid (it was zeros, drawn as a result)
    r = httpx.post(f"{url}/api/patch", json={**body, "corrupt": body["clean"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "corrupt"
    assert "same logit difference" in r.json()["error"]["message"]
    cell = httpx.post(f"{url}/api/patch/cell", json={**body, "layer": 1, "unit": 2, "top": 5}).json()
    probs = torch.softmax(patched_logits(model, clean, corrupt, 1, 2)[0, -1], dim=-1)
    assert [c["id"] for c in cell["patched"]] == probs.topk(5).indices.tolist()
    for bad, param in (({"corrupt": "abX"}, "corrupt"), ({"right": "gg"}, "right"), ({"layer": 7, "unit": 0}, "layer"),
                       ({"layer": -1, "unit": 0}, "layer"), ({"layer": 1, "unit": 6}, "unit"),
                       ({"wrong": "g"}, "wrong")):  # fmt: skip
        r = httpx.post(f"{url}/api/patch/cell", json={**body, "layer": 0, "unit": 0, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, bad


def test_explorer_takes_token_ids_and_labels_split_characters(url, model, tok):
    """A prompt given as ids is read as those ids (the page sends them once a token is picked: a
    byte of a split character decodes to U+FFFD, whose text re-encodes as three other bytes), and
    each token's label shows its bytes, as the CLI does."""
    ids = tok.encode("caf\u00e9")[:-1]  # ends with the first byte of "\u00e9", 0xc3
    assert ids[-1] == 0xC3
    data = httpx.post(f"{url}/api/next", json={"prompt": ids, "top": 5}).json()
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids]))[0][0, -1], dim=-1)
    assert [c["id"] for c in data["candidates"]] == probs.topk(5).indices.tolist()
    assert data["prompt_tokens"] == ["c", "a", "f", "\\xc3"]
    # <|endoftext|> in text is the token, as completions reads it: the page shows a pick after an
    # empty prompt (<|endoftext|> alone) as "<|endoftext|>A", which read back as 15 byte tokens
    picked = httpx.post(f"{url}/api/tokens", json={"prompt": [EOS, 65]}).json()["text"]
    assert [t["id"] for t in httpx.post(f"{url}/api/tokens", json={"prompt": picked}).json()["tokens"]] == [EOS, 65]
    tokens = httpx.post(f"{url}/api/tokens", json={"prompt": ids + [10]}).json()
    assert [t["id"] for t in tokens["tokens"]] == ids + [10] and tokens["text"] == "caf\ufffd\n"
    assert [t["label"] for t in tokens["tokens"]][-2:] == ["\\xc3", "\\n"]
    for path, body, param in (("/api/next", {"prompt": ids + [257]}, "prompt"), ("/api/tokens", {"prompt": [-1]}, "prompt"),
                              ("/api/patch", {"clean": "ab", "corrupt": "x" * 600, "right": "a", "wrong": "b"}, "corrupt"),
                              ("/api/patch", {"clean": [99_999, 1], "corrupt": "ab", "right": "a", "wrong": "b"}, "clean")):  # fmt: skip
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_explorer_page_is_self_contained(url):
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and "gptlab explorer" in page.text
    for asset in ("/static/app.js", "/static/style.css"):
        r = httpx.get(f"{url}{asset}")
        assert r.status_code == 200 and "http://" not in r.text and "https://" not in r.text
    assert "https://" not in page.text and "http://" not in page.text


def test_release_threads_ends_the_openmp_helpers_a_thread_started():
    """A thread that ran a parallel region keeps its OpenMP helpers (libgomp), and while two
    threads keep theirs on a 2-core machine, every thread sleeps between regions (a server's
    decoding ran at ~40% of its speed); kernels.release_threads ends the calling thread's helpers,
    and its next region starts them again."""
    import os

    def live_threads():
        return len(os.listdir("/proc/self/task"))

    x, seen = torch.ones(1 << 22), {}

    def work():
        torch.set_num_threads(2)
        (x * 2).sum()  # a parallel region of 2 threads: one helper
        seen["computed"] = live_threads()
        seen["released"] = kernels.release_threads(), live_threads()
        seen["sum"] = float((x * 2).sum())
        seen["again"] = live_threads()

    threads = torch.get_num_threads()
    try:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert seen["released"] == (True, seen["computed"] - 1)
    assert seen["again"] == seen["computed"] and seen["sum"] == 2 * x.numel()


EXPLORER_POSTS = {
    "/api/next": {"prompt": "Hello", "top": 3},
    "/api/tokens": {"prompt": "abcd"},
    "/api/attention": {"prompt": "hello", "layer": 1, "head": 0},
    "/api/lens": {"prompt": "hello", "top": 2},
    "/api/patch": {"clean": "abcdef", "corrupt": "abXdef", "right": "g", "wrong": "h"},
    "/api/patch/cell": {"clean": "abcdef", "corrupt": "abXdef", "right": "g", "wrong": "h", "layer": 1, "unit": 2},
}


@pytest.mark.parametrize("path", list(EXPLORER_POSTS))
def test_explorer_routes_release_their_threads_openmp_helpers(url, model, monkeypatch, path):
    """Each explorer route runs the model in a thread of FastAPI's pool and then lets that thread's
    OpenMP helpers go (kernels.release_threads), in that same thread: while they lived, the
    scheduler's decoding ran at ~40% of its speed (GPT-2 int4 after one /api/next: 243 against 671 tok/s)."""
    import gptlab.serve.explorer

    computed, released = [], []
    monkeypatch.setattr(gptlab.serve.explorer, "release_threads", lambda: released.append(threading.get_ident()))
    hook = model.transformer.wte.register_forward_hook(lambda *_: computed.append(threading.get_ident()))
    try:
        assert httpx.post(f"{url}{path}", json=EXPLORER_POSTS[path]).status_code == 200
    finally:
        hook.remove()
    assert computed and set(computed) == set(released) and len(released) == 1


def test_the_thread_that_starts_the_server_releases_its_openmp_helpers(monkeypatch):
    """The app's startup (the thread that loaded the model, under `gptlab serve`) lets its OpenMP
    helpers go before the scheduler's thread decodes (see the test above)."""
    import gptlab.serve.app

    released = []
    monkeypatch.setattr(gptlab.serve.app, "release_threads", lambda: released.append(threading.get_ident()))
    with running(create_app(serve_model(), get_tokenizer("byte"), name=NAME)):
        assert len(released) == 1 and released[0] != threading.get_ident()


def test_batch_steps_decode_with_a_module_replaced_before_the_next_request():
    """The batch's steps reuse one cache view per row count, so the C step keeps its KV pointers
    and trusts the model's plan as checked at its first step; a layer replaced between two requests
    is decoded with from the next request's prefill on, as generate does from its next prompt."""
    import copy

    model, prompt = serve_model(seed=3), [5, 6, 7]
    cache = BatchCache(model, 4, model.config.block_size)

    def greedy(n):
        start, logits = cache.prefill(prompt, 1, all_logits=False)  # (1, V)
        out = [int(logits[-1].argmax())]
        while len(out) < n:
            out.append(int(cache.step(torch.tensor([out[-1]]))[0].argmax()))
        cache.release(start, 1)
        return out

    with torch.no_grad():
        before = greedy(8)
        assert before == generate(model, [prompt], 8, temperature=0)[0][3:]
        fc = copy.deepcopy(model.transformer.h[1].mlp.c_fc)
        fc.weight.copy_(torch.randn(fc.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
        model.transformer.h[1].mlp.c_fc = fc
        after = greedy(8)
    assert after == generate(model, [prompt], 8, temperature=0)[0][3:] and after != before


def test_a_model_with_nan_logits_is_a_clear_server_error_not_a_completion(tok):
    """A model whose logits are NaN (float16 overflow, a NaN weight): greedy completions answered
    200 with token 0 repeated ("\\u0000\\u0000"), echoed logprobs and the explorer's lens failed as
    "internal error: ValueError", /api/next showed probabilities of null. Each is a 500 naming it."""
    broken = serve_model()
    with torch.no_grad():
        broken.transformer.ln_f.weight[0] = float("nan")  # every logit NaN
    with running(create_app(broken, tok, name=NAME)) as base:
        asks = [("/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 3, "temperature": 0}),
                ("/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 3}),
                ("/v1/completions", {"model": NAME, "prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}),
                ("/api/next", {"prompt": "abc"}), ("/api/tokens", {"prompt": "abc"}), ("/api/lens", {"prompt": "abc"})]  # fmt: skip
        for path, body in asks:
            r = httpx.post(base + path, json=body, timeout=60)
            assert r.status_code == 500, (path, body, r.text)
            assert "the model's logits are not finite" in r.json()["error"]["message"], (path, body)


def test_serve_command_loads_a_saved_model(tmp_path, model, monkeypatch):
    """`gptlab serve --model DIR` serves that model's weights and tokenizer under the directory's
    name (the uvicorn server itself is stubbed); --max-batch 0 is refused."""
    from gptlab.cli import main

    save_model(model, tmp_path / "m", tokenizer="byte")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    assert main(["serve", "--model", str(tmp_path / "m"), "--max-batch", "0"]) == 2
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    assert main(["serve", "--model", str(tmp_path / "m"), "--max-batch", "3", "--port", "0"]) == 0
    state = served["app"].state.gptlab
    try:
        assert state.name == "m" and state.tokenizer.name == "byte" and state.scheduler.max_batch == 3
        loaded = state.model.state_dict()
        for key, value in model.state_dict().items():
            assert torch.equal(loaded[key], value), key
    finally:
        state.scheduler.close()


def test_serve_command_serves_the_dtype_asked(tmp_path, model, monkeypatch):
    """`gptlab serve --dtype bfloat16` loads bf16 weights (the uvicorn server itself is stubbed)."""
    from gptlab.cli import main

    save_model(model, tmp_path / "m", tokenizer="byte")
    served = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    assert main(["serve", "--model", str(tmp_path / "m"), "--dtype", "bfloat16", "--port", "0"]) == 0
    state = served["app"].state.gptlab
    try:
        assert next(state.model.parameters()).dtype == torch.bfloat16
    finally:
        state.scheduler.close()


def test_a_padded_heads_spare_ids_are_never_served():
    """A model trained with vocab_multiple (257 byte ids padded to 320) whose padded id 300 is its
    argmax everywhere: completions were U+FFFD (greedy, every token); the tokenizer's ids only now,
    plain and speculative (prompt lookup), and a token prompt past the tokenizer's ids is a 400."""
    from test_generate import padded_head_model

    model, byte = padded_head_model(), get_tokenizer("byte")
    best = int(model.lm_head.weight[:257].mv(model.transformer.ln_f.bias).argmax())
    with running(create_app(model, byte, name=NAME, max_batch=2, max_queue=2)) as base:
        for extra in ({}, {"prompt_lookup": 2}):
            body = dict(model=NAME, prompt="Hi", max_tokens=5, temperature=0, return_token_ids=True, **extra)
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()
            assert reply["choices"][0]["token_ids"] == [best] * 5, reply
        reply = httpx.post(f"{base}/v1/completions", json=dict(model=NAME, prompt=[72, 300], max_tokens=2), timeout=30)
        assert reply.status_code == 400 and "must be in [0, 257)" in reply.json()["error"]["message"]


def test_an_omitted_prompt_is_the_models_own_end_of_text(tmp_path):
    """OpenAI's default prompt is <|endoftext|>, the start of a document: a model whose own BPE
    ends text with </s> (no <|endoftext|> token) was prompted with "<|endoftext|>" spelled out in
    12 plain tokens; an omitted prompt is now the model's end-of-text token, as an empty one is."""
    from conftest import s_bpe_dir

    tok = get_tokenizer(str(s_bpe_dir(tmp_path / "m")))
    model = tiny_model(vocab_size=tok.n_vocab, block_size=64)
    with running(create_app(model, tok, name=NAME, max_batch=2, max_queue=2)) as base:
        for extra in ({}, {"prompt": None}, {"prompt": ""}):
            body = dict(model=NAME, max_tokens=1, return_token_ids=True, **extra)
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()
            assert reply["choices"][0]["prompt_token_ids"] == [tok.eot_token] == [2], (extra, reply)
