"""Forward kernel of the Mamba-1 selective scan: one thread per channel, the chunk's tokens in its registers.

One program walks L in chunks of S tokens for BD channels of one sequence. The tiles are (P, BD * R, V)
(triton_tiles.py), so the scan, the chunk's last state and y's sum over the states stay inside each thread. With
R = 2 each channel has two rows (two neighbouring lanes), each scanning half of the states: twice the threads for
the same work, and one pairwise sum of y per chunk. The state carried to the next chunk goes through a small
state-major buffer (the state loop is a runtime loop, so a register carry per state is not expressible); with the
row-per-thread layout (LANES) each thread reads back what it wrote, otherwise a barrier guards it. With gradients
the buffer keeps the state entering every chunk, or every CK-th chunk (the rest then pass through a carry pair):
the checkpoints the backward recomputes from.

With a constexpr state count (NS: two rows per channel, n / 2 <= 8 states per row) the state loop is unrolled
instead: A and the carries stay in registers for the whole sequence (slots of a tile), the next state's B / C rows
are loaded while one state scans, and the rows of u / delta / z two chunks ahead are prefetched into L2
(PREFETCH): H200, b4 d5120 L8192 bf16 forward 3.76 -> 2.83 ms (docs/kernels/selective_scan.md). The carry buffer
is then written only for checkpoints.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, prefetch_l2, segment_flags
from mamba_parallel.ops.selective_scan.triton_tiles import (_at, _put, delta_tile, last_token, load_tile,
                                                            paired_state_row, rows_sum, scan_forward, state_rows,
                                                            store_tile)


@triton.jit
def selective_scan_fwd_kernel(
    u_ptr, dt_ptr, z_ptr, B_ptr, C_ptr, A_ptr, D_ptr, dtb_ptr, h0_ptr, sid_ptr,
    y_ptr, _pad_ptr, hlast_ptr, st_ptr, carry_ptr,
    L, dim, dstate, d_per_group, nchunks, nslots, _pad_n,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
    sB_b, sB_g, sB_n, sB_l, sC_b, sC_g, sC_n, sC_l, ssid_b, sy_b, sy_d, sy_l,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_SID: tl.constexpr, VARLEN: tl.constexpr,
    FAST_EXP: tl.constexpr, BD: tl.constexpr, P: tl.constexpr, V: tl.constexpr,
    R: tl.constexpr = 1, LANES: tl.constexpr = False, UNROLL: tl.constexpr = 1, STAGES: tl.constexpr = 1,
    EMU: tl.constexpr = False, NS: tl.constexpr = 0, PREFETCH: tl.constexpr = 0, CKPT: tl.constexpr = True,
    CK: tl.constexpr = 1, CKPT_APART: tl.constexpr = False,
):
    """One program: channels [pid_d * BD, +BD) of sequence pid_b, chunks of S = P * V tokens; R (1 or 2, dividing
    n) rows per channel, row R c + h scanning states [h n / R, (h + 1) n / R). LANES: the row-per-thread layout is
    guaranteed (row i in lane i mod 32), so rows pair up by a lane shuffle; EMU (tests): emulated in the
    interpreter.

    A (n, d) and st (b, nslots, n, d) fp32 are state-major, so that a warp's accesses to one state are one
    coalesced 128-byte access; slot c % nslots holds the state entering chunk c (slot 0 filled by the host).
    Writes y (b, d, L, any strides; with HAS_Z the gated y * silu(z), z read only after the state loop, so that
    channel-contiguous views of z and y cost the row-per-thread layout nothing), hlast (b or nseq, d, n) fp32 (the
    backward rebuilds y before the z gate from the checkpoints: nothing else is kept). _pad_ptr (the host passes
    y) is never read: with carry_ptr / _pad_n it keeps the timed argument list.
    carry_ptr / _pad_n: unused with CK == 1 (the host passes st and nchunks); they keep the argument list whose
    code was timed: at the unrolled forward's 168-register cap ptxas allocates by it (without them: 24 B of spills
    on sm_90). CK > 1 (with CKPT): st (b, nslots = cdiv(nchunks, CK), n, d) keeps only the state entering every
    CK-th chunk; the others pass through carry (b, 2, n, d), ping-pong.
    CKPT_APART (CKPT, CK == 1): the checkpoints go to carry_ptr's (b, nchunks, n, d) buffer in its own dtype (bf16:
    half the bytes), slot 0 filled by the host; st (b, nslots <= 2, n, d) fp32 only carries, so the forward's
    chain never passes through the narrower type.
    UNROLL states per iteration of the state loop, pipelined over STAGES stages.
    NS > 0 (LANES, no VARLEN, NS / R <= S): n = NS known, the row's states unrolled; st is then only written when
    CKPT (checkpoints for the backward). PREFETCH > 0: prefetch u / delta / z that many chunks ahead (GPU only).
    """
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BD * R)
    offs_d = pid_d * BD + rows // R                  # the channel of each row
    half = rows % R
    p_idx = tl.arange(0, P)[:, None]                 # for (P, BD) tensors
    v_idx = tl.arange(0, V)[None, None, :]           # for (P, BD, V) tensors
    tok = tl.arange(0, P)[:, None, None] * V + v_idx  # (P, 1, V) token offsets in the chunk
    tok2 = tl.arange(0, P)[:, None] * V + tl.arange(0, V)[None, :]  # (P, V) for B / C
    g = (pid_d * BD) // d_per_group
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d).to(tl.float32)[None, :, None]
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)[None, :, None]
    else:
        bias = 0.0
    B_base = B_ptr + pid_b * sB_b + g * sB_g
    C_base = C_ptr + pid_b * sC_b + g * sC_g
    nh = dstate // R
    d_off = offs_d * dstate + half * nh  # row offsets in a (d, n) slab: the row's first state
    drow = d_off[None, :, None]
    dn = dim * dstate
    s_row = half * nh * dim + offs_d  # row offsets in an (n, d) state slab: a state's channels are contiguous
    first_row = (half == 0)[None, :, None]  # the row that stores a channel's outputs
    if NS > 0:
        NH: tl.constexpr = NS // R
        # A (times log2 e) and the carries of the row's states in registers: state k in token slot k of a tile
        # (a masked load gives zeros in the tiles' layout, so slot reads / writes are register moves)
        A_k = load_tile(u_ptr + pid_b * su_b, pid_d * BD, su_d, su_l, L, L, P, BD * R, V, R)
        hc = A_k
        for k in tl.static_range(NH):
            A_k = _put(A_k, tl.load(A_ptr + s_row + k * dim) * LOG2E, k // V, k % V, P, V)
            hc = _put(hc, tl.load(st_ptr + pid_b * nslots * dn + s_row + k * dim), k // V, k % V, P, V)

    for c in range(nchunks):
        t = c * (P * V) + tok
        mt = t < L
        t2 = c * (P * V) + tok2
        mt2 = t2 < L
        t0 = c * (P * V)
        if PREFETCH > 0:  # DRAM latency off the chain: L2 holds these rows by the time they are loaded
            tn = tl.minimum(t0 + PREFETCH * (P * V), L - 1)
            prefetch_l2(u_ptr + pid_b * su_b + offs_d * su_d + tn * su_l)
            prefetch_l2(dt_ptr + pid_b * sdt_b + offs_d * sdt_d + tn * sdt_l)
            if HAS_Z:
                prefetch_l2(z_ptr + pid_b * sz_b + offs_d * sz_d + tn * sz_l)
        u = load_tile(u_ptr + pid_b * su_b, pid_d * BD, su_d, su_l, t0, L, P, BD * R, V, R)
        _, dt = delta_tile(dt_ptr + pid_b * sdt_b, pid_d * BD, sdt_d, sdt_l, t0, L, mt, bias, P, BD * R, V, R,
                           HAS_DTB, SOFTPLUS)
        dtu = dt * u
        if HAS_SID:
            s_cur, start, end = segment_flags(sid_ptr + pid_b * ssid_b, t, mt, L, mt, VARLEN)
        if CK > 1:  # checkpoints at the groups' first chunks, the carry pair between them
            if c % CK == 0:
                st_in = st_ptr + (pid_b * nslots + c // CK) * dn + s_row
            else:
                st_in = carry_ptr + (pid_b * 2 + c % 2) * dn + s_row
        else:
            st_in = st_ptr + (pid_b * nslots + c % nslots) * dn + s_row
        if c + 1 < nchunks:
            if CK > 1:
                if (c + 1) % CK == 0:
                    st_out = st_ptr + (pid_b * nslots + (c + 1) // CK) * dn + s_row
                else:
                    st_out = carry_ptr + (pid_b * 2 + (c + 1) % 2) * dn + s_row
            else:
                st_out = st_ptr + (pid_b * nslots + (c + 1) % nslots) * dn + s_row
            st_step = dim
        else:
            st_out = hlast_ptr + pid_b * dn + d_off
            st_step = 1
        if CKPT_APART:
            ck_out = carry_ptr + (pid_b * nchunks + c + 1) * dn + s_row
        y = tl.zeros([P, BD * R, V], dtype=tl.float32)
        if NS > 0:
            Bn = state_rows(B_base, 0, NH, sB_n, sB_l, t0, L, P, BD * R, V, R)
            Cn = state_rows(C_base, 0, NH, sC_n, sC_l, t0, L, P, BD * R, V, R)
            for k in tl.static_range(NH):
                B_n = Bn
                C_n = Cn
                if k + 1 < NH:  # the next state's rows are in flight while this one scans
                    Bn = state_rows(B_base, k + 1, NH, sB_n, sB_l, t0, L, P, BD * R, V, R)
                    Cn = state_rows(C_base, k + 1, NH, sC_n, sC_l, t0, L, P, BD * R, V, R)
                a = exp2(dt * _at(A_k, k // V, k % V, P, V)[None, :, None], FAST_EXP)
                if HAS_SID:
                    a = tl.where(start, 0.0, a)
                hs = scan_forward(a, dtu * B_n, _at(hc, k // V, k % V, P, V), v_idx, p_idx, P, V, LANES)
                y += hs * C_n
                h_last = last_token(hs, v_idx, p_idx, P, V)
                hc = _put(hc, h_last, k // V, k % V, P, V)
                if CKPT:
                    if c + 1 < nchunks:
                        if CK > 1:  # the registers carry the state; only the groups' checkpoints are stored
                            if (c + 1) % CK == 0:
                                tl.store(st_out + k * dim, h_last)
                        elif CKPT_APART:
                            tl.store(ck_out + k * dim, h_last)
                        else:
                            tl.store(st_out + k * dim, h_last)
        else:
            # UNROLL states per iteration: independent work for the scheduler. With the row-per-thread layout the
            # loop is software-pipelined over 2 stages: the next states' A / carry / B / C rows are fetched (async
            # copies) while these are scanned (H200: b8 d4096 L4096 forward 2.67 -> 2.23 ms; 3 stages: 2.48).
            for n0 in tl.range(0, nh, UNROLL, num_stages=STAGES):
                for k in tl.static_range(UNROLL):
                    n = n0 + k
                    A_n = (tl.load(A_ptr + s_row + n * dim).to(tl.float32) * LOG2E)[None, :, None]
                    B_n = paired_state_row(B_base, n, nh, sB_n, sB_l, t2, mt2, first_row, R)
                    C_n = paired_state_row(C_base, n, nh, sC_n, sC_l, t2, mt2, first_row, R)
                    a = exp2(dt * A_n, FAST_EXP)
                    bx = dtu * B_n
                    if HAS_SID:
                        if VARLEN and HAS_H0:  # a packed sequence starts from its own initial state
                            hin = tl.load(h0_ptr + s_cur * dn + drow + n, mask=start, other=0.0).to(tl.float32)
                            bx += a * hin
                        a = tl.where(start, 0.0, a)
                    hs = scan_forward(a, bx, tl.load(st_in + n * dim), v_idx, p_idx, P, V, LANES)
                    y += hs * C_n
                    if VARLEN:
                        tl.store(hlast_ptr + s_cur * dn + drow + n, hs, mask=end)
                        if c + 1 < nchunks:  # the packed sequences' final states are stored at their ends
                            tl.store(st_out + n * st_step, last_token(hs, v_idx, p_idx, P, V))
                    else:
                        tl.store(st_out + n * st_step, last_token(hs, v_idx, p_idx, P, V))
                    if CKPT_APART:
                        if c + 1 < nchunks:
                            tl.store(ck_out + n * dim, last_token(hs, v_idx, p_idx, P, V))
        y = rows_sum(y, R, LANES, EMU)
        if HAS_D:
            y += Dv * u
        if HAS_Z:
            zv = load_tile(z_ptr + pid_b * sz_b, pid_d * BD, sz_d, sz_l, t0, L, P, BD * R, V, R)
            y = y * zv * tl.sigmoid(zv)  # as the backward rebuilds it (its out_proj weight gradient)
        store_tile(y_ptr + pid_b * sy_b, y, pid_d * BD, sy_d, sy_l, t0, L, P, BD * R, V, R)
        if not LANES:  # with the row-per-thread layout each thread reloads the carries it stored itself
            tl.debug_barrier()  # the next chunk's entering state, for other layouts
    if NS > 0:
        for k in tl.static_range(NH):
            tl.store(hlast_ptr + pid_b * dn + d_off + k, _at(hc, k // V, k % V, P, V))
