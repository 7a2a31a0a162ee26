"""Backward kernel of the Mamba-1 selective scan: one thread per channel, the chunk's tokens in its registers.

Walks the chunks in reverse on the forward's (P, BD, V) tiles (triton_tiles.py), with state-major checkpoints /
carries / dA (b, ., n, d). Per chunk and state it recomputes the forward states from the chunk's checkpoint and runs
the adjoint dh_t = dy_t C_t + a_{t+1} dh_{t+1} in reverse (a register chain, or a reverse scan whose monoid
carries each run's first decay), so a_t is computed once per element (one exp2) and never shifted. The carry
between chunks is g = a dh at the chunk's first token (0 where a sequence starts), which is also d(initial
state). Both scans, the carries and the sums over tokens (dA, dD, d delta_bias) stay inside each thread; only
dB / dC sum over channels: per program by ``tl.reduce`` (shuffles + shared memory) into (b, d / BD, n, L)
partials, or per warp by lane shuffles (LANE_SUM, triton_lanes.py). One row (thread) per channel.

With checkpoints every CK chunks (CK > 1) the program first runs the forward recurrence over each group's chunks
(from the group's checkpoint, into a small scratch of its own, (CK, n, BD) fp32 that stays in L2) and then walks
the group's chunks in reverse as above, reading the rebuilt states: CK times fewer checkpoints kept between the
passes for one more forward scan (without y) in the backward.

Segments (SEG_CHUNKS chunks each, a multiple of CK; a third grid axis): each program walks one segment of its
channels' sequence, starting from the carry the later segments feed in (triton_bwd_carry.py), so a short grid of
channels still fills the GPU. Partial sums over tokens (dA, dD, d delta_bias) are then per sequence and segment.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_bwd_carry import segment_carry
from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, segment_flags
from mamba_parallel.ops.selective_scan.triton_lanes import rows_lane, warp_channel_sum
from mamba_parallel.ops.selective_scan.triton_tiles import (delta_tile, first_token, last_token, load_tile,
                                                            scan_adjoint, scan_forward, state_row, store_tile)


@triton.jit
def _add2(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _rebuild_group(u_ptr, dt_ptr, B_base, A_ptr, h0_ptr, sid_ptr, ckpt_ptr, scr_ptr, pid_b, c0, cg, nk, L, dim,
                   dstate, ngroups, s_row, drow, bias, su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sB_n, sB_l, ssid_b, v_idx,
                   p_idx, tok, tok2, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_H0: tl.constexpr,
                   HAS_SID: tl.constexpr, VARLEN: tl.constexpr, FAST_EXP: tl.constexpr, BD: tl.constexpr,
                   P: tl.constexpr, V: tl.constexpr, SEQ: tl.constexpr, CK: tl.constexpr):
    """The states entering chunks cg .. cg + nk of group cg / CK -> scr slots 0 .. nk (b, CK, n, d), by the
    forward's recurrence over chunks cg .. cg + nk - 1 from the group's checkpoint (no y: only each chunk's last
    state is stored). Every row reads back only what it stored itself (SEQ: the row-per-thread layout), else a
    barrier guards the slots."""
    dn = dim * dstate
    src = ckpt_ptr + (pid_b * ngroups + cg // CK) * dn + s_row
    dst = scr_ptr + pid_b * CK * dn + s_row
    for n in range(dstate):
        tl.store(dst + n * dim, tl.load(src + n * dim))
    if not SEQ:
        tl.debug_barrier()
    for j in range(nk):
        t0 = (cg + j) * (P * V)
        t = t0 + tok
        mt = t < L
        t2 = t0 + tok2
        mt2 = t2 < L
        u = load_tile(u_ptr + pid_b * su_b, c0, su_d, su_l, t0, L, P, BD, V, 1)
        _, dt = delta_tile(dt_ptr + pid_b * sdt_b, c0, sdt_d, sdt_l, t0, L, mt, bias, P, BD, V, 1, HAS_DTB,
                           SOFTPLUS)
        dtu = dt * u
        if HAS_SID:
            s_cur, start, _ = segment_flags(sid_ptr + pid_b * ssid_b, t, mt, L, mt, VARLEN)
        h_in = dst + j * dn
        for n in range(dstate):
            A_n = tl.load(A_ptr + s_row + n * dim).to(tl.float32)[None, :, None]
            B_n = state_row(B_base, n, sB_n, sB_l, t2, mt2)
            a = exp2(dt * (A_n * LOG2E), FAST_EXP)
            bx = dtu * B_n
            if HAS_SID:
                if VARLEN and HAS_H0:  # a packed sequence starts from its own initial state
                    hin = tl.load(h0_ptr + s_cur * dn + drow + n, mask=start, other=0.0).to(tl.float32)
                    bx += a * hin
                a = tl.where(start, 0.0, a)
            hs = scan_forward(a, bx, tl.load(h_in + n * dim), v_idx, p_idx, P, V, SEQ)
            tl.store(h_in + dn + n * dim, last_token(hs, v_idx, p_idx, P, V))
        if not SEQ:
            tl.debug_barrier()


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, dt_ptr, z_ptr, B_ptr, C_ptr, A_ptr, D_ptr, dtb_ptr, h0_ptr, sid_ptr, ckpt_ptr, gated_ptr, dy_ptr,
    dlast_ptr, dout_ptr,
    du_ptr, ddt_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, ddtb_ptr, dh0_ptr, adj_ptr, scr_ptr, gl_ptr, ds_ptr,
    rs_ptr,
    L, dim, dstate, d_per_group, nchunks, nblk, ngroups, seg_chunks, nseg,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
    sB_b, sB_g, sB_n, sB_l, sC_b, sC_g, sC_n, sC_l, ssid_b,
    sdo_b, sdo_d, sdo_l, sdz_b, sdz_d, sdz_l, sg_b, sg_d, sg_l, sdu_b, sdu_d, sdu_l,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_SID: tl.constexpr, VARLEN: tl.constexpr, HAS_DLAST: tl.constexpr,
    FAST_EXP: tl.constexpr, BD: tl.constexpr, P: tl.constexpr, V: tl.constexpr,
    LANE_SUM: tl.constexpr = False, LP: tl.constexpr = 0, LV: tl.constexpr = 0, UNROLL: tl.constexpr = 1,
    STAGES: tl.constexpr = 1, EMU: tl.constexpr = False, CK: tl.constexpr = 1, GATED: tl.constexpr = False,
    DY_GATED: tl.constexpr = False,
):
    """One program: channels [pid * BD, +BD) of sequence pid_b, the chunks of P * V tokens of segment pid_s
    (chunks [pid_s * seg_chunks, +seg_chunks) of nchunks, nseg segments) walked in reverse.

    A (n, d) and ckpt (b, nchunks, n, d) (states entering each chunk; fp32, or bf16 with CK == 1) are
    state-major, as the forward's; dy (b, d, L) contiguous: the output's gradient (with HAS_Z the gated output's,
    unless DY_GATED); dlast like hlast, but (b, n, d) unless VARLEN.
    HAS_Z: y before the gate is rebuilt from the recomputed states (C h summed over the state loop, + D u), so the
    forward keeps no copy of it; dz (b, d, L, any strides) comes from it and the gated output's gradient dout (any
    strides: dy itself unless DY_GATED), and with GATED the gated output y * silu(z) goes to gated (b, d, L, any
    strides): a fused layer's out_proj input for its weight gradient. DY_GATED: dy is y's gradient already (dout *
    silu(z)), so z and dout are read only after the state loop: a load of a channel-contiguous view before it (a
    layer's z and dout) makes Triton give up the row-per-thread layout (sm_90: 2 KB of spills, 5x the
    instructions), where stores and loads after the loop cost nothing of it.
    Writes du (b, d, L, any strides: stored after the state loop, e.g. channels-last for the conv's backward), ddt
    (b, d, L) contiguous; dB, dC partials (b, nblk, n, L) fp32; dA (nseg, b, n, d) (accumulated:
    zeros from the host), dD (nseg, b, d), ddtb (nseg, b, d) fp32 per-segment partials; dh0 like h0. adj
    (nseg, b, 2, n, d) fp32: ping-pong slots for g = a dh at a chunk's first token. gl (b, nseg, n, d) / ds
    (b, nseg, d) / rs (b, nseg) int32 with HAS_SID: the later segments' carries (adjoint_carry_kernel; unread with
    one segment).
    LANE_SUM (the row-per-thread layout only; P = 2^LP, V = 2^LV): dB / dC partials per warp of 32 channels
    (nblk = d / 32) by lane shuffles (triton_lanes.py) instead of per program by ``tl.reduce``.
    UNROLL states per iteration of the state loop, pipelined over STAGES stages.
    scr_ptr / ngroups: unused with CK == 1 (the host passes adj and nchunks), as the forward's: the argument list
    whose code was timed. CK > 1: ckpt (b, ngroups = cdiv(nchunks, CK), n, d) holds the state entering every
    CK-th chunk; before walking a group's chunks the program rebuilds the states entering them into its own
    slots of scr (nseg, b, CK, n, d) fp32 (``_rebuild_group``), which the walk then reads as checkpoints.
    EMU (tests): the lane paths with the shuffles emulated, so that the interpreter runs them.
    """
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    seg = tl.program_id(2)
    part = seg * tl.num_programs(1) + pid_b  # this program's row of the per-segment buffers
    rows = tl.arange(0, BD)
    offs_d = pid * BD + rows  # the channel of each row
    p_idx = tl.arange(0, P)[:, None]
    v_idx = tl.arange(0, V)[None, None, :]
    tok = tl.arange(0, P)[:, None, None] * V + v_idx
    tok2 = tl.arange(0, P)[:, None] * V + tl.arange(0, V)[None, :]
    g = (pid * BD) // d_per_group
    dn = dim * dstate
    d_off = offs_d * dstate  # row offsets in a (d, n) slab
    drow = d_off[None, :, None]
    s_row = offs_d  # row offsets in an (n, d) state slab: a state's channels are contiguous
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d).to(tl.float32)[None, :, None]
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)[None, :, None]
    else:
        bias = 0.0
    B_base = B_ptr + pid_b * sB_b + g * sB_g
    C_base = C_ptr + pid_b * sC_b + g * sC_g
    if LANE_SUM:
        grow = pid * BD + rows  # global row: 32 per warp
        lane = rows_lane(BD, EMU)
        lane_tok = lane % (P * V)  # the token this lane's sums end up holding
        lane_ok = lane < P * V
        part_base = (pid_b * nblk + grow // 32) * dstate * L + lane_tok
    else:
        part_base = (pid_b * nblk + pid) * dstate * L
    dD_acc = tl.zeros([BD], dtype=tl.float32)
    ddtb_acc = tl.zeros([BD], dtype=tl.float32)
    c_lo = seg * seg_chunks
    c_hi = tl.minimum(c_lo + seg_chunks, nchunks)
    adj_base = adj_ptr + part * 2 * dn
    scr_base = scr_ptr + seg * tl.num_programs(1) * CK * dn  # _rebuild_group adds pid_b's slots
    # the carry entering the segment's last chunk, where the walk reads it
    segment_carry(gl_ptr, ds_ptr, rs_ptr, A_ptr, adj_base + (c_hi % 2) * dn, pid_b, seg, nseg, dim, dstate, s_row,
                  HAS_SID, FAST_EXP)
    tl.debug_barrier()

    for ci in range(c_hi - c_lo):
        c = c_hi - 1 - ci
        t = c * (P * V) + tok
        mt = t < L
        t2 = c * (P * V) + tok2
        mt2 = t2 < L
        end = t == L - 1  # where d(last_state) enters
        if HAS_SID:
            s_cur, start, end = segment_flags(sid_ptr + pid_b * ssid_b, t, mt, L, end, VARLEN)
        t0 = c * (P * V)
        c0 = pid * BD
        u = load_tile(u_ptr + pid_b * su_b, c0, su_d, su_l, t0, L, P, BD, V, 1)
        dt_raw, dt = delta_tile(dt_ptr + pid_b * sdt_b, c0, sdt_d, sdt_l, t0, L, mt, bias, P, BD, V, 1, HAS_DTB,
                                SOFTPLUS)
        dtu = dt * u
        out_b = pid_b * dim * L  # the (b, d, L) contiguous buffers
        dy = load_tile(dy_ptr + out_b, c0, L, 1, t0, L, P, BD, V, 1)
        if HAS_Z:  # y's gradient through the gate (dz waits for y, rebuilt in the state loop)
            if not DY_GATED:
                zv = load_tile(z_ptr + pid_b * sz_b, c0, sz_d, sz_l, t0, L, P, BD, V, 1)
                dy = dy * zv * tl.sigmoid(zv)
            y_acc = tl.zeros([P, BD, V], dtype=tl.float32)
        if HAS_D:
            dD_acc += tl.sum(tl.sum(dy * u, axis=2), axis=0)
        if CK > 1:
            j = c % CK  # the chunk's place in its group
            if (j == CK - 1) | (c == nchunks - 1):  # the group's last chunk, walked first
                _rebuild_group(u_ptr, dt_ptr, B_base, A_ptr, h0_ptr, sid_ptr, ckpt_ptr, scr_base, pid_b, c0, c - j, j,
                               L, dim, dstate, ngroups, s_row, drow, bias, su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sB_n,
                               sB_l, ssid_b, v_idx, p_idx, tok, tok2, HAS_DTB, SOFTPLUS, HAS_H0, HAS_SID, VARLEN,
                               FAST_EXP, BD, P, V, LANE_SUM, CK)
            ck = scr_base + (pid_b * CK + j) * dn + s_row
        else:
            ck = ckpt_ptr + (pid_b * nchunks + c) * dn + s_row
        adj_in = adj_base + ((c + 1) % 2) * dn + s_row  # g entering from chunk c + 1
        adj_out = adj_base + (c % 2) * dn + s_row

        dhB = tl.zeros([P, BD, V], dtype=tl.float32)   # sum_n dh * B_n
        dhA = tl.zeros([P, BD, V], dtype=tl.float32)   # sum_n dh * a_t h_{t-1} * A_n
        # UNROLL states per iteration: independent work for the scheduler. With the row-per-thread layout:
        # software-pipelined over 3 stages (H200: b8 d4096 L4096 backward 6.55 -> 5.58 ms, b4 d5120 L8192
        # 10.2 -> 9.9).
        for n0 in tl.range(0, dstate, UNROLL, num_stages=STAGES):
            for k in tl.static_range(UNROLL):
                n = n0 + k
                A_n = tl.load(A_ptr + s_row + n * dim).to(tl.float32)[None, :, None]
                B_n = state_row(B_base, n, sB_n, sB_l, t2, mt2)
                C_n = state_row(C_base, n, sC_n, sC_l, t2, mt2)
                a = exp2(dt * (A_n * LOG2E), FAST_EXP)
                bx = dtu * B_n
                hx = bx
                if HAS_SID:
                    if VARLEN and HAS_H0:
                        hin = tl.load(h0_ptr + s_cur * dn + drow + n, mask=start, other=0.0).to(tl.float32)
                        hx += a * hin
                    am = tl.where(start, 0.0, a)
                else:
                    am = a
                hs = scan_forward(am, hx, tl.load(ck + n * dim).to(tl.float32), v_idx, p_idx, P, V, LANE_SUM)
                if HAS_Z:
                    y_acc += hs * C_n
                cx = dy * C_n
                if HAS_DLAST:
                    if VARLEN:
                        cx += tl.load(dlast_ptr + s_cur * dn + drow + n, mask=end, other=0.0).to(tl.float32)
                    else:
                        gl = tl.load(dlast_ptr + pid_b * dn + s_row + n * dim).to(tl.float32)[None, :, None]
                        cx += tl.where(end, gl, 0.0)
                dh = scan_adjoint(am, cx, tl.load(adj_in + n * dim), v_idx, p_idx, P, V, LANE_SUM)
                g_first = first_token(dh, v_idx, p_idx) * first_token(am, v_idx, p_idx)
                tl.store(adj_out + n * dim, g_first)
                if LANE_SUM:
                    m_l = lane_ok & (c * (P * V) + lane_tok < L)
                    tl.store(dB_ptr + part_base + n * L + c * (P * V), warp_channel_sum(dh * dtu, LP, LV, EMU),
                             mask=m_l)
                    tl.store(dC_ptr + part_base + n * L + c * (P * V), warp_channel_sum(dy * hs, LP, LV, EMU),
                             mask=m_l)
                else:  # over the program's channels: (P, 1, V) sums (reduced as (P, BD, 1, V): a keep_dims reduce
                    # moves the varlen code's registers)
                    sB, sC = tl.reduce((tl.reshape(dh * dtu, (P, BD, 1, V)), tl.reshape(dy * hs, (P, BD, 1, V))),
                                       axis=1, combine_fn=_add2)
                    tp = part_base + n * L + c * (P * V) + tok
                    tl.store(dB_ptr + tp, sB, mask=mt)
                    tl.store(dC_ptr + tp, sC, mask=mt)
                dhB += dh * B_n
                x = dh * (hs - bx)  # dh_t a_t h_{t-1}
                dhA += x * A_n
                dA_n = dA_ptr + part * dn + s_row + n * dim  # accumulated over chunks (zeros from the host)
                tl.store(dA_n, tl.load(dA_n) + tl.sum(tl.sum(x * dt, axis=2), axis=0))
                if HAS_H0:
                    if VARLEN:
                        tl.store(dh0_ptr + s_cur * dn + drow + n, a * dh, mask=start)
                    elif c == 0:
                        tl.store(dh0_ptr + pid_b * dn + d_off + n, g_first)
        if HAS_Z:  # the gate's gradient from the rebuilt y; z and dout read again (not held through the loop)
            if HAS_D:
                y_acc += Dv * u
            zv = load_tile(z_ptr + pid_b * sz_b, c0, sz_d, sz_l, t0, L, P, BD, V, 1)
            dout = load_tile(dout_ptr + pid_b * sdo_b, c0, sdo_d, sdo_l, t0, L, P, BD, V, 1)
            sig = tl.sigmoid(zv)
            store_tile(dz_ptr + pid_b * sdz_b, dout * y_acc * sig * (1.0 + zv * (1.0 - sig)), c0, sdz_d, sdz_l,
                       t0, L, P, BD, V, 1)
            if GATED:
                store_tile(gated_ptr + pid_b * sg_b, y_acc * zv * sig, c0, sg_d, sg_l, t0, L, P, BD, V, 1)
        du = dhB * dt
        if HAS_D:
            du += Dv * dy
        ddt = dhB * u + dhA
        if SOFTPLUS:
            ddt = ddt * tl.sigmoid(dt_raw)
        ddt = tl.where(mt, ddt, 0.0)
        if HAS_DTB:
            ddtb_acc += tl.sum(tl.sum(ddt, axis=2), axis=0)
        store_tile(du_ptr + pid_b * sdu_b, du, c0, sdu_d, sdu_l, t0, L, P, BD, V, 1)
        store_tile(ddt_ptr + out_b, ddt, c0, L, 1, t0, L, P, BD, V, 1)
        if not LANE_SUM:  # with the row-per-thread layout each thread reloads the carries it stored itself
            tl.debug_barrier()  # the carries, for other layouts

    if HAS_D:
        tl.store(dD_ptr + part * dim + offs_d, dD_acc)
    if HAS_DTB:
        tl.store(ddtb_ptr + part * dim + offs_d, ddtb_acc)
