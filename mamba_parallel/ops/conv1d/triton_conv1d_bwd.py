"""Backward Triton kernel of the causal depthwise conv1d: dx, d(initial_state) and per-program partial sums of
dweight / dbias (the caller adds the partials).

It takes dpre, the gradient at the pre-activation: dy itself without activation, or dy * silu'(pre) written by
the forward kernel in DPRE mode (one extra fp32 pass beats recomputing w shifted pre-activations here). With
pre[p] = bias + sum_k w[k] x[p - (w-1) + k] (masked by the sequence rule of triton_conv1d_fwd.py):
    dx[q] = sum_s w[w-1-s] dpre[q + s] [S(q) == S(q + s)],   dw[k] = sum_p dpre[p] x[p - (w-1) + k] [...].
The weight / bias sums are accumulated elementwise over a program's tiles and reduced across positions once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.conv1d.triton_conv1d_fwd import row_bases, seq_at


@triton.jit
def conv1d_bwd_kernel(
    X, WEIGHT, INIT, SEQ, DPRE,
    DX, DINIT, DW_PART, DB_PART,
    D, L, tiles_per_program,
    stride_x_b, stride_x_d, stride_x_l,
    stride_w_d, stride_w_k,
    stride_i_b, stride_i_d, stride_i_k,
    stride_s_b, stride_s_l,
    stride_g_b, stride_g_d, stride_g_l,
    stride_dx_b, stride_dx_d, stride_dx_l,
    stride_di_b, stride_di_d, stride_di_k,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    c = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_c = c < D
    kk = tl.arange(0, BLOCK_W)
    x_base, init_base, seq_base, seq0 = row_bases(X, INIT, SEQ, b, stride_x_b, stride_i_b, stride_s_b, HAS_INIT,
                                                  HAS_SEQ)
    g_base = DPRE + b * stride_g_b

    dw_acc = tl.zeros((BLOCK_W, BLOCK_L, BLOCK_D), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    for it in range(tiles_per_program):
        # int64 positions: position x stride overflows int32 for long channels-last inputs
        q = ((pid_l * tiles_per_program + it) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
        if HAS_SEQ:
            s_q = seq_at(seq_base, q, L, stride_s_l, seq0)
        dx = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
        for s in tl.static_range(W):
            p = q + s
            dp = tl.load(g_base + c[None, :] * stride_g_d + p[:, None] * stride_g_l,
                         mask=(p < L)[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            if s == 0:
                # dpre at the tile's own positions: the weight and bias gradients
                db_acc += dp
                for k in tl.static_range(W):
                    xq = q + (k - (W - 1))
                    xv = tl.load(x_base + c[None, :] * stride_x_d + xq[:, None] * stride_x_l,
                                 mask=((xq >= 0) & (xq < L))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                    if HAS_INIT:
                        xi = xq + (W - 1)
                        xv += tl.load(init_base + c[None, :] * stride_i_d + xi[:, None] * stride_i_k,
                                      mask=((xq < 0) & (xi >= 0))[:, None] & mask_c[None, :],
                                      other=0.0).to(tl.float32)
                    if HAS_SEQ:
                        xv = tl.where((seq_at(seq_base, xq, L, stride_s_l, seq0) == s_q)[:, None], xv, 0.0)
                    dw_acc += tl.where((kk == k)[:, None, None], (dp * xv)[None, :, :], 0.0)
            elif HAS_SEQ:
                dp = tl.where((seq_at(seq_base, p, L, stride_s_l, seq0) == s_q)[:, None], dp, 0.0)
            wk = tl.load(WEIGHT + c * stride_w_d + (W - 1 - s) * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
            dx += dp * wk[None, :]
        tl.store(DX + b * stride_dx_b + c[None, :] * stride_dx_d + q[:, None] * stride_dx_l,
                 dx.to(DX.dtype.element_ty), mask=(q < L)[:, None] & mask_c[None, :])

    part = b * tl.num_programs(0) + pid_l
    tl.store(DW_PART + part * D * W + c[None, :] * W + kk[:, None], tl.sum(dw_acc, axis=1),
             mask=(kk < W)[:, None] & mask_c[None, :])
    if HAS_BIAS:
        tl.store(DB_PART + part * D + c, tl.sum(db_acc, axis=0), mask=mask_c)

    if HAS_INIT:
        if pid_l == 0:
            # initial-state slot j holds input position j - (w-1) < 0
            qj = kk - (W - 1)
            dinit = tl.zeros((BLOCK_W, BLOCK_D), dtype=tl.float32)
            for s in tl.static_range(W):
                p = qj + s
                dp = tl.load(g_base + c[None, :] * stride_g_d + p[:, None] * stride_g_l,
                             mask=((p >= 0) & (p < L))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                if HAS_SEQ:
                    dp = tl.where((seq_at(seq_base, p, L, stride_s_l, seq0) == seq0)[:, None], dp, 0.0)
                wk = tl.load(WEIGHT + c * stride_w_d + (W - 1 - s) * stride_w_k, mask=mask_c,
                             other=0.0).to(tl.float32)
                dinit += dp * wk[None, :]
            tl.store(DINIT + b * stride_di_b + c[None, :] * stride_di_d + kk[:, None] * stride_di_k,
                     dinit.to(DINIT.dtype.element_ty), mask=(kk < W - 1)[:, None] & mask_c[None, :])
