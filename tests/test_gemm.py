"""gptlab's fp32 GEMM (gemm.mm, gl_sgemm in csrc/gemm.c): the training head's products, on every
kernel variant this CPU runs, against float64; which GEMM runs; and the chunked loss through it."""

import pytest
import torch

from gptlab import cpu, gemm, kernels
from gptlab.chunked_loss import linear_cross_entropy
from gptlab.data import IGNORE

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
    calls = []  # per gemm.mm call: whether gl_sgemm ran
    monkeypatch.setattr(gemm, "_sgemm_runs", _spy(gemm._sgemm_runs, calls))
    return calls


def _spy(fn, calls):
    def wrapped(*args):
        ran = fn(*args)
        calls.append(ran)
        return ran

    return wrapped


def added(out: torch.Tensor, accumulate: bool, bias: torch.Tensor | None) -> torch.Tensor | None:
    """What mm adds to the product: out's values when accumulating, plus the bias on every row."""
    if not accumulate and bias is None:
        return None
    return (out.clone() if accumulate else torch.zeros_like(out)) + (0 if bias is None else bias)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + "aT" * s[3] + "bT" * s[4])
def test_sgemm_is_the_product_on_every_variant(gptlab_gemm, shape, accumulate, with_bias):
    """(+)= a b, plus a bias on every row (in the tiles' first block over K: once, past 4,096
    columns too)."""
    a, b = operands(*shape)
    out = torch.randn(shape[0], shape[1])
    bias = torch.randn(shape[1]) if with_bias else None
    before = added(out, accumulate, bias)
    want = a.double() @ b.double() + (0 if before is None else before.double())
    gemm.mm(a, b, out, accumulate=accumulate, bias=bias)
    assert gptlab_gemm == [True]  # gl_sgemm ran, not torch.mm
    assert_close_to_float64(out, want, a, b, before)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + "aT" * s[3] + "bT" * s[4])
def test_sgemm_of_a_bf16_b_is_the_product_of_b_widened(gptlab_gemm, shape, monkeypatch):
    """b stored as bf16 (a bf16 layer's weight): gl_sgemm_bf16_b widens it as it packs it, the same
    fp32 product as of b.float(): within fp32 summation of the exact one, and bit-equal to gl_sgemm's
    on the widened copy."""
    a, b = operands(*shape)
    b16 = b.bfloat16()
    out, bias = torch.randn(shape[0], shape[1]), torch.randn(shape[1])
    before = out.clone() + bias
    want = a.double() @ b16.double() + before.double()
    widened = out.clone()
    gemm.mm(a, b16, out, accumulate=True, bias=bias)
    gemm.mm(a, b16.float(), widened, accumulate=True, bias=bias)
    assert gptlab_gemm == [True, True]
    assert_close_to_float64(out, want, a, b16.float(), before)
    assert torch.equal(out, widened)
    monkeypatch.setenv("GPTLAB_GEMM", "torch")  # PyTorch's product of the widened b
    torch.testing.assert_close(gemm.mm(a, b16, torch.empty(shape[0], shape[1])), a @ b16.float())


@pytest.mark.usefixtures("kernel_variant")
def test_sgemm_writes_only_its_own_rows_and_columns(gptlab_gemm):
    """out may be a view into a wider buffer (its row stride): nothing outside it changes."""
    a, b = operands(37, 21, 300, False, False)
    buf = torch.full((40, 30), 7.0)
    out = buf[2:39, 3:24]
    gemm.mm(a, b, out)
    assert_close_to_float64(out, a.double() @ b.double(), a, b)
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[2:39, 3:24] = False
    assert (buf[outside] == 7.0).all()


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + "aT" * s[3] + "bT" * s[4])
def test_mm_colmax_is_the_product_and_the_largest_of_each_column(gptlab_gemm, shape):
    """mm_colmax (the head's W x^T with what its softmax needs): the same bits as mm's product, and
    each column's largest value, found tile by tile (B whole and in blocks, edge tiles, columns
    past one block of B); out a view into a wider buffer, as the chunked loss's padded workspace."""
    a, b = operands(*shape)
    want = gemm.mm(a, b, torch.empty(shape[0], shape[1]))
    out = torch.full((shape[0], shape[1] + 5), 7.0)[:, : shape[1]]
    top = gemm.mm_colmax(a, b, out)
    assert gptlab_gemm == [True, True]
    assert torch.equal(out, want)
    assert torch.equal(top, want.amax(dim=0))


# (M, N, K) of a prompt's layer, y = x W^T + b in gl_sgemm_nt: one row, edge tiles of every size
# (MR = 6 rows of W; 16 or 32 rows of x, the last panel of x^T at most one vector wide, so half a
# tile, for 1, 5, 17 and 40 rows with AVX2's 16 columns, 1, 5 and 40 with AVX-512's 32; split, half
# a tile and dot products, for 10 and 12 rows with 16 columns, 17 and 24 with 32), W's rows past
# the transpose's blocks of 8, depths over one packed block (256) and not a multiple of 8, and
# NT_ROWS rows (against 4,100 rows of W: y^T in two slabs of 8 MB, the second 4 rows).
NT_SHAPES = [
    (1, 1, 1),
    (5, 7, 3),
    (10, 43, 300),
    (12, 43, 300),
    (17, 70, 96),
    (24, 43, 300),
    (40, 301, 600),
    (64, 33, 257),
    (gemm.NT_ROWS, 4100, 20),
]


def split_panel(M: int) -> bool:
    """Whether gl_sgemm_nt splits x^T's last panel (csrc/gemm_f32.c's split_panel): its rows past one
    vector (VW = half the tile's columns), at most VW / 2 of them, are dot products along k."""
    columns = kernels.gemm_columns()
    rest = (M - 1) % columns + 1
    return columns // 2 < rest <= columns // 2 + columns // 4


def linear_operands(M, N, K, seed=0):
    """x (M, K) a view whose rows are K + 5 apart, W (N, K), b (N,)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K + 5, generator=g)[:, :K], torch.randn(N, K, generator=g), torch.randn(N, generator=g)


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", NT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sgemm_nt_is_the_linear_layer_on_every_variant(shape, with_bias, calls, gptlab_gemm):
    """Up to NT_ROWS rows, sgemm_linear reads the weight in place (gl_sgemm_nt: y^T = W x^T, then
    transposed, with the bias): within fp32 summation of the float64 layer, x's row stride honoured."""
    x, w, b = linear_operands(*shape)
    b = b if with_bias else None
    y = gemm.sgemm_linear(x.unsqueeze(0), w, b)  # (1, M, N)
    assert calls == {"gl_sgemm_nt": 1}
    assert y.shape == (1, shape[0], shape[1])
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert_close_to_float64(y[0], want, x, w.t(), None if b is None else b.expand(shape[0], -1))
    if b is None and not split_panel(shape[0]):  # each element sums over k in gl_sgemm's tiles' order
        assert torch.equal(y[0], gemm.mm(x, w.t(), torch.empty(shape[0], shape[1])))


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("x_bf16", [False, True])
@pytest.mark.parametrize("shape", NT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sgemm_nt_of_a_bf16_weight_is_the_product_of_it_widened(shape, x_bf16, calls):
    """A bf16 layer's weight (and x, a bf16 model's activations) up to NT_ROWS rows, widened a
    block of W's rows at a time and then read as fp32 weights are: the same bits as the fp32
    product of the widened copies. Asked for bf16 y, gl_sgemm_nt rounds it as it writes it: the
    same bits as torch's rounding of the fp32 y, a NaN, infinities and an overflow included."""
    x, w, b = linear_operands(*shape)
    w16, x = w.bfloat16(), x.bfloat16() if x_bf16 else x
    nan = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)  # rounding it as a number gives -0.0
    b[:3] = torch.stack([nan, torch.tensor(-float("inf")), torch.tensor(3.4e38)])[: shape[1]]  # 3.4e38 -> bf16 inf
    y = gemm.sgemm_linear(x, w16, b)
    assert calls == {"gl_sgemm_nt": 1}
    torch.testing.assert_close(y, gemm.sgemm_linear(x.float(), w16.float(), b), rtol=0, atol=0, equal_nan=True)
    y16 = gemm.sgemm_linear(x, w16, b, torch.bfloat16)
    assert calls == {"gl_sgemm_nt": 3} and y16.dtype is torch.bfloat16
    torch.testing.assert_close(y16, y.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


def test_sgemm_nt_gives_the_same_bits_on_any_number_of_threads(calls):
    """Threads split W's rows: each element sums in one thread's order, whatever their number."""
    x, w, b = linear_operands(100, 301, 600)
    results = on_threads(lambda: gemm.sgemm_linear(x, w, b))
    assert calls == {"gl_sgemm_nt": 3}
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_mm_colmax_is_none_where_gptlabs_gemm_does_not_run(monkeypatch):
    """Where PyTorch's BLAS multiplies (GPTLAB_GEMM=torch), out is left alone and the softmax finds
    the maxima itself."""
    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    a, b = operands(30, 20, 10, False, True)
    out = torch.full((30, 20), 7.0)
    assert gemm.mm_colmax(a, b, out) is None
    assert (out == 7.0).all()


# Threads split a tall product by rows (the head's), a wide one whose B is packed in blocks by
# columns (a prompt's layers: x W^T, W stored (N, K)).
THREAD_SHAPES = [(301, 40, 600, True, False), (50, 700, 800, False, True)]


def on_threads(fn, threads=(1, 2, 3)) -> list[torch.Tensor]:
    """fn() run on each number of torch threads, the count restored after each."""
    results = []
    for n in threads:
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            results.append(fn())
        finally:
            torch.set_num_threads(before)
    return results


def products_on_threads(bf16: bool, shape, threads=(1, 2, 3)) -> list[torch.Tensor]:
    """The same product through gemm.mm on each number of threads, accumulated onto the same C."""
    a, b = operands(*shape)
    c = torch.randn(shape[0], shape[1], generator=torch.Generator().manual_seed(1))
    return on_threads(lambda: gemm.mm(a, b, c.clone(), accumulate=True, bf16=bf16), threads)


@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=["rows", "columns"])
def test_sgemm_gives_the_same_bits_on_any_number_of_threads(gptlab_gemm, shape):
    first, *others = products_on_threads(bf16=False, shape=shape)
    assert all(torch.equal(first, r) for r in others)
    a, b = operands(*shape)
    c = torch.randn(shape[0], shape[1], generator=torch.Generator().manual_seed(1))
    assert_close_to_float64(first, a.double() @ b.double() + c.double(), a, b, c)


def test_gemm_choice(monkeypatch):
    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    assert gemm.gemm_choice() == "torch"
    monkeypatch.setenv("GPTLAB_GEMM", "bogus")
    with pytest.raises(ValueError, match="GPTLAB_GEMM='bogus'"):
        gemm.gemm_choice()
    monkeypatch.delenv("GPTLAB_GEMM")
    monkeypatch.setattr(kernels, "variant", lambda: "avx2")
    monkeypatch.setattr(kernels.kernel_build, "is_x86", lambda: True)
    monkeypatch.setattr(cpu, "vendor", lambda: "AuthenticAMD")
    assert gemm.gemm_choice() == "gptlab"  # MKL's slow products on AMD (module docstring)
    # Intel's CPUs: measured (test_gemm_probe.py)
    monkeypatch.setattr(kernels, "variant", lambda: "portable")
    assert gemm.gemm_choice() == "torch"  # no SIMD: PyTorch's BLAS is faster than plain C
    monkeypatch.setattr(kernels, "variant", lambda: "neon")
    monkeypatch.setattr(kernels.kernel_build, "is_x86", lambda: False)
    assert gemm.gemm_choice() == "torch"


def test_mm_falls_back_to_torch_where_sgemm_does_not_apply(gptlab_gemm, monkeypatch):
    a, b = operands(9, 8, 7, False, False)
    out = torch.empty(8, 9).t()  # columns not contiguous: torch.mm writes it
    gemm.mm(a, b, out)
    torch.testing.assert_close(out, a @ b)
    ad = a.double()
    outd = torch.empty(9, 8, dtype=torch.float64)
    gemm.mm(ad, b.double(), outd)
    torch.testing.assert_close(outd, ad @ b.double())
    monkeypatch.setenv("GPTLAB_GEMM", "torch")  # chosen off
    out, bias = torch.randn(9, 8), torch.randn(8)
    want = out + a @ b + bias
    torch.testing.assert_close(gemm.mm(a, b, out, accumulate=True, bias=bias), want)
    assert gptlab_gemm == [False, False, False]
    with pytest.raises(ValueError, match=r"bias must be a contiguous fp32 \(8,\), not torch.float32 \(9,\)"):
        gemm.mm(a, b, out, bias=torch.randn(9))


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + "aT" * s[3] + "bT" * s[4])
def test_sgemm_of_bf16_a_and_b_is_the_product_of_both_widened(gptlab_gemm, shape, monkeypatch):
    """a and b stored as bf16 (a bf16 model's activations and weight, a long prompt): gl_sgemm_bf16_ab
    widens both as it packs them, the same bits as gl_sgemm on the widened copies; PyTorch's
    product of the widened copies where gptlab's GEMM does not run."""
    a, b = operands(*shape)
    a16, b16 = a.bfloat16(), b.bfloat16()
    bias = torch.randn(shape[1])
    out, widened = torch.empty(shape[0], shape[1]), torch.empty(shape[0], shape[1])
    gemm.mm(a16, b16, out, bias=bias)
    gemm.mm(a16.float(), b16.float(), widened, bias=bias)
    assert gptlab_gemm == [True, True]
    assert torch.equal(out, widened)
    assert_close_to_float64(out, a16.double() @ b16.double() + bias.double(), a16.float(), b16.float(), bias)
    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    torch.testing.assert_close(gemm.mm(a16, b16, torch.empty(shape[0], shape[1])), a16.float() @ b16.float())


@pytest.mark.usefixtures("kernel_variant")
@pytest.mark.parametrize("chunk_rows", [16, 1024])
def test_the_chunked_loss_through_sgemm_equals_pytorchs(monkeypatch, gptlab_gemm, chunk_rows):
    """The head's three products per chunk in gl_sgemm (the weight's gradient accumulated over
    chunks): loss and gradients as with torch.mm (measured: loss equal to 1e-7, gradients 3e-7)."""
    torch.manual_seed(3)
    x = torch.randn(37, 24, requires_grad=True)
    w = torch.randn(1000, 24, requires_grad=True)
    t = torch.randint(0, 1000, (37,))
    t[[4, 30]] = IGNORE
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


# ------------------------------------------------------------------------------------------------
# bf16 products (gemm.mm(bf16=True), gl_gemm_bf16): bf16 autocast's head on CPUs with AVX512-BF16


def _bf16_variants() -> list[str]:
    """The variants that run gl_gemm_bf16 on this CPU (none without AVX512-BF16: the feature has no
    code to run there, and mm(bf16=True) falls back to torch's product, tested below everywhere)."""
    found = []
    for v in kernels.runnable_variants():
        with kernels.use_variant(v) as lib:
            if lib.lib is not None and lib.lib.gl_has_gemm_bf16():
                found.append(v)
    return found


BF16_VARIANTS = _bf16_variants()


@pytest.fixture(params=BF16_VARIANTS)
def bf16_gemm(request, monkeypatch):
    """Each variant that has gl_gemm_bf16 here, active, with a record of each mm(bf16=True) call:
    whether gl_gemm_bf16 ran it."""
    monkeypatch.setenv("GPTLAB_GEMM", "gptlab")
    calls = []
    monkeypatch.setattr(gemm, "gemm_bf16_runs", _spy(gemm.gemm_bf16_runs, calls))
    with kernels.use_variant(request.param):
        yield calls


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().double()


def test_gemm_bf16_runs_where_the_cpu_has_avx512_bf16():
    """Not a flag silently off: with AVX512-BF16 and an AVX-512 variant (and gptlab's GEMM chosen),
    mm(bf16=True) multiplies in gl_gemm_bf16."""
    has = "avx512bf16" in kernels.cpu_features()
    expected = [v for v in kernels.runnable_variants() if has and v in ("avx512", "avx512-256")]
    assert BF16_VARIANTS == expected


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + "aT" * s[3] + "bT" * s[4])
def test_gemm_bf16_is_the_product_of_bf16_operands(bf16_gemm, shape, accumulate, with_bias):
    """Both packings of A (its rows adjacent: by k; else by rows), odd depths (a pair half past K),
    edge tiles (12 x 32), B whole and blocked, a bias (fp32): the float64 product of the
    bf16-rounded operands, to fp32 summation (measured <= 2.2e-7 of each element's sum of |a b|)."""
    a, b = operands(*shape)
    out = torch.randn(shape[0], shape[1])
    bias = torch.randn(shape[1]) if with_bias else None
    before = added(out, accumulate, bias)
    want = bf16_rounded(a) @ bf16_rounded(b) + (0 if before is None else before.double())
    gemm.mm(a, b, out, accumulate=accumulate, bf16=True, bias=bias)
    assert bf16_gemm == [True]
    assert_close_to_float64(out, want, bf16_rounded(a), bf16_rounded(b), before)


def test_mm_colmax_in_bf16_is_the_bf16_product_and_its_columns_maxima(bf16_gemm):
    a, b = operands(301, 40, 16, False, True)
    want = gemm.mm(a, b, torch.empty(301, 40), bf16=True)
    out = torch.empty(301, 40)
    top = gemm.mm_colmax(a, b, out, bf16=True)
    assert bf16_gemm == [True, True]
    assert torch.equal(out, want) and torch.equal(top, want.amax(dim=0))


def test_gemm_bf16_takes_any_strides_and_writes_only_its_own_part(bf16_gemm):
    """A with neither rows nor columns adjacent (every other column), out a view into a wider buffer."""
    a = torch.randn(29, 2 * 301)[:, ::2]  # (29, 301), strides (602, 2)
    b = torch.randn(301, 45)
    buf = torch.full((33, 50), 7.0)
    out = buf[1:30, 2:47]
    gemm.mm(a, b, out, bf16=True)
    assert_close_to_float64(out, bf16_rounded(a) @ bf16_rounded(b), bf16_rounded(a), bf16_rounded(b))
    outside = torch.ones_like(buf, dtype=torch.bool)
    outside[1:30, 2:47] = False
    assert (buf[outside] == 7.0).all()


def test_gemm_bf16_rounds_to_nearest_even_and_keeps_nan(bf16_gemm):
    """1 + 2^-8 lies halfway between two bf16 values and rounds to the even one (1.0), 1 + 3 2^-9 up
    (truncating gives 1.0); a NaN whose payload is in the low bits only stays NaN (rounding its bits
    as a number's would make it infinite)."""
    a = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-9, 1 + 2**-7 + 2**-8]])  # (1, 3)
    out = gemm.mm(a, torch.eye(3), torch.empty(1, 3), bf16=True)
    assert out.tolist() == [[1.0, 1 + 2**-7, 1 + 2**-6]] == a.bfloat16().float().tolist()
    nan = torch.tensor([[0x7F800001]], dtype=torch.int32).view(torch.float32)  # (1, 1)
    out = gemm.mm(nan, torch.ones(1, 1), torch.empty(1, 1), bf16=True)
    assert out.isnan().all()


@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=["rows", "columns"])
def test_gemm_bf16_gives_the_same_bits_on_any_number_of_threads(bf16_gemm, shape):
    first, *others = products_on_threads(bf16=True, shape=shape)
    assert all(torch.equal(first, r) for r in others)


@pytest.mark.parametrize("accumulate", [False, True])
def test_mm_bf16_without_the_kernel_is_torchs_bf16_product(monkeypatch, accumulate):
    """Where gl_gemm_bf16 does not run (no AVX512-BF16, or GPTLAB_GEMM=torch): torch's bf16 product,
    the same values (bf16 products are exact in fp32; sums to fp32 rounding: <= 1e-6 measured)."""
    monkeypatch.setenv("GPTLAB_GEMM", "torch")
    assert not gemm.gemm_bf16_runs()
    a, b = operands(37, 45, 300, True, False)
    out = torch.randn(37, 45)
    before = out.clone()
    gemm.mm(a, b, out, accumulate=accumulate, bf16=True)
    want = bf16_rounded(a) @ bf16_rounded(b) + (before.double() if accumulate else 0)
    # torch's bf16 matmul rounds its result to bf16 (2^-9 relative), then out adds it in fp32
    scale = bf16_rounded(a).abs() @ bf16_rounded(b).abs() + (before.double().abs() if accumulate else 0)
    assert ((out.double() - want).abs() / scale).max() < 2**-8
    with pytest.raises(ValueError, match="fp32 operands"):
        gemm.mm(a.bfloat16(), b.bfloat16(), out, bf16=True)


@pytest.mark.parametrize("chunk_rows", [16, 1024])
def test_the_chunked_loss_under_bf16_autocast_through_gemm_bf16(bf16_gemm, chunk_rows):
    """bf16 autocast's head in gl_gemm_bf16: the loss of the bf16-rounded x and weight in float64 to
    fp32 rounding (measured 2e-8 relative), their gradients to bf16 rounding of the softmax's
    gradient (measured <= 1.9e-3 of the largest; 1.4e-3 x's, 1.1e-3 w's)."""
    torch.manual_seed(3)
    x = torch.randn(37, 24, requires_grad=True)
    w = torch.randn(1000, 24, requires_grad=True)
    t = torch.randint(0, 1000, (37,))
    t[[4, 30]] = IGNORE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, t, chunk_rows=chunk_rows)
    got = (loss, *torch.autograd.grad(loss, (x, w)))
    chunks = -(-37 // chunk_rows)
    assert bf16_gemm.count(True) == 3 * chunks + 1  # three products per chunk, and the forward's check
    xr, wr = bf16_rounded(x.detach()).requires_grad_(), bf16_rounded(w.detach()).requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(xr @ wr.t(), t)
    ref = (ref_loss, *torch.autograd.grad(ref_loss, (xr, wr)))
    assert abs(got[0].item() - ref[0].item()) < 1e-6 * ref[0].item()
    for g, r in zip(got[1:], ref[1:], strict=True):
        assert g.dtype == torch.float32
        assert ((g.double() - r).abs().max() / r.abs().max()).item() < 5e-3
