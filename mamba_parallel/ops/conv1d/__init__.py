"""Causal depthwise conv1d (Mamba's short convolution): full sequence ``causal_conv1d`` and one-token
``causal_conv1d_update`` for decoding."""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import check_int, check_ndim, check_shape, kernel_module
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.conv1d import naive

ACTIVATIONS = (None, "silu")


def _kernel():
    return kernel_module(__name__)


def _check_common(op: str, d: int, weight, bias, activation) -> int:
    check_ndim(op, "weight", weight, (2,), "(d, w)")
    check_shape(op, "weight", weight, ("d", d), ("w", weight.shape[1]))
    if weight.shape[1] < 1:
        raise ValueError(f"{op}: weight width w must be >= 1, got shape {tuple(weight.shape)}")
    check_shape(op, "bias", bias, ("d", d))
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    return weight.shape[1]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, initial_state: torch.Tensor | None = None,
                  seq_idx: torch.Tensor | None = None, return_final_state: bool = False):
    """Depthwise causal convolution over the last axis.

    x (b, d, L) any strides; weight (d, w); bias (d,); activation None or "silu"; initial_state (b, d, w-1) = the
    w-1 inputs before x (zeros when None); seq_idx (b, L) int32 (non-decreasing): no input flows across positions
    where it changes. Returns y (b, d, L) in x.dtype, y[t] = act(bias + sum_k weight[:, k] * x[t - (w-1) + k]);
    with return_final_state also final_state (b, d, w-1) = the last w-1 inputs (x.dtype), for decoding.
    """
    op = "causal_conv1d"
    check_ndim(op, "x", x, (3,), "(b, d, L)")
    b, d, L = x.shape
    w = _check_common(op, d, weight, bias, activation)
    check_shape(op, "initial_state", initial_state, ("b", b), ("d", d), ("w-1", w - 1))
    check_shape(op, "seq_idx", seq_idx, ("b", b), ("L", L))
    check_int(op, "seq_idx", seq_idx)
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().causal_conv1d(x, weight, bias, activation, initial_state, seq_idx, return_final_state)
    return naive.causal_conv1d(x, weight, bias, activation, initial_state, seq_idx, return_final_state)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One decoding step of ``causal_conv1d``.

    x (b, d) the new token; conv_state (B, d, w-1) the previous w-1 inputs, oldest first, updated IN PLACE (rows
    ``state_indices`` (b,) int if given, else all rows and B == b); weight (d, w); bias (d,) -> y (b, d) in x.dtype.
    """
    op = "causal_conv1d_update"
    check_ndim(op, "x", x, (2,), "(b, d)")
    b, d = x.shape
    w = _check_common(op, d, weight, bias, activation)
    check_ndim(op, "conv_state", conv_state, (3,), "(B, d, w-1)")
    nb = conv_state.shape[0] if state_indices is not None else b
    check_shape(op, "conv_state", conv_state, ("B", nb), ("d", d), ("w-1", w - 1))
    check_shape(op, "state_indices", state_indices, ("b", b))
    check_int(op, "state_indices", state_indices)
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().causal_conv1d_update(x, conv_state, weight, bias, activation, state_indices)
    return naive.causal_conv1d_update(x, conv_state, weight, bias, activation, state_indices)


__all__ = ["causal_conv1d", "causal_conv1d_update"]
