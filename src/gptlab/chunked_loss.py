"""The output head and the cross-entropy loss in one pass over row chunks.

For a small model the head dominates training: with GPT-2's 50,257-token vocabulary, B16xT128
gives fp32 logits of 412 MB per step, written by the matmul, read by softmax, written again as
their gradient and read by two more matmuls. `linear_cross_entropy` computes, for a chunk of rows
at a time, the logits, the loss and the gradient of the loss with respect to the logits, and turns
that gradient straight into the gradients of the hidden states and of the head weight; the
chunk's logits are then dropped. Backward only scales the stored gradients. The matmuls run in
the autocast dtype (bf16 logits under bf16 autocast); the softmax runs in fp32.

The same value as `F.cross_entropy(x @ weight.T, targets, ignore_index=-100)` (mean over the
non-ignored targets), to float rounding.
"""

from __future__ import annotations

import torch

from gptlab import kernels

IGNORE_INDEX = -100
CHUNK_ROWS = 128


def _chunk_grad(x_c, w_t, t_c, all_valid: bool, out: torch.Tensor):
    """For rows x_c (n, C) and the head w_t (C, V): the summed loss and d(sum loss)/d(logits) (n, V),
    fp32, written into `out` (n, V)."""
    if out.dtype == x_c.dtype:
        logits = torch.mm(x_c, w_t, out=out)  # (n, V)
    else:
        logits = out.copy_(x_c @ w_t)  # (n, V) fp32 from bf16/fp16 logits
    row_loss = kernels.softmax_xent_(logits, t_c)  # in C on CPU: 3 passes over the logits, not 5
    if row_loss is not None:
        return row_loss.sum(), logits
    valid = t_c != IGNORE_INDEX  # (n,)
    t_safe = t_c.clamp_min(0)[:, None]  # (n, 1)
    target_logit = logits.gather(1, t_safe).squeeze(1)  # (n,)
    peak = logits.amax(dim=1, keepdim=True)  # (n, 1)
    probs = logits.sub_(peak).exp_()  # in place: the logits are not needed again
    total = probs.sum(dim=1, keepdim=True)  # (n, 1)
    row_loss = (total.log() + peak).squeeze(1) - target_logit  # (n,) logsumexp - target
    probs.div_(total)
    probs.scatter_add_(1, t_safe, torch.full_like(target_logit, -1.0)[:, None])  # softmax - onehot
    if not all_valid:
        probs.mul_(valid[:, None])
    return row_loss.masked_fill(~valid, 0.0).sum(), probs


def _accumulate_grads(d, x_c, w, grad_x_c, grad_w) -> None:
    """grad_x_c = d @ w and grad_w += d.T @ x_c for one chunk: d (n, V), x_c (n, C), w (V, C).

    fp32 (BLAS takes transposed operands as they are): grad_w is (V, C), written in place with no
    temporaries. bf16/fp16: oneDNN copies a transposed operand on each call, so the matmuls run on
    contiguous ones and grad_w is kept transposed, (C, V), in fp32.
    """
    if d.dtype == torch.float32:
        torch.mm(d, w, out=grad_x_c)
        grad_w.addmm_(d.t(), x_c)
    else:
        grad_x_c.copy_(d @ w)
        grad_w += x_c.t().contiguous() @ d


_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def _workspace(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """A (rows, vocab) fp32 buffer for one chunk's logits, kept between calls on CPU.

    A fresh tensor of this size (~100 MB for 512 rows of GPT-2's vocabulary) comes from mmap and
    is zero-filled page by page by the kernel on every call: measured ~20 ms per chunk on a 2-core
    Xeon, ~10% of a demo training step. Keeping one buffer per device costs its size once.
    """
    if device.type != "cpu":
        return torch.empty(rows, vocab, dtype=torch.float32, device=device)  # caching allocator reuses it
    buf = _WORKSPACE.get(device)
    if buf is None or buf.size(0) < rows or buf.size(1) != vocab:
        buf = _WORKSPACE[device] = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    return buf[:rows]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, compute_dtype, chunk_rows):
        x2 = x.reshape(-1, x.size(-1))  # (N, C)
        t = targets.reshape(-1)  # (N,)
        bad = (t != IGNORE_INDEX) & ((t < 0) | (t >= weight.size(0)))  # (N,)
        if bool(bad.any()):
            raise ValueError(
                f"target {int(t[bad][0])} outside the vocabulary [0, {weight.size(0)}) (and not {IGNORE_INDEX})"
            )
        n_valid = (t != IGNORE_INDEX).sum()
        all_valid = bool(n_valid == t.numel())  # then no row needs masking
        n_valid = n_valid.clamp_min(1)
        xc = x2.to(compute_dtype)
        w = weight.to(compute_dtype)  # (V, C)
        fp32 = compute_dtype == torch.float32
        # bf16/fp16: every matmul on contiguous operands (oneDNN would copy a transposed one per call)
        w_t = w.t() if fp32 else w.t().contiguous()  # (C, V)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_x = torch.empty(x2.shape, dtype=torch.float32, device=x.device) if need_grad else None
        grad_w_shape = w.shape if fp32 else w_t.shape  # (V, C), or (C, V): see _accumulate_grads
        grad_w = torch.zeros(grad_w_shape, dtype=torch.float32, device=x.device) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        buffer = _workspace(min(chunk_rows, x2.size(0)), w.size(0), x.device)  # (chunk_rows, V) fp32
        for s in range(0, x2.size(0), chunk_rows):
            x_c = xc[s : s + chunk_rows]  # (n, C)
            chunk_loss, dlogits = _chunk_grad(x_c, w_t, t[s : s + chunk_rows], all_valid, buffer[: x_c.size(0)])
            loss += chunk_loss
            if need_grad:
                _accumulate_grads(dlogits.to(compute_dtype), x_c, w, grad_x[s : s + chunk_rows], grad_w)
        ctx.save_for_backward(grad_x, grad_w, n_valid)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.w_transposed = x.shape, x.dtype, weight.dtype, not fp32
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid
        gx = (grad_x * scale).to(ctx.x_dtype).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            gw = (grad_w.t() if ctx.w_transposed else grad_w) * scale  # (V, C)
            gw = gw.to(ctx.w_dtype).contiguous()
        else:
            gw = None
        return gx, gw, None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int = CHUNK_ROWS):
    """Mean cross-entropy of logits x @ weight.T against targets, without materialising all logits.

    x (..., C), weight (V, C), targets (...) with IGNORE_INDEX (-100) for positions to skip.
    Under autocast the matmuls run in the autocast dtype.
    """
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = x.dtype
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(x, weight, targets, compute_dtype, chunk_rows)
