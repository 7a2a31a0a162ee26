"""Reference of the decode step's fused linears: the unfused ops they replace, one after the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_parallel.ops.conv1d import naive as conv_naive
from mamba_parallel.ops.norm import naive as norm_naive


def _conv_columns(out: torch.Tensor, conv) -> torch.Tensor:
    """Columns [conv.start, conv.start + C) of ``out`` through the conv's one-token update + silu (state in place)."""
    if conv is None:
        return out
    c = conv.state.shape[1]
    seg = out[:, conv.start:conv.start + c]
    y = conv_naive.causal_conv1d_update(seg, conv.state, conv.weight, conv.bias, activation="silu")
    return torch.cat([out[:, :conv.start], y, out[:, conv.start + c:]], dim=1)


def add_rms_norm_linear(x, residual, norm_weight, weight, bias=None, eps: float = 1e-5,
                        residual_in_fp32: bool = True, conv=None):
    """x (b, K), residual (b, K) or None -> (F.linear(add_rms_norm(x, residual)) [conv columns], new residual)."""
    y, new_res = norm_naive.add_rms_norm(x, residual, norm_weight, eps, residual_in_fp32)
    out = F.linear(y, weight.to(y.dtype), None if bias is None else bias.to(y.dtype))
    return _conv_columns(out, conv), new_res


def linear_partials(x, weight, k_per_split: int):
    """x (b, K), weight (N, K) -> (S, b, N) fp32: x's K slices of k_per_split channels times weight's, S slices."""
    xs = x.float().split(k_per_split, dim=1)
    ws = weight.float().split(k_per_split, dim=1)
    return torch.stack([F.linear(a, w) for a, w in zip(xs, ws)])
