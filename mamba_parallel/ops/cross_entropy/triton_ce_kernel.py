"""Triton kernel for one chunk of linear cross-entropy: per-row loss from fp32 logits and, optionally, the logits'
gradient (softmax - onehot) * scale written over them (or into a half-precision buffer for the next matmul)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ce_chunk_kernel(
    LOGITS, DLOGITS, LABELS, LOSS, SCALE,
    V, stride_logits, stride_dlogits, stride_scale, ignore_index,
    WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row. SCALE[row * stride_scale] multiplies the row's gradient (stride 0: one scalar)."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    base = LOGITS + row * stride_logits
    cols = tl.arange(0, BLOCK_V)

    # pass 1: per-lane running max and sum of exponentials, merged once at the end. Lanes start at a finite
    # floor so that exp(m_old - m_new) is never exp(-inf + inf).
    m = tl.full([BLOCK_V], -1e30, tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))

    if WRITE_LOSS:
        target = tl.load(base + label, mask=valid, other=0.0).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - target, 0.0))

    if WRITE_GRAD:
        scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)
        dbase = DLOGITS + row * stride_dlogits
        for v0 in range(0, V, BLOCK_V):
            idx = v0 + cols
            mask = idx < V
            x = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
            g = (tl.exp(x - lse) - tl.where(idx == label, 1.0, 0.0)) * scale
            tl.store(dbase + idx, g.to(DLOGITS.dtype.element_ty), mask=mask)
