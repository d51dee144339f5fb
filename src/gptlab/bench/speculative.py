"""gptlab bench speculative: speculative decoding against plain decoding, same weights, same run.

Three parts, batch 1, greedy (so every speculative run must give plain decoding's tokens, which
each row checks):

- **lookup**: prompt lookup on a context that repeats itself (a passage, random tokens or the
  opening of --text, then the passage quoted again, cut short: the continuation can copy it),
  and on random tokens (nothing to copy, except what a random model repeats on its own);
- **draft**: a draft model against the target. Without --draft-model, the draft is the target's
  own first --draft-layers blocks with its embeddings and head (an early-exit draft sharing the
  weights, so it agrees with the target more often than an unrelated random model would);
- **sweep**: speedup against acceptance rate. An oracle proposer knows plain decoding's
  continuation and proposes it with each token replaced by a wrong one with probability
  1 - rate: proposals cost nothing, so the row shows what verification itself returns at that
  acceptance, with k fixed and with the adaptive k.

Weights: --model (default: `gpt2`'s shape with random weights; any --model spec works, e.g. a
trained checkpoint or, with the network, `gpt2-xl` with `--draft-model gpt2`). tok/s is new
tokens over the wall time of the whole call, prompt included (the same prompt for both), best of
--repeats. Results go to bench/results/speculative-*.json.
"""

from __future__ import annotations

import argparse
import random
import time
from unittest import mock

import torch

from gptlab import speculative as spec
from gptlab.bench.common import add_out_argument, positive, write_results
from gptlab.generation import generate
from gptlab.loading import load_model
from gptlab.meta import meta_device
from gptlab.model import GPT
from gptlab.sampling import SamplingParams


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gptlab bench speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:gpt2", help="target model spec (default: gpt2 shape, random weights)")
    p.add_argument("--draft-model", default=None, help="draft model spec (default: the target's first blocks)")
    p.add_argument("--draft-layers", type=positive, default=2, help="blocks of the early-exit draft (default 2)")
    p.add_argument("--parts", nargs="+", default=["lookup", "draft", "sweep"], choices=["lookup", "draft", "sweep"])
    p.add_argument("--prompt-len", type=positive, default=128, help="prompt tokens (default 128)")
    p.add_argument(
        "--text", default=None, help="a text file whose opening the quoting context quotes (default: random tokens)"
    )
    p.add_argument("--new-tokens", type=positive, default=128, help="new tokens per run (default 128)")
    p.add_argument(
        "--num-draft-tokens", type=positive, default=4, help="k, tokens proposed per verification (default 4)"
    )
    p.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.5, 0.7, 0.8, 0.9, 1.0], help="sweep's rates")
    p.add_argument("--repeats", type=positive, default=3, help="runs per row; the best counts (default 3)")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads (default: torch's choice)")
    add_out_argument(p)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Proposers for the bench


def early_exit_draft(model: GPT, n_layer: int) -> GPT:
    """A draft made of the target's first n_layer blocks, its embeddings, final norm and head
    (shared tensors, no copy)."""
    if not 1 <= n_layer <= model.config.n_layer:  # more blocks than it has: an AttributeError deep in the step
        raise ValueError(f"--draft-layers {n_layer}: an early-exit draft takes at most the model's {model.config.n_layer} blocks")  # fmt: skip
    config = type(model.config).from_dict({**model.config.to_dict(), "n_layer": n_layer})
    with meta_device():
        draft = GPT(config)
    draft.transformer = torch.nn.ModuleDict(
        {name: (module[:n_layer] if name == "h" else module) for name, module in model.transformer.items()}
    )
    draft.lm_head = model.lm_head
    return draft.eval()


class Oracle:
    """A stand-in for speculative.PromptLookup that proposes the known continuation `truth`, each
    token replaced by a wrong one with probability 1 - rate (seeded)."""

    truth: list[int] = []
    rate: float = 1.0
    vocab: int = 2

    def __init__(self, tokens, max_ngram):
        self.tokens = list(tokens)
        self.rng = random.Random(0)

    def extend(self, tokens) -> None:
        self.tokens += tokens

    def propose(self, k: int) -> list[int]:
        right = self.truth[len(self.tokens) : len(self.tokens) + k]
        return [t if self.rng.random() < self.rate else (t + 1) % self.vocab for t in right]


# ---------------------------------------------------------------------------------------------
# Timing


def best_of(repeats: int, fn):
    """(last result, best seconds) over `repeats` calls of fn()."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def run_plain(model, prompt, args) -> tuple[list[int], float]:
    out, seconds = best_of(args.repeats, lambda: generate(model, [prompt], args.new_tokens, temperature=0)[0])
    return out, seconds


def run_speculative(model, prompt, args, plain, plain_s, name, **kwargs) -> dict:
    """One row: speculative tokens/s, acceptance, speedup over the plain run, identical tokens."""
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)

    def once():
        stats = spec.SpeculationStats()
        out = list(prompt)
        for new in spec.decode(model, [prompt], params, stats=stats, **kwargs):
            out += new[0]
        return out, stats

    (out, stats), seconds = best_of(args.repeats, once)
    row = dict(
        name=name,
        tok_s=round(args.new_tokens / seconds, 2),
        plain_tok_s=round(args.new_tokens / plain_s, 2),
        speedup=round(plain_s / seconds, 3),
        acceptance=round(stats.acceptance, 3),
        tokens_per_forward=round(stats.tokens / max(stats.steps, 1), 2),
        forwards=stats.steps,
        proposed=stats.proposed,
        same_tokens_as_plain=out == plain,
    )
    print(
        f"  {name:<34} {row['tok_s']:>7.1f} tok/s  plain {row['plain_tok_s']:>6.1f}  speedup {row['speedup']:.2f}x"
        f"  acceptance {row['acceptance']:.0%}  {row['tokens_per_forward']:.2f} tok/forward"
        f"  {'identical' if row['same_tokens_as_plain'] else 'DIFFERENT TOKENS'}"
    )
    return row


# ---------------------------------------------------------------------------------------------
# The three parts


def fixed_and_adaptive(model, prompt, args, plain, plain_s, name, **kwargs) -> list[dict]:
    """Two rows: k fixed at --num-draft-tokens, and the adaptive k (same proposer)."""
    rows = []
    for adaptive in (False, True):
        label = f"{name} ({'adaptive' if adaptive else f'k={args.num_draft_tokens}'})"
        row = run_speculative(model, prompt, args, plain, plain_s, label, adaptive=adaptive,
                              num_draft_tokens=args.num_draft_tokens, **kwargs)  # fmt: skip
        rows.append(dict(row, adaptive=adaptive))
    return rows


def passage_tokens(args, n: int, vocab_size: int, g) -> list[int]:
    """n tokens to quote: the opening of --text (in the model's tokenizer), or random ids."""
    if args.text is None:
        return torch.randint(0, vocab_size, (n,), generator=g).tolist()
    from gptlab.loading import tokenizer_name
    from gptlab.tokenizer import get_tokenizer

    with open(args.text, encoding="utf-8") as f:
        ids = get_tokenizer(tokenizer_name(args.model)).encode(f.read())
    if len(ids) < n:
        raise ValueError(f"--text has {len(ids)} tokens; the quoting context needs {n}")
    return ids[:n]


def part_lookup(model, args, g) -> list[dict]:
    V = model.config.vocab_size
    passage = passage_tokens(args, args.prompt_len // 2, V, g)
    rows = []
    for name, prompt in [
        ("lookup, quoting context", passage + passage[: args.prompt_len - len(passage)]),
        ("lookup, random context", torch.randint(0, V, (args.prompt_len,), generator=g).tolist()),
    ]:
        plain, plain_s = run_plain(model, prompt, args)
        rows += fixed_and_adaptive(model, prompt, args, plain, plain_s, name, prompt_lookup=3)
    return rows


def part_draft(model, draft, args, g) -> list[dict]:
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
    plain, plain_s = run_plain(model, prompt, args)
    return fixed_and_adaptive(model, prompt, args, plain, plain_s, "draft", draft_model=draft)


def part_sweep(model, args, g) -> list[dict]:
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
    plain, plain_s = run_plain(model, prompt, args)
    rows = []
    with mock.patch.object(spec, "PromptLookup", Oracle):
        Oracle.truth, Oracle.vocab = plain, model.config.vocab_size
        for rate in args.rates:
            Oracle.rate = rate
            pair = fixed_and_adaptive(model, prompt, args, plain, plain_s, f"oracle at {rate:.0%}", prompt_lookup=1)
            rows += [dict(row, rate=rate) for row in pair]
    return rows


def main(argv=None) -> int:
    args = parse_args(argv or [])
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(args.model)
    draft = load_model(args.draft_model) if args.draft_model else early_exit_draft(model, args.draft_layers)
    g = torch.Generator().manual_seed(0)
    print(f"speculative decoding: {args.model}, batch 1, greedy, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, best of {args.repeats}")  # fmt: skip
    parts = {}
    with torch.no_grad():
        generate(model, [[1, 2, 3]], 4, temperature=0)  # warm up: kernels built, threads started
        if "lookup" in args.parts:
            parts["lookup"] = part_lookup(model, args, g)
        if "draft" in args.parts:
            parts["draft"] = part_draft(model, draft, args, g)
        if "sweep" in args.parts:
            parts["sweep"] = part_sweep(model, args, g)
    config = dict(vars(args), draft=args.draft_model or f"first {args.draft_layers} blocks of the target")
    write_results("speculative", {"config": config, **parts}, args.out)
    return 0
