"""RMSNorm family: ``rms_norm``, ``add_rms_norm`` (residual add fused with the norm), ``add_rms_norm_linear`` (the
block's add + norm and the mixer's in_proj as one node), ``gated_rms_norm`` (Mamba-2), ``gated_rms_norm_linear``
(Mamba-2's gated norm and out_proj as one node). The two norm + linear nodes keep no norm output."""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import check_divides, check_ndim, check_shape, kernel_module
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.norm import naive


def _kernel():
    return kernel_module(__name__)


def _check_weight(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_ndim(op, "x", x, tuple(range(1, 9)), "(..., d)")
    check_shape(op, "weight", weight, ("d", x.shape[-1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x (..., d), weight (d,) -> y (..., d) in x.dtype; y = x / sqrt(mean(x^2, -1) + eps) * weight (fp32 math)."""
    _check_weight("rms_norm", x, weight)
    if use_triton(x, op="rms_norm", has_kernel=_kernel() is not None):
        return _kernel().rms_norm(x, weight, eps)
    return naive.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-5,
                 residual_in_fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d), residual (..., d) or None, weight (d,) -> (y, new_residual), both (..., d).

    new_residual = x + residual (fp32 when ``residual_in_fp32``, else x.dtype); y = rms_norm(new_residual) in
    x.dtype. The pre-norm block: the residual stream is carried in fp32 between layers.
    """
    _check_weight("add_rms_norm", x, weight)
    check_shape("add_rms_norm", "residual", residual, *(("...", s) for s in x.shape[:-1]), ("d", x.shape[-1]))
    if use_triton(x, op="add_rms_norm", has_kernel=_kernel() is not None):
        return _kernel().add_rms_norm(x, residual, weight, eps, residual_in_fp32)
    return naive.add_rms_norm(x, residual, weight, eps, residual_in_fp32)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        lin_weight: torch.Tensor, lin_bias: torch.Tensor | None = None, eps: float = 1e-5,
                        residual_in_fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d), residual (..., d) or None, weight (d,), lin_weight (e, d), lin_bias (e,) or None ->
    (out (..., e), new_residual (..., d)).

    y, new_residual = add_rms_norm(x, residual, weight, eps, residual_in_fp32); out = F.linear(y, lin_weight,
    lin_bias), the matmul in autocast's dtype when autocast is on (as nn.Linear), else in the promotion of y's and
    lin_weight's dtypes. On the Triton path, with the new residual in fp32, it is one autograd node that keeps no
    norm output and no cast copy of lin_weight (the new residual, rstd, both weights as given): the norm's backward
    kernel writes y again for lin_weight's gradient (docs/memory.md).
    """
    _check_weight("add_rms_norm_linear", x, weight)
    check_shape("add_rms_norm_linear", "residual", residual, *(("...", s) for s in x.shape[:-1]), ("d", x.shape[-1]))
    check_ndim("add_rms_norm_linear", "lin_weight", lin_weight, (2,), "(e, d)")
    check_shape("add_rms_norm_linear", "lin_weight", lin_weight, ("e", lin_weight.shape[0]), ("d", x.shape[-1]))
    check_shape("add_rms_norm_linear", "lin_bias", lin_bias, ("e", lin_weight.shape[0]))
    if use_triton(x, op="add_rms_norm_linear", has_kernel=_kernel() is not None):
        return _kernel().add_rms_norm_linear(x, residual, weight, lin_weight, lin_bias, eps, residual_in_fp32)
    return naive.add_rms_norm_linear(x, residual, weight, lin_weight, lin_bias, eps, residual_in_fp32)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-5,
                   group_size: int | None = None, norm_before_gate: bool = False) -> torch.Tensor:
    """x (..., d), z (..., d) or None, weight (d,) -> y (..., d) in x.dtype.

    The RMS is taken over each group of ``group_size`` consecutive channels (None: all d), as Mamba-2 does with
    ngroups > 1. norm_before_gate=False: y = rmsnorm(x * silu(z)) * weight; True: y = rmsnorm(x) * weight *
    silu(z). z None: plain (grouped) RMSNorm.
    """
    _check_weight("gated_rms_norm", x, weight)
    check_shape("gated_rms_norm", "z", z, *(("...", s) for s in x.shape[:-1]), ("d", x.shape[-1]))
    if group_size is not None:
        check_divides("gated_rms_norm", "group_size", group_size, "d", x.shape[-1])
    if use_triton(x, op="gated_rms_norm", has_kernel=_kernel() is not None):
        return _kernel().gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate)
    return naive.gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate)


def gated_rms_norm_linear(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, out_weight: torch.Tensor,
                          out_bias: torch.Tensor | None = None, eps: float = 1e-5, group_size: int | None = None,
                          norm_before_gate: bool = False) -> torch.Tensor:
    """x (..., d), z (..., d) or None, weight (d,), out_weight (e, d), out_bias (e,) or None -> (..., e).

    F.linear(gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate), out_weight, out_bias), the matmul in
    autocast's dtype when autocast is on (as nn.Linear), else in the promotion of x's and out_weight's dtypes.
    On the Triton path it is one autograd node that keeps no norm output (x, z, the norm's rstd and out_weight as
    given): the norm's backward kernel writes it again for out_weight's gradient (docs/memory.md).
    """
    _check_weight("gated_rms_norm_linear", x, weight)
    check_shape("gated_rms_norm_linear", "z", z, *(("...", s) for s in x.shape[:-1]), ("d", x.shape[-1]))
    check_ndim("gated_rms_norm_linear", "out_weight", out_weight, (2,), "(e, d)")
    check_shape("gated_rms_norm_linear", "out_weight", out_weight, ("e", out_weight.shape[0]), ("d", x.shape[-1]))
    check_shape("gated_rms_norm_linear", "out_bias", out_bias, ("e", out_weight.shape[0]))
    if group_size is not None:
        check_divides("gated_rms_norm_linear", "group_size", group_size, "d", x.shape[-1])
    if use_triton(x, op="gated_rms_norm_linear", has_kernel=_kernel() is not None):
        return _kernel().gated_rms_norm_linear(x, z, weight, out_weight, out_bias, eps, group_size, norm_before_gate)
    return naive.gated_rms_norm_linear(x, z, weight, out_weight, out_bias, eps, group_size, norm_before_gate)


__all__ = ["rms_norm", "add_rms_norm", "add_rms_norm_linear", "gated_rms_norm", "gated_rms_norm_linear"]
