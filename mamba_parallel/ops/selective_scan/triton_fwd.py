"""Forward kernel of the Mamba-1 selective scan (tiling in triton_common)."""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, linear_combine, softplus


@triton.jit
def selective_scan_fwd_kernel(
    u_ptr, dt_ptr, z_ptr, B_ptr, C_ptr, A_ptr, D_ptr, dtb_ptr, h0_ptr, sid_ptr,
    y_ptr, ypre_ptr, hlast_ptr, st_ptr,
    L, dim, dstate, d_per_group, nchunks, nslots,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
    sB_b, sB_g, sB_n, sB_l, sC_b, sC_g, sC_n, sC_l, ssid_b,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_SID: tl.constexpr, VARLEN: tl.constexpr, SAVE_YPRE: tl.constexpr,
    FAST_EXP: tl.constexpr, BD: tl.constexpr, T: tl.constexpr,
):
    """One program: channels [pid_d * BD, +BD) of sequence pid_b, the whole length.

    st (b, nslots, d, n) fp32: slot c % nslots holds the state entering chunk c; the host fills slot 0 (initial
    state or zeros). nslots == nchunks keeps them all (the checkpoints), nslots <= 2 ping-pongs.
    Writes y (b, d, L) contiguous; ypre = y before the z gate when SAVE_YPRE; hlast (b or nseq, d, n) fp32.
    """
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)  # BD divides d: no channel mask
    offs_t = tl.arange(0, T)
    g = (pid_d * BD) // d_per_group
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d).to(tl.float32)
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)
    B_base = B_ptr + pid_b * sB_b + g * sB_g
    C_base = C_ptr + pid_b * sC_b + g * sC_g
    out_off = pid_b * dim * L + offs_d[:, None] * L
    d_off = offs_d * dstate  # row offsets in a (d, n) slab
    dn = dim * dstate

    for c in range(nchunks):
        t = c * T + offs_t
        mt = t < L
        mdt = mt[None, :]
        u = tl.load(u_ptr + pid_b * su_b + offs_d[:, None] * su_d + t[None, :] * su_l, mask=mdt,
                    other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + pid_b * sdt_b + offs_d[:, None] * sdt_d + t[None, :] * sdt_l, mask=mdt,
                     other=0.0).to(tl.float32)
        if HAS_DTB:
            dt += bias[:, None]
        if SOFTPLUS:
            dt = softplus(dt)
        dtu = dt * u
        if HAS_SID:
            s_cur = tl.load(sid_ptr + pid_b * ssid_b + t, mask=mt, other=0)
            s_prev = tl.load(sid_ptr + pid_b * ssid_b + t - 1, mask=mt & (t > 0), other=0)
            start = mt & (s_cur != s_prev) & (t > 0)
            if VARLEN:
                start = start | (t == 0)
                s_next = tl.load(sid_ptr + pid_b * ssid_b + t + 1, mask=(t + 1) < L, other=0)
                end = mt & (((t + 1) >= L) | (s_next != s_cur))
        # one-hot weights of the chunk's last token: h_last = sum_t w_t h_t is one FMA chain per thread
        w_last = tl.where(offs_t == tl.minimum(T - 1, L - 1 - c * T), 1.0, 0.0)[None, :]
        st_in = st_ptr + (pid_b * nslots + c % nslots) * dn + d_off
        if c + 1 < nchunks:
            st_out = st_ptr + (pid_b * nslots + (c + 1) % nslots) * dn + d_off
        else:
            st_out = hlast_ptr + pid_b * dn + d_off
        y = tl.zeros([BD, T], dtype=tl.float32)
        for n in range(dstate):
            A_n = tl.load(A_ptr + d_off + n).to(tl.float32) * LOG2E
            B_n = tl.load(B_base + n * sB_n + t * sB_l, mask=mt, other=0.0)
            C_n = tl.load(C_base + n * sC_n + t * sC_l, mask=mt, other=0.0)
            a = exp2(dt * A_n[:, None], FAST_EXP)
            bx = dtu * B_n[None, :]
            if HAS_SID:
                if VARLEN and HAS_H0:  # a packed sequence starts from its own initial state
                    hin = tl.load(h0_ptr + s_cur[None, :] * dn + d_off[:, None] + n, mask=start[None, :],
                                  other=0.0).to(tl.float32)
                    bx += a * hin
                a = tl.where(start[None, :], 0.0, a)
            acum, hs = tl.associative_scan((a, bx), axis=1, combine_fn=linear_combine)
            hs += acum * tl.load(st_in + n)[:, None]
            y += hs * C_n[None, :]
            if VARLEN:
                tl.store(hlast_ptr + s_cur[None, :] * dn + d_off[:, None] + n, hs, mask=end[None, :])
                if c + 1 < nchunks:  # the packed sequences' final states are stored at their ends
                    tl.store(st_out + n, tl.sum(hs * w_last, axis=1))
            else:
                tl.store(st_out + n, tl.sum(hs * w_last, axis=1))
        if HAS_D:
            y += Dv[:, None] * u
        if HAS_Z:
            if SAVE_YPRE:
                tl.store(ypre_ptr + out_off + t[None, :], y, mask=mdt)
            zv = tl.load(z_ptr + pid_b * sz_b + offs_d[:, None] * sz_d + t[None, :] * sz_l, mask=mdt,
                         other=0.0).to(tl.float32)
            y *= zv * tl.sigmoid(zv)
        tl.store(y_ptr + out_off + t[None, :], y, mask=mdt)
        tl.debug_barrier()  # the next chunk's entering state was stored by other threads
