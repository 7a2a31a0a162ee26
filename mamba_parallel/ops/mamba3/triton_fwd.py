"""Mamba-3 forward kernels: the fused scan (outputs and final states) and the state sweep, SISO (R = 1) and MIMO
(rank R).

A chunk of T tokens is handled as T * R rows, token-major (row = token * R + rank): row (t, r) carries the rank-r
input u = x_t * mimo_x_r, B_{t,r}, C_{t,r}; every row of a token shares its decay, trapezoid weights and phase.
The state is the trapezoid-augmented one: token j enters it with weight w_j = gamma_j + beta_{j+1}, so the next
token's half step of j is already in it.
``scan_fwd``: one program per (row of the batch, head, headdim block) walks the chunks in order with the state
(p, n) and the rotary phase in registers; per chunk it rotates B and C once, writes the outputs
y_i = sum_{j before i} (q_i . k_j) exp(cs_i - cs_j) w_j u_j + gamma_i sum_{j same token} (q_i . k_j) u_j
+ exp(cs_i) q_i . H_in + D u_i, gated by silu(z * mimo_z), folded over the ranks with mimo_o, then advances the
state. Nothing per chunk goes to memory: the only writes are y (and y before the gate, for the backward) and the
final states.
The same kernel without the outputs (``STATES``) writes the state and phase entering every chunk: the backward's
recomputation (they are larger than x, so the forward does not keep them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.mamba3.triton_common import (load_pairs, load_rank_rows, pair_columns, per_token, rotate_pairs,
                                                      rows, token_scalars, wrap_angle)


@triton.jit
def scan_fwd_kernel(X, DT, AA, TRAP, Bm, Cm, BIAS_B, BIAS_C, ANG, D, Z, MX, MZ, MO, INIT_SSM, INIT_ANG, CINIT, CFINAL,
                    Y, YPRE, FIN_SSM, FIN_ANG, HS, THS,
                    L, NC, H, HPG, P, NH, NA,
                    sxb, sxt, sxh, sxp, sdb, sdt, sdh, sbb, sbt, sbr, sbg, sbn, scb, sct, scr, scg, scn,
                    sab, sat, sah, saa, szb, szt, szh, szp, srb, srt, srr, srh, srp, sob, sot, soh, sop,
                    T: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BLOCK_P: tl.constexpr,
                    HALVED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                    HAS_MX: tl.constexpr, HAS_MZ: tl.constexpr, HAS_MO: tl.constexpr, HAS_INIT: tl.constexpr,
                    KEEP_YPRE: tl.constexpr, OUTPUTS: tl.constexpr, STATES: tl.constexpr, PREC: tl.constexpr):
    """OUTPUTS: write Y, per token (strides so*) when HAS_MO (the ranks folded), else per row (strides sr*, like
    YPRE); YPRE (y before the gate and the fold) when KEEP_YPRE (the backward reads it). STATES: write the state
    (HS, x.dtype) and phase (THS) entering every chunk (rows, h, nc, p, n) / (rows, h, nc, a). With OUTPUTS the
    final states go to FIN_SSM / FIN_ANG wherever a chunk's final code is >= 0."""
    pid = tl.program_id(0)
    pp = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    g = h // HPG
    N = 2 * NH
    offs_p = pp * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, BH)
    pm, jm, am = offs_p < P, offs_j < NH, offs_j < NA
    col1, col2 = pair_columns(offs_j, N, HALVED)
    hm = pm[:, None] & jm[None, :]
    first = (offs_j * 0 + pp) == 0  # the phases are written by the first headdim block
    dtype = X.dtype.element_ty
    x_ptr = X + b * sxb + h * sxh
    scal = b * sdb + h * sdh
    b_ptr = Bm + b * sbb + g * sbg
    ang_ptr = ANG + b * sab + h * sah
    H1 = tl.zeros((BLOCK_P, BH), dtype=tl.float32)
    H2 = tl.zeros((BLOCK_P, BH), dtype=tl.float32)
    th = tl.zeros((BH,), dtype=tl.float32)
    for c in range(NC):
        ci = tl.load(CINIT + b * NC + c)
        cf = tl.load(CFINAL + b * NC + c)
        start = ci != -2
        if HAS_INIT:  # a sequence starting here from initial state ci (ci = -1: from zero)
            ok = (offs_j * 0 + ci) >= 0  # a vector: the interpreter takes no scalar in a mask
            idx = tl.maximum(ci, 0).to(tl.int64)
            base = INIT_SSM + (idx * H + h) * P * N
            i1 = tl.load(base + offs_p[:, None] * N + col1[None, :], mask=hm & ok[None, :], other=0.0)
            i2 = tl.load(base + offs_p[:, None] * N + col2[None, :], mask=hm & ok[None, :], other=0.0)
            th0 = tl.load(INIT_ANG + (idx * H + h) * NA + offs_j, mask=am & ok, other=0.0)
            H1 = tl.where(start, i1, H1)
            H2 = tl.where(start, i2, H2)
            th = tl.where(start, th0, th)
        else:
            H1 = tl.where(start, 0.0, H1)
            H2 = tl.where(start, 0.0, H2)
            th = tl.where(start, 0.0, th)
        if STATES:
            out = HS + ((b * H + h) * NC + c) * P * N + offs_p[:, None] * N
            tl.store(out + col1[None, :], H1.to(HS.dtype.element_ty), mask=hm)
            tl.store(out + col2[None, :], H2.to(HS.dtype.element_ty), mask=hm)
            tl.store(THS + ((b * H + h) * NC + c) * NA + offs_j, th, mask=am & first)

        # the chunk's token scalars, phases, rotated B (k) and C (q), input u
        t, rank, lead = rows(c, T, R)
        tok = t - c * T
        valid = t < L
        next_ok = (t + 1 < L) & ((tok < T - 1) | (t * 0 + cf == -2))
        dt, la, gamma, w = token_scalars(DT + scal, AA + scal, TRAP + scal, sdt, t, valid, next_ok)
        la = tl.where(lead, la, 0.0)  # one row per token sums the decay and the phase
        cs = tl.cumsum(la, 0)
        tot = tl.sum(la, 0)
        om = tl.load(ang_ptr + t[:, None] * sat + offs_j[None, :] * saa, mask=valid[:, None] & am[None, :],
                     other=0.0).to(tl.float32)
        dphi = tl.where(lead[:, None], om * dt[:, None], 0.0)
        th_t = th[None, :] + tl.cumsum(dphi, 0)
        cos, sin = tl.cos(th_t), tl.sin(th_t)
        b1, b2 = load_pairs(b_ptr, t * sbt + rank * sbr, sbn, valid, col1, col2, jm)
        if HAS_BIAS:
            b1 += load_rank_rows(BIAS_B + h * R * N, rank, col1, N, R, jm)
            b2 += load_rank_rows(BIAS_B + h * R * N, rank, col2, N, R, jm)
        k1, k2 = rotate_pairs(b1, b2, cos, sin)
        k1, k2 = k1.to(dtype), k2.to(dtype)
        xm = valid[:, None] & pm[None, :]
        u = tl.load(x_ptr + t[:, None] * sxt + offs_p[None, :] * sxp, mask=xm, other=0.0).to(tl.float32)
        if HAS_MX:
            u *= load_rank_rows(MX + h * R * P, rank, offs_p, P, R, pm)
        if OUTPUTS:
            _chunk_outputs(Cm, BIAS_C, D, Z, MZ, MO, Y, YPRE, g, H1, H2, k1, k2, u, cos, sin, cs, w, gamma, t, tok,
                           rank, valid, xm, c, b, h, L, P, N, col1, col2, jm, pm, offs_p,
                           scb, sct, scr, scg, scn, szb, szt, szh, szp, srb, srt, srr, srh, srp, sob, sot, soh, sop,
                           T, R, BLOCK_P, HAS_BIAS, HAS_D, HAS_Z, HAS_MZ, HAS_MO, KEEP_YPRE, PREC)

        # the state and phase leaving the chunk
        uw = (u * (tl.exp(tot - cs) * w)[:, None]).to(dtype)
        decay = tl.exp(tot)
        H1 = H1 * decay + tl.dot(tl.trans(uw), k1, input_precision=PREC)
        H2 = H2 * decay + tl.dot(tl.trans(uw), k2, input_precision=PREC)
        th = wrap_angle(th + tl.sum(dphi, 0))
        if OUTPUTS:
            ok = (offs_j * 0 + cf) >= 0  # the sequence ends here with final state cf
            idx = tl.maximum(cf, 0).to(tl.int64)
            fin = FIN_SSM + (idx * H + h) * P * N + offs_p[:, None] * N
            tl.store(fin + col1[None, :], H1, mask=hm & ok[None, :])
            tl.store(fin + col2[None, :], H2, mask=hm & ok[None, :])
            tl.store(FIN_ANG + (idx * H + h) * NA + offs_j, th, mask=am & ok & first)


@triton.jit
def _chunk_outputs(Cm, BIAS_C, D, Z, MZ, MO, Y, YPRE, g, H1, H2, k1, k2, u, cos, sin, cs, w, gamma, t, tok, rank,
                   valid, xm, c, b, h, L, P, N, col1, col2, jm, pm, offs_p,
                   scb, sct, scr, scg, scn, szb, szt, szh, szp, srb, srt, srr, srh, srp, sob, sot, soh, sop,
                   T: tl.constexpr, R: tl.constexpr, BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_MZ: tl.constexpr, HAS_MO: tl.constexpr,
                   KEEP_YPRE: tl.constexpr, PREC: tl.constexpr):
    """One chunk's outputs: within the chunk (earlier tokens with their decay and w, the same token's rows with
    gamma), plus the state entering it (H1, H2, in registers), plus D u; gated, folded over the ranks."""
    dtype = k1.dtype
    c1, c2 = load_pairs(Cm + b * scb + g * scg, t * sct + rank * scr, scn, valid, col1, col2, jm)
    if HAS_BIAS:
        c1 += load_rank_rows(BIAS_C + h * R * N, rank, col1, N, R, jm)
        c2 += load_rank_rows(BIAS_C + h * R * N, rank, col2, N, R, jm)
    q1, q2 = rotate_pairs(c1, c2, cos, sin)
    q1, q2 = q1.to(dtype), q2.to(dtype)
    S = tl.dot(q1, tl.trans(k1), input_precision=PREC) + tl.dot(q2, tl.trans(k2), input_precision=PREC)
    ti = tok[:, None]
    tj = tok[None, :]
    E = tl.exp(tl.where(ti > tj, cs[:, None] - cs[None, :], float("-inf")))
    W = E * w[None, :] + tl.where(ti == tj, gamma[:, None], 0.0)
    y = tl.dot((S * W).to(dtype), u.to(dtype), input_precision=PREC)
    inter = tl.dot(q1, tl.trans(H1.to(dtype)), input_precision=PREC) \
        + tl.dot(q2, tl.trans(H2.to(dtype)), input_precision=PREC)
    y += tl.exp(cs)[:, None] * inter
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
        om_ = (tt < L)[:, None] & pm[None, :]
        tl.store(Y + b * sob + h * soh + tt[:, None] * sot + offs_p[None, :] * sop, y.to(Y.dtype.element_ty),
                 mask=om_)
    else:
        tl.store(Y + row_out, y.to(Y.dtype.element_ty), mask=xm)
