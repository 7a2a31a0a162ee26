"""The adjoint carries that let the Mamba-1 scan's backward walk sequence segments in parallel.

The backward (triton_bwd.py) runs one thread per channel through the sequence in reverse; with few channels (a
small model: b8 x d1536 is 3 warps per SM) that walk is latency-bound, so it splits the sequence into segments
walked at once. A segment's walk needs g, the adjoint a_f dh_f at the first token f of the segment after it. g is
linear in what the later tokens feed in, and with cum_t = delta_f + ... + delta_t (inclusive) over segment k

    g_loc[k] = sum_{t in k} exp(A cum_t) C_t dy_t  (+ exp(A cum_{L-1}) dlast in the last segment)
    g[k]     = g_loc[k] + exp(A sum_{t in k} delta_t) g[k + 1]

so each segment's g_loc is a sum over its tokens (a cumsum of delta, no recurrence): this pass computes every
g_loc and delta sum at full parallelism, and each backward program folds the later segments' into its carry
before its walk (a loop over segments, not tokens). The pass costs one exp per element and state, as the walk.
A restart (seq_idx / cu_seqlens: a token whose state does not depend on the one before) cuts the chain: the
tokens from a segment's first restart on add nothing to its g_loc, and a segment with a restart passes no carry
through (its decay is 0). Packed sequences' d(last state) enter at each sequence's last token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, segment_flags
from mamba_parallel.ops.selective_scan.triton_tiles import (_at, _put, delta_tile, last_token, load_tile,
                                                            scan_forward)


@triton.jit
def _upto(state, dstate, bound):
    """bound for a state the program has (< dstate), else 0: a mask bound, since a scalar condition and-ed into a
    mask gives integers in the interpreter."""
    return tl.where(state < dstate, bound, 0)


@triton.jit
def adjoint_carry_kernel(
    dt_ptr, dtb_ptr, z_ptr, dy_ptr, C_ptr, A_ptr, dlast_ptr, sid_ptr, gl_ptr, ds_ptr, rs_ptr,
    L, dim, dstate, d_per_group, seg_len, nseg, ngrp,
    sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sC_b, sC_g, sC_n, sC_l, ssid_b,
    HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, GATE_DY: tl.constexpr, HAS_DLAST: tl.constexpr,
    HAS_SID: tl.constexpr, VARLEN: tl.constexpr, FAST_EXP: tl.constexpr, BD: tl.constexpr, P: tl.constexpr,
    V: tl.constexpr, NS: tl.constexpr, LANES: tl.constexpr,
):
    """One program: channels [pid * BD, +BD) of sequence pid_b, states [grp NS, +NS) (NS <= P V), segment seg + 1
    (segment 0's is never needed; program_id(2) = seg ngrp + grp), its tokens [seg_len (seg + 1), +seg_len) in
    chunks of P V, as the backward's tiles hold them (triton_tiles.py): with the row-per-thread layout (LANES)
    each thread owns a channel's tokens, so the running delta sum is a register chain and the sums over tokens
    stay in its registers; the NS states' A and sums live in token slots of a tile.

    dt, z (b, d, L) any strides; dy (b, d, L) contiguous (GATE_DY: the gated output's gradient, times silu(z)
    here as in the backward); C (b, g, n, L) strides sC_*; A (n, d) state-major; dlast (b, n, d) state-major, or
    with VARLEN (nseq, d, n) per packed sequence; sid (b, L) int32 sequence ids (HAS_SID: seq_idx, or with VARLEN
    the packed sequences of cu_seqlens). Writes gl (b, nseg, n, d) = g_loc and ds (b, nseg, d) = the segment's
    delta sum, fp32, and with HAS_SID rs (b, nseg) int32: whether the segment holds a restart (slot 0 unwritten)."""
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    seg = tl.program_id(2) // ngrp + 1
    n0 = (tl.program_id(2) % ngrp) * NS
    c0 = pid * BD
    offs_d = c0 + tl.arange(0, BD)
    v_idx = tl.arange(0, V)[None, None, :]
    p_idx = tl.arange(0, P)[:, None]
    tok = tl.arange(0, P)[:, None, None] * V + v_idx  # (P, 1, V) token offsets in a chunk
    tok2 = tl.arange(0, P)[:, None] * V + tl.arange(0, V)[None, :]  # (P, V), for C's rows
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)[None, :, None]
    else:
        bias = 0.0
    C_base = C_ptr + pid_b * sC_b + (c0 // d_per_group) * sC_g
    t_lo = seg * seg_len
    t_hi = tl.minimum(t_lo + seg_len, L)
    dy_base = dy_ptr + pid_b * dim * L
    # A (times log2 e) and the sums of the program's states, state k in token slot k of a tile
    zero = load_tile(dy_base, c0, L, 1, L, L, P, BD, V, 1)  # all masked: zeros in the tiles' layout
    A_k = zero
    acc = zero
    for k in tl.static_range(NS):
        A_k = _put(A_k, tl.load(A_ptr + (n0 + k) * dim + offs_d, mask=offs_d < _upto(n0 + k, dstate, dim),
                                other=0.0) * LOG2E, k // V, k % V, P, V)
    cum = tl.zeros([BD], dtype=tl.float32)  # delta summed from the segment's first token
    alive = cum + 1.0  # 1 until the segment's first restart, then 0
    for t0 in range(t_lo, t_hi, P * V):
        t = t0 + tok
        mt = t < t_hi
        # delta and dy are 0 from t_hi on: those tokens add nothing
        _, dt = delta_tile(dt_ptr + pid_b * sdt_b, c0, sdt_d, sdt_l, t0, t_hi, mt, bias, P, BD, V, 1, HAS_DTB,
                           SOFTPLUS)
        c = scan_forward(zero + 1.0, dt, cum, v_idx, p_idx, P, V, LANES)
        cum = last_token(c, v_idx, p_idx, P, V)
        dy = load_tile(dy_base, c0, L, 1, t0, t_hi, P, BD, V, 1)
        if GATE_DY:
            zv = load_tile(z_ptr + pid_b * sz_b, c0, sz_d, sz_l, t0, t_hi, P, BD, V, 1)
            dy = dy * zv * tl.sigmoid(zv)
        if HAS_SID:
            s_cur, start, end = segment_flags(sid_ptr + pid_b * ssid_b, t, mt, L, t == L - 1, VARLEN)
            # up to the segment's first restart: alive_t = alive_{t-1} (1 - start_t)
            live = scan_forward(zero + 1.0 - start.to(tl.float32), zero, alive, v_idx, p_idx, P, V, LANES)
            alive = last_token(live, v_idx, p_idx, P, V)
            dy = dy * live
        for k in tl.static_range(NS):
            Cn = tl.load(C_base + (n0 + k) * sC_n + (t0 + tok2) * sC_l,
                         mask=(t0 + tok2) < _upto(n0 + k, dstate, t_hi), other=0.0)[:, None, :]
            cx = Cn * dy
            if HAS_DLAST and VARLEN:  # each packed sequence's d(last state) at its last token
                cx += tl.load(dlast_ptr + (s_cur * dim + offs_d[None, :, None]) * dstate + n0 + k,
                              mask=end & (offs_d[None, :, None] < _upto(n0 + k, dstate, dim)),
                              other=0.0).to(tl.float32) * live
            w = exp2(_at(A_k, k // V, k % V, P, V)[None, :, None] * c, FAST_EXP)
            s = tl.sum(tl.sum(w * cx, axis=2), axis=0)
            acc = _put(acc, _at(acc, k // V, k % V, P, V) + s, k // V, k % V, P, V)
    row = pid_b * nseg + seg
    for k in tl.static_range(NS):
        g = _at(acc, k // V, k % V, P, V)
        if HAS_DLAST and not VARLEN:
            if seg == nseg - 1:  # d(last state) enters at token L - 1, the last segment's last
                dl = tl.load(dlast_ptr + pid_b * dim * dstate + (n0 + k) * dim + offs_d,
                             mask=offs_d < _upto(n0 + k, dstate, dim), other=0.0).to(tl.float32)
                g += exp2(_at(A_k, k // V, k % V, P, V) * cum, FAST_EXP) * dl * alive
        tl.store(gl_ptr + (row * dstate + n0 + k) * dim + offs_d, g, mask=offs_d < _upto(n0 + k, dstate, dim))
    if n0 == 0:
        tl.store(ds_ptr + row * dim + offs_d, cum)
        if HAS_SID:
            tl.store(rs_ptr + row, (tl.min(alive, axis=0) == 0.0).to(tl.int32))


@triton.jit
def segment_carry(gl_ptr, ds_ptr, rs_ptr, A_ptr, slot_ptr, pid_b, seg, nseg, dim, dstate, s_row,
                  HAS_SID: tl.constexpr, FAST_EXP: tl.constexpr):
    """g entering segment ``seg`` from the later ones (0 for the last) -> slot_ptr (n, d) state-major, at this
    program's channels s_row: g = g_loc[k] + exp(A ds[k]) g over k = nseg - 1 .. seg + 1 (adjoint_carry_kernel;
    with HAS_SID no decay through a segment with a restart)."""
    for n in range(dstate):
        A_n = tl.load(A_ptr + s_row + n * dim).to(tl.float32) * LOG2E
        g = tl.zeros(s_row.shape, dtype=tl.float32)
        for i in range(nseg - 1 - seg):
            row = pid_b * nseg + nseg - 1 - i
            decay = exp2(A_n * tl.load(ds_ptr + row * dim + s_row), FAST_EXP)
            if HAS_SID:
                decay = tl.where(tl.load(rs_ptr + row) == 0, decay, 0.0)
            g = tl.load(gl_ptr + (row * dstate + n) * dim + s_row) + decay * g
        tl.store(slot_ptr + n * dim + s_row, g)
