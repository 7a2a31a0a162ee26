"""RMSNorm, residual-add + RMSNorm and gated RMSNorm in plain PyTorch (the specification; fp32 math), and the
gated norm followed by a linear layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_parallel.ops._common import compute_dtype, fp32_math, linear_dtype, linear_in


@fp32_math
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x (..., d), weight (d,) -> x / sqrt(mean(x^2) + eps) * weight, (..., d) in x.dtype."""
    ct = compute_dtype(x, weight)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.to(ct)
    return y.to(x.dtype)


@fp32_math
def add_rms_norm(x, residual, weight, eps: float = 1e-5, residual_in_fp32: bool = True):
    """x (..., d), residual (..., d) or None -> (rms_norm(x + residual) in x.dtype, x + residual).

    The new residual is fp32 (fp64 for fp64 inputs) when ``residual_in_fp32``, else x.dtype.
    """
    ct = compute_dtype(x, residual, weight)
    new_res = x.to(ct) if residual is None else x.to(ct) + residual.to(ct)
    y = new_res * torch.rsqrt(new_res.square().mean(-1, keepdim=True) + eps) * weight.to(ct)
    res_dtype = ct if residual_in_fp32 else x.dtype
    return y.to(x.dtype), new_res.to(res_dtype)


@fp32_math
def gated_rms_norm(x, z, weight, eps: float = 1e-5, group_size: int | None = None, norm_before_gate: bool = False):
    """x/z (..., d), weight (d,) -> (..., d) in x.dtype, RMS taken per group of ``group_size`` channels.

    norm_before_gate=False: rmsnorm(x * silu(z)) * weight; True: rmsnorm(x) * weight * silu(z). z None: no gate.
    """
    ct = compute_dtype(x, z, weight)
    d = x.shape[-1]
    gs = d if group_size is None else group_size
    xf = x.to(ct)
    gate = None if z is None else F.silu(z.to(ct))
    if gate is not None and not norm_before_gate:
        xf = xf * gate
    xg = xf.unflatten(-1, (d // gs, gs))
    y = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(ct)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


def gated_rms_norm_linear(x, z, weight, out_weight, out_bias=None, eps: float = 1e-5, group_size: int | None = None,
                          norm_before_gate: bool = False):
    """x/z (..., d), weight (d,), out_weight (e, d), out_bias (e,) or None -> (..., e): F.linear of the gated norm's
    output (x.dtype) in ``linear_dtype`` (autocast's when on: what nn.Linear would compute)."""
    y = gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate)
    return linear_in(y, out_weight, out_bias, linear_dtype(y, out_weight))


def add_rms_norm_linear(x, residual, weight, lin_weight, lin_bias=None, eps: float = 1e-5,
                        residual_in_fp32: bool = True):
    """x (..., d), residual (..., d) or None, weight (d,), lin_weight (e, d), lin_bias (e,) or None ->
    (F.linear of add_rms_norm's output in ``linear_dtype``: (..., e), the new residual (..., d))."""
    y, new_res = add_rms_norm(x, residual, weight, eps, residual_in_fp32)
    return linear_in(y, lin_weight, lin_bias, linear_dtype(y, lin_weight)), new_res
