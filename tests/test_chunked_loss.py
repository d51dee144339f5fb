"""gptlab.chunked_loss: chunked head + cross-entropy equals the plain computation."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from gptlab import kernels, ops
from gptlab.chunked_loss import _LinearCrossEntropy, linear_cross_entropy, token_logprobs
from gptlab.data import IGNORE
from gptlab.quantize import Int8Linear


@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
def test_matches_plain_cross_entropy_and_its_gradients(chunk_rows):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (3, 7))
    t[0, :3] = IGNORE  # ignored positions
    ref = F.cross_entropy((x @ w.t()).view(-1, 50), t.view(-1), ignore_index=IGNORE)
    gx, gw = torch.autograd.grad(ref, (x, w))
    loss = linear_cross_entropy(x, w, t, chunk_rows=chunk_rows)
    fx, fw = torch.autograd.grad(loss * 1.0, (x, w))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fx, gx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fw, gw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_evaluation_computes_the_loss_without_gradients(mode, monkeypatch):
    """Under torch.no_grad (training's evaluation) the weights still require grad, and a Function's
    needs_input_grad says so; the gradient products must not run anyway (they made an evaluation
    batch cost ~85% of a training step on the Zen 5 held to AVX2). The loss is unchanged."""
    import gptlab.chunked_loss as chunked_loss

    torch.manual_seed(2)
    x = torch.randn(2, 9, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (2, 9))
    calls = []
    accumulate = chunked_loss._accumulate_grads
    monkeypatch.setattr(chunked_loss, "_accumulate_grads", lambda *a, **k: calls.append(1) or accumulate(*a, **k))
    with getattr(torch, mode)():
        loss = linear_cross_entropy(x, w, t, chunk_rows=5)
    assert calls == [] and not loss.requires_grad
    ref = F.cross_entropy((x @ w.t()).view(-1, 50), t.view(-1))
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    linear_cross_entropy(x, w, t, chunk_rows=5).backward()  # with grad: one product pair per chunk
    assert len(calls) == 4 and w.grad is not None


def test_an_incoming_gradient_scales_the_gradients_and_they_accumulate():
    """Backward with a gradient other than 1 (a loss divided over micro-batches, or scaled), twice
    into the same .grad: the gradients of the plain computation. Backward hands out the stored
    gradients themselves when the incoming one is 1; they must not be reused or changed."""
    torch.manual_seed(1)
    x = torch.randn(2, 9, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (2, 9))
    (F.cross_entropy((x @ w.t()).view(-1, 50), t.view(-1)) * 0.25).backward()
    F.cross_entropy((x @ w.t()).view(-1, 50), t.view(-1)).backward()  # .grad: 1.25x the loss's gradients
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (linear_cross_entropy(x, w, t) * 0.25).backward()
    linear_cross_entropy(x, w, t).backward()
    torch.testing.assert_close(x.grad, want[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-5, atol=1e-7)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.skipif(not kernels.available()[0], reason=f"gptlab's kernels are not built here: {kernels.available()[2]}")
def test_the_c_softmax_given_the_maxima_reads_the_logits_once_to_the_same_bits():
    """softmax_exp_ with each column's largest logit given (mm_colmax's) skips its first pass: the
    same exps, losses and inverse sums as when it finds them, on a padded (V, n) view."""
    torch.manual_seed(2)
    logits = torch.randn(1000, 37 + 16)[:, :37] * 4  # (V, n), rows 53 apart
    t = torch.randint(0, 1000, (37,))
    t[3] = IGNORE
    found, given = logits.clone(), logits.clone()
    a = ops.softmax_exp_(found, t)
    b = ops.softmax_exp_(given, t, logits.amax(dim=0))
    assert a is not None and b is not None  # the C softmax ran, on every variant
    assert torch.equal(found, given) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_model_loss_is_the_same_with_and_without_logits():
    model = tiny_model().train()
    idx = torch.randint(0, 97, (2, 12))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    none, chunked = model(idx[:, :-1], idx[:, 1:], return_logits=False)
    assert none is None and logits.shape == (2, 11, 97)
    torch.testing.assert_close(chunked, loss, rtol=1e-6, atol=1e-6)
    chunked.backward()
    g_chunked = model.transformer.wte.weight.grad.clone()
    model.zero_grad()
    loss.backward()
    torch.testing.assert_close(g_chunked, model.transformer.wte.weight.grad, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_stays_close():
    model = tiny_model().train()
    idx = torch.randint(0, 97, (2, 12))
    _, ref = model(idx[:, :-1], idx[:, 1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx[:, :-1], idx[:, 1:], return_logits=False)
    assert loss.dtype == torch.float32
    # Measured: |bf16 - fp32| <= 2.2e-4 over 20 seeds of this model (median 4e-5); all-zero
    # logits would be 0.045 away, so 1e-3 tells a working bf16 path from a broken one. Not 0:
    # the matmuls did run in bf16.
    assert 0 < abs(loss.item() - ref.item()) < 1e-3


def test_bf16_products_in_pytorch_reuse_their_buffers_and_compute_as_fresh_ones(monkeypatch):
    """Where bf16 autocast's head products run in PyTorch (an Intel CPU's oneDNN; forced here by
    GPTLAB_GEMM=torch), W x^T and the rounded e go into one kept bf16 buffer, not fresh ~100 MB
    tensors (page faults: a demo step 164 -> 116 ms on the Intel Xeon 6/207). Two calls in a row,
    chunks of 16, 16 and 5 rows: the same loss and gradients, bit for bit, as with fresh buffers,
    and within bf16's rounding of the fp32 computation."""
    import gptlab.chunked_loss as chunked_loss

    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    kept = chunked_loss._workspace

    def run(seed):
        x, w, t = head_inputs(seed=seed, ignored=[3])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_and_grads(lambda: linear_cross_entropy(x, w, t, chunk_rows=16), x, w)

    asked = []
    monkeypatch.setattr(chunked_loss, "_workspace", lambda *a: asked.append(a[3:]) or kept(*a))
    got = [run(seed) for seed in (3, 4)]
    assert asked.count((torch.bfloat16,)) == 2 * 2 * 3  # two calls x 3 chunks: the product, then e
    buffer = chunked_loss._WORKSPACE[torch.device("cpu"), torch.bfloat16]
    outs, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: outs.append(k.get("out")) or mm(*a, **k))
    assert run(4) and chunked_loss._WORKSPACE[torch.device("cpu"), torch.bfloat16] is buffer  # kept
    products = [o for o in outs if o is not None and o.dtype is torch.bfloat16]  # W x^T, chunk by chunk
    assert len(products) == 3 and all(o.data_ptr() == buffer.data_ptr() for o in products)
    monkeypatch.setattr(torch, "mm", mm)
    fresh = lambda rows, vocab, device, dtype=torch.float32: (  # noqa: E731
        kept(rows, vocab, device) if dtype is torch.float32 else torch.empty(vocab, rows, dtype=dtype)
    )
    monkeypatch.setattr(chunked_loss, "_workspace", fresh)
    for seed, (loss, grads) in zip((3, 4), got, strict=True):
        ref_loss, ref_grads = run(seed)
        assert torch.equal(loss, ref_loss) and all(map(torch.equal, grads, ref_grads))
        x, w, t = head_inputs(seed=seed, ignored=[3])
        fp32 = loss_and_grads(lambda: linear_cross_entropy(x, w, t), x, w)  # noqa: B023
        # measured over seeds 3-8: the loss 1.4e-5 to 5.2e-4 relative, gradients 5.2e-3 to 1.4e-2
        # of their largest element
        assert abs(loss - fp32[0]) <= 5e-3 * fp32[0].abs()
        for g, r in zip(grads, fp32[1], strict=True):
            assert (g - r).abs().max() <= 4e-2 * r.abs().max()


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.skipif(not kernels.available()[0], reason=f"gptlab's kernels are not built here: {kernels.available()[2]}")
def test_the_c_softmax_runs_and_agrees_with_pytorchs(monkeypatch):
    """On CPU the chunk's softmax and loss are one C call (ops.softmax_exp_); the
    PyTorch ops it replaces give the same numbers (measured: the loss equal, gradients within
    2.4e-7 of their largest value; a softmax that forgets the one-hot, the max, the masked tail or
    the ignored rows fails here or in the test above)."""
    calls = []
    real = ops.softmax_exp_
    monkeypatch.setattr(ops, "softmax_exp_", lambda *a: calls.append(1) or real(*a))
    x, w, t = head_inputs(seed=1, ignored=[5])
    got = loss_and_grads(lambda: linear_cross_entropy(x, w, t, chunk_rows=16), x, w)
    assert len(calls) == 3  # chunks of 16, 16 and 5 rows
    with kernels.use_kernels(False):
        ref = loss_and_grads(lambda: linear_cross_entropy(x, w, t, chunk_rows=16), x, w)
    assert_same_loss_and_grads(got, ref)


def head_inputs(seed: int, ignored: list[int]):
    """37 rows of 16 features, a head over 1,000 tokens (not a multiple of 16), targets with the
    `ignored` rows set to IGNORE."""
    torch.manual_seed(seed)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(1000, 16, requires_grad=True)
    t = torch.randint(0, 1000, (37,))
    t[ignored] = IGNORE
    return x, w, t


def loss_and_grads(loss_fn, x, w):
    loss = loss_fn()
    return loss, torch.autograd.grad(loss, (x, w))


def assert_same_loss_and_grads(got, ref):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("c_kernels", [True, False])
def test_a_target_outside_the_vocabulary_is_refused(c_kernels):
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    for bad in (10, -1):
        t = torch.tensor([1, 2, bad, 3])
        with kernels.use_kernels(c_kernels), pytest.raises(ValueError, match=f"target {bad} outside the vocabulary"):
            linear_cross_entropy(x, w, t)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.skipif(not kernels.available()[0], reason=f"gptlab's kernels are not built here: {kernels.available()[2]}")
def test_the_c_softmax_refuses_a_target_outside_the_vocabulary():
    """Called directly (linear_cross_entropy checks first), the kernel never writes past a row."""
    with pytest.raises(ValueError, match="target 10 outside the vocabulary"):
        ops.softmax_xent_(torch.randn(10, 3), torch.tensor([1, 10, IGNORE]))  # (V, n)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("c_kernels", [True, False])
@pytest.mark.parametrize("head_kind", ["fp32", "bf16", "int8"])
def test_token_logprobs_are_log_softmax_at_the_targets(c_kernels, head_kind):
    """Scoring's head (token_logprobs: chunked, transposed, the C cross-entropy without its
    gradient) against log_softmax of the whole logits: the target's log-probability and whether
    it is the argmax (measured: 9.5e-7 apart, fp32, bf16 and int8; a kernel that keeps its
    gradient pass, or takes the peak of one thread's rows, fails here)."""
    torch.manual_seed(3)
    head = torch.nn.Linear(16, 1000, bias=False)  # a vocabulary that is not a multiple of 16
    x = torch.randn(37, 16)
    if head_kind == "bf16":
        head, x = head.to(torch.bfloat16), x.to(torch.bfloat16)
    elif head_kind == "int8":
        head = Int8Linear.from_linear(head)
    with torch.no_grad():
        logits = head(x).float()  # (37, 1000)
    t = torch.randint(0, 1000, (37,))
    t[::3] = logits.argmax(-1)[::3]  # a third of the targets are the greedy token
    t[1::3] = logits[:, :500].argmax(-1)[1::3]  # a third the largest of the half one thread streams
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the C kernel splits the vocabulary between its threads
    try:
        with kernels.use_kernels(c_kernels):
            logprob, greedy = token_logprobs(x, head, t, chunk_rows=16)
    finally:
        torch.set_num_threads(threads)
    ref = F.log_softmax(logits, dim=-1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(logprob, ref, rtol=0, atol=1e-5)
    assert torch.equal(greedy, logits.argmax(-1) == t) and greedy[::3].all()


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.skipif(not kernels.available()[0], reason=f"gptlab's kernels are not built here: {kernels.available()[2]}")
@pytest.mark.parametrize("grad", [True, False])
def test_the_c_softmax_keeps_a_long_tail_of_tiny_probabilities(grad):
    """A trained model's logits: a few near the top, fifty thousand ~20 below. Each tail term is
    under half a unit in the last place of a running sum near 1, so plain summation drops them
    all (measured here: the loss 1.2e-4 off); compensated summation keeps them (measured: 1.6e-7;
    PyTorch's fp32 log_softmax is 3.7e-5 off)."""
    torch.manual_seed(4)
    V, n = 50257, 16
    logits = torch.randn(n, V) * 2 - 20  # (n, V)
    logits[:, :3] = torch.randn(n, 3)
    targets = torch.randint(0, 3, (n,))
    exact = -torch.log_softmax(logits.double(), -1).gather(1, targets[:, None]).squeeze(1)  # (n,)
    z = logits.t().contiguous()  # (V, n)
    loss = ops.softmax_xent_(z, targets) if grad else ops.cross_entropy_t(z, targets)[0]
    assert (loss.double() - exact).abs().max() < 1e-6


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.skipif(not kernels.available()[0], reason=f"gptlab's kernels are not built here: {kernels.available()[2]}")
def test_the_c_softmax_gradient_is_softmax_minus_one_hot_and_zero_where_ignored():
    """ops.softmax_xent_ (softmax_exp_ finished): the logits become softmax - onehot, an
    ignored row's column all zeros, and the losses are cross_entropy's (measured: gradients 6e-8
    apart, losses 1.9e-6 on values ~10)."""
    torch.manual_seed(5)
    V, n = 1000, 37
    logits = torch.randn(n, V) * 3  # (n, V)
    t = torch.randint(0, V, (n,))
    t[[2, 30]] = IGNORE
    z = logits.t().contiguous()  # (V, n)
    loss = ops.softmax_xent_(z, t)
    ref = torch.softmax(logits, -1) - F.one_hot(t.clamp_min(0), V)  # (n, V)
    ref[t == IGNORE] = 0.0
    torch.testing.assert_close(z.t(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, F.cross_entropy(logits, t, reduction="none"), rtol=1e-6, atol=1e-5)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("c_kernels", [True, False])
def test_ignored_rows_inside_a_chunk_count_for_nothing(c_kernels):
    """linear_cross_entropy drops ignored rows before the head; the chunk's own masking (the C
    kernel's inv = 0, PyTorch's `valid`) still has to hold when they reach it, as they do here."""
    x, w, t = head_inputs(seed=6, ignored=[0, 17, 36])
    with kernels.use_kernels(c_kernels):
        got = loss_and_grads(lambda: _LinearCrossEntropy.apply(x, w, t, torch.float32, 16, True), x, w)
    assert_same_loss_and_grads(got, loss_and_grads(lambda: F.cross_entropy(x @ w.t(), t), x, w))


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("c_kernels", [True, False])
def test_a_batch_with_every_target_ignored_has_zero_loss_and_gradients(c_kernels):
    """No row reaches the head (an SFT batch of prompts only): loss 0 and zero gradients, not the
    uninitialized buffer the first chunk would otherwise have overwritten."""
    torch.manual_seed(7)
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.randn(1000, 16, requires_grad=True)
    t = torch.full((2, 5), IGNORE)
    with kernels.use_kernels(c_kernels):
        loss = linear_cross_entropy(x, w, t)
        gx, gw = torch.autograd.grad(loss, (x, w))
    assert loss.item() == 0.0
    assert torch.equal(gx, torch.zeros_like(gx)) and torch.equal(gw, torch.zeros_like(gw))
