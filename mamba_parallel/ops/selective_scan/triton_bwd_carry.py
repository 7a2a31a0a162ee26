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

from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, segment_flags, softplus


@triton.jit
def adjoint_carry_kernel(
    dt_ptr, dtb_ptr, z_ptr, dy_ptr, C_ptr, A_ptr, dlast_ptr, sid_ptr, gl_ptr, ds_ptr, rs_ptr,
    L, dim, dstate, d_per_group, seg_len, nseg,
    sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sC_b, sC_g, sC_n, sC_l, ssid_b,
    HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, GATE_DY: tl.constexpr, HAS_DLAST: tl.constexpr,
    HAS_SID: tl.constexpr, VARLEN: tl.constexpr, FAST_EXP: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr,
    T: tl.constexpr,
):
    """One program: channels [pid * BD, +BD) of sequence pid_b, segment pid_s + 1 (segment 0's is never needed),
    its tokens [seg * seg_len, +seg_len) in tiles of T.

    dt, z (b, d, L) any strides; dy (b, d, L) contiguous (GATE_DY: the gated output's gradient, times silu(z)
    here as in the backward); C (b, g, n, L) strides sC_*; A (n, d) state-major; dlast (b, n, d) state-major, or
    with VARLEN (nseq, d, n) per packed sequence; sid (b, L) int32 sequence ids (HAS_SID: seq_idx, or with VARLEN
    the packed sequences of cu_seqlens). Writes gl (b, nseg, n, d) = g_loc and ds (b, nseg, d) = the segment's
    delta sum, fp32, and with HAS_SID rs (b, nseg) int32: whether the segment holds a restart (slot 0 unwritten)."""
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    seg = tl.program_id(2) + 1
    offs_d = pid * BD + tl.arange(0, BD)
    nn = tl.arange(0, NP)
    mn = nn < dstate
    A2 = tl.load(A_ptr + nn[:, None] * dim + offs_d[None, :], mask=mn[:, None], other=0.0).to(tl.float32) * LOG2E
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)[:, None]
    C_base = C_ptr + pid_b * sC_b + ((pid * BD) // d_per_group) * sC_g
    acc = tl.zeros([NP, BD], dtype=tl.float32)
    cum = tl.zeros([BD], dtype=tl.float32)
    restarts = tl.full([], 0, tl.int32)  # seen in the segment so far
    t_lo = seg * seg_len
    t_hi = tl.minimum(t_lo + seg_len, L)
    for t0 in range(t_lo, t_hi, T):
        t = t0 + tl.arange(0, T)
        mt = (t < t_hi)[None, :]
        dt = tl.load(dt_ptr + pid_b * sdt_b + offs_d[:, None] * sdt_d + t[None, :] * sdt_l, mask=mt,
                     other=0.0).to(tl.float32)
        if HAS_DTB:
            dt += bias
        if SOFTPLUS:
            dt = softplus(dt)
        dt = tl.where(mt, dt, 0.0)
        c = tl.cumsum(dt, axis=1) + cum[:, None]  # (BD, T): delta summed from the segment's first token
        cum += tl.sum(dt, axis=1)
        dy = tl.load(dy_ptr + (pid_b * dim + offs_d[:, None]) * L + t[None, :], mask=mt, other=0.0).to(tl.float32)
        if GATE_DY:
            zv = tl.load(z_ptr + pid_b * sz_b + offs_d[:, None] * sz_d + t[None, :] * sz_l, mask=mt,
                         other=0.0).to(tl.float32)
            dy = dy * zv * tl.sigmoid(zv)
        Cn = tl.load(C_base + nn[:, None] * sC_n + t[None, :] * sC_l, mask=mn[:, None] & mt, other=0.0)
        w = exp2(A2[:, :, None] * c[None, :, :], FAST_EXP)  # (NP, BD, T)
        cx = Cn.to(tl.float32)[:, None, :] * dy[None, :, :]
        if HAS_SID:
            mtok = t < t_hi
            s_cur, start, end = segment_flags(sid_ptr + pid_b * ssid_b, t, mtok, L, t == L - 1, VARLEN)
            seen = tl.cumsum(start.to(tl.int32), axis=0) + restarts
            restarts += tl.sum(start.to(tl.int32), axis=0)
            w = tl.where((seen == 0)[None, None, :], w, 0.0)  # up to the segment's first restart
            if HAS_DLAST and VARLEN:  # each packed sequence's d(last state) at its last token
                cx += tl.load(dlast_ptr + (s_cur[None, None, :] * dim + offs_d[None, :, None]) * dstate
                              + nn[:, None, None], mask=end[None, None, :] & mn[:, None, None],
                              other=0.0).to(tl.float32)
        acc += tl.sum(w * cx, axis=2)
    if HAS_DLAST and not VARLEN:
        if seg == nseg - 1:  # d(last state) enters at token L - 1, the last segment's last
            dl = tl.load(dlast_ptr + pid_b * dim * dstate + nn[:, None] * dim + offs_d[None, :], mask=mn[:, None],
                         other=0.0).to(tl.float32)
            decay = exp2(A2 * cum[None, :], FAST_EXP)
            if HAS_SID:
                decay = tl.where(restarts == 0, decay, 0.0)
            acc += decay * dl
    row = pid_b * nseg + seg
    tl.store(gl_ptr + (row * dstate + nn[:, None]) * dim + offs_d[None, :], acc, mask=mn[:, None])
    tl.store(ds_ptr + row * dim + offs_d, cum)
    if HAS_SID:
        tl.store(rs_ptr + row, restarts)


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
