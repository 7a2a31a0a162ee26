"""Single-pass backward Triton kernel of the causal depthwise conv1d (width W <= 4): dx, d(initial_state) and
per-program partial sums of dweight / dbias, with no fp32 dpre tensor in memory.

dpre = dy * silu'(pre) (dy itself without activation) is recomputed where it is needed. With pre[p] = bias +
sum_k w[k] x[p - (w-1) + k] and the sequence rule of triton_conv1d_fwd.py:
    dx[q] = sum_s w[w-1-s] dpre[q + s] [S(q) == S(q + s)],   dw[k] = sum_p dpre[p] x[p - (w-1) + k] [...].
Triton cannot shift a register tile along positions, so dpre[q + s] comes one of three ways (constexpr MODE):
  MODE_RECOMPUTE  pre at q + s recomputed by ``conv_preact`` for every shift s (its W shifted loads hit L1);
  MODE_XREUSE     the 2W-1 shifted x tiles loaded once per tile, every pre at q + s built from registers;
  MODE_GATHER     pre and dpre computed once per position, shifted by ``tl.gather``; tiles overlap by W-1
                  positions and each tile owns (writes dx, dweight, dbias for) its first BLOCK_L - (W-1).
The weight / bias products are summed over a tile's positions at once into (BLOCK_D,) vectors, one per tap
(DW_DEFER=False), or accumulated elementwise over all of a program's tiles and summed once (DW_DEFER=True: no
per-tile cross-thread reduction, BLOCK_L x BLOCK_D more registers per tap). A program walks
``tiles_per_program`` tiles along L and writes one partial row. With PREFETCH, the next tile's x and dy are loaded
before the current tile is computed, so a program keeps two tiles of DRAM reads in flight (the loop is
latency-bound otherwise: a tile's loads wait for the previous tile's compute). FAST_SIGMOID (GPU only) takes the
sigmoid from flush-to-zero approximate ex2 / rcp instructions (inline PTX, ~2 ulp).

Addressing: one int64 scalar base per tile (batch row, channel block, first position) plus int32 in-tile offsets,
so per-element address math stays 32-bit (position x stride overflows int32 for long channels-last inputs only
as an absolute offset). MODE_RECOMPUTE keeps conv_preact's absolute int64 positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.conv1d.triton_conv1d_fwd import conv_preact, row_bases, seq_at

MODE_RECOMPUTE = 0
MODE_XREUSE = 1
MODE_GATHER = 2
MAX_WIDTH = 4  # taps are written out below; wider filters take the two-pass backward


@triton.jit
def _x_tile(xt, init_base, rel, q, j: tl.constexpr, cl, c, mask_c, L, stride_x_d, stride_x_l, stride_i_d,
            stride_i_k, W: tl.constexpr, HAS_INIT: tl.constexpr):
    """Input at positions q + j -> (BLOCK_L, BLOCK_D) fp32: x (tile base xt, in-tile rows rel), the initial state
    before position 0, else 0."""
    pos = q + j
    xv = tl.load(xt + (rel + j)[:, None] * stride_x_l + cl[None, :] * stride_x_d,
                 mask=((pos >= 0) & (pos < L))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        pi = pos + (W - 1)
        xv += tl.load(init_base + c[None, :] * stride_i_d + pi[:, None] * stride_i_k,
                      mask=((pos < 0) & (pi >= 0))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    return xv


@triton.jit
def _pick(j: tl.constexpr, a_m3, a_m2, a_m1, a_0, a_p1, a_p2, a_p3):
    """The value at offset j in -3..3 (shifted tiles live in named registers)."""
    if j == -3:
        r = a_m3
    elif j == -2:
        r = a_m2
    elif j == -1:
        r = a_m1
    elif j == 0:
        r = a_0
    elif j == 1:
        r = a_p1
    elif j == 2:
        r = a_p2
    else:
        r = a_p3
    return r


@triton.jit
def _tap(k: tl.constexpr, v0, v1, v2, v3):
    """Per-tap value k in 0..3."""
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
def _preact_regs(s: tl.constexpr, x_m3, x_m2, x_m1, x_0, x_p1, x_p2, x_p3, sq_m3, sq_m2, sq_m1, sq_0, sq_p1,
                 sq_p2, sq_p3, w0, w1, w2, w3, bias, W: tl.constexpr, HAS_SEQ: tl.constexpr):
    """pre at q + s from the shifted input tiles in registers (taps outside S(q + s) masked) -> fp32 tile."""
    pre = tl.zeros_like(x_0) + bias[None, :]
    for k in tl.static_range(W):
        xv = _pick(s + k - (W - 1), x_m3, x_m2, x_m1, x_0, x_p1, x_p2, x_p3)
        if HAS_SEQ:
            sj = _pick(s + k - (W - 1), sq_m3, sq_m2, sq_m1, sq_0, sq_p1, sq_p2, sq_p3)
            xv = tl.where((sj == _pick(s, sq_m3, sq_m2, sq_m1, sq_0, sq_p1, sq_p2, sq_p3))[:, None], xv, 0.0)
        pre += _tap(k, w0, w1, w2, w3)[None, :] * xv
    return pre


@triton.jit
def _taps(WEIGHT, BIAS, c, mask_c, stride_w_d, stride_w_k, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(w0, w1, w2, w3, bias) (BLOCK_D,) fp32 for channels c; taps past W alias tap 0, bias 0 without one."""
    w0 = tl.load(WEIGHT + c * stride_w_d, mask=mask_c, other=0.0).to(tl.float32)
    w1 = w0
    w2 = w0
    w3 = w0
    if W > 1:
        w1 = tl.load(WEIGHT + c * stride_w_d + stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    if W > 2:
        w2 = tl.load(WEIGHT + c * stride_w_d + 2 * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    if W > 3:
        w3 = tl.load(WEIGHT + c * stride_w_d + 3 * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
    bias = tl.zeros_like(w0)
    if HAS_BIAS:
        bias = tl.load(BIAS + c, mask=mask_c, other=0.0).to(tl.float32)
    return w0, w1, w2, w3, bias


@triton.jit
def _sigmoid_ftz(x):
    """1 / (1 + 2^(-x log2 e)) with the flush-to-zero approximate ex2 / rcp (2 MUFU + 2 ALU, ~2 ulp): tl.sigmoid's
    denormal and IEEE-division handling costs ~7 more instructions per call, and the fused backward calls it up to
    W times per element. GPU only (inline PTX)."""
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
def _wsum(acc, v, DW_DEFER: tl.constexpr):
    """Add a (BLOCK_L, BLOCK_D) weight-gradient product to its accumulator: elementwise, or summed over rows."""
    if DW_DEFER:
        acc += v
    else:
        acc += tl.sum(v, axis=0)
    return acc


@triton.jit
def _wfinal(acc, DW_DEFER: tl.constexpr):
    r = acc
    if DW_DEFER:
        r = tl.sum(acc, axis=0)
    return r


@triton.jit
def conv1d_bwd_fused_kernel(
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
    MODE: tl.constexpr, DW_DEFER: tl.constexpr, PREFETCH: tl.constexpr, FAST_SIGMOID: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c0 = pid_d * BLOCK_D
    cl = tl.arange(0, BLOCK_D)
    c = c0 + cl
    mask_c = c < D
    x_base, init_base, seq_base, seq0 = row_bases(X, INIT, SEQ, b, stride_x_b, stride_i_b, stride_s_b, HAS_INIT,
                                                  HAS_SEQ)
    # channel-block bases (int64); in-tile offsets below are int32
    x_cb = x_base + c0.to(tl.int64) * stride_x_d
    dy_cb = DY + b * stride_dy_b + c0.to(tl.int64) * stride_dy_d
    dx_cb = DX + b * stride_dx_b + c0.to(tl.int64) * stride_dx_d
    # taps (BLOCK_D,) fp32 loaded once per program
    w0, w1, w2, w3, bias = _taps(WEIGHT, BIAS, c, mask_c, stride_w_d, stride_w_k, W, HAS_BIAS)

    # MODE_GATHER tiles overlap by W-1 positions: the last W-1 rows only supply dpre to the others' shifts
    if MODE == 2:
        STEP = BLOCK_L - (W - 1)
    else:
        STEP = BLOCK_L
    rows = tl.arange(0, BLOCK_L)
    own = rows < STEP
    if DW_DEFER:
        dw0 = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    else:
        dw0 = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dw1 = dw0
    dw2 = dw0
    dw3 = dw0
    db = dw0
    if PREFETCH:
        # x and dy of the program's first tile; each iteration then loads the next tile's before computing
        t_first = pid_l * tiles_per_program * STEP
        t_end = t_first + tiles_per_program * STEP
        x_nx = tl.load(x_cb + t_first.to(tl.int64) * stride_x_l + rows[:, None] * stride_x_l
                       + cl[None, :] * stride_x_d, mask=(t_first + rows < L)[:, None] & mask_c[None, :], other=0.0)
        dy_nx = tl.load(dy_cb + t_first.to(tl.int64) * stride_dy_l + rows[:, None] * stride_dy_l
                        + cl[None, :] * stride_dy_d, mask=(t_first + rows < L)[:, None] & mask_c[None, :],
                        other=0.0)
    for it in range(tiles_per_program):
        t0 = (pid_l * tiles_per_program + it) * STEP
        q = t0 + rows  # int32 positions (L < 2^31); only offsets from the tile's base are multiplied by strides
        xt = x_cb + t0.to(tl.int64) * stride_x_l
        dyt = dy_cb + t0.to(tl.int64) * stride_dy_l
        s_q = seq0
        if HAS_SEQ:
            s_q = seq_at(seq_base, q.to(tl.int64), L, stride_s_l, seq0)

        # shifted inputs x[q + j] and sequence ids S(q + j) in registers (MODE 1: j = -(W-1)..W-1, MODE 2:
        # j <= 0 for x); unused offsets alias j = 0
        if PREFETCH:
            # this tile's x and dy arrived during the previous tile's compute; the shifted loads below hit L1
            x_0 = x_nx.to(tl.float32)
            dy0 = dy_nx.to(tl.float32)
            t1 = t0 + STEP
            # nothing past the program's last tile (a tensor compare: the interpreter rejects scalar bool masks)
            nx_mask = ((t1 + rows < L) & (t1 + 0 * rows < t_end))[:, None] & mask_c[None, :]
            x_nx = tl.load(x_cb + t1.to(tl.int64) * stride_x_l + rows[:, None] * stride_x_l
                           + cl[None, :] * stride_x_d, mask=nx_mask, other=0.0)
            dy_nx = tl.load(dy_cb + t1.to(tl.int64) * stride_dy_l + rows[:, None] * stride_dy_l
                            + cl[None, :] * stride_dy_d, mask=nx_mask, other=0.0)
        else:
            x_0 = _x_tile(xt, init_base, rows, q, 0, cl, c, mask_c, L, stride_x_d, stride_x_l, stride_i_d,
                          stride_i_k, W, HAS_INIT)
            dy0 = tl.load(dyt + rows[:, None] * stride_dy_l + cl[None, :] * stride_dy_d,
                          mask=(q < L)[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        x_m3 = x_0
        x_m2 = x_0
        x_m1 = x_0
        x_p1 = x_0
        x_p2 = x_0
        x_p3 = x_0
        sq_m3 = s_q
        sq_m2 = s_q
        sq_m1 = s_q
        sq_p1 = s_q
        sq_p2 = s_q
        sq_p3 = s_q
        if MODE != 0:
            if W > 1:
                x_m1 = _x_tile(xt, init_base, rows, q, -1, cl, c, mask_c, L, stride_x_d, stride_x_l, stride_i_d,
                               stride_i_k, W, HAS_INIT)
            if W > 2:
                x_m2 = _x_tile(xt, init_base, rows, q, -2, cl, c, mask_c, L, stride_x_d, stride_x_l, stride_i_d,
                               stride_i_k, W, HAS_INIT)
            if W > 3:
                x_m3 = _x_tile(xt, init_base, rows, q, -3, cl, c, mask_c, L, stride_x_d, stride_x_l, stride_i_d,
                               stride_i_k, W, HAS_INIT)
            if MODE == 1 and SILU:
                if W > 1:
                    x_p1 = _x_tile(xt, init_base, rows, q, 1, cl, c, mask_c, L, stride_x_d, stride_x_l,
                                   stride_i_d, stride_i_k, W, HAS_INIT)
                if W > 2:
                    x_p2 = _x_tile(xt, init_base, rows, q, 2, cl, c, mask_c, L, stride_x_d, stride_x_l,
                                   stride_i_d, stride_i_k, W, HAS_INIT)
                if W > 3:
                    x_p3 = _x_tile(xt, init_base, rows, q, 3, cl, c, mask_c, L, stride_x_d, stride_x_l,
                                   stride_i_d, stride_i_k, W, HAS_INIT)
            if HAS_SEQ:
                q64 = q.to(tl.int64)
                if W > 1:
                    sq_m1 = seq_at(seq_base, q64 - 1, L, stride_s_l, seq0)
                    sq_p1 = seq_at(seq_base, q64 + 1, L, stride_s_l, seq0)
                if W > 2:
                    sq_m2 = seq_at(seq_base, q64 - 2, L, stride_s_l, seq0)
                    sq_p2 = seq_at(seq_base, q64 + 2, L, stride_s_l, seq0)
                if W > 3:
                    sq_m3 = seq_at(seq_base, q64 - 3, L, stride_s_l, seq0)
                    sq_p3 = seq_at(seq_base, q64 + 3, L, stride_s_l, seq0)

        # dpre at the tile's own positions
        dp0 = dy0
        if SILU:
            if MODE == 0:
                pre = conv_preact(x_base, init_base, seq_base, WEIGHT, BIAS, q.to(tl.int64), c, mask_c, L,
                                  stride_x_d, stride_x_l, stride_i_d, stride_i_k, stride_s_l, stride_w_d, stride_w_k,
                                  seq0, W, HAS_BIAS, HAS_INIT, HAS_SEQ, BLOCK_L, BLOCK_D)
            else:
                pre = _preact_regs(0, x_m3, x_m2, x_m1, x_0, x_p1, x_p2, x_p3, sq_m3, sq_m2, sq_m1, s_q, sq_p1,
                                   sq_p2, sq_p3, w0, w1, w2, w3, bias, W, HAS_SEQ)
            dp0 = _dsilu(dy0, pre, FAST_SIGMOID)

        # weight / bias gradients from dpre at the owned positions and the W shifted inputs
        dpw = dp0
        if MODE == 2:
            dpw = tl.where(own[:, None], dp0, 0.0)
        db = _wsum(db, dpw, DW_DEFER)
        for k in tl.static_range(W):
            if MODE == 0:
                xv = _x_tile(xt, init_base, rows, q, k - (W - 1), cl, c, mask_c, L, stride_x_d, stride_x_l,
                             stride_i_d, stride_i_k, W, HAS_INIT)
                if HAS_SEQ:
                    xv = tl.where((seq_at(seq_base, q.to(tl.int64) + (k - (W - 1)), L, stride_s_l, seq0)
                                   == s_q)[:, None], xv, 0.0)
            else:
                xv = _pick(k - (W - 1), x_m3, x_m2, x_m1, x_0, x_p1, x_p2, x_p3)
                if HAS_SEQ:
                    sj = _pick(k - (W - 1), sq_m3, sq_m2, sq_m1, s_q, sq_p1, sq_p2, sq_p3)
                    xv = tl.where((sj == s_q)[:, None], xv, 0.0)
            if k == 0:
                dw0 = _wsum(dw0, dpw * xv, DW_DEFER)
            elif k == 1:
                dw1 = _wsum(dw1, dpw * xv, DW_DEFER)
            elif k == 2:
                dw2 = _wsum(dw2, dpw * xv, DW_DEFER)
            else:
                dw3 = _wsum(dw3, dpw * xv, DW_DEFER)

        # dx[q] = sum_s w[W-1-s] dpre[q + s]
        dx = _tap(W - 1, w0, w1, w2, w3)[None, :] * dp0
        for s in tl.static_range(1, W):
            if MODE == 2:
                # rows past STEP are never stored, so clamping their source row is harmless
                src = tl.minimum(rows + s, BLOCK_L - 1)
                dp = tl.gather(dp0, tl.broadcast_to(src[:, None], (BLOCK_L, BLOCK_D)), 0)
            else:
                dp = tl.load(dyt + (rows + s)[:, None] * stride_dy_l + cl[None, :] * stride_dy_d,
                             mask=(q + s < L)[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                if SILU:
                    if MODE == 0:
                        pre_s = conv_preact(x_base, init_base, seq_base, WEIGHT, BIAS, q.to(tl.int64) + s, c, mask_c,
                                            L, stride_x_d, stride_x_l, stride_i_d, stride_i_k, stride_s_l, stride_w_d,
                                            stride_w_k, seq0, W, HAS_BIAS, HAS_INIT, HAS_SEQ, BLOCK_L, BLOCK_D)
                    else:
                        pre_s = _preact_regs(s, x_m3, x_m2, x_m1, x_0, x_p1, x_p2, x_p3, sq_m3, sq_m2, sq_m1, s_q,
                                             sq_p1, sq_p2, sq_p3, w0, w1, w2, w3, bias, W, HAS_SEQ)
                    dp = _dsilu(dp, pre_s, FAST_SIGMOID)
            if HAS_SEQ:
                if MODE == 1:
                    sq_s = _pick(s, sq_m3, sq_m2, sq_m1, s_q, sq_p1, sq_p2, sq_p3)
                else:
                    sq_s = seq_at(seq_base, q.to(tl.int64) + s, L, stride_s_l, seq0)
                dp = tl.where((sq_s == s_q)[:, None], dp, 0.0)
            dx += _tap(W - 1 - s, w0, w1, w2, w3)[None, :] * dp
        tl.store(dx_cb + t0.to(tl.int64) * stride_dx_l + rows[:, None] * stride_dx_l + cl[None, :] * stride_dx_d,
                 dx.to(DX.dtype.element_ty), mask=(own & (q < L))[:, None] & mask_c[None, :])

    part = (b * tl.num_programs(0) + pid_l) * D * W
    tl.store(DW_PART + part + c * W, _wfinal(dw0, DW_DEFER), mask=mask_c)
    if W > 1:
        tl.store(DW_PART + part + c * W + 1, _wfinal(dw1, DW_DEFER), mask=mask_c)
    if W > 2:
        tl.store(DW_PART + part + c * W + 2, _wfinal(dw2, DW_DEFER), mask=mask_c)
    if W > 3:
        tl.store(DW_PART + part + c * W + 3, _wfinal(dw3, DW_DEFER), mask=mask_c)
    if HAS_BIAS:
        tl.store(DB_PART + (b * tl.num_programs(0) + pid_l) * D + c, _wfinal(db, DW_DEFER), mask=mask_c)

    if HAS_INIT:
        if pid_l == 0:
            # initial-state slot j holds input position j - (w-1) < 0; it feeds outputs 0 .. j
            kk = tl.arange(0, BLOCK_W)
            qj = (kk - (W - 1)).to(tl.int64)
            dinit = tl.zeros((BLOCK_W, BLOCK_D), dtype=tl.float32)
            for s in tl.static_range(W):
                p = qj + s
                dp = tl.load(dy_cb + p[:, None] * stride_dy_l + cl[None, :] * stride_dy_d,
                             mask=((p >= 0) & (p < L))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                if SILU:
                    pre_s = conv_preact(x_base, init_base, seq_base, WEIGHT, BIAS, p, c, mask_c, L,
                                        stride_x_d, stride_x_l, stride_i_d, stride_i_k, stride_s_l, stride_w_d,
                                        stride_w_k, seq0, W, HAS_BIAS, HAS_INIT, HAS_SEQ, BLOCK_W, BLOCK_D)
                    dp = _dsilu(dp, pre_s, FAST_SIGMOID)
                if HAS_SEQ:
                    dp = tl.where((seq_at(seq_base, p, L, stride_s_l, seq0) == seq0)[:, None], dp, 0.0)
                dinit += _tap(W - 1 - s, w0, w1, w2, w3)[None, :] * dp
            tl.store(DINIT + b * stride_di_b + c[None, :] * stride_di_d + kk[:, None] * stride_di_k,
                     dinit.to(DINIT.dtype.element_ty), mask=(kk < W - 1)[:, None] & mask_c[None, :])
