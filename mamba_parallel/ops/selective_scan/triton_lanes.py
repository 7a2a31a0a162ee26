"""Sum over a warp's 32 channels of a (P, BD, V) tile, as a reduce-scatter of lane shuffles (GPU only).

``tl.sum`` over the channel axis all-reduces every one of the S = P * V tokens a thread holds: 5 shuffle + add
levels per token, each result then replicated in all 32 lanes, plus a shared-memory round across warps. Halving
instead: at level k a lane keeps the half of its tokens picked by bit k of its lane id, sends the other half to the
lane that differs in that bit and adds what it receives. After log2(S) levels each lane holds one token summed
over S lanes; the remaining levels are plain butterflies. That is S - 1 + 5 - log2(S) shuffles per thread instead
of 5 S (16 vs 80 for S = 16), and no shared memory: each warp writes its own partial (b, d / 32, n, L).

Layout contract (checked by the host, which enables this path only then): the row-per-thread layout, lane l of
warp w owning row 32 w + l of the program and all S tokens in registers. Token halves are taken with ``tl.reshape`` +
``tl.split``, which only relabel registers; lane l ends with token l mod S.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lane_id(like):
    """The lane (0..31) of the thread holding each element of int32 tensor ``like``."""
    return tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [like], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def butterfly(x, MASK: tl.constexpr, AXIS: tl.constexpr, EMU: tl.constexpr = False):
    """x from lane (own lane xor MASK), same register (shfl.sync.bfly over the full warp); AXIS is x's row axis.
    EMU (tests, interpreter): the same exchange as a gather along AXIS, row r taking row r xor MASK, which is what
    the shuffle does in the row-per-thread layout (row r in lane r mod 32)."""
    if EMU:
        rows = tl.arange(0, x.shape[AXIS]) ^ MASK  # x is 3-D
        if AXIS == 0:
            idx = rows[:, None, None]
        else:
            idx = rows[None, :, None]
        return tl.gather(x, tl.broadcast_to(idx, x.shape), AXIS)
    else:
        return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, $2, 0x1f, -1;", "=f,f,r",
                                         [x, tl.full(x.shape, MASK, tl.int32)], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _halve_last(x, lane, BIT: tl.constexpr, AXIS: tl.constexpr, EMU: tl.constexpr):
    """(., ., 2K) -> (., ., K): keep the tokens 2k + (lane bit BIT), plus the partner lane's same tokens."""
    e0, e1 = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2] // 2, 2)))
    up = ((lane >> BIT) & 1) == 1
    keep = tl.where(up, e1, e0)
    send = tl.where(up, e0, e1)
    return keep + butterfly(send, 1 << BIT, AXIS, EMU)


@triton.jit
def rows_lane(ROWS: tl.constexpr, EMU: tl.constexpr):
    """(ROWS,) lane ids of a program's rows in the row-per-thread layout (EMU: row mod 32, as that layout has
    them)."""
    if EMU:
        return tl.arange(0, ROWS) % 32
    else:
        return lane_id(tl.zeros([ROWS], dtype=tl.int32))


@triton.jit
def warp_channel_sum(x, LP: tl.constexpr, LV: tl.constexpr, EMU: tl.constexpr = False):
    """x (P, BD, V) fp32 with P = 2^LP, V = 2^LV -> (BD,) where lane l holds the sum over the lanes of its warp
    of token l mod (P V) (token p V + v; lanes l >= P V hold duplicates)."""
    lane = rows_lane(x.shape[1], EMU)[None, :, None]
    for k in tl.static_range(LV):  # the token's low bits: v
        x = _halve_last(x, lane, k, 1, EMU)
    x = tl.permute(x, (1, 2, 0))  # (BD, 1, P)
    lane = tl.permute(lane, (1, 2, 0))
    for k in tl.static_range(LP):  # then p
        x = _halve_last(x, lane, LV + k, 0, EMU)
    for k in tl.static_range(LP + LV, 5):  # lanes still holding the same token: plain butterflies
        x += butterfly(x, 1 << k, 0, EMU)
    return tl.reshape(x, (x.shape[0],))
