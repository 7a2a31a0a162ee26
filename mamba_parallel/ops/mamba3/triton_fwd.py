"""Mamba-3 forward sweep, SISO (R = 1) and MIMO (rank R).

A chunk of T tokens is handled as T * R rows, token-major (row = token * R + rank): row (t, r) carries the rank-r
input u = x_t * mimo_x_r and the rotated k_{t,r} (B + bias turned by the token's phase) and q_{t,r} (the same of
C), which triton_rotate wrote before. Every row of a token shares its decay and trapezoid weights. The state is
the trapezoid-augmented one: token j enters it with weight w_j = gamma_j + beta_{j+1}, so the next token's half
step of j is already in it.

One program per (batch row, head, headdim block) walks the chunks in order with the state (p, n) in registers;
per chunk it writes the outputs
y_i = sum_{j before i} (q_i . k_j) exp(cs_i - cs_j) w_j u_j + gamma_i sum_{j same token} (q_i . k_j) u_j
+ exp(cs_i) q_i . H_in + D u_i, gated by silu(z * mimo_z), folded over the ranks with mimo_o, then advances the
state. For the backward it also writes y before the gate and the state entering every chunk (x.dtype): the
backward starts from those instead of sweeping the chunks again.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.mamba3.triton_common import load_rank_rows, per_token, rows, token_scalars


@triton.jit
def scan_fwd_kernel(X, DT, AA, TRAP, KT, QT, D, Z, MX, MZ, MO, INIT_SSM, CINIT, CFINAL, Y, YPRE, FIN_SSM, HS,
                    L, NC, H, P, N,
                    sxb, sxt, sxh, sxp, sdb, sdt, sdh, skb, skt, skr, skh, szb, szt, szh, szp,
                    srb, srt, srr, srh, srp, sob, sot, soh, sop,
                    T: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BLOCK_P: tl.constexpr,
                    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_MX: tl.constexpr, HAS_MZ: tl.constexpr,
                    HAS_MO: tl.constexpr, HAS_INIT: tl.constexpr, KEEP_YPRE: tl.constexpr,
                    KEEP_STATES: tl.constexpr, PREC: tl.constexpr):
    """Y per token (strides so*) when HAS_MO (the ranks folded), else per row (strides sr*, like YPRE); YPRE (y
    before the gate and the fold) when KEEP_YPRE; HS (rows, h, nc, p, n) the state entering every chunk when
    KEEP_STATES. Final states go to FIN_SSM wherever a chunk's final code is >= 0 (the phases are the caller's)."""
    pid = tl.program_id(0)
    pp = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    offs_p = pp * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BN)
    pm, nm = offs_p < P, offs_n < N
    hm = pm[:, None] & nm[None, :]
    state_off = offs_p[:, None] * N + offs_n[None, :]
    dtype = X.dtype.element_ty
    x_ptr = X + b * sxb + h * sxh
    scal = b * sdb + h * sdh
    k_ptr = KT + b * skb + h * skh
    q_ptr = QT + b * skb + h * skh
    S_ = tl.zeros((BLOCK_P, BN), dtype=tl.float32)
    for c in range(NC):
        ci = tl.load(CINIT + b * NC + c)
        cf = tl.load(CFINAL + b * NC + c)
        start = ci != -2
        if HAS_INIT:  # a sequence starting here from initial state ci (ci = -1: from zero)
            ok = (offs_n * 0 + ci) >= 0  # a vector: the interpreter takes no scalar in a mask
            idx = tl.maximum(ci, 0).to(tl.int64)
            init = tl.load(INIT_SSM + (idx * H + h) * P * N + state_off, mask=hm & ok[None, :], other=0.0)
            S_ = tl.where(start, init, S_)
        else:
            S_ = tl.where(start, 0.0, S_)
        if KEEP_STATES:
            tl.store(HS + ((b * H + h) * NC + c) * P * N + state_off, S_.to(HS.dtype.element_ty), mask=hm)

        t, rank, lead = rows(c, T, R)
        tok = t - c * T
        valid = t < L
        next_ok = (t + 1 < L) & ((tok < T - 1) | (t * 0 + cf == -2))
        dt, la, gamma, w = token_scalars(DT + scal, AA + scal, TRAP + scal, sdt, t, valid, next_ok)
        la = tl.where(lead, la, 0.0)  # one row per token sums the decay
        cs = tl.cumsum(la, 0)
        tot = tl.sum(la, 0)
        kq = t[:, None] * skt + rank[:, None] * skr + offs_n[None, :]
        km = valid[:, None] & nm[None, :]
        k = tl.load(k_ptr + kq, mask=km, other=0.0)
        q = tl.load(q_ptr + kq, mask=km, other=0.0)
        xm = valid[:, None] & pm[None, :]
        u = tl.load(x_ptr + t[:, None] * sxt + offs_p[None, :] * sxp, mask=xm, other=0.0).to(tl.float32)
        if HAS_MX:
            u *= load_rank_rows(MX + h * R * P, rank, offs_p, P, R, pm)

        # within the chunk (earlier tokens with their decay and w, the same token's rows with gamma), the state
        # entering it, D u
        scores = tl.dot(q, tl.trans(k), input_precision=PREC)
        ti = tok[:, None]
        tj = tok[None, :]
        E = tl.exp(tl.where(ti > tj, cs[:, None] - cs[None, :], float("-inf")))
        W = E * w[None, :] + tl.where(ti == tj, gamma[:, None], 0.0)
        y = tl.dot((scores * W).to(dtype), u.to(dtype), input_precision=PREC)
        y += tl.exp(cs)[:, None] * tl.dot(q, tl.trans(S_.to(dtype)), input_precision=PREC)
        if HAS_D:
            y += tl.load(D + h).to(tl.float32) * u
        row_out = b * srb + h * srh + t[:, None] * srt + rank[:, None] * srr + offs_p[None, :] * srp
        if KEEP_YPRE:
            tl.store(YPRE + row_out, y.to(YPRE.dtype.element_ty), mask=xm)
        if HAS_Z:
            zv = tl.load(Z + b * szb + h * szh + t[:, None] * szt + offs_p[None, :] * szp, mask=xm,
                         other=0.0).to(tl.float32)
            if HAS_MZ:
                zv *= load_rank_rows(MZ + h * R * P, rank, offs_p, P, R, pm)
            y = y * zv * tl.sigmoid(zv)
        if HAS_MO:  # fold the ranks: y_t = sum_r mimo_o_r * y_{t,r}
            y = per_token(y * load_rank_rows(MO + h * R * P, rank, offs_p, P, R, pm), T, R, BLOCK_P)
            tt = c * T + tl.arange(0, T)
            tl.store(Y + b * sob + h * soh + tt[:, None] * sot + offs_p[None, :] * sop, y.to(Y.dtype.element_ty),
                     mask=(tt < L)[:, None] & pm[None, :])
        else:
            tl.store(Y + row_out, y.to(Y.dtype.element_ty), mask=xm)

        # the state leaving the chunk
        uw = (u * (tl.exp(tot - cs) * w)[:, None]).to(dtype)
        S_ = S_ * tl.exp(tot) + tl.dot(tl.trans(uw), k, input_precision=PREC)
        ok = (offs_n * 0 + cf) >= 0  # the sequence ends here with final state cf
        idx = tl.maximum(cf, 0).to(tl.int64)
        tl.store(FIN_SSM + (idx * H + h) * P * N + state_off, S_, mask=hm & ok[None, :])
