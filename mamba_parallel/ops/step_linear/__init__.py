"""The linears of a one-token decode step with their neighbours fused in: ``add_rms_norm_linear`` (a block's
pre-norm, the mixer's in_proj and, optionally, its conv update) and ``linear_partials`` (a split-K GEMV whose
sum the next kernel takes). The gated norm + out_proj of Mamba-2 is ``ops.gated_rms_norm_linear``, which runs the
same kernel for a few rows without autograd. No autograd here: decoding only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mamba_parallel.ops._common import check_ndim, check_shape, kernel_module
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.step_linear import naive


class ConvStep(NamedTuple):
    """A causal depthwise conv's one-token update applied to output columns [start, start + C) of a linear:
    state (b, C, w - 1) updated in place, weight (C, w), bias (C,) or None; silu after."""

    state: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    start: int


def _kernel():
    return kernel_module(__name__)


def _check_conv(op: str, conv: ConvStep, b: int, n: int) -> None:
    check_ndim(op, "conv.state", conv.state, (3,), "(b, C, w - 1)")
    c, w1 = conv.state.shape[1], conv.state.shape[2]
    check_shape(op, "conv.state", conv.state, ("b", b), ("C", c), ("w - 1", w1))
    check_shape(op, "conv.weight", conv.weight, ("C", c), ("w", w1 + 1))
    check_shape(op, "conv.bias", conv.bias, ("C", c))
    if not 0 <= conv.start <= n - c:
        raise ValueError(f"{op}: conv columns [{conv.start}, {conv.start + c}) do not lie within the {n} output "
                         f"columns")


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                        weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5,
                        residual_in_fp32: bool = True, conv: ConvStep | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's pre-norm and linear. x (b, K), residual (b, K) or None, norm_weight (K,), weight (N, K) in
    x.dtype, bias (N,) or None -> (out (b, N) in x.dtype, new_residual (b, K)).

    new_residual = x + residual (fp32 when ``residual_in_fp32``, else x.dtype); out = F.linear(rms_norm(
    new_residual) * norm_weight in x.dtype, weight, bias), as ``add_rms_norm`` then ``F.linear``. With ``conv``,
    out's columns [conv.start, conv.start + C) are then replaced by ``causal_conv1d_update(those columns,
    conv.state, conv.weight, conv.bias, activation="silu")`` (conv.state updated in place).
    """
    op = "add_rms_norm_linear"
    check_ndim(op, "x", x, (2,), "(b, K)")
    b, k = x.shape
    check_shape(op, "residual", residual, ("b", b), ("K", k))
    check_shape(op, "norm_weight", norm_weight, ("K", k))
    check_ndim(op, "weight", weight, (2,), "(N, K)")
    n = weight.shape[0]
    check_shape(op, "weight", weight, ("N", n), ("K", k))
    check_shape(op, "bias", bias, ("N", n))
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight is {weight.dtype} but x is {x.dtype}; the decode step runs in one dtype")
    if conv is not None:
        _check_conv(op, conv, b, n)
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().add_rms_norm_linear(x, residual, norm_weight, weight, bias, eps, residual_in_fp32, conv)
    return naive.add_rms_norm_linear(x, residual, norm_weight, weight, bias, eps, residual_in_fp32, conv)


def default_split(n: int, k: int) -> int:
    """K channels per slice of ``linear_partials`` for an (n, k) weight: about 256 programs of 16 columns (two per
    SM of an H100), slices of at least 128 channels, a multiple of 64."""
    slices = max(1, min(k // 128, 256 // max(1, -(-n // 16))))
    if slices == 1:
        return k
    per = -(-k // slices)
    return -(-per // 64) * 64


def linear_partials(x: torch.Tensor, weight: torch.Tensor, k_per_split: int | None = None) -> torch.Tensor:
    """A split-K linear without the final sum. x (b, K), weight (N, K) in x.dtype -> (S, b, N) fp32 with
    S = ceil(K / k_per_split): slice s is x[:, s k : (s + 1) k] @ weight[:, s k : (s + 1) k]^T (k = k_per_split,
    ``default_split(N, K)`` when None), so ``out.sum(0)`` is the linear. For a GEMV with few output columns, whose
    consumer sums the slices itself."""
    op = "linear_partials"
    check_ndim(op, "x", x, (2,), "(b, K)")
    b, k = x.shape
    check_ndim(op, "weight", weight, (2,), "(N, K)")
    check_shape(op, "weight", weight, ("N", weight.shape[0]), ("K", k))
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight is {weight.dtype} but x is {x.dtype}; the decode step runs in one dtype")
    if k_per_split is None:
        k_per_split = default_split(weight.shape[0], k)
    if not isinstance(k_per_split, int) or k_per_split < 1:
        raise ValueError(f"{op}: k_per_split must be a positive int, got {k_per_split!r}")
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().linear_partials(x, weight, k_per_split)
    return naive.linear_partials(x, weight, k_per_split)


__all__ = ["ConvStep", "add_rms_norm_linear", "default_split", "linear_partials"]
