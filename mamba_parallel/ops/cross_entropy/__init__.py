"""Cross-entropy of a linear head, ``linear_cross_entropy``: logits are made chunk by chunk (never all at once)."""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import check_int, check_ndim, check_shape, kernel_module
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.cross_entropy import naive

REDUCTIONS = ("mean", "sum", "none")


def _kernel():
    return kernel_module(__name__)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean", chunk_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of logits = hidden @ weight.T against labels, computed in fp32 over row chunks.

    hidden (N, d); weight (V, d); labels (N,) int64, rows with ``ignore_index`` contribute nothing.
    reduction "mean" (over non-ignored rows; NaN when there are none, like F.cross_entropy), "sum" (used by
    context parallel) or "none" -> scalar, or (N,) for "none"; fp32. chunk_size = rows per chunk (None: a chunk of
    logits of about 16M elements); peak extra memory is one chunk of logits in forward and backward.
    """
    op = "linear_cross_entropy"
    check_ndim(op, "hidden", hidden, (2,), "(N, d)")
    N, d = hidden.shape
    check_ndim(op, "weight", weight, (2,), "(V, d)")
    check_shape(op, "weight", weight, ("V", weight.shape[0]), ("d", d))
    check_shape(op, "labels", labels, ("N", N))
    check_int(op, "labels", labels)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{op}: chunk_size must be a positive int or None, got {chunk_size!r}")
    if use_triton(hidden, op=op, has_kernel=_kernel() is not None):
        return _kernel().linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk_size)
    return naive.linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk_size)


__all__ = ["linear_cross_entropy"]
