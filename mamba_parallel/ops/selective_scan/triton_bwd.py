"""Backward kernel of the Mamba-1 selective scan.

Walks the chunks in reverse. Per chunk and state it recomputes the forward states from the checkpoint entering
the chunk (one forward scan), then runs the adjoint recurrence dh_t = dy_t C_t + a_{t+1} dh_{t+1} (one reverse
scan). Identities that avoid shifting register tiles: a_t h_{t-1} = h_t - delta_t B_t u_t, and a_{t+1} comes from
delta loaded at t + 1. The adjoint entering from the later chunk goes through a small ping-pong global buffer
(a (BD,) store per state, a barrier per chunk). dB / dC are summed over the program's BD channels and
written as (b, d / BD, n, L) partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, linear_combine, softplus


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, dt_ptr, z_ptr, B_ptr, C_ptr, A_ptr, D_ptr, dtb_ptr, h0_ptr, sid_ptr, ckpt_ptr, ypre_ptr, dy_ptr,
    dlast_ptr,
    du_ptr, ddt_ptr, dz_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, ddtb_ptr, dh0_ptr, adj_ptr,
    L, dim, dstate, d_per_group, nchunks, nblk,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l,
    sB_b, sB_g, sB_n, sB_l, sC_b, sC_g, sC_n, sC_l, ssid_b,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_SID: tl.constexpr, VARLEN: tl.constexpr, HAS_DLAST: tl.constexpr,
    FAST_EXP: tl.constexpr, BD: tl.constexpr, T: tl.constexpr,
):
    """One program: channels [pid * BD, +BD) of sequence pid_b (nblk = d / BD blocks).

    ckpt (b, nchunks, d, n): states entering each chunk; ypre (b, d, L): y before the z gate; dy (b, d, L)
    contiguous; dlast like hlast. Writes du, ddt, dz (b, d, L); dB, dC partials (b, nblk, n, L) fp32; dA (b, d, n)
    (accumulated: zeros from the host), dD (b, d), ddtb (b, d) fp32 per-sequence partials; dh0 like h0.
    adj (b, 2, d, n) fp32 zeros: ping-pong slots for the adjoint at the first token of a chunk.
    """
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_d = pid * BD + tl.arange(0, BD)
    offs_t = tl.arange(0, T)
    g = (pid * BD) // d_per_group
    dn = dim * dstate
    d_off = offs_d * dstate
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d).to(tl.float32)
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)
    B_base = B_ptr + pid_b * sB_b + g * sB_g
    C_base = C_ptr + pid_b * sC_b + g * sC_g
    part_base = (pid_b * nblk + pid) * dstate * L
    out_off = pid_b * dim * L + offs_d[:, None] * L
    w_first = tl.where(offs_t == 0, 1.0, 0.0)[None, :]  # one-hot: column 0 as one FMA chain per thread

    dD_acc = tl.zeros([BD], dtype=tl.float32)
    ddtb_acc = tl.zeros([BD], dtype=tl.float32)

    for ci in range(nchunks):
        c = nchunks - 1 - ci
        t = c * T + offs_t
        mt = t < L
        mdt = mt[None, :]
        mnext = (t + 1) < L  # a_{t+1} exists and couples t to t + 1
        end = t == L - 1     # where d(last_state) enters
        if HAS_SID:
            s_cur = tl.load(sid_ptr + pid_b * ssid_b + t, mask=mt, other=0)
            s_prev = tl.load(sid_ptr + pid_b * ssid_b + t - 1, mask=mt & (t > 0), other=0)
            s_next = tl.load(sid_ptr + pid_b * ssid_b + t + 1, mask=mnext, other=0)
            start = mt & (s_cur != s_prev) & (t > 0)
            if VARLEN:
                start = start | (t == 0)
                end = mt & (((t + 1) >= L) | (s_next != s_cur))
            mnext = mnext & (s_next == s_cur)
        u = tl.load(u_ptr + pid_b * su_b + offs_d[:, None] * su_d + t[None, :] * su_l, mask=mdt,
                    other=0.0).to(tl.float32)
        dt_ptrs = dt_ptr + pid_b * sdt_b + offs_d[:, None] * sdt_d + t[None, :] * sdt_l
        dt_raw = tl.load(dt_ptrs, mask=mdt, other=0.0).to(tl.float32)
        dt_nx = tl.load(dt_ptrs + sdt_l, mask=mnext[None, :], other=0.0).to(tl.float32)
        if HAS_DTB:
            dt_raw += bias[:, None]
            dt_nx += bias[:, None]
        if SOFTPLUS:
            dt = softplus(dt_raw)
            dt_nx = softplus(dt_nx)
        else:
            dt = dt_raw
        dtu = dt * u
        dy = tl.load(dy_ptr + out_off + t[None, :], mask=mdt, other=0.0).to(tl.float32)
        if HAS_Z:
            zv = tl.load(z_ptr + pid_b * sz_b + offs_d[:, None] * sz_d + t[None, :] * sz_l, mask=mdt,
                         other=0.0).to(tl.float32)
            yp = tl.load(ypre_ptr + out_off + t[None, :], mask=mdt, other=0.0).to(tl.float32)
            sig = tl.sigmoid(zv)
            tl.store(dz_ptr + out_off + t[None, :], dy * yp * sig * (1.0 + zv * (1.0 - sig)), mask=mdt)
            dy = dy * zv * sig
        if HAS_D:
            dD_acc += tl.sum(dy * u, axis=1)
        ck = ckpt_ptr + (pid_b * nchunks + c) * dn + d_off
        adj_in = adj_ptr + (pid_b * 2 + (c + 1) % 2) * dn + d_off  # adjoint entering from chunk c + 1
        adj_out = adj_ptr + (pid_b * 2 + c % 2) * dn + d_off

        dhB = tl.zeros([BD, T], dtype=tl.float32)   # sum_n dh * B_n
        dhA = tl.zeros([BD, T], dtype=tl.float32)   # sum_n dh * a_t h_{t-1} * A_n
        for n in range(dstate):
            A_n = tl.load(A_ptr + d_off + n).to(tl.float32)
            B_n = tl.load(B_base + n * sB_n + t * sB_l, mask=mt, other=0.0)
            C_n = tl.load(C_base + n * sC_n + t * sC_l, mask=mt, other=0.0)
            # recompute the forward states of this chunk and state index
            a = exp2(dt * (A_n * LOG2E)[:, None], FAST_EXP)
            bx = dtu * B_n[None, :]
            hx = bx
            if HAS_SID:
                if VARLEN and HAS_H0:
                    hin = tl.load(h0_ptr + s_cur[None, :] * dn + d_off[:, None] + n, mask=start[None, :],
                                  other=0.0).to(tl.float32)
                    hx += a * hin
                am = tl.where(start[None, :], 0.0, a)
            else:
                am = a
            acum, hs = tl.associative_scan((am, hx), axis=1, combine_fn=linear_combine)
            hs += acum * tl.load(ck + n)[:, None]
            tl.store(dC_ptr + part_base + n * L + t, tl.sum(dy * hs, axis=0), mask=mt)
            hb = hs - bx  # a_t h_{t-1}
            # adjoint, reverse in time
            a_nx = tl.where(mnext[None, :], exp2(dt_nx * (A_n * LOG2E)[:, None], FAST_EXP), 0.0)
            cx = dy * C_n[None, :]
            if HAS_DLAST:
                if VARLEN:
                    cx += tl.load(dlast_ptr + s_cur[None, :] * dn + d_off[:, None] + n, mask=end[None, :],
                                  other=0.0).to(tl.float32)
                else:
                    gl = tl.load(dlast_ptr + pid_b * dn + d_off + n).to(tl.float32)
                    cx += tl.where(end[None, :], gl[:, None], 0.0)
            pcum, dh = tl.associative_scan((a_nx, cx), axis=1, combine_fn=linear_combine, reverse=True)
            dh += pcum * tl.load(adj_in + n)[:, None]
            tl.store(dB_ptr + part_base + n * L + t, tl.sum(dh * dtu, axis=0), mask=mt)
            tl.store(adj_out + n, tl.sum(dh * w_first, axis=1))
            dhB += dh * B_n[None, :]
            x = dh * hb
            dhA += x * A_n[:, None]
            dA_n = dA_ptr + pid_b * dn + d_off + n  # accumulated over chunks (zeros from the host)
            tl.store(dA_n, tl.load(dA_n) + tl.sum(x * dt, axis=1))
            if HAS_H0:
                if VARLEN:
                    tl.store(dh0_ptr + s_cur[None, :] * dn + d_off[:, None] + n, a * dh, mask=start[None, :])
                elif c == 0:
                    tl.store(dh0_ptr + pid_b * dn + d_off + n, tl.sum(a * dh * w_first, axis=1))
        du = dhB * dt
        if HAS_D:
            du += Dv[:, None] * dy
        # u and delta again (cache hits) rather than keeping them live through the state loop
        u = tl.load(u_ptr + pid_b * su_b + offs_d[:, None] * su_d + t[None, :] * su_l, mask=mdt,
                    other=0.0).to(tl.float32)
        ddt = dhB * u + dhA
        if SOFTPLUS:
            dt_raw = tl.load(dt_ptrs, mask=mdt, other=0.0).to(tl.float32)
            if HAS_DTB:
                dt_raw += bias[:, None]
            ddt = ddt * tl.sigmoid(dt_raw)
        ddt = tl.where(mdt, ddt, 0.0)
        if HAS_DTB:
            ddtb_acc += tl.sum(ddt, axis=1)
        tl.store(du_ptr + out_off + t[None, :], du, mask=mdt)
        tl.store(ddt_ptr + out_off + t[None, :], ddt, mask=mdt)
        tl.debug_barrier()  # the adjoint carry was stored by other threads

    if HAS_D:
        tl.store(dD_ptr + pid_b * dim + offs_d, dD_acc)
    if HAS_DTB:
        tl.store(ddtb_ptr + pid_b * dim + offs_d, ddtb_acc)
