"""gptlab bench serve: the OpenAI-compatible server against gptlab's own generate(), same weights.

`gptlab serve` decodes in a worker thread, batches concurrent requests, and pays HTTP, JSON and its
event loop for every token; generate() in one process, on the same prompts batched the same way,
is what it could reach. This saves the model (--model, default GPT-2's shape with random weights,
in --mode) to a temporary directory, starts `gptlab serve` on it as a subprocess on a free port of
127.0.0.1 (its own default threads, unless --threads), and times greedy completions of --new-tokens
tokens, the server and generate() taking turns round by round:

- one client, non-streaming and streaming, against generate() of one prompt;
- --clients clients at once, non-streaming, against generate() of as many prompts in one batch.

Every completion's token ids must equal generate()'s for its prompt alone (`return_token_ids`,
`ignore_eos`) up to the first near tie (NEAR_TIE): a fast wrong server fails the run. The clients are threads of this process, on the
same cores as the server. tok/s is new tokens over the wall time, prompt included; best of
--rounds. Results go to bench/results/serve-*.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from gptlab.bench.common import add_out_argument, positive, write_results
from gptlab.generation import generate
from gptlab.loading import load_model, tokenizer_name

MODES = ("fp32", "bf16", "int8", "int4")
NAME = "bench"
# Where a completion first leaves generate()'s greedy tokens, generate()'s own logits there may
# prefer its token by at most this much. The server's rows are right-aligned in a shared, masked KV
# cache, so their sums run in another order, and 8-bit activations (int4, int8) amplify that: GPT-2's
# shape with random weights, the batch cache's logits against generate()'s, 64 steps (AMD EPYC Zen 5):
# fp32 1.3e-6, bf16 0.031, int8 0 (bitwise), int4 0.075 at most.
NEAR_TIE = {"fp32": 1e-3, "bf16": 0.1, "int8": 0.25, "int4": 0.25}


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gptlab bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:gpt2", help="model spec (default: gpt2 shape, random weights)")
    p.add_argument("--mode", default="int4", choices=MODES, help="weights: fp32, bf16, int8 or int4 (default int4)")
    p.add_argument("--new-tokens", type=positive, default=128, help="tokens per completion (default 128)")
    p.add_argument("--prompt-len", type=positive, default=16, help="prompt tokens, random (default 16)")
    p.add_argument("--clients", type=positive, default=16, help="clients at once in the batched row (default 16)")
    p.add_argument("--rounds", type=positive, default=3, help="rounds; the best of each row counts (default 3)")
    p.add_argument("--threads", type=positive, default=None, help="the server's --threads (default: its own default)")
    add_out_argument(p)
    return p.parse_args(argv)


def model_in(spec: str, mode: str):
    """The model `spec` names, in `mode` (int4 in groups of 32, as the llama.cpp rows)."""
    from gptlab.quantize import quantize_model

    model = load_model(spec, dtype=torch.bfloat16 if mode == "bf16" else None).eval()
    if mode in ("int8", "int4"):
        model = quantize_model(model, mode, **({"group_size": 32} if mode == "int4" else {}))
    return model


def save(model, mode: str, directory: str, tokenizer: str) -> None:
    from gptlab.checkpoint import save_model
    from gptlab.quantize import save_quantized

    (save_quantized if mode in ("int8", "int4") else save_model)(model, directory, tokenizer=tokenizer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`gptlab serve` on `directory` in a subprocess, on a free port of 127.0.0.1."""

    def __init__(self, directory: str, mode: str, threads: int | None):
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "gptlab", "serve", "--model", directory, "--name", NAME,
               "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning"]  # fmt: skip
        cmd += ["--dtype", "bfloat16"] if mode == "bf16" else []
        cmd += ["--threads", str(threads)] if threads else []
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> str:
        """Wait for /health; returns the server's startup line. RuntimeError if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gptlab serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return next((ln for ln in self.output().splitlines() if ln.startswith("gptlab serve:")), "")
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"gptlab serve did not answer /health in {timeout:.0f} s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def complete(url: str, prompt: list[int], new_tokens: int, stream: bool) -> list[int] | int:
    """A greedy completion of exactly new_tokens tokens: its token ids, or (streaming) their count
    as the final usage chunk gives it."""
    body = dict(model=NAME, prompt=prompt, max_tokens=new_tokens, temperature=0, ignore_eos=True, stream=stream,
                return_token_ids=True, stream_options={"include_usage": True} if stream else None)  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        response = urllib.request.urlopen(request, timeout=600)
    except urllib.error.HTTPError as e:  # a 4xx: the server's OpenAI-style body says why
        message = json.loads(e.read() or b"{}").get("error", {}).get("message", "")
        raise ValueError(f"the server refused the completion (HTTP {e.code}): {message}") from None
    with response:
        if not stream:
            return json.load(response)["choices"][0]["token_ids"]
        count = None
        for line in response:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                count = usage["completion_tokens"] if usage else count
        return count


def difference(model, prompt: list[int], got: list[int], want: list[int]) -> float | None:
    """None when `got` is generate()'s `want`; else how much generate()'s logits prefer its token
    where the two first part (inf for a different length)."""
    if got == want:
        return None
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if i is None:
        return float("inf")
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt + want[:i]]), last_only=True)  # (1, 1, V)
    return float(logits[0, -1, want[i]].float() - logits[0, -1, got[i]].float())


def rows_of(prompts: torch.Tensor, new_tokens: int, model) -> list[list[int]]:
    """generate()'s greedy new tokens for the prompts (B, T) in one batch."""
    return [row[prompts.size(1) :] for row in generate(model, prompts.tolist(), new_tokens, temperature=0)]


def main(argv=None) -> int:
    args = parse_args(argv or [])
    torch.manual_seed(0)  # a preset's random weights
    model = model_in(args.model, args.mode)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.clients, args.prompt_len), generator=g)  # (clients, T)
    one, n = prompts[:1], args.new_tokens
    expected = [rows_of(prompts[i : i + 1], n, model)[0] for i in range(args.clients)]  # each alone, untimed
    best = {}

    def timed(key: str, fn, tokens: int):
        t0 = time.perf_counter()
        out = fn()
        best[key] = max(best.get(key, 0.0), tokens / (time.perf_counter() - t0))
        return out

    mismatches, near_ties = {}, {}  # completion -> generate()'s margin where it first parts (every round's)

    def check(label: str, prompt: list[int], got: list[int], want: list[int]) -> None:
        margin = difference(model, prompt, got, want)
        if margin is not None:
            (near_ties if margin <= NEAR_TIE[args.mode] else mismatches)[label] = round(margin, 4)

    with tempfile.TemporaryDirectory() as tmp:
        save(model, args.mode, tmp, tokenizer_name(args.model))
        server = Server(tmp, args.mode, args.threads)
        try:
            startup = server.wait_ready()
            complete(server.url, one[0].tolist(), 4, stream=False)  # the server's first request warms it
            rows_of(one, 4, model)
            with ThreadPoolExecutor(args.clients) as pool:
                for _ in range(args.rounds):
                    timed("generate_one", lambda: rows_of(one, n, model), n)
                    got = timed("server_one", lambda: complete(server.url, one[0].tolist(), n, False), n)
                    check("1 client", one[0].tolist(), got, expected[0])
                    count = timed("server_one_stream", lambda: complete(server.url, one[0].tolist(), n, True), n)
                    if count != n:
                        mismatches["1 client, streaming"] = f"{count} tokens"
                    timed("generate_batch", lambda: rows_of(prompts, n, model), n * args.clients)
                    calls = lambda: list(pool.map(lambda p: complete(server.url, p, n, False), prompts.tolist()))
                    got = timed("server_batch", calls, n * args.clients)
                    for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
                        check(f"client {i}", prompts[i].tolist(), tokens, want)
        finally:
            server.close()

    rows = [
        ("1 client, non-streaming", "server_one", "generate_one"),
        ("1 client, streaming", "server_one_stream", "generate_one"),
        (f"{args.clients} clients at once", "server_batch", "generate_batch"),
    ]
    print(f"gptlab bench serve: {args.model} {args.mode}, {n} new tokens after {args.prompt_len}; {startup}")
    print(f"  {'':<26}{'server tok/s':>13}{'generate() tok/s':>18}{'ratio':>8}")
    results = []
    for label, ours, ceiling in rows:
        ratio = best[ours] / best[ceiling]
        print(f"  {label:<26}{best[ours]:>13.1f}{best[ceiling]:>18.1f}{ratio:>7.2f}x")
        results.append(dict(row=label, server_tok_s=round(best[ours], 1), generate_tok_s=round(best[ceiling], 1),
                            ratio=round(ratio, 3)))  # fmt: skip
    ties = (
        f"; {len(near_ties)} of {args.clients + 1} part at a near tie (<= {NEAR_TIE[args.mode]})" if near_ties else ""
    )
    print(f"token ids: {f'DIFFER: {mismatches}' if mismatches else 'as generate() gives them'}{ties}")
    settings = dict(model=args.model, mode=args.mode, new_tokens=n, prompt_len=args.prompt_len, clients=args.clients,
                    rounds=args.rounds, server=startup, server_threads=args.threads)  # fmt: skip
    write_results("serve", dict(settings=settings, rows=results, mismatches=mismatches, near_ties=near_ties), args.out)
    return 1 if mismatches else 0
