"""One-token recurrent steps for decoding: ``selective_state_update`` (Mamba-1) and ``ssd_state_update`` (Mamba-2).

Both update the state IN PLACE and give the same outputs as the full scans fed one token at a time.
"""

from __future__ import annotations

import math

import torch

from mamba_parallel.ops._common import check_divides, check_int, check_ndim, check_shape, kernel_module
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.state_update import naive


def _kernel():
    return kernel_module(__name__)


def _check_state_rows(op: str, state: torch.Tensor, b: int, state_indices) -> int:
    check_shape(op, "state_indices", state_indices, ("b", b))
    check_int(op, "state_indices", state_indices)
    if not state.is_floating_point():
        raise ValueError(f"{op}: state must be floating point, got {state.dtype}")
    return state.shape[0] if state_indices is not None else b


def _check_groups(op: str, B, C, b: int, n: int, heads: int, heads_name: str) -> None:
    check_ndim(op, "B", B, (2, 3), "(b, n) or (b, g, n)")
    if B.dim() == 2:
        check_shape(op, "B", B, ("b", b), ("n", n))
        check_shape(op, "C", C, ("b", b), ("n", n))
    else:
        g = B.shape[1]
        check_shape(op, "B", B, ("b", b), ("g", g), ("n", n))
        check_shape(op, "C", C, ("b", b), ("g", g), ("n", n))
        check_divides(op, "B/C groups g", g, heads_name, heads)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                           z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           dt_softplus: bool = False, state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One Mamba-1 token. state (B, d, n) fp32 updated IN PLACE (rows ``state_indices`` (b,) if given, else all
    with B == b); x, dt, z (b, d); A (d, n); B, C (b, n) or (b, g, n); D, dt_bias (d,) -> y (b, d) in x.dtype.

    dt <- softplus(dt + dt_bias) if dt_softplus; state = exp(dt A) state + dt B x; y = state C + D x; y *= silu(z).
    """
    op = "selective_state_update"
    check_ndim(op, "x", x, (2,), "(b, d)")
    b, d = x.shape
    check_ndim(op, "state", state, (3,), "(B, d, n)")
    n = state.shape[2]
    nb = _check_state_rows(op, state, b, state_indices)
    check_shape(op, "state", state, ("B", nb), ("d", d), ("n", n))
    check_shape(op, "dt", dt, ("b", b), ("d", d))
    check_shape(op, "A", A, ("d", d), ("n", n))
    _check_groups(op, B, C, b, n, d, "d")
    check_shape(op, "D", D, ("d", d))
    check_shape(op, "z", z, ("b", b), ("d", d))
    check_shape(op, "dt_bias", dt_bias, ("d", d))
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices)
    return naive.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices)


def ssd_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                     dt_limit: tuple[float, float] = (0.0, math.inf),
                     state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One Mamba-2 token. state (B, h, p, n) fp32 updated IN PLACE (rows ``state_indices`` (b,) if given, else all
    with B == b); x, z (b, h, p); dt (b, h); A (h,); B, C (b, g, n); D (h,) or (h, p); dt_bias (h,)
    -> y (b, h, p) in x.dtype.

    dt <- clamp(softplus(dt + dt_bias), *dt_limit); state = exp(dt A) state + dt x B^T; y = state C + D x;
    y *= silu(z).
    """
    op = "ssd_state_update"
    check_ndim(op, "x", x, (3,), "(b, h, p)")
    b, h, p = x.shape
    check_ndim(op, "state", state, (4,), "(B, h, p, n)")
    n = state.shape[3]
    nb = _check_state_rows(op, state, b, state_indices)
    check_shape(op, "state", state, ("B", nb), ("h", h), ("p", p), ("n", n))
    check_shape(op, "dt", dt, ("b", b), ("h", h))
    check_shape(op, "A", A, ("h", h))
    check_ndim(op, "B", B, (3,), "(b, g, n)")
    _check_groups(op, B, C, b, n, h, "heads h")
    if D is not None:
        if D.dim() == 2:
            check_shape(op, "D", D, ("h", h), ("p", p))
        else:
            check_shape(op, "D", D, ("h", h))
    check_shape(op, "z", z, ("b", b), ("h", h), ("p", p))
    check_shape(op, "dt_bias", dt_bias, ("h", h))
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"{op}: dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        return _kernel().ssd_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                          state_indices)
    return naive.ssd_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, state_indices)


__all__ = ["selective_state_update", "ssd_state_update"]
