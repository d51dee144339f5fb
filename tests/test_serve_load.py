"""A bounded load test of `gptlab serve`: 32 concurrent streaming clients x 64 tokens on loopback.

The server runs as its own process (`python -m gptlab serve`), so the clients do not share its
interpreter. The same 32 requests are served one at a time, then all at once; batching must give
at least 1.5x the total throughput (measured 1.8-2.4x), with every request complete and no errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from conftest import tiny_model
from gptlab.checkpoint import save_model
from test_serve import free_port

CLIENTS = 32
TOKENS = 64
NAME = "load-tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve-load") / NAME
    save_model(tiny_model(0, vocab_size=257, block_size=256), directory, tokenizer="byte")
    port = free_port()
    cmd = [sys.executable, "-m", "gptlab", "serve", "--model", str(directory), "--port", str(port),
           "--max-batch", str(CLIENTS), "--max-queue", str(2 * CLIENTS), "--threads", "1", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"gptlab serve did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


async def stream_one(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str | None]:
    """One streaming request; returns (tokens received, error or None)."""
    body = dict(model=NAME, prompt=f"client {i}: ", max_tokens=TOKENS, temperature=1.0, seed=i, stream=True,
                ignore_eos=True)  # fmt: skip
    chunks, done, usage = 0, False, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return 0, f"status {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return 0, f"error chunk: {chunk['error']}"
                chunks += 1
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        return 0, f"{type(e).__name__}: {e}"
    if not done or usage is None or usage["completion_tokens"] != TOKENS or chunks < TOKENS // 2:
        return 0, f"incomplete: {chunks} chunks, done={done}, usage={usage}"
    return usage["completion_tokens"], None


async def run_load(url: str, concurrent: bool) -> dict:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await stream_one(client, url, -1)  # warm up the connection and the server
        t0 = time.perf_counter()
        if concurrent:
            results = await asyncio.gather(*(stream_one(client, url, i) for i in range(CLIENTS)))
        else:
            results = [await stream_one(client, url, i) for i in range(CLIENTS)]
        seconds = time.perf_counter() - t0
    tokens = sum(t for t, _ in results)
    errors = [e for _, e in results if e]
    return dict(requests=CLIENTS, tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds, errors=errors)


def test_batched_throughput_well_above_sequential(server, capsys):
    # Each way twice, alternating, keeping the faster run: the machine may be busy with other work.
    runs = [asyncio.run(run_load(server, concurrent=c)) for c in (False, True, False, True)]
    sequential = max(runs[0::2], key=lambda r: r["tokens_per_s"])
    batched = max(runs[1::2], key=lambda r: r["tokens_per_s"])
    health = httpx.get(f"{server}/health").json()
    speedup = batched["tokens_per_s"] / sequential["tokens_per_s"]
    with capsys.disabled():
        print(f"\nserve load test: {CLIENTS} streaming clients x {TOKENS} tokens, tiny byte-level model, loopback")
        for name, r in (("one at a time", sequential), ("concurrent", batched)):
            print(f"  {name:<14} {r['requests']} requests  {r['tokens']} tokens  {r['seconds']:.2f} s  "
                  f"{r['tokens_per_s']:.0f} tokens/s  errors={len(r['errors'])}")  # fmt: skip
        print(f"  speedup {speedup:.2f}x  (largest batch {health['max_rows']} rows)")
    assert all(r["errors"] == [] for r in runs), [r["errors"][:3] for r in runs]
    assert sequential["tokens"] == batched["tokens"] == CLIENTS * TOKENS
    assert health["max_rows"] >= CLIENTS // 2, "the concurrent requests were not decoded together"
    # Measured on the AMD EPYC, 2026-12-01: 1.80-2.43x (one request at a time decodes through the
    # fused C step, a batch of more than 8 rows through the modules); a scheduler that serialized
    # the requests would give ~1.0x, so 1.5 still tells batching from none.
    assert speedup >= 1.5, (
        f"batched {batched['tokens_per_s']:.0f} tokens/s vs sequential {sequential['tokens_per_s']:.0f}"
    )
