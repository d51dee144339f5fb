"""The output head and the cross-entropy loss in one pass over row chunks.

For a small model the head dominates training: with GPT-2's 50,257-token vocabulary, B16xT128
gives fp32 logits of 412 MB per step, written by the matmul, read by softmax, written again as
their gradient and read by two more matmuls. `linear_cross_entropy` computes, for a chunk of rows
at a time, the logits, the loss and the gradient of the loss with respect to the logits, and turns
that gradient straight into the gradients of the hidden states and of the head weight; the
chunk's logits are then dropped. The gradient softmax - onehot is never formed over the whole
(V, n) chunk: the logits become exp(logits - max) (two passes: max; exp and sum), and the
normalization and the one-hot go to the small (n, C) side of the two products (one pass fewer
over ~200 MB per step of the demo). Backward only scales the stored gradients. The matmuls run in
the autocast dtype (bf16 logits under bf16 autocast); the softmax runs in fp32. Under bf16 autocast
on a CPU with AVX512-BF16 the three products run in gl_gemm_bf16 instead (gemm.gemm_bf16_runs):
fp32 operands rounded to bf16 as they are packed, fp32 sums, and the logits kept in fp32.

The same value as `F.cross_entropy(x @ weight.T, targets, ignore_index=IGNORE)` (mean over the
non-ignored targets), to float rounding.

`token_logprobs` is the same pass for scoring (evaluation, lm-eval's loglikelihood): each row's
log-probability of its target and whether the target is the greedy token, with no gradient.
"""

from __future__ import annotations

import torch

from gptlab import gemm, ops
from gptlab.data import IGNORE

# Rows per chunk: larger chunks multiply faster, up to a batch of the demo's size. Measured on the
# AMD EPYC (2 threads, 1024 rows of a 128-wide head over 50,257 tokens, forward + backward):
# 128 rows 516-631 ms, 256 512-532, 512 472, 1024 432-447; the chunk's logits take 206 MB.
CHUNK_ROWS = 1024


def _chunk_grad(x_c, w, t_c, out: torch.Tensor, bf16: bool = False):
    """For rows x_c (n, C) and the head w (V, C): the summed loss, e = exp(logits - max) per row,
    transposed (V, n) fp32 and written into `out` (V, n), and inv (n,), 1 / the row's sum of e (0
    for an ignored row), so that d(sum loss)/d(logits) = inv * e - onehot (see _accumulate_grads).

    Transposed because W x^T runs faster than x W^T on CPU for this shape, and so do its two
    backward products (measured on the AMD EPYC, 2 threads, 512 rows: 95 against 67 GFLOP/s
    forward; 107/82 against 119/74 for the inputs' and the weight's gradients: ~15% less in all).
    bf16: x_c and w fp32, multiplied as bf16 (gemm.mm)."""
    peak = None
    if out.dtype == x_c.dtype:
        peak = gemm.mm_colmax(w, x_c.t(), out, bf16=bf16)  # (n,) each row's largest logit, or None
        logits = out if peak is not None else gemm.mm(w, x_c.t(), out, bf16=bf16)  # (V, n)
    else:
        product = _workspace(x_c.size(0), w.size(0), out.device, w.dtype)  # (V, n) bf16/fp16, kept
        logits = out.copy_(torch.mm(w, x_c.t().contiguous(), out=product))  # (V, n) fp32
    scored = ops.softmax_exp_(logits, t_c, peak)  # in C on CPU: 1-2 passes over the logits, not 5
    if scored is not None:
        row_loss, inv = scored
        return row_loss.sum(), logits, inv
    valid = t_c != IGNORE  # (n,)
    t_safe = t_c.clamp_min(0)[None, :]  # (1, n)
    target_logit = logits.gather(0, t_safe).squeeze(0)  # (n,)
    peak = logits.amax(dim=0, keepdim=True)  # (1, n)
    e = logits.sub_(peak).exp_()  # in place: the logits are not needed again
    total = e.sum(dim=0)  # (n,)
    row_loss = total.log() + peak.squeeze(0) - target_logit  # (n,) logsumexp - target
    inv = total.reciprocal().masked_fill_(~valid, 0.0)  # (n,)
    return row_loss.masked_fill(~valid, 0.0).sum(), e, inv


def _accumulate_grads(e, inv, t_c, x_c, w, w_t, grad_x_c, grad_w, first: bool, scale: float, bf16: bool = False):
    """grad_x_c = d^T @ w and grad_w += d @ x_c (= on the first chunk: grad_w starts uninitialized,
    sparing a 26 MB zero fill per step) for one chunk's d = scale (inv * e - onehot(t_c)): e (V, n),
    inv (n,), x_c (n, C), w (V, C). The scaling and the one-hot go to the (n, C) side, so the (V, n)
    matrix is read only by the two products.

    fp32 (and bf16 in gl_gemm_bf16, which takes fp32 operands): BLAS takes the transposed e as it
    is; grad_w (V, C) is written in place with no temporaries. bf16/fp16: oneDNN copies a
    transposed operand on each call, so the products run on contiguous ones (w_t is w.T made
    contiguous once).
    """
    rows = (t_c != IGNORE).nonzero().squeeze(1)  # (k,) rows with a target
    targets = t_c[rows]  # (k,)
    inv = inv * scale  # (n,)
    x_scaled = x_c * inv.to(x_c.dtype)[:, None]  # (n, C)
    if e.dtype == torch.float32:
        gemm.mm(e.t(), w, grad_x_c, bf16=bf16)
        gemm.mm(e, x_scaled, grad_w, accumulate=not first, bf16=bf16)  # the first: grad_w's old values are not read
    else:
        grad_x_c.copy_((w_t @ e).t())
        if first:
            grad_w.copy_(e @ x_scaled)
        else:
            grad_w += e @ x_scaled
    grad_x_c.mul_(inv[:, None])
    grad_x_c.index_add_(0, rows, w[targets].to(grad_x_c.dtype), alpha=-scale)  # the one-hot's part
    grad_w.index_add_(0, targets, x_c[rows].to(grad_w.dtype), alpha=-scale)


_WORKSPACE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


# Floats between the starts of the workspace's rows beyond its `rows`: one cache line. A chunk of
# 1024 rows would otherwise put its logits' rows exactly 4 KB apart, and the products reading them
# down a column (e^T W packs 256 of them per block) land every row in the same few sets of L1 and
# L2. Measured on the AMD EPYC Zen 5 held to AVX2 (2 threads, the demo's 1024 x 128 x 50,257
# head, medians of 5): W x^T, e^T W, e x 52.2, 67.1, 61.8 ms unpadded; 51.5, 59.6, 58.2 padded by
# 16 (8, 32 and 64: 166-169 ms in all).
ROW_PAD = 16


def _workspace(rows: int, vocab: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (vocab, rows) buffer for one chunk's transposed logits, kept between calls on CPU: fp32
    with its rows ROW_PAD floats longer than `rows` (a view), or, for the bf16/fp16 products of
    autocast in PyTorch (_chunk_grad, and e rounded for _accumulate_grads), contiguous in `dtype`.

    A fresh tensor of this size (~100 MB for 512 rows of GPT-2's vocabulary) comes from mmap and
    is zero-filled page by page by the kernel on every call: measured ~20 ms per chunk on a 2-core
    Xeon, ~10% of a demo training step. Keeping one buffer per device and dtype costs its size
    once. For bf16 (Intel Xeon 6/207, the demo's 1,024 x 128 x 50,257 head): W x^T 34.0 ms into a
    fresh tensor, 8.3 into a kept one (14.5 into a padded one); e rounded to bf16 40.3 ms, 14.1.
    """
    if device.type != "cpu":
        return torch.empty(vocab, rows, dtype=dtype, device=device)  # caching allocator reuses it
    stride = rows + (ROW_PAD if dtype is torch.float32 else 0)
    buf = _WORKSPACE.get((device, dtype))
    if buf is None or buf.numel() < stride * vocab:
        buf = _WORKSPACE[device, dtype] = torch.empty(stride * vocab, dtype=dtype, device=device)
    return buf[: stride * vocab].view(vocab, stride)[:, :rows]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, compute_dtype, chunk_rows, grad_mode):
        x2 = x.reshape(-1, x.size(-1))  # (N, C)
        t = targets.reshape(-1)  # (N,)
        bad = (t != IGNORE) & ((t < 0) | (t >= weight.size(0)))  # (N,)
        if bool(bad.any()):
            raise ValueError(f"target {int(t[bad][0])} outside the vocabulary [0, {weight.size(0)}) (and not {IGNORE})")
        n_valid = max(int((t != IGNORE).sum()), 1)
        bf16 = compute_dtype == torch.bfloat16 and gemm.gemm_bf16_runs(x.device)  # gl_gemm_bf16 rounds fp32 operands
        mm_dtype = torch.float32 if bf16 else compute_dtype
        xc = x2.to(mm_dtype)
        w = weight.to(mm_dtype)  # (V, C)
        w_t = None if mm_dtype == torch.float32 else w.t().contiguous()  # (C, V): see _accumulate_grads
        # needs_input_grad holds under torch.no_grad too (it follows requires_grad only), so the
        # caller's grad mode comes as an argument: evaluation computes no gradients.
        need_grad = grad_mode and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        grad_x = torch.empty(x2.shape, dtype=torch.float32, device=x.device) if need_grad else None
        # (V, C): the first chunk writes it whole; with no rows at all (every target ignored) it stays 0
        new = torch.empty if x2.size(0) else torch.zeros
        grad_w = new(w.shape, dtype=torch.float32, device=x.device) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, x2.size(0), chunk_rows):
            x_c = xc[s : s + chunk_rows]  # (n, C)
            buffer = _workspace(x_c.size(0), w.size(0), x.device)  # (V, n) fp32
            t_c = t[s : s + chunk_rows]  # (n,)
            chunk_loss, e, inv = _chunk_grad(x_c, w, t_c, buffer, bf16)
            loss += chunk_loss
            if need_grad:
                if mm_dtype != torch.float32:  # rounded into a kept buffer (the product's, used up)
                    e = _workspace(e.size(1), e.size(0), x.device, mm_dtype).copy_(e)  # (V, n)
                _accumulate_grads(e, inv, t_c, x_c, w, w_t, grad_x[s : s + chunk_rows], grad_w,
                                  first=s == 0, scale=1.0 / n_valid, bf16=bf16)  # fmt: skip
        ctx.save_for_backward(grad_x, grad_w)  # the mean's gradients
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        # A loss backpropagated as it is (grad_loss 1) takes the stored gradients themselves: the
        # head's (V, C) is 26 MB for GPT-2's vocabulary, and a scaled copy of it cost ~3.4 ms of
        # a ~250 ms demo step (AMD EPYC Zen 5 at AVX2).
        unit = bool(grad_loss == 1)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (grad_x if unit else grad_x * grad_loss).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gw = (grad_w if unit else grad_w * grad_loss).to(ctx.w_dtype).contiguous()  # (V, C)
        return gx, gw, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int = CHUNK_ROWS):
    """Mean cross-entropy of logits x @ weight.T against targets, without materialising all logits.

    x (..., C), weight (V, C), targets (...) with IGNORE (-100) for positions to skip.
    Under autocast the matmuls run in the autocast dtype.
    """
    keep = targets != IGNORE
    if not bool(keep.all()):  # masked fine-tuning: the head runs on the rows that count only
        x, targets = x.reshape(-1, x.size(-1))[keep.reshape(-1)], targets.reshape(-1)[keep.reshape(-1)]  # (n, C), (n,)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = x.dtype
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(x, weight, targets, compute_dtype, chunk_rows, torch.is_grad_enabled())


@torch.no_grad()
def token_logprobs(x: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk_rows: int = CHUNK_ROWS):
    """For rows x (N, C) under the output head (a Linear, or a quantized one) and targets (N,):
    (log p(target) (N,) fp32, whether the target has the largest logit (N,) bool), chunk by chunk,
    never holding (N, V) logits. A tie for the largest logit counts as greedy (torch.argmax would
    pick the first of them).
    """
    logprob = torch.empty(x.size(0), dtype=torch.float32, device=x.device)
    greedy = torch.empty(x.size(0), dtype=torch.bool, device=x.device)
    for s in range(0, x.size(0), chunk_rows):
        x_c, t_c = x[s : s + chunk_rows], targets[s : s + chunk_rows]  # (n, C), (n,)
        logits = _head_t(head, x_c)  # (V, n) fp32
        target = logits.gather(0, t_c[None, :]).squeeze(0)  # (n,)
        scored = ops.cross_entropy_t(logits, t_c)
        if scored is None:  # PyTorch: another device, or no kernels
            scored = torch.logsumexp(logits, dim=0) - target, logits.amax(dim=0)
        loss, peak = scored
        logprob[s : s + chunk_rows] = -loss
        greedy[s : s + chunk_rows] = target >= peak
    return logprob, greedy


def _head_t(head: torch.nn.Module, x_c: torch.Tensor) -> torch.Tensor:
    """The head's logits for rows x_c (n, C), transposed: (V, n) fp32 and contiguous."""
    weight = getattr(head, "weight", None)
    if not (isinstance(head, torch.nn.Linear) and head.bias is None and weight.dtype == x_c.dtype):
        return head(x_c).float().t().contiguous()  # a quantized head computes (n, V) its own way
    if x_c.dtype != torch.float32:
        return (weight @ x_c.t()).float()
    return gemm.mm(weight, x_c.t(), _workspace(x_c.size(0), weight.size(0), x_c.device))
