"""Pieces shared by the Mamba-1 scan kernels: exp2, softplus, L2 prefetch and the segment flags of seq_idx.

The kernels (triton_fwd.py, triton_bwd.py) give each channel a row of the tile and keep a chunk's S tokens in its
registers, so the token scans, the carries and the sums over tokens stay inside the thread (triton_tiles.py). Which
path and tiles they launch with is chosen in launch.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # Triton kernels may read constexpr globals only


@triton.jit
def exp2(x, FAST: tl.constexpr):
    """2^x; FAST (GPU): one flush-to-zero MUFU instruction, no denormal fix-up (decays below 2^-126 are 0)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ``ptrs`` (GPU only; no data comes back, the dummy result is unused)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def segment_flags(sid_row, t, mt, L, end, VARLEN: tl.constexpr):
    """seq_idx of one row at tokens t (mt = t < L) -> (s_cur, start, end): start marks tokens whose state restarts
    (a new sequence; with VARLEN also token 0); with VARLEN, end marks each packed sequence's last token, otherwise
    the given ``end`` passes through."""
    s_cur = tl.load(sid_row + t, mask=mt, other=0)
    s_prev = tl.load(sid_row + t - 1, mask=mt & (t > 0), other=0)
    start = mt & (s_cur != s_prev) & (t > 0)
    if VARLEN:
        start = start | (t == 0)
        s_next = tl.load(sid_row + t + 1, mask=(t + 1) < L, other=0)
        end = mt & (((t + 1) >= L) | (s_next != s_cur))
    return s_cur, start, end


@triton.jit
def softplus(x):
    # log(1 + e^x), exact enough in fp32; the linear branch avoids overflow (as torch's threshold=20).
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
