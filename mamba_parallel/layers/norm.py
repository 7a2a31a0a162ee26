"""Norm modules: ``RMSNorm`` (pre-norm of every block, final norm) and ``RMSNormGated`` (Mamba-2's ``mixer.norm``).

Both keep mamba_ssm's state-dict names (a single ``weight``). ``add_norm`` is the pre-norm residual step of a block
for either an RMSNorm or a LayerNorm (``config.rms_norm = False``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mamba_parallel import ops


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim (size ``dim``)."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> (..., dim) in x.dtype."""
        return ops.rms_norm(x, self.weight, self.eps)


class RMSNormGated(nn.Module):
    """Mamba-2's output norm: RMS over groups of ``group_size`` channels, gated by silu(z).

    ``norm_before_gate=False`` (mamba_ssm's default): rmsnorm(x * silu(z)) * weight. ``group_size`` is d_inner /
    ngroups so the statistics never mix B/C groups; tensor parallelism shards whole groups and keeps it unchanged.
    """

    def __init__(self, dim: int, eps: float = 1e-5, group_size: int | None = None, norm_before_gate: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """x, z (..., dim) -> (..., dim) in x.dtype."""
        return ops.gated_rms_norm(x, z, self.weight, self.eps, group_size=self.group_size,
                                  norm_before_gate=self.norm_before_gate)


def make_norm(dim: int, rms_norm: bool, eps: float, device=None, dtype=None) -> nn.Module:
    """RMSNorm when ``rms_norm`` (every Mamba preset), else LayerNorm (weight + bias, as mamba_ssm)."""
    if rms_norm:
        return RMSNorm(dim, eps=eps, device=device, dtype=dtype)
    return nn.LayerNorm(dim, eps=eps, device=device, dtype=dtype)


def add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
             residual_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm residual step. x, residual (b, L, d) -> (norm(x + residual) in x.dtype, x + residual).

    The new residual is fp32 when ``residual_in_fp32`` (the stream that crosses all layers keeps full precision).
    """
    if isinstance(norm, RMSNorm):
        return ops.add_rms_norm(x, residual, norm.weight, norm.eps, residual_in_fp32=residual_in_fp32)
    res_dtype = torch.float32 if residual_in_fp32 else x.dtype
    new_res = x.to(res_dtype) if residual is None else x.to(res_dtype) + residual.to(res_dtype)
    w = None if norm.weight is None else norm.weight.float()
    b = None if norm.bias is None else norm.bias.float()
    y = F.layer_norm(new_res.float(), norm.normalized_shape, w, b, norm.eps)
    return y.to(x.dtype), new_res
