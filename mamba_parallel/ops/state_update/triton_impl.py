"""Triton decode steps: ``selective_state_update`` (Mamba-1) and ``ssd_state_update`` (Mamba-2).

Arguments are validated by ``mamba_parallel.ops.state_update``. The state is updated in place (any strides, any
float dtype; fp32 math); no autograd (decoding only).
"""

from __future__ import annotations

import math

import torch
import triton

from mamba_parallel.ops.state_update.triton_kernels import mamba1_step_kernel, mamba2_step_kernel


def _tile(width: int, dstate_pow2: int) -> int:
    """Rows of a (rows, n) state tile: about 2K fp32 elements per program keeps many programs in flight."""
    return max(1, min(triton.next_power_of_2(width), max(1, 2048 // dstate_pow2)))


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_indices=None):
    """state (B, d, n) in place; x, dt, z (b, d); A (d, n); B, C (b, n) or (b, g, n); D, dt_bias (d,) -> y (b, d)."""
    b, d = x.shape
    n = state.shape[2]
    B3 = B if B.dim() == 3 else B.unsqueeze(1)
    C3 = C if C.dim() == 3 else C.unsqueeze(1)
    y = torch.empty((b, d), device=x.device, dtype=x.dtype)
    if b == 0:
        return y
    ns = triton.next_power_of_2(n)
    bd = _tile(d, ns)
    zz = z if z is not None else x
    mamba1_step_kernel[(triton.cdiv(d, bd), b)](
        state, x, dt, A, B3, C3, D if D is not None else y, zz, dt_bias if dt_bias is not None else y,
        state_indices if state_indices is not None else y, y,
        d, n, d // B3.shape[1],
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B3.stride(), *C3.stride(), *zz.stride(),
        y.stride(0),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None, SOFTPLUS=dt_softplus,
        HAS_IDX=state_indices is not None, BD=bd, NS=ns, num_warps=4,
    )
    return y


def ssd_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, math.inf), state_indices=None):
    """state (B, h, p, n) in place; x, z (b, h, p); dt (b, h); A (h,); B, C (b, g, n); D (h,) or (h, p);
    dt_bias (h,) -> y (b, h, p)."""
    b, h, p = x.shape
    n = state.shape[3]
    y = torch.empty((b, h, p), device=x.device, dtype=x.dtype)
    if b == 0:
        return y
    ns = triton.next_power_of_2(n)
    bp = _tile(p, ns)
    zz = z if z is not None else x
    if D is None:
        sD = (0, 0)
    else:
        sD = tuple(D.stride()) if D.dim() == 2 else (D.stride(0), 0)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    clamp = (lo, hi) != (0.0, math.inf)
    mamba2_step_kernel[(triton.cdiv(p, bp), h, b)](
        state, x, dt, A, B, C, D if D is not None else y, zz, dt_bias if dt_bias is not None else y,
        state_indices if state_indices is not None else y, y,
        p, n, h // B.shape[1], lo, hi if math.isfinite(hi) else 3.0e38,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(), *sD,
        y.stride(0), y.stride(1),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None, SOFTPLUS=dt_softplus,
        CLAMP=clamp, HAS_IDX=state_indices is not None, BP=bp, NS=ns, num_warps=4,
    )
    return y
