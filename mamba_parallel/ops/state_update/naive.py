"""One-token recurrent steps for Mamba-1 and Mamba-2 in plain PyTorch (the specification; fp32 math)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mamba_parallel.ops._common import compute_dtype, fp32_math, process_dt


def _write_rows(state: torch.Tensor, rows: torch.Tensor | None, new: torch.Tensor) -> None:
    if rows is None:
        state.copy_(new)
    else:
        state[rows] = new


def _read_rows(state: torch.Tensor, rows: torch.Tensor | None, ct: torch.dtype) -> torch.Tensor:
    # A copy: autograd may save it, and the state itself is overwritten in place below.
    return state.to(ct, copy=True) if rows is None else state[rows].to(ct)


def _per_channel(t: torch.Tensor, channels: int) -> torch.Tensor:
    """(b, n) or (b, g, n) -> (b, channels, n): channel block i of channels/g uses group i."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.repeat_interleave(channels // t.shape[1], dim=1)


@fp32_math
def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_indices=None):
    """state (B, d, n) in place; x, dt, z (b, d); A (d, n); B, C (b, n) or (b, g, n); D (d,) -> y (b, d)."""
    ct = compute_dtype(x, state, A)
    d = x.shape[1]
    rows = None if state_indices is None else state_indices.long()
    s = _read_rows(state, rows, ct)
    dtf = process_dt(dt, dt_bias, dt_softplus, dtype=ct)
    xf = x.to(ct)
    Bc, Cc = _per_channel(B.to(ct), d), _per_channel(C.to(ct), d)
    s = torch.exp(dtf.unsqueeze(-1) * A.to(ct)) * s + (dtf * xf).unsqueeze(-1) * Bc
    _write_rows(state, rows, s.to(state.dtype))
    y = (s * Cc).sum(-1)
    if D is not None:
        y = y + D.to(ct) * xf
    if z is not None:
        y = y * F.silu(z.to(ct))
    return y.to(x.dtype)


@fp32_math
def ssd_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, math.inf), state_indices=None):
    """state (B, h, p, n) in place; x, z (b, h, p); dt (b, h); A (h,); B, C (b, g, n); D (h,)/(h, p) -> (b, h, p)."""
    ct = compute_dtype(x, state, A)
    h = x.shape[1]
    rows = None if state_indices is None else state_indices.long()
    s = _read_rows(state, rows, ct)
    dtf = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype=ct)  # (b, h)
    xf = x.to(ct)
    Bh, Ch = _per_channel(B.to(ct), h), _per_channel(C.to(ct), h)  # (b, h, n)
    decay = torch.exp(dtf * A.to(ct))[..., None, None]
    s = decay * s + (dtf[..., None] * xf).unsqueeze(-1) * Bh.unsqueeze(2)
    _write_rows(state, rows, s.to(state.dtype))
    y = (s * Ch.unsqueeze(2)).sum(-1)
    if D is not None:
        Df = D.to(ct)
        y = y + (Df if Df.dim() == 2 else Df[:, None]) * xf
    if z is not None:
        y = y * F.silu(z.to(ct))
    return y.to(x.dtype)
