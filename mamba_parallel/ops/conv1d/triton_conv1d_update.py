"""One-token decode step of the causal conv1d: y = act(bias + w . [state, x]) and the state shifted in place."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def conv1d_update_kernel(
    X, STATE, WEIGHT, BIAS, IDX, Y,
    D,
    stride_x_b, stride_x_d,
    stride_st_b, stride_st_d, stride_st_k,
    stride_w_d, stride_w_k,
    stride_y_b, stride_y_d,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_IDX: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = c < D
    row = b
    if HAS_IDX:
        row = tl.load(IDX + b).to(tl.int64)
    st = STATE + row * stride_st_b + c * stride_st_d

    x = tl.load(X + b * stride_x_b + c * stride_x_d, mask=mask, other=0.0)
    acc = tl.load(WEIGHT + c * stride_w_d + (W - 1) * stride_w_k, mask=mask, other=0.0).to(tl.float32) \
        * x.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=mask, other=0.0).to(tl.float32)
    # Each thread reads slot k before it overwrites slot k (with slot k + 1) one iteration later.
    for k in tl.static_range(W - 1):
        s = tl.load(st + k * stride_st_k, mask=mask, other=0.0)
        acc += tl.load(WEIGHT + c * stride_w_d + k * stride_w_k, mask=mask, other=0.0).to(tl.float32) \
            * s.to(tl.float32)
        if k > 0:
            tl.store(st + (k - 1) * stride_st_k, s, mask=mask)
    if W > 1:
        tl.store(st + (W - 2) * stride_st_k, x.to(STATE.dtype.element_ty), mask=mask)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Y + b * stride_y_b + c * stride_y_d, acc.to(Y.dtype.element_ty), mask=mask)
