"""Mamba-3 backward kernels (SISO and MIMO, T * R rows per chunk as in triton_fwd). Both read the rotated q / k the
forward kept (triton_rotate): no trigonometry here.

``dstates``: one program per (batch row, head, headdim block) walks the chunks backwards carrying dH, the gradient
of the (augmented) state: it writes dH at the end of every chunk, then dH <- exp(tot) dH + sum_i exp(cs_i) dy_i
q_i^T over the chunk's rows. At a sequence start it writes the gradient of the initial state. With ``TURN`` it
also writes, per chunk the sequence goes on after, <dH, J H> per rotated pair (J: a quarter turn of each pair, H the
state leaving the chunk): what turning every later phase moves the loss by, less the final states' share (the
caller's phase carry; it cancels where a sum of per-token phase gradients would not).
``chunk_bwd``: one program per (batch row, head, chunk) with the whole headdim: with H entering the chunk and dH
at its end, every gradient of the chunk's inputs: dx, dz, those of the rotated k and q (per head; triton_rotate's
unrotate turns them back into dB / dC and derives the phase's gradient), and per token the gradients of the
decay's log (da) and of w and gamma (the trapezoid weights), and the chunk's shares of dD and of the MIMO scales'
gradients. It runs in two launches, each doing about half of that work (``PART``): fewer live tiles each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.mamba3.triton_common import (load_halves, load_pairs_below, load_rank_rows, per_rank,
                                                      per_token, per_token_vec, rows, store_halves, token_scalars)


@triton.jit
def _gate_back(DY, Z, YPRE, MZ, MO, row_off, tok_off, zoff, rank, offs_p, h, P, m, pm, R: tl.constexpr,
               HAS_Z: tl.constexpr, HAS_MZ: tl.constexpr, HAS_MO: tl.constexpr):
    """Per row: the output gradient before the gate and the rank fold -> (dyg, dz per row, dy of the row's token
    (HAS_MO), the gated output yg (HAS_MO: what mimo_o multiplied)). YPRE (y before the gate) is kept per row
    whenever there is a gate or a fold."""
    if HAS_MO:
        dy_tok = tl.load(DY + tok_off, mask=m, other=0.0).to(tl.float32)
        dy = dy_tok * load_rank_rows(MO + h * R * P, rank, offs_p, P, R, pm)
    else:
        dy = tl.load(DY + row_off, mask=m, other=0.0).to(tl.float32)
        dy_tok = dy
    if HAS_Z:
        z = tl.load(Z + zoff, mask=m, other=0.0).to(tl.float32)
        if HAS_MZ:
            z *= load_rank_rows(MZ + h * R * P, rank, offs_p, P, R, pm)
        sg = tl.sigmoid(z)
        ypre = tl.load(YPRE + row_off, mask=m, other=0.0).to(tl.float32)
        return dy * z * sg, dy * ypre * sg * (1.0 + z * (1.0 - sg)), dy_tok, ypre * z * sg
    if HAS_MO:
        return dy, dy, dy_tok, tl.load(YPRE + row_off, mask=m, other=0.0).to(tl.float32)
    return dy, dy, dy_tok, dy


@triton.jit
def dstates_kernel(DY, Z, YPRE, MZ, MO, DT, AA, TRAP, QT, CINIT, CFINAL, DFIN, DHS, DINIT, HS, TURN, DYG, DZ,
                   L, NC, H, P, NH, NA, NPB,
                   sdb, sdt, sdh, skb, skt, skr, skh, srb, srt, srr, srh, srp,
                   sob, sot, soh, sop, szb, szt, szh, szp,
                   T: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BLOCK_P: tl.constexpr,
                   HALVED: tl.constexpr, HAS_Z: tl.constexpr, HAS_MZ: tl.constexpr,
                   HAS_MO: tl.constexpr, HAS_DFIN: tl.constexpr, HAS_DINIT: tl.constexpr, HAS_TURN: tl.constexpr,
                   STORE_DYG: tl.constexpr, PREC: tl.constexpr):
    """TURN (rows, h, nc, NPB, a) fp32: one slot per headdim block (NPB at least their number; the caller sums
    them; every element written here, the slots no block of this launch owns
    zeroed). STORE_DYG (SISO with a gate): the output gradient after the gate's backward (DYG, x.dtype) and dz
    (DZ) are written per token (dx's strides, sob ..), so chunk_bwd reads one tensor instead of dy, z and ypre."""
    pid = tl.program_id(0)
    pp = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    N = 2 * NH
    offs_p = pp * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, BH)
    pm, am = offs_p < P, offs_j < NA
    prow = offs_p * N  # the state's rows (p, n), n contiguous
    scal = b * sdb + h * sdh
    q_ptr = QT + b * skb + h * skh
    dtype = DHS.dtype.element_ty
    dH1 = tl.zeros((BLOCK_P, BH), dtype=tl.float32)
    dH2 = tl.zeros((BLOCK_P, BH), dtype=tl.float32)
    for cc in range(NC):
        c = NC - 1 - cc
        ci = tl.load(CINIT + b * NC + c)
        cf = tl.load(CFINAL + b * NC + c)
        if HAS_DFIN:  # a sequence ends here: its state gradient starts from d final (cf = -1: zero)
            ok = pm & ((offs_p * 0 + cf) >= 0)  # a vector: the interpreter takes no scalar in a mask
            idx = tl.maximum(cf, 0).to(tl.int64)
            f1, f2 = load_halves(DFIN + (idx * H + h) * P * N, prow, ok, 0, NH, BH, HALVED)
            dH1 = tl.where(cf != -2, f1, dH1)
            dH2 = tl.where(cf != -2, f2, dH2)
        else:
            dH1 = tl.where(cf != -2, 0.0, dH1)
            dH2 = tl.where(cf != -2, 0.0, dH2)
        store_halves(DHS + ((b * H + h) * NC + c) * P * N, prow, dH1, dH2, pm, 0, NH, BH, HALVED)
        if HAS_TURN:  # the sequence goes on: H leaving this chunk is the state entering the next one
            on = (offs_j * 0 + cf) == -2
            nxt = HS + ((b * H + h) * NC + tl.minimum(c + 1, NC - 1)) * P * N
            s1, s2 = load_pairs_below(nxt, prow, pm & ((offs_p * 0 + cf) == -2), 0, NH, NA, BH, HALVED)  # turning
            turn = TURN + ((b * H + h) * NC + c) * NPB * NA + offs_j
            tl.store(turn + pp * NA, tl.where(on, tl.sum(dH2 * s1 - dH1 * s2, 0), 0.0), mask=am)
            if pp == tl.num_programs(1) - 1:  # the slots past this launch's blocks (an autotuner's trial launch
                for q in range(pp + 1, NPB):  # with narrower blocks wrote there; the caller sums every slot)
                    tl.store(turn + q * NA, tl.zeros((BH,), dtype=tl.float32), mask=am)

        t, rank, lead = rows(c, T, R)
        valid = t < L
        # w is not used here (the compiler drops its loads), but its next-token mask must still stop at the end
        dt, la, gamma, w = token_scalars(DT + scal, AA + scal, TRAP + scal, sdt, t, valid, t + 1 < L)
        la = tl.where(lead, la, 0.0)
        cs = tl.cumsum(la, 0)
        tot = tl.sum(la, 0)
        q1, q2 = load_halves(q_ptr, t * skt + rank * skr, valid, 0, NH, BH, HALVED)
        ym = valid[:, None] & pm[None, :]
        tok_off = b * sob + h * soh + t[:, None] * sot + offs_p[None, :] * sop
        dy, dzr, _, _ = _gate_back(DY, Z, YPRE, MZ, MO,
                                   b * srb + h * srh + t[:, None] * srt + rank[:, None] * srr + offs_p[None, :] * srp,
                                   tok_off, b * szb + h * szh + t[:, None] * szt + offs_p[None, :] * szp,
                                   rank, offs_p, h, P, ym, pm, R, HAS_Z, HAS_MZ, HAS_MO)
        if STORE_DYG:  # R == 1: a row is a token
            tl.store(DYG + tok_off, dy.to(DYG.dtype.element_ty), mask=ym)
            tl.store(DZ + tok_off, dzr.to(DZ.dtype.element_ty), mask=ym)
        dyw = (dy * tl.exp(cs)[:, None]).to(dtype)
        decay = tl.exp(tot)
        dH1 = dH1 * decay + tl.dot(tl.trans(dyw), q1.to(dtype), input_precision=PREC)
        dH2 = dH2 * decay + tl.dot(tl.trans(dyw), q2.to(dtype), input_precision=PREC)
        if HAS_DINIT:  # a sequence starts here: dH is the gradient of its (augmented) initial state
            ok = pm & ((offs_p * 0 + ci) >= 0)
            idx = tl.maximum(ci, 0).to(tl.int64)
            store_halves(DINIT + (idx * H + h) * P * N, prow, dH1, dH2, ok, 0, NH, BH, HALVED)


@triton.jit
def _add2(a1, a2, b1, b2):
    return a1 + b1, a2 + b2


@triton.jit
def _columns(ptr, off, rows_ok, n0, N, BN: tl.constexpr):
    """Columns n0 .. n0 + BN of the rows at ``off`` (rows,) of a tensor whose n axis is contiguous, in its stored
    dtype: what the dots read as is (the per-chunk backward never turns a pair, so it needs no pair halves)."""
    cols = n0 + tl.arange(0, BN)
    return tl.load(ptr + off[:, None] + cols[None, :], mask=rows_ok[:, None] & (cols < N)[None, :], other=0.0)


@triton.jit
def _store_columns(ptr, off, v, rows_ok, n0, N, BN: tl.constexpr):
    cols = n0 + tl.arange(0, BN)
    mask = rows_ok[:, None] & (cols < N)[None, :]
    tl.store(ptr + off[:, None] + cols[None, :], v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def chunk_bwd_kernel(X, DY, Z, YPRE, DYG, DT, AA, TRAP, KT, QT, D, MX, MZ, MO, CFINAL, HS,
                     DHS, DX, DZ, DK, DQ, DW, DG, DA, DD, DMX, DMZ, DMO,
                     L, NC, H, P, NH, NA, NDA, s_da,
                     sxb, sxt, sxh, sxp, sdb, sdt, sdh, skb, skt, skr, skh,
                     srb, srt, srr, srh, srp, sob, sot, soh, sop, szb, szt, szh, szp,
                     sgb, sgt, sgr, sgh,
                     T: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BP: tl.constexpr, BJ: tl.constexpr,
                     HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                     HAS_MX: tl.constexpr, HAS_MZ: tl.constexpr, HAS_MO: tl.constexpr, HAS_DYG: tl.constexpr,
                     PREC: tl.constexpr, PART: tl.constexpr, SPLIT: tl.constexpr = False):
    """The state's n columns are taken 2 BJ at a time (BJ pairs' worth, at most all), in three passes: the scores
    S = q k^T, then (after the chunk's (T, T) terms) k dH^T for du, then per block again dq, dk and what they give.
    Only one block's tiles are live at a time. Nothing here turns a pair: every product runs over n in the order
    the rotation wrote it, so blocks are plain column ranges, read in their stored dtype straight into the dots.
    DK / DQ (rows, L, [R,] h, n) fp32 or bf16: the gradients of the rotated k and q, in the same columns (the
    caller turns them back to B's and C's).
    Two launches, each with about half the live tiles (du's part fits two programs on an SM):
    PART 1 the scores and everything du needs (dx, dz, dD, the MIMO scales, dw, dg); then PART 2 dq and dk. DA
    (NDA, rows, L, h) fp32, slots s_da apart: each part's share of the decay's per-token gradient (through that
    token's own decay; token_bwd sums the slots, then from the end of the chunk). PART 1 writes slot 0, PART 2
    slot 1 + jb from the program of block jb (split) or slot 1 from the one program walking every block; its last
    program zeroes the slots past those (an autotuner's trial with more programs wrote there).
    SPLIT (PART 2): one program per column block (grid axis 2) instead of one walking them all: the chunk's (T, T)
    terms are recomputed per block, each program holds one block's tiles, and twice the programs share the SMs.
    HAS_DYG: dstates already took the gate's backward (DYG per token, dz written there): dy is read from DYG."""
    NJB: tl.constexpr = (BH + BJ - 1) // BJ
    BN: tl.constexpr = 2 * (BH // NJB)  # columns of n per block (BJ pairs' worth)
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    N = 2 * NH
    offs_p = tl.arange(0, BP)
    pm = offs_p < P
    dtype = X.dtype.element_ty

    cf = tl.load(CFINAL + b * NC + c)
    t, rank, lead = rows(c, T, R)
    tok = t - c * T
    valid = t < L
    next_ok = (t + 1 < L) & ((tok < T - 1) | (t * 0 + cf == -2))
    scal = b * sdb + h * sdh
    dt, la, gamma, w = token_scalars(DT + scal, AA + scal, TRAP + scal, sdt, t, valid, next_ok)
    la = tl.where(lead, la, 0.0)
    cs = tl.cumsum(la, 0)
    tot = tl.sum(la, 0)
    coef = tl.exp(tot - cs) * w  # row j's weight in the state leaving the chunk
    ecs = tl.exp(cs)

    xm = valid[:, None] & pm[None, :]
    xv = tl.load(X + b * sxb + h * sxh + t[:, None] * sxt + offs_p[None, :] * sxp, mask=xm, other=0.0)
    xv = xv.to(tl.float32)
    u = xv
    if HAS_MX:
        mx = load_rank_rows(MX + h * R * P, rank, offs_p, P, R, pm)
        u = xv * mx
    ud = u.to(dtype)
    row_off = b * srb + h * srh + t[:, None] * srt + rank[:, None] * srr + offs_p[None, :] * srp
    tok_off = b * sob + h * soh + t[:, None] * sot + offs_p[None, :] * sop
    if HAS_DYG:  # R == 1, no fold: a row is a token; dstates wrote dz (dzr, dy_tok, yg serve the gate and the fold)
        dy = tl.load(DYG + tok_off, mask=xm, other=0.0).to(tl.float32)
    else:
        dy, dzr, dy_tok, yg = _gate_back(DY, Z, YPRE, MZ, MO, row_off, tok_off,
                                         b * szb + h * szh + t[:, None] * szt + offs_p[None, :] * szp,
                                         rank, offs_p, h, P, xm, pm, R, HAS_Z, HAS_MZ, HAS_MO)
    tt = c * T + tl.arange(0, T)  # per-token outputs
    tm = tt < L
    tmp = tm[:, None] & pm[None, :]
    tok_out = b * sob + h * soh + tt[:, None] * sot + offs_p[None, :] * sop
    mrank = ((b * H + h) * NC + c) * R * P + tl.arange(0, R)[:, None] * P + offs_p[None, :]
    if HAS_MO and PART == 1:
        tl.store(DMO + mrank, per_rank(dy_tok * yg, T, R, BP), mask=pm[None, :])
    if HAS_Z and not HAS_DYG and PART == 1:
        zraw = tl.load(Z + b * szb + h * szh + t[:, None] * szt + offs_p[None, :] * szp, mask=xm,
                       other=0.0).to(tl.float32)
        if HAS_MZ:
            tl.store(DMZ + mrank, per_rank(zraw * dzr, T, R, BP), mask=pm[None, :])
            dzr *= load_rank_rows(MZ + h * R * P, rank, offs_p, P, R, pm)
        tl.store(DZ + tok_out, per_token(dzr, T, R, BP).to(DZ.dtype.element_ty), mask=tmp)
    dyd = dy.to(dtype)
    if HAS_D and PART == 1:
        tl.store(DD + (b * H + h) * NC + c, tl.sum(tl.sum(dy * u, 1), 0))
    hs = ((b * H + h) * NC + c) * P * N
    prow = offs_p * N  # the states' rows (p, n), n contiguous
    qk_off = b * skb + h * skh + t * skt + rank * skr  # the rotated q / k rows (n contiguous)

    # the chunk's (T, T) terms, in an order that keeps few of them live (each is 16 registers a thread at 8 warps):
    # G = dy u^T and V = S * G give the trapezoid weights' and the decay's per-token gradients; then the weights
    # W give du = (S * W)^T dy (D u's share on the diagonal) and PW = G * W, what pass 2 needs
    ti = tok[:, None]
    tj = tok[None, :]
    strict = ti > tj
    same = ti == tj
    if PART == 1:
        # pass 1 over the column blocks: the scores S = q k^T
        S = tl.zeros((T * R, T * R), dtype=tl.float32)
        for jb in tl.static_range(NJB):
            qb = _columns(QT, qk_off, valid, jb * BN, N, BN).to(dtype)
            kb = _columns(KT, qk_off, valid, jb * BN, N, BN).to(dtype)
            S += tl.dot(qb, tl.trans(kb), input_precision=PREC)
    G = tl.dot(dyd, tl.trans(ud), input_precision=PREC)  # G_ij = dy_i . u_j
    if PART == 1:
        V = S * G
        EV = tl.where(strict, tl.exp(tl.minimum(cs[:, None] - cs[None, :], 0.0)) * V, 0.0)
        dw = tl.sum(EV, 0)
        # the row sums as one reduction (the warps exchange partial sums once); sum_i EV_ij w_j is w_j dw_j
        dg, ev_w = tl.reduce((tl.where(same, V, 0.0), EV * w[None, :]), 1, _add2)
        dcs = ev_w - w * dw
    W = tl.where(strict, tl.exp(tl.minimum(cs[:, None] - cs[None, :], 0.0)) * w[None, :], 0.0) \
        + tl.where(same, gamma[:, None], 0.0)
    if PART == 1:
        SW = S * W
        if HAS_D:
            diag = tl.arange(0, T * R)[:, None] == tl.arange(0, T * R)[None, :]
            SW += tl.where(diag, tl.load(D + h).to(tl.float32), 0.0)
        du = tl.dot(tl.trans(SW.to(dtype)), dyd, input_precision=PREC)

        # du's share through the state leaving the chunk: k dH^T (H, dH stay in their stored dtype, x.dtype)
        KdH = tl.zeros((T * R, BP), dtype=tl.float32)
        for jb in tl.static_range(NJB):
            kb = _columns(KT, qk_off, valid, jb * BN, N, BN).to(dtype)
            dHb = _columns(DHS + hs, prow, pm, jb * BN, N, BN).to(dtype)
            KdH += tl.dot(kb, tl.trans(dHb), input_precision=PREC)
        du += coef[:, None] * KdH
        Zs = tl.sum(ud.to(tl.float32) * KdH, 1)  # u_j^T dH k_j
        if HAS_MX:
            tl.store(DMX + mrank, per_rank(xv * du, T, R, BP), mask=pm[None, :])
            du *= mx
        tl.store(DX + tok_out, per_token(du, T, R, BP).to(DX.dtype.element_ty), mask=tmp)

    if PART == 2:
        PW = (G * W).to(dtype)
        PWt = tl.trans(PW)
        # pass 2 over the column blocks: dq, dk (of the rotated vectors; triton_rotate's unrotate turns them back into
        # dB / dC and takes the phase's gradient from them)
        qdyH = tl.zeros((T * R,), dtype=tl.float32)  # q_i^T H^T dy_i
        dHH = 0.0
        noff = b * sgb + h * sgh + t * sgt + rank * sgr  # DK / DQ: per head
        RUN: tl.constexpr = 1 if SPLIT else NJB
        jbase = tl.program_id(2) if SPLIT else 0
        for jj in tl.static_range(RUN):
            jb = jbase + jj
            qb = _columns(QT, qk_off, valid, jb * BN, N, BN).to(dtype)
            kb = _columns(KT, qk_off, valid, jb * BN, N, BN).to(dtype)
            Hb = _columns(HS + hs, prow, pm, jb * BN, N, BN).to(dtype)
            dHb = _columns(DHS + hs, prow, pm, jb * BN, N, BN).to(dtype)
            dHH += tl.sum(tl.sum(dHb.to(tl.float32) * Hb.to(tl.float32), 1), 0)
            dyH = tl.dot(dyd, Hb, input_precision=PREC)  # (rows, BN)
            dq = tl.dot(PW, kb, input_precision=PREC) + ecs[:, None] * dyH
            dk = tl.dot(PWt, qb, input_precision=PREC) + coef[:, None] * tl.dot(ud, dHb, input_precision=PREC)
            qdyH += tl.sum(qb.to(tl.float32) * dyH, 1)
            _store_columns(DQ, noff, dq, valid, jb * BN, N, BN)
            _store_columns(DK, noff, dk, valid, jb * BN, N, BN)

    # per-token scalars: the trapezoid weights and the decay's log. The gradient of the chunk's total decay
    # (dtot) reaches every token up to the chunk's last: it is added there (past it nothing is stored)
    if PART == 2:
        dcs = ecs * qdyH
        dtot = tl.exp(tot) * dHH
    else:
        dw += tl.exp(tot - cs) * Zs
        dcs -= coef * Zs
        dtot = tl.sum(coef * Zs, 0)
    dcs = per_token_vec(dcs, T, R)
    dcs += tl.where(tl.arange(0, T) == tl.minimum(T - 1, L - 1 - c * T), dtot, 0.0)
    soff = b * sdb + h * sdh + tt * sdt
    if PART == 1:
        tl.store(DW + soff, per_token_vec(dw, T, R), mask=tm)
        tl.store(DG + soff, per_token_vec(dg, T, R), mask=tm)
        tl.store(DA + soff, dcs, mask=tm)
    else:
        tl.store(DA + (1 + jbase) * s_da + soff, dcs, mask=tm)
        if jbase + RUN == NJB:  # the last program: the slots past the ones this launch writes are zeroed
            for q in range(2 + jbase, NDA):
                tl.store(DA + q * s_da + soff, tl.zeros((T,), dtype=tl.float32), mask=tm)
