"""Forward Triton kernel of the causal depthwise conv1d; in DPRE mode it also starts the SiLU backward.

Tile = BLOCK_L positions x BLOCK_D channels of one batch row. x is read through its strides; when the channel
stride is 1 (the channels-last layout the Mamba-2 layer produces) Triton specialises it and loads along channels
are coalesced, when the position stride is 1 loads along positions are. The w shifted reads of one tile hit cache.

Sequence rule (see naive.py): input q feeds output p only if S(q) == S(p), with S(q) = seq_idx[q] for q >= 0 and
seq_idx[0] for the initial-state inputs (q < 0).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def seq_at(seq_base, pos, L, stride_s_l, seq0):
    """S(pos): the sequence id of input/output positions ``pos`` (seq_idx[0] before the start, -1 past the end)."""
    s = tl.load(seq_base + pos * stride_s_l, mask=(pos >= 0) & (pos < L), other=-1)
    return tl.where(pos < 0, seq0, s)


@triton.jit
def row_bases(X, INIT, SEQ, b, stride_x_b, stride_i_b, stride_s_b, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr):
    """Batch row b: (x base, initial-state base, seq_idx base, seq_idx[b, 0] or 0), shared by both passes."""
    # absent inputs get X as a placeholder base (never read: their loads are compiled out); Triton 3.6 cannot
    # return a None pointer from a jit function
    init_base = X
    if HAS_INIT:
        init_base = INIT + b * stride_i_b
    seq_base = X
    seq0 = 0
    if HAS_SEQ:
        seq_base = SEQ + b * stride_s_b
        seq0 = tl.load(seq_base)
    return X + b * stride_x_b, init_base, seq_base, seq0


@triton.jit
def conv1d_fwd_kernel(
    X, WEIGHT, BIAS, INIT, SEQ, DY, Y,
    D, L,
    stride_x_b, stride_x_d, stride_x_l,
    stride_w_d, stride_w_k,
    stride_i_b, stride_i_d, stride_i_k,
    stride_s_b, stride_s_l,
    stride_dy_b, stride_dy_d, stride_dy_l,
    stride_y_b, stride_y_d, stride_y_l,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
    DPRE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Y = act(pre). With DPRE (first step of the SiLU backward): Y = dy * silu'(pre), the gradient at pre."""
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    # int64 positions: position x stride overflows int32 for long channels-last inputs (L 256k x 8512 channels)
    t = (pid_l * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    c = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_c = c < D
    mask = (t < L)[:, None] & mask_c[None, :]
    x_base, init_base, seq_base, seq0 = row_bases(X, INIT, SEQ, b, stride_x_b, stride_i_b, stride_s_b, HAS_INIT,
                                                  HAS_SEQ)

    # pre = bias + sum_k w[:, k] x[t - (w-1) + k]
    acc = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if HAS_SEQ:
        s_out = seq_at(seq_base, t, L, stride_s_l, seq0)
    for k in tl.static_range(W):
        q = t + (k - (W - 1))
        wk = tl.load(WEIGHT + c * stride_w_d + k * stride_w_k, mask=mask_c, other=0.0).to(tl.float32)
        xv = tl.load(x_base + c[None, :] * stride_x_d + q[:, None] * stride_x_l,
                     mask=((q >= 0) & (q < L))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        if HAS_INIT:
            qi = q + (W - 1)
            xv += tl.load(init_base + c[None, :] * stride_i_d + qi[:, None] * stride_i_k,
                          mask=((q < 0) & (qi >= 0))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        if HAS_SEQ:
            xv = tl.where((seq_at(seq_base, q, L, stride_s_l, seq0) == s_out)[:, None], xv, 0.0)
        acc += xv * wk[None, :]
    if DPRE:
        dy = tl.load(DY + b * stride_dy_b + c[None, :] * stride_dy_d + t[:, None] * stride_dy_l, mask=mask,
                     other=0.0).to(tl.float32)
        sig = tl.sigmoid(acc)
        acc = dy * sig * (1.0 + acc * (1.0 - sig))
    elif SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Y + b * stride_y_b + c[None, :] * stride_y_d + t[:, None] * stride_y_l, acc.to(Y.dtype.element_ty),
             mask=mask)
