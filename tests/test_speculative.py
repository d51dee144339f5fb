"""Speculative decoding (gptlab.speculative): greedy identity with plain decoding, the sampling
distribution (chi-square), cache rollback, batches whose rows accept different numbers, stop
strings and EOS inside an accepted run, the adaptive proposal length."""

import itertools

import pytest
import torch

from conftest import tiny_config, tiny_model
from gptlab import speculative as spec
from gptlab.classifier import model_for
from gptlab.config import GPTConfig
from gptlab.generation import generate, generate_text, stream_text
from gptlab.model import GPT
from gptlab.sampling import SamplingParams
from test_generate import PATTERN, echo_dir, echo_model  # noqa: F401  (a byte-level model that learned a repeating text, saved)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for tiny models


def run(model, rows, params, **kwargs):
    """decode's output as full rows (prompt + new tokens), and its stats."""
    stats = spec.SpeculationStats()
    out = [list(r) for r in rows]
    for new in spec.decode(model, rows, params, stats=stats, **kwargs):
        for o, t in zip(out, new, strict=True):
            o += t
    return out, stats


def prompts(n_rows, lengths=(5, 9, 3, 7), vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n_rows)]


def llama_tiny(seed):
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_name("llama-tiny", vocab_size=97)).eval()


VARIANTS = {
    "gpt2": lambda seed: tiny_model(seed),
    "rope": lambda seed: tiny_model(seed, pos_embedding="rope"),
    "llama-tiny": llama_tiny,
}
PROPOSERS = {
    "lookup": lambda model, draft: dict(prompt_lookup=3),
    "draft": lambda model, draft: dict(draft_model=draft),
    "self-draft": lambda model, draft: dict(draft_model=model),  # every proposal accepted
}


# --- greedy: the same tokens as plain decoding ----------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("n_rows", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_greedy_equals_plain_decoding(variant, proposer, n_rows, adaptive):
    model, draft = VARIANTS[variant](0), VARIANTS[variant](1)
    rows = prompts(n_rows)
    plain = generate(model, rows, 20, temperature=0)
    out, stats = run(
        model, rows, SamplingParams(temperature=0, max_new_tokens=20), adaptive=adaptive,
        **PROPOSERS[proposer](model, draft),
    )  # fmt: skip
    assert out == plain
    if not adaptive:
        assert stats.proposed > 0  # it did speculate
    if proposer == "self-draft" and not adaptive:
        assert stats.accepted == stats.proposed and stats.steps == 4  # 5 tokens per verification


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
@pytest.mark.parametrize("n_rows", [1, 3])
def test_greedy_over_bf16_caches_equals_plain_decoding(proposer, n_rows):
    """Both models' KV caches in bf16 (a quantized model's default): verifications write and read
    rounded keys as one-token steps do, so the tokens are plain decoding's over the same caches."""
    model, draft = tiny_model(0), tiny_model(1)
    model.kv_cache_dtype = draft.kv_cache_dtype = torch.bfloat16
    rows = prompts(n_rows)
    plain = generate(model, rows, 20, temperature=0)
    out, stats = run(model, rows, SamplingParams(temperature=0, max_new_tokens=20), **PROPOSERS[proposer](model, draft))
    assert out == plain and stats.proposed > 0
    assert spec.RowCache(model, 1, 4).cache.layers[0][0].dtype == torch.bfloat16


@pytest.mark.parametrize("proposer", ["lookup", "self-draft"])
def test_greedy_with_repetition_penalty_equals_plain_decoding(proposer):
    """Each verified position is penalised for the drafts before it, as plain decoding would be."""
    model = tiny_model(0)
    rows = prompts(3)
    plain = generate(model, rows, 20, temperature=0, repetition_penalty=1.8)
    params = SamplingParams(temperature=0, max_new_tokens=20, repetition_penalty=1.8)
    out, stats = run(model, rows, params, adaptive=False, **PROPOSERS[proposer](model, None))
    assert out == plain and stats.accepted > 0


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_greedy_equals_plain_past_block_size(proposer, pos):
    """Past block_size both re-encode the last window_keep tokens at the same point (batch of one)."""
    model, draft = tiny_model(0, pos_embedding=pos), tiny_model(1, pos_embedding=pos, block_size=16)
    rows = prompts(1, lengths=(20,))
    for keep in (None, 10):
        plain = generate(model, rows, 40, temperature=0, window_keep=keep)
        params = SamplingParams(temperature=0, max_new_tokens=40)
        out, _ = run(model, rows, params, window_keep=keep, adaptive=False, **PROPOSERS[proposer](model, draft))
        assert out == plain


def test_a_draft_past_its_context_slides_its_window_once_in_a_while(monkeypatch):
    """A draft whose context the rows outgrow re-encodes its last window once, then feeds only
    the new tokens: it counted the window's tokens from the row's start, so every verification
    re-encoded the whole window (5 re-encodes in 5 verifications, 131 tokens fed for 12 new)."""
    model, draft = tiny_model(0, block_size=64), tiny_model(1, block_size=32)
    rows = prompts(1, lengths=(40,))
    resets = []
    reset = spec.RowCache.reset
    monkeypatch.setattr(spec.RowCache, "reset", lambda cache: (resets.append(cache.model is draft), reset(cache))[1])
    plain = generate(model, rows, 20, temperature=0)
    out, stats = run(model, rows, SamplingParams(temperature=0, max_new_tokens=20), adaptive=False, draft_model=draft,
                     num_draft_tokens=2)  # fmt: skip
    assert out == plain
    # the first encode and a slide every ~8 tokens: measured 2 in 9 verifications (was 7 in 7)
    assert resets.count(True) <= 4 < stats.steps, (resets.count(True), stats.steps)


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
def test_greedy_equals_plain_from_a_prompt_longer_than_block_size(proposer):
    """A prompt past block_size keeps its last block_size tokens in decode, as in generate (decode
    took its last window_keep: other tokens, as gptlab bench speculative showed)."""
    model, draft = tiny_model(0), tiny_model(1, block_size=16)
    block = model.config.block_size
    rows = prompts(1, lengths=(block + 7,))
    plain = generate(model, rows, 12, temperature=0)
    out, _ = run(model, rows, SamplingParams(temperature=0, max_new_tokens=12), adaptive=False,
                 **PROPOSERS[proposer](model, draft))  # fmt: skip
    assert out == plain


def test_verification_logits_match_decode_steps():
    """Why greedy identity holds: the k+1-token verification forward and one-token steps give
    the same logits up to float32 rounding (measured max difference 1.4e-6 on logits of size ~1)."""
    model = tiny_model(0)
    row = prompts(1, lengths=(9,))[0]
    cache = spec.RowCache(model, 1, 32)
    cache.feed([row[:-1]])
    verified = cache.feed([row[-1:] + [5, 6, 7, 8]], all_logits=True)[0]  # (5, V)
    cache.rollback([4])
    stepped = [cache.feed([[t]])[0, -1] for t in [row[-1], 5, 6, 7, 8][1:]]
    assert cache.lengths == [13]
    torch.testing.assert_close(torch.stack(stepped), verified[1:], atol=1e-5, rtol=0)


# --- sampling: the target distribution, exactly -----------------------------------------------------


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs; cells expecting fewer than 5 are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.double), stat / 2))


def test_acceptance_rule_keeps_the_target_distribution():
    """accept() on fixed p and q far apart: the first token out follows p_0, the second p_1 given
    an accepted first draft (Leviathan et al., Theorem 1), for a sampled q and a one-hot q."""
    g = torch.Generator().manual_seed(0)
    V, B = 6, 40_000
    p = torch.softmax(torch.randn(3, V, generator=g) * 2, -1)  # p_0, p_1, p_2
    q = torch.softmax(torch.randn(2, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q, B, replacement=True, generator=g).T  # (B, 2) drawn from q
    accepted, extra = spec.accept(p.expand(B, 3, V), drafts, q.expand(B, 2, V), g)
    first = torch.where(accepted > 0, drafts[:, 0], extra)
    assert chi_square_p_value(torch.bincount(first, minlength=V), p[0]) > 1e-3
    second = torch.where(accepted > 1, drafts[:, 1], extra)[accepted > 0]
    assert chi_square_p_value(torch.bincount(second, minlength=V), p[1]) > 1e-3
    assert 0 < (accepted == 0).float().mean() < 1  # both branches of the rule ran
    lookup = torch.full((B, 2), 2)  # one-hot q: the same token always proposed
    accepted, extra = spec.accept(p.expand(B, 3, V), lookup, None, g)
    first = torch.where(accepted > 0, lookup[:, 0], extra)
    assert chi_square_p_value(torch.bincount(first, minlength=V), p[0]) > 1e-3


def exact_two_token_distribution(model, prompt, params):
    """P(t1, t2 | prompt) over all V^2 pairs, from full forwards (no cache)."""
    from gptlab.sampling import probabilities

    V = model.config.vocab_size
    with torch.no_grad():
        p1 = probabilities(model(torch.tensor([prompt]))[0][:, -1], params)[0]  # (V,)
        rows = torch.tensor([prompt + [t] for t in range(V)])
        p2 = probabilities(model(rows)[0][:, -1], params)  # (V, V)
    return (p1[:, None] * p2).flatten()  # (V*V,)


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_speculative_sampling_matches_the_models_distribution(proposer):
    """6000 rows of one prompt in one batch, each drawing its first two tokens from one
    verification of two proposals (rows accept 0, 1 or 2): the pairs follow the model's exact
    distribution (chi-square), as plain sampling's do. Measured p-values: 0.60 (draft), 0.84
    (lookup), 0.30 plain; accepting always, or redrawing from p instead of norm(max(0, p - q)), gives < 1e-6."""
    model, draft = tiny_model(0, vocab_size=6, block_size=8), tiny_model(3, vocab_size=6, block_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # p far from the draft's q
    prompt = [1, 1, 1]  # lookup proposes [1, 1], which p gives 0.69
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    exact = exact_two_token_distribution(model, prompt, params)
    kwargs = dict(draft_model=draft) if proposer == "draft" else dict(prompt_lookup=2)
    out, stats = run(model, [prompt] * 6000, params, generator=torch.Generator().manual_seed(0), num_draft_tokens=2,
                     adaptive=False, **kwargs)  # fmt: skip
    pairs = torch.tensor([r[3] * 6 + r[4] for r in out])
    assert chi_square_p_value(torch.bincount(pairs, minlength=36), exact) > 1e-3
    assert 0.3 < stats.acceptance < 0.7  # measured 0.42 (draft), 0.57 (lookup): rows accepted different numbers
    plain = generate(model, [prompt] * 6000, 2, generator=1)
    plain_pairs = torch.tensor([r[3] * 6 + r[4] for r in plain])
    assert chi_square_p_value(torch.bincount(plain_pairs, minlength=36), exact) > 1e-3


# --- caches -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_rollback_then_feed_equals_a_fresh_forward(pos):
    """Rows reject different numbers of tokens (holes under the shared write position); each
    row's next logits equal a full forward over what it kept plus what it was fed next."""
    model = tiny_model(0, pos_embedding=pos)
    rows = prompts(3)
    cache = spec.RowCache(model, 3, 32)
    cache.feed(rows)
    fed = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    cache.feed(fed, all_logits=True)
    cache.rollback([4, 1, 3])  # keep 0, 3 and 1 of them
    assert cache.holes and cache.pos == len(max(rows, key=len)) + 3
    kept = [r + f[:n] for r, f, n in zip(rows, fed, [0, 3, 1], strict=True)]
    nxt = [[40], [41, 42], [43]]
    logits = cache.feed(nxt, all_logits=True)  # (3, 2, V), chunks right-aligned
    for b, (r, c) in enumerate(zip(kept, nxt, strict=True)):
        full = model(torch.tensor([r + c]))[0][0, -len(c) :]  # (len(c), V)
        torch.testing.assert_close(logits[b, -len(c) :], full, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [len(r) + len(c) for r, c in zip(kept, nxt, strict=True)]


def test_batch_of_one_rolls_back_without_holes():
    model = tiny_model(0)
    cache = spec.RowCache(model, 1, 32)
    cache.feed([[1, 2, 3]])
    cache.feed([[4, 5, 6, 7]], all_logits=True)
    cache.rollback([2])
    assert (cache.pos, cache.lengths, cache.holes) == (5, [5], False)


def test_rows_accept_different_numbers_in_one_batch():
    """One row repeats its prompt (lookup proposals accepted), the other does not: within the same
    verification they gain different numbers of tokens, and both equal plain decoding."""
    model = tiny_model(0)
    loop = generate(model, [[7, 8]], 24, temperature=0)[0]  # greedy falls into a loop
    rows = [loop[:20], prompts(1, lengths=(6,), seed=5)[0]]
    gains = []
    stats = spec.SpeculationStats()
    out = [list(r) for r in rows]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    for new in spec.decode(model, rows, params, prompt_lookup=2, adaptive=False, stats=stats):
        gains.append([len(t) for t in new])
        for o, t in zip(out, new, strict=True):
            o += t
    assert out == generate(model, rows, 12, temperature=0)
    assert any(a != b and a and b for a, b in gains)


# --- ends: EOS, max_new_tokens, stop strings ---------------------------------------------------------


@pytest.mark.parametrize("n_rows", [1, 3])
def test_eos_inside_an_accepted_run(n_rows):
    """The eos token falls mid-run for a self-draft (all accepted): the row ends there, eos kept."""
    model = tiny_model(0)
    rows = prompts(n_rows)
    free = generate(model, rows, 16, temperature=0)
    eos = free[0][len(rows[0]) + 6]  # row 0's 7th new token
    plain = generate(model, rows, 16, temperature=0, eos_id=eos)
    out, stats = run(model, rows, SamplingParams(temperature=0, max_new_tokens=16), eos_id=eos,
                     draft_model=model, num_draft_tokens=4, adaptive=False)  # fmt: skip
    assert out == plain
    assert out[0][-1] == eos and len(out[0]) <= len(rows[0]) + 7
    tensor_plain = generate(model, torch.tensor([rows[0]]), 16, temperature=0, eos_id=eos)
    tokens = list(spec.generate_tokens(model, [rows[0]], SamplingParams(temperature=0, max_new_tokens=16),
                                       eos_id=eos, draft_model=model, adaptive=False))  # fmt: skip
    assert rows[0] + torch.stack(tokens, 1)[0].tolist() == tensor_plain[0].tolist()


def test_generate_tokens_yields_like_plain_decoding():
    """The regrouped iterator gives generation's shape: (B,) per position, eos after a row ends."""
    model = tiny_model(0)
    rows = [r[:3] for r in prompts(3)]
    eos = generate(model, rows, 1, temperature=0)[1][-1]  # rows 1 and 2 end at once, row 0 goes on
    plain = generate(model, torch.tensor(rows), 10, temperature=0, eos_id=eos)
    assert plain[0, 3:].ne(eos).all() and plain[1:, 3:].eq(eos).all()
    params = SamplingParams(temperature=0, max_new_tokens=10)
    stats = spec.SpeculationStats()
    steps, verified = [], []
    tokens = spec.generate_tokens(model, rows, params, eos_id=eos, prompt_lookup=2,
                                  num_draft_tokens=1, adaptive=False, stats=stats)  # fmt: skip
    for step in tokens:
        steps.append(step)
        verified.append(stats.steps)
    assert torch.stack(steps, 1).tolist() == plain[:, 3:].tolist()
    assert verified.count(stats.steps) <= 2  # streamed as verified (<= 2 tokens each), not held to the end


# --- never much slower ------------------------------------------------------------------------------


def test_draft_length_backs_off_when_nothing_is_accepted():
    control = spec.DraftLength(max_k=6, cost=0.1)
    ks = []
    for _ in range(1000):
        k = control.next_k()
        ks.append(k)
        if k:
            control.update([k], [0])
    assert ks[0] == 6 and ks[-1] == 0
    assert sum(k > 0 for k in ks) < 20  # probes at growing intervals: <2% of steps verify extra rows


def test_draft_length_grows_when_everything_is_accepted():
    control = spec.DraftLength(max_k=6, cost=0.1)
    control.update([6], [0])
    control.update([6], [0])
    assert control.k < 6
    for _ in range(20):
        control.update([max(control.next_k(), 1)], [max(control.next_k(), 1)])
    assert control.k == 6
    costly = spec.DraftLength(max_k=6, cost=1.1)  # a draft as big as the target never pays
    costly.update([6], [6])
    assert costly.k == 0


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    lookup = spec.PromptLookup([1, 2, 3, 9, 2, 3, 4, 5, 6, 1, 2, 3], max_ngram=3)
    assert lookup.propose(3) == [9, 2, 3]  # "1 2 3" occurred at the start
    lookup.extend([7])
    assert lookup.propose(2) == []  # 7 never occurred before
    latest = spec.PromptLookup([5, 1, 7, 1, 8, 1], max_ngram=2)
    assert latest.propose(1) == [8]  # equal matches: the latest occurrence (the freshest context)
    loop = spec.PromptLookup([5, 6, 5, 6, 5], max_ngram=2)
    assert loop.propose(5) == [6, 5, 6, 5, 6]  # runs into the end: continued with its period


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_lookup=-1), "prompt_lookup"),
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(prompt_lookup=2, draft_model="self"), "not both"),
        (dict(draft_model="other-vocab"), "vocabulary"),
        (dict(draft_model="classifier"), "the draft model is a sequence classifier"),  # was a traceback inside it
        (dict(draft_model="gpt2"), "draft_model must be a loaded model"),  # a spec: was an AttributeError
        (dict(prompt_lookup=2, window_keep=0), r"window_keep must be in \[1, block_size\], got 0"),  # was the default
        (dict(prompt_lookup=2, window_keep=33), "got 33"),
    ],
)
def test_bad_settings_raise_value_error(kwargs, match):
    model = tiny_model(0)
    if kwargs.get("draft_model") == "self":
        kwargs["draft_model"] = model
    elif kwargs.get("draft_model") == "other-vocab":
        kwargs["draft_model"] = tiny_model(0, vocab_size=50)
    elif kwargs.get("draft_model") == "classifier":
        kwargs["draft_model"] = model_for(tiny_config(num_labels=2, labels=["a", "b"], pad_token_id=0)).eval()
    with pytest.raises(ValueError, match=match):
        next(spec.decode(model, [[1, 2]], SamplingParams(max_new_tokens=3), **kwargs))


# --- the benchmark -----------------------------------------------------------------------------------


def test_bench_speculative_refuses_a_draft_of_more_blocks_than_the_model(tmp_path):
    from gptlab.bench.speculative import main

    # gpt2-tiny has 2 blocks: 5 was an AttributeError from the fused step
    with pytest.raises(ValueError, match="--draft-layers 5: an early-exit draft takes at most the model's 2 blocks"):
        main(["--model", "gpt2-tiny", "--draft-layers", "5", "--parts", "draft", "--out", str(tmp_path)])


def test_bench_speculative_runs_every_part_and_keeps_plain_tokens(tmp_path, capsys):
    import json

    from gptlab.bench.speculative import main

    args = ["--model", "gpt2-tiny", "--prompt-len", "16", "--new-tokens", "10", "--repeats", "1",
            "--rates", "0", "1", "--draft-layers", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    (path,) = tmp_path.glob("speculative-*.json")
    results = json.loads(path.read_text())
    rows = results["lookup"] + results["draft"] + results["sweep"]
    assert len(rows) == 4 + 2 + 4 and all(r["same_tokens_as_plain"] for r in rows)
    sweep = {(r["rate"], r["adaptive"]): r for r in results["sweep"]}
    assert sweep[(1.0, False)]["acceptance"] == 1.0 and sweep[(0.0, False)]["acceptance"] == 0.0
    assert sweep[(1.0, False)]["tokens_per_forward"] > 3  # k=4: up to 5 tokens per verification
    assert sweep[(0.0, True)]["proposed"] < sweep[(0.0, False)]["proposed"] / 2  # adaptive k stops proposing
    assert "speedup" in capsys.readouterr().out
    text = tmp_path / "quote.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer")
    assert main([*args, "--parts", "lookup", "--text", str(text)]) == 0
    with pytest.raises(ValueError, match="--text has"):
        main([*args, "--parts", "lookup", "--text", str(text), "--prompt-len", "100"])


# --- through generate, stream_text and the CLI ---------------------------------------------------------


def test_generate_takes_draft_model_and_prompt_lookup():
    model, draft = tiny_model(0), tiny_model(1)
    rows = prompts(3)
    plain = generate(model, rows, 12, temperature=0, eos_id=5)
    assert generate(model, rows, 12, temperature=0, eos_id=5, prompt_lookup=2) == plain
    assert generate(model, rows, 12, temperature=0, eos_id=5, draft_model=draft, num_draft_tokens=3) == plain
    idx = torch.tensor([rows[0][:3]])
    plain = generate(model, idx, 12, temperature=0, num_samples=2)
    assert torch.equal(generate(model, idx, 12, temperature=0, num_samples=2, prompt_lookup=2), plain)
    sampled = generate(model, idx, 12, num_samples=2, seed=3, draft_model=draft)
    assert sampled.shape == plain.shape
    with pytest.raises(ValueError, match="compiled_step"):
        generate(model, idx, 4, prompt_lookup=2, compiled_step=lambda *a, **k: None)


def test_stop_string_inside_an_accepted_run(echo_model):  # noqa: F811  (the imported fixture)
    """The stop string completes at a token in the middle of an accepted run: the text ends
    before it, as plain decoding's does, and the rest of the run is dropped."""
    model, tok = echo_model
    full = generate_text(model, tok, PATTERN, 40, temperature=0)
    stop = "é! 日"
    ids = tok.encode(PATTERN)
    runs = [len(new[0]) for new in spec.decode(model, [ids], SamplingParams(temperature=0, max_new_tokens=40),
                                               prompt_lookup=3)]  # fmt: skip
    new_ids = generate(model, [ids], 40, temperature=0)[0][len(ids) :]
    j = next(j for j in range(len(new_ids)) if stop in tok.decode(new_ids[: j + 1]))  # where the stop completes
    ends = list(itertools.accumulate(runs))
    run = next(i for i, e in enumerate(ends) if e > j)
    assert runs[run] > 1 and ends[run] - 1 > j  # inside a run, not at its last token
    for kwargs in (dict(prompt_lookup=3), dict(draft_model=model)):
        assert generate_text(model, tok, PATTERN, 40, temperature=0, **kwargs) == full
        pieces = list(stream_text(model, tok, PATTERN, 40, temperature=0, stop=stop, **kwargs))
        assert "".join(pieces) == full[: full.index(stop)]


def test_cli_generate_speculates_with_the_same_output(echo_model, echo_dir, capsys):  # noqa: F811
    from gptlab.cli import main

    model, tok = echo_model
    greedy = ["generate", "--model", echo_dir, "--prompt", PATTERN, "--temperature", "0", "--max-new-tokens", "30"]
    expected = PATTERN + generate_text(model, tok, PATTERN, 30, temperature=0, stop="é! 日") + "\n"
    for flags in (["--prompt-lookup", "3"], ["--draft-model", echo_dir, "--num-draft-tokens", "6"]):
        assert main([*greedy, "--stop", "é! 日", *flags]) == 0
        assert capsys.readouterr().out == expected
    assert main([*greedy, "--prompt-lookup", "-1"]) == 2
    captured = capsys.readouterr()
    assert "prompt_lookup" in captured.err and captured.err.count("\n") == 1 and not captured.out
    assert main([*greedy, "--draft-model", "gpt2-tiny"]) == 2  # another vocabulary
    assert "vocabulary" in capsys.readouterr().err


# --- the server -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """A server with a draft model (a different tiny model over the same bytes), its model and client."""
    import openai

    from gptlab.serve.app import create_app
    from gptlab.tokenizer import get_tokenizer
    from test_serve import running, serve_model

    model, draft, tok = serve_model(0), serve_model(1), get_tokenizer("byte")
    with running(create_app(model, tok, name="tiny", max_batch=8, draft_model=draft)) as url:
        yield model, tok, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60), url


def speculative_requests(url) -> int:
    import httpx

    return httpx.get(f"{url}/health").json()["speculative"]


def test_server_speculates_with_the_same_tokens(served):
    model, tok, client, url = served
    ids = tok.encode("abcabcabc")
    plain = generate(model, [ids], 40, temperature=0, eos_id=256)[0][len(ids) :]
    plain = [t for t in plain if t != 256]
    for extra in ({"prompt_lookup": 3}, {}):  # per-request prompt lookup; the server's draft model
        before = speculative_requests(url)
        out = client.completions.create(model="tiny", prompt="abcabcabc", max_tokens=40, temperature=0,
                                        extra_body={"return_token_ids": True, **extra})  # fmt: skip
        assert out.choices[0].token_ids == plain
        assert speculative_requests(url) == before + 1
        chunks = list(client.completions.create(model="tiny", prompt="abcabcabc", max_tokens=40, temperature=0,
                                                stream=True, extra_body=extra))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks) == tok.decode(plain)
        text = out.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = client.completions.create(model="tiny", prompt="abcabcabc", max_tokens=40, temperature=0, stop=stop,
                                        extra_body=extra)  # fmt: skip
        assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_server_speculative_sampling_is_seeded_and_logprobs_fall_back(served):
    model, tok, client, url = served
    kwargs = dict(model="tiny", prompt="xyz", max_tokens=20, n=2, temperature=1.0, seed=5)
    for extra in ({"prompt_lookup": 2, "ignore_eos": True}, {"ignore_eos": True}):
        a, b = (client.completions.create(**kwargs, extra_body=extra) for _ in range(2))
        assert [c.text for c in a.choices] == [c.text for c in b.choices]
        assert a.usage.completion_tokens == 40
    before = speculative_requests(url)
    scored = client.completions.create(model="tiny", prompt="xyz", max_tokens=5, temperature=0, logprobs=2)
    assert len(scored.choices[0].logprobs.token_logprobs) >= 1  # the draft server answers it by plain steps
    assert speculative_requests(url) == before
    import openai

    with pytest.raises(openai.BadRequestError, match="prompt_lookup"):
        client.completions.create(model="tiny", prompt="xyz", max_tokens=5, logprobs=1, extra_body={"prompt_lookup": 2})


def test_adaptive_k_stays_within_the_cpu_kernels_rows():
    from gptlab import kernels

    assert spec.most_draft_tokens(4, 1, "cpu") == 4  # 5 rows fit
    if kernels.available()[0]:
        assert spec.most_draft_tokens(12, 1, "cpu") == kernels.MAX_ROWS - 1  # 8 rows: k = 7
        assert spec.most_draft_tokens(4, 3, "cpu") == 1  # 3 rows x 2
    assert spec.most_draft_tokens(4, 16, "cpu") == 4  # no k fits: left alone
