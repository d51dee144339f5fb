"""gptlab.sampling: SamplingParams' validation and defaults, the filters against transformers'
warpers, and probabilities() as the exact distribution sample_next draws from."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gptlab import kernels, ops, sampling
from gptlab.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    min_p_mask,
    probabilities,
    sample_next,
    seen_tokens,
    top_k_mask,
    top_p_mask,
)

NEG = float("-inf")


# --- SamplingParams ------------------------------------------------------------------------------


def test_defaults_are_the_off_values():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (1.0, 0, 1.0, 0.0, 1.0)
    assert (p.seed, p.num_samples, p.stop) == (None, 1, ())
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(probabilities(logits, p), F.softmax(logits, dim=-1))  # nothing filtered
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=None), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_k=None), r"top_k=0 turns it off"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=None), r"top_p=1\.0 turns it off"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_p=None), r"min_p=0\.0 turns it off"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=None), r"repetition_penalty=1\.0 turns it off"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=None), "max_new_tokens"),
        (dict(num_samples=0), "num_samples"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[3]), "stop"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_exported_from_the_package():
    import gptlab

    assert gptlab.SamplingParams is SamplingParams


def test_good_settings_and_stop_normalised():
    p = SamplingParams(temperature=0, top_k=1, top_p=1, min_p=1, repetition_penalty=1.2, seed=-(2**63), stop="ab")
    assert p.stop == ("ab",) and p.greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=["a"]) == SamplingParams(stop=("a",))  # hashable, comparable


def test_generator_from_the_seed():
    a = SamplingParams(seed=5).generator("cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=torch.Generator().manual_seed(5)))
    assert SamplingParams().generator("cpu") is None  # torch's global generator
    fresh = [SamplingParams().generator("cpu", fresh=True) for _ in range(2)]
    assert fresh[0].initial_seed() != fresh[1].initial_seed()


# --- the filters ---------------------------------------------------------------------------------


def test_top_k_mask_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])
    assert top_k_mask(logits, 2).tolist() == [[NEG, 3.0, 2.0, NEG, NEG]]
    assert top_k_mask(logits, 10).tolist() == logits.tolist()


@pytest.fixture(params=["c", "sort"])
def nucleus_path(request):
    """top_p_mask's two ways: gptlab's kernel (gl_top_p_keep, no sort), and sorting where the
    kernels are off or do not run."""
    if request.param == "c" and not kernels.available()[0]:
        pytest.skip(f"gptlab's kernels are not built here: {kernels.available()[2]}")
    with kernels.use_kernels(request.param == "c"):
        yield request.param


def test_top_p_mask_keeps_the_smallest_nucleus(nucleus_path):
    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15]])
    logits = probs.log()
    kept = lambda p: (top_p_mask(logits, p) > NEG).tolist()[0]  # noqa: E731
    assert kept(0.45) == [False, True, False, False]  # 0.5 alone reaches 0.45 (p = 0.5 would be a tie
    # that rounding decides: at ATen's DEFAULT level the mass before the second token is 0.49999997)
    assert kept(0.6) == [False, True, True, False]
    assert kept(0.9) == [False, True, True, True]  # 0.5 + 0.3 + 0.15 = 0.95 >= 0.9
    assert kept(0.96) == [True, True, True, True]
    assert kept(0.01) == [False, True, False, False]  # the top token always stays
    assert F.softmax(top_p_mask(torch.zeros(1, 5), 1.0), -1).allclose(torch.full((1, 5), 0.2))
    # equal probabilities: the earlier ids, on both paths (sorting kept ids 3-5 where C kept 0-2),
    # also where the nucleus ends among more ties than the first look (512) takes
    assert (top_p_mask(torch.zeros(1, 6), 0.34) > NEG).tolist() == [[True] * 3 + [False] * 3]
    assert (top_p_mask(torch.zeros(1, 600), 0.5) > NEG).nonzero()[:, 1].tolist() == list(range(300))


def test_min_p_mask_scales_with_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = (min_p_mask(probs.log(), 0.28) > NEG).tolist()[0]  # threshold 0.28 * 0.5 = 0.14 (0.3's
    # 0.15 would be a tie that rounding decides: the third probability is 0.15000001 at ATen's AVX2
    # level and 0.14999999 at DEFAULT, a CPU without AVX2)
    assert kept == [True, True, True, False]


def test_masks_agree_with_transformers_warpers():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.zeros(4, 1, dtype=torch.long)
    for ours, theirs in [
        (top_k_mask(logits, 17), TopKLogitsWarper(17)(ids, logits.clone())),
        (top_p_mask(logits, 0.8), TopPLogitsWarper(0.8)(ids, logits.clone())),
        (min_p_mask(logits, 0.05), MinPLogitsWarper(0.05)(ids, logits.clone())),
    ]:
        assert torch.equal(ours.isinf(), theirs.isinf())


@pytest.mark.parametrize("scale", [0.3, 8.0])
def test_top_p_agrees_with_transformers_on_a_wide_nucleus_and_a_narrow_one(scale, nucleus_path):
    """top_p_mask looks among the TOP_P_FIRST most likely tokens, and sorts every token only when
    those hold less than p: a flat distribution (its nucleus thousands of tokens wide) takes the
    sort, a peaked one (a few tokens) the first look; both keep what transformers keeps."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)) * scale
    kept = top_p_mask(logits, 0.9) > NEG
    assert torch.equal(kept, TopPLogitsWarper(0.9)(torch.zeros(3, 1, dtype=torch.long), logits.clone()) > NEG)
    widest = int(kept.sum(-1).max())
    assert widest > sampling.TOP_P_FIRST if scale < 1 else widest < sampling.TOP_P_FIRST  # measured 4,186 and 6


def test_top_p_in_c_never_sorts_and_ranks_equal_probabilities_in_vocabulary_order(monkeypatch):
    """gl_top_p_keep sorts only the tokens of the probability bucket the nucleus ends in, on every
    kernel variant: a flat row over GPT-2's vocabulary keeps what sorting keeps, and where the
    nucleus ends among equal probabilities, the earlier ids are kept."""
    if not kernels.available()[0]:
        pytest.skip(f"gptlab's kernels are not built here: {kernels.available()[2]}")
    logits = torch.randn(2, 50257, generator=torch.Generator().manual_seed(7)) * 1.5
    with kernels.use_kernels(False):
        sorted_kept = top_p_mask(logits, 0.9) > NEG
    ties = torch.tensor([[3.0, 1.0, 1.0, 1.0, 1.0, 0.0]]).log()  # 0.3, four of 0.1, 0 (sum 0.7: normalised)
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "_argsort_descending", None)  # a sort would fail
        patch.setattr(torch, "topk", None)
        for variant in kernels.runnable_variants():
            with kernels.use_variant(variant):
                assert torch.equal(top_p_mask(logits, 0.9) > NEG, sorted_kept), variant  # ~12,000 of 50,257 kept
                # 0.3/0.7 = 0.43, then 0.14 each: ids 1 and 2 reach 0.71; 0.6 needs them, not 3 or 4
                assert (top_p_mask(ties, 0.6) > NEG).tolist() == [[True, True, True, False, False, False]]
    assert 5_000 < int(sorted_kept.sum(-1).min()) and int(sorted_kept.sum(-1).max()) < 45_000


def test_top_p_takes_any_leading_dimensions(nucleus_path):
    """(..., V): a wide row before a narrow one in one (1, 2, V) tensor is masked as alone, and a
    tensor that requires grad is masked the same (its wide row sorted through NumPy)."""
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(5)) * 0.3
    peaked = torch.randn(5000, generator=torch.Generator().manual_seed(6)) * 8.0
    rows = torch.stack([flat, peaked])[None]  # (1, 2, V)
    alone = torch.stack([top_p_mask(flat[None], 0.9)[0], top_p_mask(peaked[None], 0.9)[0]])[None]
    assert torch.equal(top_p_mask(rows, 0.9).isinf(), alone.isinf())
    assert torch.equal(top_p_mask(rows.clone().requires_grad_(), 0.9).isinf(), alone.isinf())  # under autograd too


def test_draw_in_c_gives_the_ids_of_the_pytorch_arithmetic():
    """gl_draw (ops.draw), on every kernel variant: the first id whose float64 cumulative sum
    exceeds u x the row's sum, as torch's cumsum and searchsorted find it, at u on the sums'
    boundaries (exact binary fractions), and through draw() the same ids for the same seed."""
    if not kernels.available()[0]:
        pytest.skip(f"gptlab's kernels are not built here: {kernels.available()[2]}")
    probs = torch.tensor([[0.25, 0.0, 0.25, 0.5]] * 6)
    u = torch.tensor([[0.0], [0.25], [0.5], [0.75], [0.9999], [1.0]], dtype=torch.float64)  # 1.0: past every sum
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=3).squeeze(-1)
    assert expected.tolist() == [0, 2, 3, 3, 3, 3]
    g = torch.Generator().manual_seed(3)
    rows = torch.rand(64, 1000, generator=g) ** 8 * (
        torch.rand(64, 1, generator=g) * 10
    )  # peaked and flat, unnormalized
    rows[::7, 500:] = 0.0
    with kernels.use_kernels(False):
        plain = sampling.draw(rows, torch.Generator().manual_seed(9))
    for variant in kernels.runnable_variants():
        with kernels.use_variant(variant):
            assert ops.draw(probs, u).tolist() == expected.tolist(), variant
            assert torch.equal(sampling.draw(rows, torch.Generator().manual_seed(9)), plain), variant
            assert ops.draw(torch.tensor([[0.5, float("nan")]]), u[:1]) is None  # the caller raises


def test_draw_never_takes_a_zero_and_follows_each_rows_probabilities():
    probs = torch.zeros(3, 50)
    probs[0, [0, 7, 49]] = torch.tensor([0.2, 0.5, 0.3])  # the first and the last entries
    probs[1, 49] = 2.0  # all the mass in the last entry, not normalized
    probs[2, 10:40] = torch.linspace(1.0, 3.0, 30)
    draws = sampling.draw(probs.repeat(10_000, 1), torch.Generator().manual_seed(0)).view(10_000, 3)
    assert set(draws[:, 0].tolist()) == {0, 7, 49} and set(draws[:, 1].tolist()) == {49}
    assert draws[:, 2].min() >= 10 and draws[:, 2].max() < 40
    for row in (0, 2):
        counts = torch.bincount(draws[:, row], minlength=50).double()
        kept = probs[row] > 0
        expected = probs[row].double() / probs[row].sum() * 10_000
        chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
        assert chi2 < 59.7, chi2  # chi-square at p = 0.001, 29 degrees of freedom (row 2); measured 3.5 and 17.8
    for bad in (torch.zeros(1, 4), torch.tensor([[0.5, float("nan"), 0.5]]), torch.tensor([[1.0, float("inf")]])):
        with pytest.raises(ValueError, match="finite and non-negative"):
            sampling.draw(bad)


def test_repetition_penalty_formula_and_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0], [1.0, 1.0, 1.0, 1.0]])
    context = torch.tensor([[0, 1, 1], [3, 3, -1]])  # -1: padding, ignored
    out = apply_repetition_penalty(logits, context, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, -3.0], [1.0, 1.0, 1.0, 0.5]]
    assert torch.equal(apply_repetition_penalty(logits, seen_tokens([[0, 1], [3]], 4), 2.0), out)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(context[:1], logits[:1].clone())
    torch.testing.assert_close(apply_repetition_penalty(logits[:1], context[:1], 1.3), ref)


# --- probabilities and sample_next ---------------------------------------------------------------


def test_probabilities_is_transformers_chain_of_processors():
    """Penalty, temperature, top-k, top-p, min-p in transformers' order, then softmax."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 2
    context = torch.randint(0, 200, (3, 30), generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    chain = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7), TopKLogitsWarper(40),
        TopPLogitsWarper(0.9), MinPLogitsWarper(0.02),
    ])  # fmt: skip
    expected = F.softmax(chain(context, logits.clone()), dim=-1)
    ours = probabilities(logits, params, seen_tokens(context, 200))
    assert ours.dtype == torch.float32 and ours.shape == (3, 200)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    # Temperature alone: softmax(logits / T), sharper below 1.
    torch.testing.assert_close(probabilities(logits, SamplingParams(temperature=0.5)), F.softmax(logits / 0.5, -1))


def test_greedy_is_one_hot_on_the_penalised_argmax():
    logits = torch.tensor([[1.0, 3.0, 2.9], [0.0, -1.0, 5.0]])
    seen = seen_tokens([[1], []], 3)
    params = SamplingParams(temperature=0, repetition_penalty=2.0)  # row 0: 3.0 -> 1.5 < 2.9
    assert probabilities(logits, params, seen).tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
    assert sample_next(logits, params, seen=seen).tolist() == [2, 2]
    assert torch.equal(sample_next(logits, SamplingParams(temperature=0)), logits.argmax(-1))
    with pytest.raises(ValueError, match="seen"):
        probabilities(logits, params)  # the penalty needs the context


def test_sample_next_draws_from_probabilities():
    """Frequencies of 20,000 draws match probabilities() (chi-square over the 6 kept tokens)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.5, -1.0, 2.5, 1.5]])
    params = SamplingParams(temperature=1.3, top_k=6, top_p=0.95, min_p=0.05)
    probs = probabilities(logits, params)[0]
    draws = sample_next(logits.repeat(20_000, 1), params, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=8).double()
    kept = probs > 0
    assert set(draws.unique().tolist()) <= set(kept.nonzero().flatten().tolist())
    expected = probs.double() * 20_000
    chi2 = float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    assert int(kept.sum()) == 6  # top-k keeps 6; top-p 0.95 and min-p 0.05 drop none of them here
    assert chi2 < 20.5, chi2  # chi-square at p = 0.001 with 5 degrees of freedom; measured 6.93 (seed 0)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-30, 1e-3])
def test_tiny_temperature_is_the_argmax_not_nan(temperature):
    """Dividing float32 logits by 1e-300 once gave inf (NaN after the softmax; the server answered 500)."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 5
    probs = probabilities(logits, SamplingParams(temperature=temperature, top_p=0.9, min_p=0.1))
    assert torch.isfinite(probs).all()
    assert torch.equal(probs, F.one_hot(logits.argmax(-1), 300).float())  # gaps here are >> temperature
    assert torch.equal(sample_next(logits, SamplingParams(temperature=temperature, top_k=5)), logits.argmax(-1))


@pytest.mark.parametrize("penalty", [1e-245, 1e300])
def test_extreme_repetition_penalty_stays_finite(penalty):
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.ones(1, 4, dtype=torch.bool)  # every token seen: nothing unpenalised to fall back on
    probs = probabilities(logits, SamplingParams(repetition_penalty=penalty), seen)
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
    assert int(sample_next(logits, SamplingParams(repetition_penalty=penalty), seen=seen)) in range(4)
