"""Sampling means what it says: the tokens drawn follow softmax(logits / T) after transformers'
own top-k, top-p, min-p and repetition-penalty processors, through `gptlab.generate` and through
the server's /v1/completions.

A tiny GPT whose next-token logits are a fixed row, whatever the context, makes each sampled token
an independent draw from a known distribution, so a chi-square test checks the sampler end to end
(KV cache, decode steps, the server's scheduler). A test on the exact distribution checks the
values the filters keep (renormalised probabilities), not only which tokens they drop.
"""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import gptlab
from conftest import tiny_model
from gptlab.serve.app import create_app
from gptlab.tokenizer import get_tokenizer

V = 257  # the byte tokenizer's vocabulary, so the server can serve the same model
PROMPT = 3  # a prompt token that is also a likely next token (the repetition penalty shows)
# Eight plausible next tokens; the rest, end-of-text included, have probability ~e^-32 of the top.
LIKELY = [3, 17, 42, 65, 97, 128, 200, 255]
LOGITS = torch.full((V,), -30.0)
LOGITS[LIKELY] = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.5])
DRAWS = 4000
# Chi-square tests at p = 0.001 with fixed seeds: each passes or fails deterministically; a right
# sampler fails one only if torch's random stream changes and it lands in the 0.1% tail.
Z_999 = 3.090  # the standard normal's 0.999 quantile


def constant_model(logits: torch.Tensor = LOGITS):
    """A tiny GPT whose next-token logits are `logits` (V,) at every position and context: the final
    norm's gain is 0, so it outputs its bias e_0, and column 0 of the untied head is `logits`."""
    model = tiny_model(0, vocab_size=V, block_size=64, tie_weights=False)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = logits
    return model.eval()


def reference_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, context=()):
    """transformers' processors in the order its `generate` applies them, then softmax: (B, V)."""
    scores = logits.float().clone()[None] if logits.dim() == 1 else logits.float().clone()
    ids = torch.tensor([list(context)] * scores.size(0), dtype=torch.long)
    steps = []
    if penalty != 1.0:
        steps.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature != 1.0:
        steps.append(TemperatureLogitsWarper(temperature))
    if top_k:
        steps.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        steps.append(TopPLogitsWarper(top_p))
    if min_p:
        steps.append(MinPLogitsWarper(min_p))
    for step in steps:
        scores = step(ids, scores)
    return F.softmax(scores, dim=-1)


def seeded(seed: int) -> dict:
    """generate's seed keyword: `seed` where it takes one, else `generator` (an int seed)."""
    return {"seed": seed} if "seed" in inspect.signature(gptlab.generate).parameters else {"generator": seed}


def generate_draws(model, steps: int, **sampling) -> torch.Tensor:
    """DRAWS tokens from gptlab.generate: DRAWS // steps continuations of one prompt, `steps` tokens each."""
    out = gptlab.generate(model, [[PROMPT]], steps, num_samples=DRAWS // steps, **seeded(1234), **sampling)
    return torch.tensor([row[1:] for row in out]).flatten()  # (DRAWS,)


def chi_square(draws: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at p=0.001) of draws (N,) against probs (V,). Tokens expected
    fewer than 5 times share one bin; a token of probability 0 must never be drawn."""
    probs = probs.double()
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    impossible = probs == 0
    assert counts[impossible].sum() == 0, f"drew tokens of probability 0: {impossible.nonzero().flatten().tolist()}"
    expected = probs * draws.numel()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    if expected[-1] < 1e-9:  # no small bin
        observed, expected = observed[:-1], expected[:-1]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    # Wilson-Hilferty: the chi-square quantile from the normal one (within 1% for df >= 2).
    critical = df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def assert_follows(draws: torch.Tensor, probs: torch.Tensor) -> None:
    statistic, critical = chi_square(draws, probs)
    assert statistic < critical, (
        f"chi-square {statistic:.1f} >= {critical:.1f}: the draws do not follow the distribution"
    )


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for tiny models


@pytest.fixture(scope="module")
def model():
    return constant_model()


def test_the_constant_model_has_the_logits_it_was_given(model):
    with torch.no_grad():
        logits, _ = model(torch.tensor([[PROMPT, 9, 250]]))
    assert torch.equal(logits[0, -1], LOGITS) and torch.equal(logits[0, 0], LOGITS)


def test_the_chi_square_test_tells_distributions_apart(model):
    # Its power on this row: the draws at T=1 fail against softmax(logits * 0.8) and softmax(logits / 0.8).
    draws = generate_draws(model, 16, temperature=1.0)
    assert_follows(draws, reference_probs(LOGITS)[0])
    for wrong in (0.8, 1.25):
        statistic, critical = chi_square(draws, reference_probs(LOGITS, temperature=wrong)[0])
        assert statistic > 2 * critical


# ------------------------------------------------------------------------------ gptlab.generate


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_generate_samples_softmax_of_logits_over_temperature(model, temperature):
    draws = generate_draws(model, 16, temperature=temperature)
    assert_follows(draws, F.softmax(LOGITS.double() / temperature, dim=-1))


def test_temperature_zero_is_the_argmax(model):
    assert set(generate_draws(model, 16, temperature=0.0).tolist()) == {LIKELY[0]}


FILTERS = {
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.2),
    "top_k+top_p+min_p, T=0.7": dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.1),
    "top_p, T=1.5": dict(temperature=1.5, top_p=0.7),
    "min_p, T=1.5": dict(temperature=1.5, min_p=0.3),
}


@pytest.mark.parametrize("settings", list(FILTERS.values()), ids=list(FILTERS))
def test_generate_samples_what_transformers_filters_keep(model, settings):
    probs = reference_probs(LOGITS, **settings)[0]
    kept = int((probs > 0).sum())
    assert 1 < kept < len(LIKELY)  # the filter cuts, and leaves a distribution to check
    assert_follows(generate_draws(model, 16, **settings), probs)


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_generate_applies_the_repetition_penalty_to_the_prompt(model, penalty):
    # One step per row: the penalty depends on the context, which grows as tokens are drawn.
    draws = generate_draws(model, 1, repetition_penalty=penalty, temperature=0.8)
    probs = reference_probs(LOGITS, penalty=penalty, temperature=0.8, context=[PROMPT])[0]
    assert_follows(draws, probs)
    statistic, critical = chi_square(draws, reference_probs(LOGITS, temperature=0.8)[0])
    assert statistic > 2 * critical  # the draws tell the penalty from none


# ------------------------------------------------------------------ the exact distribution


SETTINGS = [
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=5),
    dict(top_p=0.3),
    dict(temperature=0.8, top_p=0.9),
    dict(min_p=0.05),
    dict(temperature=1.7, min_p=0.2),
    dict(temperature=0.9, top_k=20, top_p=0.75, min_p=0.02),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s in SETTINGS])
def test_filtered_distribution_equals_transformers(settings):
    """The renormalised probabilities of the kept tokens, on random rows, against transformers' warpers."""
    from gptlab.sampling import SamplingParams, probabilities

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 100, generator=gen) * 3  # (B, V)
    ours = probabilities(logits, SamplingParams(**settings))
    theirs = reference_probs(logits, **settings)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)  # measured max |diff| 6e-8 (float32 rounding)


def test_repetition_penalty_distribution_equals_transformers():
    from gptlab.sampling import SamplingParams, probabilities, seen_tokens

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen) * 3  # (B, V), positive and negative logits
    context = [[1, 2, 3, 7], [0, 0, 9], [49], [5, 6, 7, 8, 10, 11, 12]]
    ours = probabilities(logits, SamplingParams(repetition_penalty=1.3), seen_tokens(context, 50))
    for row, ids in enumerate(context):
        theirs = reference_probs(logits[row], penalty=1.3, context=ids)[0]
        torch.testing.assert_close(ours[row], theirs, rtol=0, atol=1e-6)


# -------------------------------------------------------------------------------- the server

NAME = "constant"
N = 50  # choices per request, all decoded together


@pytest.fixture(scope="module")
def client(model):
    app = create_app(model, get_tokenizer("byte"), name=NAME, max_batch=N)
    with TestClient(app) as client:
        yield client


def server_draws(client, max_tokens: int = 20, **sampling) -> torch.Tensor:
    """DRAWS tokens from /v1/completions: requests of N choices of `max_tokens` tokens, seeds 0, 1, ..."""
    draws = []
    for seed in range(DRAWS // (N * max_tokens)):
        body = dict(model=NAME, prompt=[PROMPT], max_tokens=max_tokens, n=N, seed=seed, ignore_eos=True,
                    return_token_ids=True, **sampling)  # fmt: skip
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == N and all(len(c["token_ids"]) == max_tokens for c in choices)
        draws += [t for c in choices for t in c["token_ids"]]
    return torch.tensor(draws)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_server_samples_softmax_of_logits_over_temperature(client, temperature):
    draws = server_draws(client, temperature=temperature)
    assert_follows(draws, F.softmax(LOGITS.double() / temperature, dim=-1))
    # and not the default temperature's distribution: the server forwarded it
    statistic, critical = chi_square(draws, F.softmax(LOGITS.double(), dim=-1))
    assert statistic > 2 * critical


def test_server_temperature_zero_is_the_argmax(client):
    assert set(server_draws(client, temperature=0).tolist()) == {LIKELY[0]}


SERVER_FILTERS = {
    "top_p, T=0.7": dict(temperature=0.7, top_p=0.8),
    "top_k+min_p, T=1.5": dict(temperature=1.5, top_k=5, min_p=0.15),
}


@pytest.mark.parametrize("settings", list(SERVER_FILTERS.values()), ids=list(SERVER_FILTERS))
def test_server_samples_what_transformers_filters_keep(client, settings):
    probs = reference_probs(LOGITS, **settings)[0]
    assert 1 < int((probs > 0).sum()) < len(LIKELY)
    assert_follows(server_draws(client, **settings), probs)


def test_server_applies_the_repetition_penalty(client):
    draws = server_draws(client, max_tokens=1, repetition_penalty=1.5, temperature=0.8)
    assert_follows(draws, reference_probs(LOGITS, penalty=1.5, temperature=0.8, context=[PROMPT])[0])
    statistic, critical = chi_square(draws, reference_probs(LOGITS, temperature=0.8)[0])
    assert statistic > 2 * critical
