"""Backward Triton kernel of the RMSNorm family (see triton_norm_fwd.py for the forward it differentiates).

One pass: each program owns one channel group and a contiguous block of rows. It walks its rows one at a time,
writes dx (and dz, the residual's gradient; on request the forward's output again) for each, and accumulates the
weight gradient of its rows in an fp32 register vector of the group's width; at the end it stores that vector as
one partial row, which the caller sums over programs (a small reduce). x, dy and z are read once, instead of a
second time by a column-reduction kernel. The grid is a few programs per SM, so each program's partial row is
amortised over many rows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_bwd_kernel(
    X, Z, W, DY, DRES_OUT, RSTD,
    DX, DX2, DZ, DW_PART, Y,
    M, N, rows_per_program,
    stride_x, stride_z, stride_dy, stride_dres_out, stride_dx, stride_dx2, stride_dz, stride_dw_part, stride_y,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, HAS_DRES_OUT: tl.constexpr, STORE_DX2: tl.constexpr,
    STORE_Y: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (p, g): rows [p * rows_per_program, min(M, (p + 1) * rows_per_program)) of channel group g.

    X is the normalised input before the gate (for add_rms_norm: the new residual); RSTD is (groups, M).
    DX2 (optional) receives the same gradient as DX in a second dtype (the residual's gradient).
    Y (STORE_Y) receives the forward's output, the same values (the same fp32 products in the same order): a
    following matmul's weight gradient needs it, and keeping it from the forward would cost its memory. It is
    stored last in the row, when little else is live (stored earlier, ptxas needs up to 25 more registers).
    DW_PART[p, g * N + c] = sum over the program's rows of dy * xhat (* silu(z) when the gate follows the norm):
    y = w * (x * gate * rstd) or w * (x * rstd) * gate, so dw is dy times y / w either way.
    """
    pid = tl.program_id(0)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    cols = group * N + offs
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row in range(row_start, row_end):
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
                tl.store(DZ + row * stride_dz + cols, (dy * xhat * w * dgate_dz).to(DZ.dtype.element_ty),
                         mask=mask)
                dy = dy * gate
            else:
                # y = rmsnorm(x * gate) * w
                xhat = x * gate * rstd
        else:
            xhat = x * rstd
        dw += dy * xhat
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
        if STORE_Y:
            if HAS_Z and NORM_BEFORE_GATE:
                tl.store(Y + row * stride_y + cols, (xhat * w * gate).to(Y.dtype.element_ty), mask=mask)
            else:
                tl.store(Y + row * stride_y + cols, (xhat * w).to(Y.dtype.element_ty), mask=mask)
        if STORE_DX2:
            tl.store(DX2 + row * stride_dx2 + cols, dx.to(DX2.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * stride_dw_part + cols, dw, mask=mask)
