"""Chunked linear cross-entropy in plain PyTorch (the specification).

A custom autograd.Function: forward keeps only the per-row log-sum-exp; backward recomputes each chunk of
logits, so the peak extra memory is one (chunk, V) block of fp32 logits in both passes.
"""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import compute_dtype, fp32_math

# Default chunk: about this many logits (fp32: 64 MiB).
CHUNK_ELEMENTS = 1 << 24


def default_chunk_rows(n_rows: int, vocab: int) -> int:
    return max(1, min(n_rows, CHUNK_ELEMENTS // max(1, vocab)))


class _ChunkedLinearCE(torch.autograd.Function):
    """hidden (N, d), weight (V, d), labels (N,) -> per-row loss (N,) (0 on ignored rows), in the compute dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk):
        ct = compute_dtype(hidden, weight)
        N = hidden.shape[0]
        w = weight.to(ct)
        valid = labels != ignore_index
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        losses = hidden.new_empty(N, dtype=ct)
        lse = hidden.new_empty(N, dtype=ct)
        for s in range(0, N, chunk):
            logits = hidden[s:s + chunk].to(ct) @ w.T
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, safe[s:s + chunk, None]).squeeze(1)
            losses[s:s + chunk] = lse[s:s + chunk] - target
        losses = torch.where(valid, losses, torch.zeros_like(losses))
        ctx.save_for_backward(hidden, weight, safe, valid, lse)
        ctx.chunk = chunk
        return losses

    @staticmethod
    @fp32_math
    def backward(ctx, grad_losses):
        hidden, weight, safe, valid, lse = ctx.saved_tensors
        ct = lse.dtype
        w = weight.to(ct)
        g = torch.where(valid, grad_losses.to(ct), torch.zeros_like(lse))
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk].to(ct)
            # d loss_i / d logits_i = softmax_i - onehot(label_i), scaled by the row's incoming gradient.
            dlogits = torch.exp(h @ w.T - lse[s:s + ctx.chunk, None])
            dlogits.scatter_add_(1, safe[s:s + ctx.chunk, None], -torch.ones_like(lse[s:s + ctx.chunk, None]))
            dlogits.mul_(g[s:s + ctx.chunk, None])
            if need_h:
                grad_h[s:s + ctx.chunk] = (dlogits @ w).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(dlogits.T, h)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None


@fp32_math
def linear_cross_entropy(hidden, weight, labels, ignore_index=-100, reduction="mean", chunk_size=None):
    """hidden (N, d), weight (V, d), labels (N,) -> loss: scalar ("mean" over non-ignored rows, "sum") or (N,)
    ("none", 0 on ignored rows); fp32 (fp64 for fp64 inputs)."""
    chunk = chunk_size or default_chunk_rows(hidden.shape[0], weight.shape[0])
    losses = _ChunkedLinearCE.apply(hidden, weight, labels, ignore_index, chunk)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (labels != ignore_index).sum()
