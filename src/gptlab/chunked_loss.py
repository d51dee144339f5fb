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

IGNORE_INDEX = -100
CHUNK_ROWS = 512


def _chunk_grad(x_c, w_t, t_c, all_valid: bool):
    """For rows x_c (n, C) and the head w_t (C, V): the summed loss and d(sum loss)/d(logits) (n, V), fp32."""
    logits = (x_c @ w_t).float()  # (n, V)
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


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, compute_dtype, chunk_rows):
        x2 = x.reshape(-1, x.size(-1))  # (N, C)
        t = targets.reshape(-1)  # (N,)
        n_valid = (t != IGNORE_INDEX).sum()
        all_valid = bool(n_valid == t.numel())  # then no row needs masking
        n_valid = n_valid.clamp_min(1)
        # Every matmul below is untransposed on contiguous operands: with bf16, oneDNN would
        # otherwise copy a transposed (V, n) or (V, C) operand on each call.
        xc = x2.to(compute_dtype)
        w = weight.to(compute_dtype)  # (V, C)
        w_t = w.t().contiguous()  # (C, V)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_x = torch.empty(x2.shape, dtype=torch.float32, device=x.device) if need_grad else None
        grad_w_t = torch.zeros(w_t.shape, dtype=torch.float32, device=x.device) if need_grad else None  # (C, V)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, x2.size(0), chunk_rows):
            x_c = xc[s : s + chunk_rows]  # (n, C)
            chunk_loss, dlogits = _chunk_grad(x_c, w_t, t[s : s + chunk_rows], all_valid)
            loss += chunk_loss
            if need_grad:
                d = dlogits.to(compute_dtype)  # (n, V)
                grad_x[s : s + chunk_rows] = d @ w  # (n, C)
                grad_w_t += x_c.t().contiguous() @ d  # (C, V)
        ctx.save_for_backward(grad_x, grad_w_t, n_valid)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w_t, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid
        gx = (grad_x * scale).to(ctx.x_dtype).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        gw = (grad_w_t.t() * scale).to(ctx.w_dtype).contiguous() if ctx.needs_input_grad[1] else None
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
