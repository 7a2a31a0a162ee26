"""Forward Triton kernel shared by the RMSNorm family: optional residual add, optional SiLU gate, group-wise RMS.

One program normalises one group of one row; the statistics are fp32 whatever the input dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_fwd_kernel(
    X, Z, RES, W, Y, RES_OUT, RSTD,
    M, N,  # rows, channels per group
    stride_x, stride_z, stride_res, stride_y, stride_res_out,
    eps,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * N + tl.arange(0, BLOCK_N)
    mask = tl.arange(0, BLOCK_N) < N

    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_RES:
        tl.store(RES_OUT + row * stride_res_out + cols, x.to(RES_OUT.dtype.element_ty), mask=mask)
    if HAS_Z:
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        gate = z * tl.sigmoid(z)
        if not NORM_BEFORE_GATE:
            x = x * gate

    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    # rstd is stored (groups, rows): the backward walks rows of one group.
    tl.store(RSTD + group * M + row, rstd)

    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y = y * gate
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
