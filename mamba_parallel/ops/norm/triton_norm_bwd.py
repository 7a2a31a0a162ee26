"""Backward Triton kernels of the RMSNorm family (see triton_norm_fwd.py for the forward they differentiate).

Two kernels instead of one persistent loop: ``norm_bwd_dx_kernel`` is row-parallel like the forward (one group of
one row per program, so many rows are in flight per SM), and ``norm_bwd_dw_kernel`` reduces the weight gradient
down columns in tiles, writing one fp32 partial row per program (the caller sums the partials). The second
kernel re-reads x, dy (and z), which costs less than the low occupancy of a loop that carries a full-row
weight-gradient accumulator per program.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_bwd_dx_kernel(
    X, Z, W, DY, DRES_OUT, RSTD,
    DX, DX2, DZ,
    M, N,
    stride_x, stride_z, stride_dy, stride_dres_out, stride_dx, stride_dx2, stride_dz,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, HAS_DRES_OUT: tl.constexpr, STORE_DX2: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """X is the normalised input before the gate (for add_rms_norm: the new residual).

    DX2 (optional) receives the same gradient as DX in a second dtype (the residual's gradient).
    """
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * N + tl.arange(0, BLOCK_N)
    mask = tl.arange(0, BLOCK_N) < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + group * M + row)
    if HAS_Z:
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(z)
        gate = z * sig
        dgate_dz = sig * (1.0 + z * (1.0 - sig))
        if NORM_BEFORE_GATE:
            # y = xhat * w * gate
            xhat = x * rstd
            tl.store(DZ + row * stride_dz + cols, (dy * xhat * w * dgate_dz).to(DZ.dtype.element_ty), mask=mask)
            dy = dy * gate
        else:
            # y = rmsnorm(x * gate) * w
            xhat = x * gate * rstd
    else:
        xhat = x * rstd
    dxhat = dy * w
    du = (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / N)) * rstd
    if HAS_Z:
        if NORM_BEFORE_GATE:
            dx = du
        else:
            tl.store(DZ + row * stride_dz + cols, (du * x * dgate_dz).to(DZ.dtype.element_ty), mask=mask)
            dx = du * gate
    else:
        dx = du
    if HAS_DRES_OUT:
        dx += tl.load(DRES_OUT + row * stride_dres_out + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if STORE_DX2:
        tl.store(DX2 + row * stride_dx2 + cols, dx.to(DX2.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd_dw_kernel(
    X, Z, DY, RSTD, DW_PART,
    M, D, N, rows_per_program,
    stride_x, stride_z, stride_dy,
    HAS_Z: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """DW_PART[pid_r, c] = sum over this program's rows of dy * x * rstd (* silu(z)).

    Both gate placements give the same weight gradient: y = w * (x * rstd * gate) either way, only rstd differs,
    and that is the saved one. rows_per_program is a multiple of BLOCK_R.
    """
    pid_r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = cols < D
    group = cols // N
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    row0 = pid_r.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program, BLOCK_R):
        rows = row0 + i + tl.arange(0, BLOCK_R)
        mask = (rows < M)[:, None] & mask_c[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + group[None, :] * M + rows[:, None], mask=mask, other=0.0)
        t = dy * x * rstd
        if HAS_Z:
            z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            t = t * z * tl.sigmoid(z)
        acc += t
    tl.store(DW_PART + pid_r * D + cols, tl.sum(acc, axis=0), mask=mask_c)
