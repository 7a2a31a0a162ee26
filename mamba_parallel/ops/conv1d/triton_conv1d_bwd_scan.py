"""Single-pass backward of the causal depthwise conv1d (width W <= 4) that walks positions one row at a time.

A program owns BLOCK_D channels and a chunk of positions [t0, t0 + chunk). Every thread keeps, per channel, a
sliding window of the last three inputs x[p-3..p-1] and pre-activation gradients dpre[p-3..p-1] in registers, so
at each position p it computes pre[p] and dpre[p] = dy[p] silu'(pre[p]) once, adds dpre[p] x[p-3+m] to its
weight-gradient accumulators, and completes dx[p-3] = sum_s w[W-1-s] dpre[p-3+s]. No shifted reloads, no
recomputed sigmoids and no cross-thread reductions: each element's x and dy are read once, dx written once. The
chunk runs three rows past its end (dpre only, for its last dx rows); the first chunk's rows before position 0 are
the initial state's gradient. W < 4 is handled as W = 4 with leading zero taps.

Rows go BLOCK_L (1, 2, 4 or 8) per step, in three phases: load every row, compute, store every dx row. Loads may
not move above a store (dx could alias x or dy as far as the compiler knows), so loading row by row between stores
would leave one row of loads in flight per thread; instead the next step's rows are loaded before the current
step is computed. The chunk is BLOCK_L x tiles_per_program rows.

One row's loads are contiguous over channels in the channels-last layout (the Mamba-2 layer's); in the contiguous
layout every channel is its own cache line, so this path suits channels-last inputs (launch.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.conv1d.triton_conv1d_fwd import row_bases, seq_at

@triton.jit
def _tap(k: tl.constexpr, v0, v1, v2, v3):
    """Value k in 0..3 of four held in named registers (taps, window rows)."""
    if k == 0:
        r = v0
    elif k == 1:
        r = v1
    elif k == 2:
        r = v2
    else:
        r = v3
    return r


@triton.jit
def _sigmoid_ftz(x):
    """1 / (1 + 2^(-x log2 e)) with the flush-to-zero approximate ex2 / rcp (2 MUFU + 2 ALU, ~2 ulp): tl.sigmoid's
    denormal and IEEE-division handling costs ~7 more instructions per element. GPU only (inline PTX)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 t; mul.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; add.f32 t, t, 0f3F800000; "
        "rcp.approx.ftz.f32 $0, t; }",
        "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _dsilu(dy, pre, FAST: tl.constexpr):
    """dy * silu'(pre)."""
    if FAST:
        sig = _sigmoid_ftz(pre)
    else:
        sig = tl.sigmoid(pre)
    return dy * sig * (1.0 + pre * (1.0 - sig))


@triton.jit
def _row_mask(cl, n_c, cond):
    """Channels cl < n_c where the scalar row condition holds: one vector compare (and a bool vector in the
    interpreter, whose block & scalar gives integers)."""
    return cl < tl.where(cond, n_c, 0)


@triton.jit
def _row_x(x_cb, init_base, p, cl, c, n_c, L, stride_x_d, stride_x_l, stride_i_d, stride_i_k,
           W: tl.constexpr, HAS_INIT: tl.constexpr):
    """Input row at position p (scalar) -> (BLOCK_D,) fp32: x, the initial state before position 0, else 0."""
    v = tl.load(x_cb + p.to(tl.int64) * stride_x_l + cl * stride_x_d, mask=_row_mask(cl, n_c, (p >= 0) & (p < L)),
                other=0.0).to(tl.float32)
    if HAS_INIT:
        v += tl.load(init_base + c * stride_i_d + (p + (W - 1)) * stride_i_k,
                     mask=_row_mask(cl, n_c, (p < 0) & (p + (W - 1) >= 0)), other=0.0).to(tl.float32)
    return v


@triton.jit
def _ld_row(base, p, cl, n_c, L, stride_d, stride_l):
    """Row p (scalar, >= 0) of a channels block in the input dtype; zeros past L."""
    return tl.load(base + p.to(tl.int64) * stride_l + cl * stride_d, mask=_row_mask(cl, n_c, p < L), other=0.0)


@triton.jit
def _ld_rows(x_cb, dy_cb, p0, cl, n_c, L, stride_x_d, stride_x_l, stride_dy_d, stride_dy_l, R: tl.constexpr):
    """x and dy rows p0 .. p0 + R - 1 (p0 >= 0; zeros past L), in the input dtype -> (x0..x7, y0..y7), rows past R
    aliasing row 0."""
    x0 = _ld_row(x_cb, p0, cl, n_c, L, stride_x_d, stride_x_l)
    y0 = _ld_row(dy_cb, p0, cl, n_c, L, stride_dy_d, stride_dy_l)
    x1, x2, x3, x4, x5, x6, x7 = x0, x0, x0, x0, x0, x0, x0
    y1, y2, y3, y4, y5, y6, y7 = y0, y0, y0, y0, y0, y0, y0
    if R > 1:
        x1 = _ld_row(x_cb, p0 + 1, cl, n_c, L, stride_x_d, stride_x_l)
        y1 = _ld_row(dy_cb, p0 + 1, cl, n_c, L, stride_dy_d, stride_dy_l)
    if R > 2:
        x2 = _ld_row(x_cb, p0 + 2, cl, n_c, L, stride_x_d, stride_x_l)
        y2 = _ld_row(dy_cb, p0 + 2, cl, n_c, L, stride_dy_d, stride_dy_l)
        x3 = _ld_row(x_cb, p0 + 3, cl, n_c, L, stride_x_d, stride_x_l)
        y3 = _ld_row(dy_cb, p0 + 3, cl, n_c, L, stride_dy_d, stride_dy_l)
    if R > 4:
        x4 = _ld_row(x_cb, p0 + 4, cl, n_c, L, stride_x_d, stride_x_l)
        y4 = _ld_row(dy_cb, p0 + 4, cl, n_c, L, stride_dy_d, stride_dy_l)
        x5 = _ld_row(x_cb, p0 + 5, cl, n_c, L, stride_x_d, stride_x_l)
        y5 = _ld_row(dy_cb, p0 + 5, cl, n_c, L, stride_dy_d, stride_dy_l)
        x6 = _ld_row(x_cb, p0 + 6, cl, n_c, L, stride_x_d, stride_x_l)
        y6 = _ld_row(dy_cb, p0 + 6, cl, n_c, L, stride_dy_d, stride_dy_l)
        x7 = _ld_row(x_cb, p0 + 7, cl, n_c, L, stride_x_d, stride_x_l)
        y7 = _ld_row(dy_cb, p0 + 7, cl, n_c, L, stride_dy_d, stride_dy_l)
    return x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def _pick8(r: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """Row r in 0..7 of values held in named registers."""
    if r < 4:
        o = _tap(r, v0, v1, v2, v3)
    else:
        o = _tap(r - 4, v4, v5, v6, v7)
    return o


@triton.jit
def _set8(r: tl.constexpr, v, v0, v1, v2, v3, v4, v5, v6, v7):
    """(v0..v7) with row r in 0..7 replaced by v (named registers: Triton has no register arrays)."""
    if r == 0:
        v0 = v
    elif r == 1:
        v1 = v
    elif r == 2:
        v2 = v
    elif r == 3:
        v3 = v
    elif r == 4:
        v4 = v
    elif r == 5:
        v5 = v
    elif r == 6:
        v6 = v
    else:
        v7 = v
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _scan_step(p, x0, dy, xm3, xm2, xm1, dpm3, dpm2, dpm1, sm3, sm2, sm1, da0, da1, da2, da3, db,
               a0, a1, a2, a3, bias, seq_base, seq0, L, stride_s_l,
               HAS_SEQ: tl.constexpr, SILU: tl.constexpr, FAST_SIGMOID: tl.constexpr, ACCUMULATE: tl.constexpr):
    """Position p with input row x0 and output gradient row dy (fp32): dpre[p], the weight / bias products
    (ACCUMULATE: rows of the chunk) and dx[p - 3]. -> the windows shifted by one, the accumulators, dx[p - 3]."""
    s0 = seq0
    x3 = xm3
    x2 = xm2
    x1 = xm1
    if HAS_SEQ:
        # a tap only reads inputs of p's own sequence
        s0 = seq_at(seq_base, p.to(tl.int64), L, stride_s_l, seq0)
        x3 = tl.where(sm3 == s0, xm3, 0.0)
        x2 = tl.where(sm2 == s0, xm2, 0.0)
        x1 = tl.where(sm1 == s0, xm1, 0.0)
    dp = dy
    if SILU:
        dp = _dsilu(dy, bias + a0 * x3 + a1 * x2 + a2 * x1 + a3 * x0, FAST_SIGMOID)
    if ACCUMULATE:
        db += dp
        da0 += dp * x3
        da1 += dp * x2
        da2 += dp * x1
        da3 += dp * x0
    # dx[q], q = p - 3: dpre[q + s] of q's own sequence
    e2 = dpm2
    e1 = dpm1
    e0 = dp
    if HAS_SEQ:
        e2 = tl.where(sm2 == sm3, dpm2, 0.0)
        e1 = tl.where(sm1 == sm3, dpm1, 0.0)
        e0 = tl.where(s0 == sm3, dp, 0.0)
        sm3 = sm2
        sm2 = sm1
        sm1 = s0
    dxq = a3 * dpm3 + a2 * e2 + a1 * e1 + a0 * e0
    return xm2, xm1, x0, dpm2, dpm1, dp, sm3, sm2, sm1, da0, da1, da2, da3, db, dxq


@triton.jit
def _store_dx(q, dxq, t0, t_end, L, dx_cb, dinit_b, cl, c, n_c, stride_dx_d, stride_dx_l, stride_di_d,
              stride_di_k, W: tl.constexpr, HAS_INIT: tl.constexpr):
    """dx row q when it belongs to the chunk; before position 0 (first chunk only) the initial state's gradient."""
    tl.store(dx_cb + q.to(tl.int64) * stride_dx_l + cl * stride_dx_d, dxq.to(dx_cb.dtype.element_ty),
             mask=_row_mask(cl, n_c, (q >= t0) & (q < t_end) & (q < L)))
    if HAS_INIT:
        # initial-state slot j = q + (W - 1) holds input q < 0
        j = q + (W - 1)
        tl.store(dinit_b + c * stride_di_d + j * stride_di_k, dxq.to(dinit_b.dtype.element_ty),
                 mask=_row_mask(cl, n_c, (q < 0) & (j >= 0) & (t0 == 0)))


@triton.jit
def conv1d_bwd_scan_kernel(
    X, WEIGHT, BIAS, INIT, SEQ, DY,
    DX, DINIT, DW_PART, DB_PART,
    D, L, tiles_per_program,
    stride_x_b, stride_x_d, stride_x_l,
    stride_w_d, stride_w_k,
    stride_i_b, stride_i_d, stride_i_k,
    stride_s_b, stride_s_l,
    stride_dy_b, stride_dy_d, stride_dy_l,
    stride_dx_b, stride_dx_d, stride_dx_l,
    stride_di_b, stride_di_d, stride_di_k,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tl.static_assert(BLOCK_L <= 8, "one-pass conv backward: BLOCK_L (rows per step) must be 1, 2, 4 or 8")
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c0 = pid_d * BLOCK_D
    cl = tl.arange(0, BLOCK_D)
    c = c0 + cl
    n_c = D - c0  # channels of this block: cl < n_c
    mask_c = cl < n_c
    x_base, init_base, seq_base, seq0 = row_bases(X, INIT, SEQ, b, stride_x_b, stride_i_b, stride_s_b, HAS_INIT,
                                                  HAS_SEQ)
    x_cb = x_base + c0.to(tl.int64) * stride_x_d
    dy_cb = DY + b * stride_dy_b + c0.to(tl.int64) * stride_dy_d
    dx_cb = DX + b * stride_dx_b + c0.to(tl.int64) * stride_dx_d
    dinit_b = DINIT + b * stride_di_b
    # the filter padded to width 4 on the left: tap m is w[m - (4 - W)], zeros before it
    a0 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    a1 = a0
    a2 = a0
    if W > 3:
        a0 = tl.load(WEIGHT + c * stride_w_d + (W - 4) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    if W > 2:
        a1 = tl.load(WEIGHT + c * stride_w_d + (W - 3) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    if W > 1:
        a2 = tl.load(WEIGHT + c * stride_w_d + (W - 2) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    a3 = tl.load(WEIGHT + c * stride_w_d + (W - 1) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + c, mask=mask_c, other=0.0).to(tl.float32)

    chunk = tiles_per_program * BLOCK_L
    t0 = pid_l * chunk
    t_end = t0 + chunk
    # windows before the chunk: inputs x[t0-3 .. t0-1] (initial state / zeros before 0); dpre there only feeds dx
    # rows of the previous chunk, so zeros
    xm3 = _row_x(x_cb, init_base, t0 - 3, cl, c, n_c, L, stride_x_d, stride_x_l, stride_i_d, stride_i_k, W,
                 HAS_INIT)
    xm2 = _row_x(x_cb, init_base, t0 - 2, cl, c, n_c, L, stride_x_d, stride_x_l, stride_i_d, stride_i_k, W,
                 HAS_INIT)
    xm1 = _row_x(x_cb, init_base, t0 - 1, cl, c, n_c, L, stride_x_d, stride_x_l, stride_i_d, stride_i_k, W,
                 HAS_INIT)
    dpm3 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dpm2 = dpm3
    dpm1 = dpm3
    sm3 = seq0
    sm2 = seq0
    sm1 = seq0
    if HAS_SEQ:
        sm3 = seq_at(seq_base, (t0 - 3).to(tl.int64), L, stride_s_l, seq0)
        sm2 = seq_at(seq_base, (t0 - 2).to(tl.int64), L, stride_s_l, seq0)
        sm1 = seq_at(seq_base, (t0 - 1).to(tl.int64), L, stride_s_l, seq0)
    da0 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    da1 = da0
    da2 = da0
    da3 = da0
    db = da0
    nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, ny0, ny1, ny2, ny3, ny4, ny5, ny6, ny7 = _ld_rows(
        x_cb, dy_cb, t0, cl, n_c, L, stride_x_d, stride_x_l, stride_dy_d, stride_dy_l, BLOCK_L)
    for it in range(tiles_per_program):
        p0 = t0 + it * BLOCK_L
        x0, x1, x2, x3, x4, x5, x6, x7 = nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7
        y0, y1, y2, y3, y4, y5, y6, y7 = ny0, ny1, ny2, ny3, ny4, ny5, ny6, ny7
        # the next step's rows (past the chunk after the last step: the tail below reuses them)
        nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, ny0, ny1, ny2, ny3, ny4, ny5, ny6, ny7 = _ld_rows(
            x_cb, dy_cb, p0 + BLOCK_L, cl, n_c, L, stride_x_d, stride_x_l, stride_dy_d, stride_dy_l, BLOCK_L)
        d0, d1, d2, d3, d4, d5, d6, d7 = dpm3, dpm3, dpm3, dpm3, dpm3, dpm3, dpm3, dpm3
        for r in tl.static_range(BLOCK_L):
            xm3, xm2, xm1, dpm3, dpm2, dpm1, sm3, sm2, sm1, da0, da1, da2, da3, db, dxq = _scan_step(
                p0 + r, _pick8(r, x0, x1, x2, x3, x4, x5, x6, x7).to(tl.float32),
                _pick8(r, y0, y1, y2, y3, y4, y5, y6, y7).to(tl.float32),
                xm3, xm2, xm1, dpm3, dpm2, dpm1, sm3, sm2, sm1, da0, da1, da2, da3, db,
                a0, a1, a2, a3, bias, seq_base, seq0, L, stride_s_l, HAS_SEQ, SILU, FAST_SIGMOID, True)
            d0, d1, d2, d3, d4, d5, d6, d7 = _set8(r, dxq, d0, d1, d2, d3, d4, d5, d6, d7)
        for r in tl.static_range(BLOCK_L):
            _store_dx(p0 + r - 3, _pick8(r, d0, d1, d2, d3, d4, d5, d6, d7), t0, t_end, L, dx_cb, dinit_b, cl, c,
                      n_c, stride_dx_d, stride_dx_l, stride_di_d, stride_di_k, W, HAS_INIT)

    # three rows past the chunk: dpre only, to complete dx of its last rows
    if BLOCK_L >= 4:
        x0, x1, x2, x3, y0, y1, y2, y3 = nx0, nx1, nx2, nx3, ny0, ny1, ny2, ny3
    else:
        x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7 = _ld_rows(
            x_cb, dy_cb, t_end, cl, n_c, L, stride_x_d, stride_x_l, stride_dy_d, stride_dy_l, 4)
    d0 = dpm3
    d1 = dpm3
    d2 = dpm3
    for r in tl.static_range(3):
        xm3, xm2, xm1, dpm3, dpm2, dpm1, sm3, sm2, sm1, da0, da1, da2, da3, db, dxq = _scan_step(
            t_end + r, _tap(r, x0, x1, x2, x3).to(tl.float32), _tap(r, y0, y1, y2, y3).to(tl.float32),
            xm3, xm2, xm1, dpm3, dpm2, dpm1, sm3, sm2, sm1, da0, da1, da2, da3, db,
            a0, a1, a2, a3, bias, seq_base, seq0, L, stride_s_l, HAS_SEQ, SILU, FAST_SIGMOID, False)
        if r == 0:
            d0 = dxq
        elif r == 1:
            d1 = dxq
        else:
            d2 = dxq
    for r in tl.static_range(3):
        _store_dx(t_end + r - 3, _tap(r, d0, d1, d2, d2), t0, t_end, L, dx_cb, dinit_b, cl, c, n_c, stride_dx_d,
                  stride_dx_l, stride_di_d, stride_di_k, W, HAS_INIT)

    # padded tap m = k + (4 - W) is weight k
    part = (b * tl.num_programs(0) + pid_l) * D * W
    for k in tl.static_range(W):
        tl.store(DW_PART + part + c * W + k, _tap(k + (4 - W), da0, da1, da2, da3), mask=mask_c)
    if HAS_BIAS:
        tl.store(DB_PART + (b * tl.num_programs(0) + pid_l) * D + c, db, mask=mask_c)
