"""gptlab's fp32 GEMM (kernels.mm, gl_sgemm in csrc/gemm.c): the training head's products, on every
kernel variant this CPU runs, against float64; which GEMM runs; and the chunked loss through it."""

import pytest
import torch

from gptlab import kernels
from gptlab.chunked_loss import linear_cross_entropy

pytestmark = pytest.mark.skipif(not kernels.available()[0], reason=f"no kernels built: {kernels.available()[2]}")

# (M, N, K, a transposed, b transposed): the head's three layouts at small sizes (W x^T, e^T W, e x),
# depths over one packed block (256), B packed whole and a block at a time (over 2 MB), columns past
# one block (4,096), edge tiles of every size.
SHAPES = [
    (1, 1, 1, False, False),
    (7, 5, 3, False, False),
    (301, 40, 16, False, True),
    (40, 16, 301, True, False),
    (301, 16, 40, False, False),
    (150, 33, 600, False, False),
    (50, 700, 800, True, True),
    (3, 4100, 20, False, True),
]


def operands(M, N, K, a_t, b_t, seed=0):
    """a (M, K) and b (K, N) fp32, each a transposed view of a contiguous tensor when asked."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(K, M, generator=g).t() if a_t else torch.randn(M, K, generator=g)
    b = torch.randn(N, K, generator=g).t() if b_t else torch.randn(K, N, generator=g)
    return a, b


def assert_close_to_float64(got, want64, a, b, c=None):
    """Within 1e-6 of each element's sum of |a b| (+ |c|, what it added to): fp32 sums in another
    order, measured <= 2e-7."""
    scale = a.double().abs() @ b.double().abs() + (0 if c is None else c.double().abs())
    worst = ((got.double() - want64).abs() / scale.clamp_min(1e-30)).max().item()
    assert worst < 1e-6, worst


@pytest.fixture
def gptlab_gemm(monkeypatch):
    monkeypatch.setenv("GPTLAB_GEMM", "gptlab")
    calls = []  # per kernels.mm call: whether gl_sgemm ran
    monkeypatch.setattr(kernels, "_sgemm_runs", _spy(kernels._sgemm_runs, calls))
    return calls


def _spy(fn, calls):
    def wrapped(*args):
        ran = fn(*args)
        calls.append(ran)
        return ran

    return wrapped


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + "aT" * s[3] + "bT" * s[4])
def test_sgemm_is_the_product_on_every_variant(gptlab_gemm, shape, accumulate):
    a, b = operands(*shape)
    out = torch.randn(shape[0], shape[1])
    before = out.clone() if accumulate else None
    want = a.double() @ b.double() + (before.double() if accumulate else 0)
    kernels.mm(a, b, out, accumulate=accumulate)
    assert gptlab_gemm == [True]  # gl_sgemm ran, not torch.mm
    assert_close_to_float64(out, want, a, b, before)


@pytest.mark.usefixtures("kernel_variant")
def test_sgemm_writes_only_its_own_rows_and_columns(gptlab_gemm):
    """out may be a view into a wider buffer (its row stride): nothing outside it changes."""
    a, b = operands(37, 21, 300, False, False)
    buf = torch.full((40, 30), 7.0)
    out = buf[2:39, 3:24]
    kernels.mm(a, b, out)
    assert_close_to_float64(out, a.double() @ b.double(), a, b)
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[2:39, 3:24] = False
    assert (buf[outside] == 7.0).all()


def test_sgemm_gives_the_same_bits_on_any_number_of_threads(gptlab_gemm):
    a, b = operands(301, 40, 600, True, False)
    results = []
    for threads in (1, 2, 3):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append(kernels.mm(a, b, torch.empty(301, 40)))
        finally:
            torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_gemm_choice(monkeypatch):
    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    assert kernels.gemm_choice() == "torch"
    monkeypatch.setenv("GPTLAB_GEMM", "bogus")
    with pytest.raises(ValueError, match="GPTLAB_GEMM='bogus'"):
        kernels.gemm_choice()
    monkeypatch.delenv("GPTLAB_GEMM")
    monkeypatch.setattr(kernels, "variant", lambda: "avx2")
    monkeypatch.setattr(kernels.kernel_build, "is_x86", lambda: True)
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "AuthenticAMD")
    assert kernels.gemm_choice() == "gptlab"  # MKL's slow products on AMD (module docstring)
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "GenuineIntel")
    assert kernels.gemm_choice() == "torch"  # MKL on Intel: not measured against ours, kept
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(kernels, "variant", lambda: "portable")
    assert kernels.gemm_choice() == "torch"  # no SIMD: PyTorch's BLAS is faster than plain C
    monkeypatch.setattr(kernels, "variant", lambda: "neon")
    monkeypatch.setattr(kernels.kernel_build, "is_x86", lambda: False)
    assert kernels.gemm_choice() == "torch"


def test_mm_falls_back_to_torch_where_sgemm_does_not_apply(gptlab_gemm, monkeypatch):
    a, b = operands(9, 8, 7, False, False)
    out = torch.empty(8, 9).t()  # columns not contiguous: torch.mm writes it
    kernels.mm(a, b, out)
    torch.testing.assert_close(out, a @ b)
    ad = a.double()
    outd = torch.empty(9, 8, dtype=torch.float64)
    kernels.mm(ad, b.double(), outd)
    torch.testing.assert_close(outd, ad @ b.double())
    monkeypatch.setenv("GPTLAB_GEMM", "torch")  # chosen off
    kernels.mm(a, b, torch.empty(9, 8))
    assert gptlab_gemm == [False, False, False]


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("chunk_rows", [16, 1024])
def test_the_chunked_loss_through_sgemm_equals_pytorchs(monkeypatch, gptlab_gemm, chunk_rows):
    """The head's three products per chunk in gl_sgemm (the weight's gradient accumulated over
    chunks): loss and gradients as with torch.mm (measured: loss equal to 1e-7, gradients 3e-7)."""
    torch.manual_seed(3)
    x = torch.randn(37, 24, requires_grad=True)
    w = torch.randn(1000, 24, requires_grad=True)
    t = torch.randint(0, 1000, (37,))
    t[[4, 30]] = -100
    loss = linear_cross_entropy(x, w, t, chunk_rows=chunk_rows)
    got = (loss, *torch.autograd.grad(loss, (x, w)))
    chunks = -(-37 // chunk_rows)
    assert gptlab_gemm.count(True) == 3 * chunks
    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    loss = linear_cross_entropy(x, w, t, chunk_rows=chunk_rows)
    ref = (loss, *torch.autograd.grad(loss, (x, w)))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=0)
    for g, r in zip(got[1:], ref[1:], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
