"""The fused decode step, three stages per block (naive.py states the math):

1. ``norm_in_proj_conv``: the block's RMSNorm, in_proj and the conv update of its conv columns (Mamba-2's xBC,
   Mamba-1's x);
2. Mamba-2: ``state_update_gate``: the SSM state update, D and the z gate, with the output norm's weight and sums
   of squares per norm group; Mamba-1: ``mamba1_x_proj_state_update``: x_proj (split over K), dt_proj, the
   state update, D and the z gate;
3. ``gated_out_proj_residual``: out_proj of the (normed) gated output, added into the fp32 residual in place.

No autograd (decoding only). The states and the residual are updated in place.
"""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import check_divides, check_ndim, check_shape, kernel_module
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.decode_step import naive


def _kernel():
    return kernel_module(__name__)


def norm_in_proj_conv(residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                      conv_state: torch.Tensor, conv_start: int) -> torch.Tensor:
    """residual (b, K) fp32; norm_weight (K,); weight (N, K), bias (N,); conv_weight (C, d_conv), conv_bias (C,);
    conv_state (b, C, d_conv - 1), updated in place -> zxbcdt (b, N) in weight.dtype:
    in_proj(rmsnorm(residual) norm_weight), its columns [conv_start, conv_start + C) through the conv + silu."""
    op = "norm_in_proj_conv"
    check_ndim(op, "residual", residual, (2,), "(b, K)")
    b, k = residual.shape
    check_ndim(op, "weight", weight, (2,), "(N, K)")
    n = weight.shape[0]
    check_shape(op, "weight", weight, ("N", n), ("K", k))
    check_shape(op, "norm_weight", norm_weight, ("K", k))
    check_shape(op, "bias", bias, ("N", n))
    check_ndim(op, "conv_weight", conv_weight, (2,), "(C, d_conv)")
    c, dc = conv_weight.shape
    check_shape(op, "conv_bias", conv_bias, ("C", c))
    check_shape(op, "conv_state", conv_state, ("b", b), ("C", c), ("d_conv - 1", dc - 1))
    if dc < 2 or not 0 <= conv_start <= n - c:
        raise ValueError(f"{op}: the conv columns [{conv_start}, {conv_start + c}) must lie in in_proj's {n} "
                         f"outputs, with d_conv >= 2 (got {dc})")
    if residual.dtype != torch.float32 or residual.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"{op}: residual must be fp32 and residual / weight contiguous along K, got "
                         f"{residual.dtype}, strides {residual.stride()} / {weight.stride()}")
    if use_triton(residual, op=op, has_kernel=_kernel() is not None):
        return _kernel().norm_in_proj_conv(residual, norm_weight, eps, weight, bias, conv_weight, conv_bias,
                                           conv_state, conv_start)
    return naive.norm_in_proj_conv(residual, norm_weight, eps, weight, bias, conv_weight, conv_bias, conv_state,
                                   conv_start)


def state_update_gate(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor, dt_bias: torch.Tensor | None,
                      dt_limit: tuple[float, float], norm_weight: torch.Tensor,
                      ngroups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """state (b, h, p, n) in place; x, z (b, h, p); dt (b, h) raw (softplus inside); A (h,); B, C (b, g, n);
    D (h,) or (h, p); dt_bias (h,); norm_weight (h p,); ngroups: the output norm's groups (whole heads each)
    -> gw (b, h p) fp32 (= y silu(z) norm_weight), sumsq (b, ngroups, P) fp32 (P partial sums of (y silu(z))^2
    per group)."""
    op = "state_update_gate"
    check_ndim(op, "x", x, (3,), "(b, h, p)")
    b, h, p = x.shape
    check_ndim(op, "state", state, (4,), "(b, h, p, n)")
    n = state.shape[3]
    check_shape(op, "state", state, ("b", b), ("h", h), ("p", p), ("n", n))
    check_shape(op, "z", z, ("b", b), ("h", h), ("p", p))
    check_shape(op, "dt", dt, ("b", b), ("h", h))
    check_shape(op, "A", A, ("h", h))
    check_ndim(op, "B", B, (3,), "(b, g, n)")
    g = B.shape[1]
    check_shape(op, "B", B, ("b", b), ("g", g), ("n", n))
    check_shape(op, "C", C, ("b", b), ("g", g), ("n", n))
    check_divides(op, "B / C groups g", g, "heads h", h)
    if D is not None:
        check_shape(op, "D", D, *((("h", h), ("p", p)) if D.dim() == 2 else (("h", h),)))
    check_shape(op, "dt_bias", dt_bias, ("h", h))
    check_shape(op, "norm_weight", norm_weight, ("h p", h * p))
    check_divides(op, "norm groups ngroups", ngroups, "heads h", h)
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().state_update_gate(state, x, dt, A, B, C, D, z, dt_bias, dt_limit, norm_weight, ngroups)
    return naive.state_update_gate(state, x, dt, A, B, C, D, z, dt_bias, dt_limit, norm_weight, ngroups)


def gated_out_proj_residual(gw: torch.Tensor, sumsq: torch.Tensor | None, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """gw (b, K); sumsq (b, G, P) fp32 (partial sums of squares per norm group of K / G channels; None: no norm);
    weight (N, K), bias (N,); residual (b, N) fp32, updated in place and returned: residual += out_proj(gw rstd)."""
    op = "gated_out_proj_residual"
    check_ndim(op, "gw", gw, (2,), "(b, K)")
    b, k = gw.shape
    if sumsq is not None:
        check_ndim(op, "sumsq", sumsq, (3,), "(b, G, P)")
        check_divides(op, "norm groups G", sumsq.shape[1], "K", k)
    check_ndim(op, "weight", weight, (2,), "(N, K)")
    n = weight.shape[0]
    check_shape(op, "weight", weight, ("N", n), ("K", k))
    check_shape(op, "bias", bias, ("N", n))
    check_shape(op, "residual", residual, ("b", b), ("N", n))
    if (residual.dtype != torch.float32 or (sumsq is not None and (sumsq.dtype != torch.float32
                                                                    or not sumsq.is_contiguous()))
            or gw.stride(-1) != 1 or residual.stride(-1) != 1 or weight.stride(-1) != 1):
        raise ValueError(f"{op}: sumsq and residual must be fp32 (got {None if sumsq is None else sumsq.dtype}, "
                         f"{residual.dtype}), sumsq contiguous, gw / residual / weight contiguous along their last "
                         "dimension")
    if use_triton(gw, op=op, has_kernel=_kernel() is not None):
        return _kernel().gated_out_proj_residual(gw, sumsq, eps, weight, bias, residual)
    return naive.gated_out_proj_residual(gw, sumsq, eps, weight, bias, residual)


def mamba1_x_proj_state_update(state: torch.Tensor, x: torch.Tensor, z: torch.Tensor, x_proj_weight: torch.Tensor,
                               dt_proj_weight: torch.Tensor, dt_bias: torch.Tensor | None, A: torch.Tensor,
                               D: torch.Tensor | None, bcdt_eps: float | None = None) -> torch.Tensor:
    """state (b, d, n) in place; x (the conv's output), z (b, d); x_proj_weight (r + 2n, d); dt_proj_weight (d, r);
    dt_bias (d,); A (d, n); D (d,) -> y (b, d) in x.dtype: Mamba-1's x_proj, dt_proj, softplus, state update, D and
    silu(z) gate for one token; ``bcdt_eps``: Falcon-Mamba's RMS norms of dt_low, B and C (None: none)."""
    op = "mamba1_x_proj_state_update"
    check_ndim(op, "x", x, (2,), "(b, d)")
    b, d = x.shape
    check_ndim(op, "state", state, (3,), "(b, d, n)")
    n = state.shape[2]
    check_shape(op, "state", state, ("b", b), ("d", d), ("n", n))
    check_shape(op, "z", z, ("b", b), ("d", d))
    check_ndim(op, "dt_proj_weight", dt_proj_weight, (2,), "(d, r)")
    r = dt_proj_weight.shape[1]
    check_shape(op, "dt_proj_weight", dt_proj_weight, ("d", d), ("r", r))
    check_shape(op, "x_proj_weight", x_proj_weight, ("r + 2n", r + 2 * n), ("d", d))
    check_shape(op, "dt_bias", dt_bias, ("d", d))
    check_shape(op, "A", A, ("d", d), ("n", n))
    check_shape(op, "D", D, ("d", d))
    if x.stride(-1) != 1 or z.stride(-1) != 1 or x_proj_weight.stride(-1) != 1 or dt_proj_weight.stride(-1) != 1:
        raise ValueError(f"{op}: x, z and the weights must be contiguous along their last dimension")
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().mamba1_x_proj_state_update(state, x, z, x_proj_weight, dt_proj_weight, dt_bias, A, D,
                                                    bcdt_eps)
    return naive.mamba1_x_proj_state_update(state, x, z, x_proj_weight, dt_proj_weight, dt_bias, A, D, bcdt_eps)


__all__ = ["norm_in_proj_conv", "state_update_gate", "gated_out_proj_residual", "mamba1_x_proj_state_update"]
