"""Mamba-3 backward kernels (SISO): the reverse state-gradient sweep and the per-chunk gradients.

``dstates``: one program per (row, head, headdim block) walks the chunks backwards carrying dH, the gradient of
the (augmented) state: it writes dH at the end of every chunk, then dH <- exp(tot) dH + sum_i exp(cs_i) dy_i q_i^T.
At a sequence start it writes the gradient of the initial state.
``chunk_bwd``: one program per (row, head, chunk) with the whole headdim: with H entering the chunk and dH at its
end, every gradient of the chunk's inputs: dx, dz, dB / dC (per head, before the rotation), and per token the
gradients of the decay's log (da), of w and gamma (the trapezoid weights) and of the phase (summed from the end
of the chunk: the rest comes from later chunks, added by the caller), and dD's share.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.mamba3.triton_common import load_pairs, pair_columns, rotate_pairs, token_scalars


@triton.jit
def _gated(DY, Z, YPRE, off, zoff, m, HAS_Z: tl.constexpr):
    """dy with the gate's backward applied: dy * silu(z) -> (that, dz) (dz = dy without a gate). DY and YPRE
    share the offsets ``off``; z has its own strides (a view of the projection)."""
    dy = tl.load(DY + off, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(Z + zoff, mask=m, other=0.0).to(tl.float32)
        sg = tl.sigmoid(z)
        ypre = tl.load(YPRE + off, mask=m, other=0.0).to(tl.float32)
        return dy * z * sg, dy * ypre * sg * (1.0 + z * (1.0 - sg))
    return dy, dy


@triton.jit
def dstates_kernel(DY, Z, YPRE, DT, AA, TRAP, Cm, BIAS, ANG, CINIT, CFINAL, THS, DFIN, DHS, DINIT,
                   L, NC, H, HPG, P, NH, NA,
                   sdb, sdt, sdh, scb, sct, scg, scn, sab, sat, sah, saa, syb, syt, syh, syp, szb, szt, szh, szp,
                   T: tl.constexpr, BH: tl.constexpr, BLOCK_P: tl.constexpr, HALVED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, HAS_DFIN: tl.constexpr, HAS_DINIT: tl.constexpr,
                   PREC: tl.constexpr):
    pid = tl.program_id(0)
    pp = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    N = 2 * NH
    offs_t = tl.arange(0, T)
    offs_p = pp * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, BH)
    pm, jm, am = offs_p < P, offs_j < NH, offs_j < NA
    col1, col2 = pair_columns(offs_j, N, HALVED)
    hm = pm[:, None] & jm[None, :]
    scal = b * sdb + h * sdh
    c_ptr = Cm + b * scb + (h // HPG) * scg
    if HAS_BIAS:
        bias1 = tl.load(BIAS + h * N + col1, mask=jm, other=0.0).to(tl.float32)
        bias2 = tl.load(BIAS + h * N + col2, mask=jm, other=0.0).to(tl.float32)
    dtype = DHS.dtype.element_ty
    dH1 = tl.zeros((BLOCK_P, BH), dtype=tl.float32)
    dH2 = tl.zeros((BLOCK_P, BH), dtype=tl.float32)
    for cc in range(NC):
        c = NC - 1 - cc
        ci = tl.load(CINIT + b * NC + c)
        cf = tl.load(CFINAL + b * NC + c)
        if HAS_DFIN:  # a sequence ends here: its state gradient starts from d final (cf = -1: zero)
            ok = (offs_j * 0 + cf) >= 0  # a vector: the interpreter takes no scalar in a mask
            idx = tl.maximum(cf, 0).to(tl.int64)
            base = DFIN + (idx * H + h) * P * N + offs_p[:, None] * N
            f1 = tl.load(base + col1[None, :], mask=hm & ok[None, :], other=0.0)
            f2 = tl.load(base + col2[None, :], mask=hm & ok[None, :], other=0.0)
            dH1 = tl.where(cf != -2, f1, dH1)
            dH2 = tl.where(cf != -2, f2, dH2)
        else:
            dH1 = tl.where(cf != -2, 0.0, dH1)
            dH2 = tl.where(cf != -2, 0.0, dH2)
        out = DHS + ((b * H + h) * NC + c) * P * N + offs_p[:, None] * N
        tl.store(out + col1[None, :], dH1.to(dtype), mask=hm)
        tl.store(out + col2[None, :], dH2.to(dtype), mask=hm)

        t = c * T + offs_t
        valid = t < L
        dt, la, gamma, w = token_scalars(DT + scal, AA + scal, TRAP + scal, sdt, t, valid, valid)
        cs = tl.cumsum(la, 0)
        tot = tl.sum(la, 0)
        th_c = tl.load(THS + ((b * H + h) * NC + c) * NA + offs_j, mask=am, other=0.0)
        om = tl.load(ANG + b * sab + h * sah + t[:, None] * sat + offs_j[None, :] * saa,
                     mask=valid[:, None] & am[None, :], other=0.0).to(tl.float32)
        th_t = th_c[None, :] + tl.cumsum(om * dt[:, None], 0)
        c1, c2 = load_pairs(c_ptr, sct, scn, t, valid, col1, col2, jm)
        if HAS_BIAS:
            c1 += bias1[None, :]
            c2 += bias2[None, :]
        q1, q2 = rotate_pairs(c1, c2, tl.cos(th_t), tl.sin(th_t))
        ym = valid[:, None] & pm[None, :]
        dy, _ = _gated(DY, Z, YPRE, b * syb + h * syh + t[:, None] * syt + offs_p[None, :] * syp,
                       b * szb + h * szh + t[:, None] * szt + offs_p[None, :] * szp, ym, HAS_Z)
        dyw = (dy * tl.exp(cs)[:, None]).to(dtype)
        decay = tl.exp(tot)
        dH1 = dH1 * decay + tl.dot(tl.trans(dyw), q1.to(dtype), input_precision=PREC)
        dH2 = dH2 * decay + tl.dot(tl.trans(dyw), q2.to(dtype), input_precision=PREC)
        if HAS_DINIT:  # a sequence starts here: dH is the gradient of its (augmented) initial state
            ok = (offs_j * 0 + ci) >= 0
            idx = tl.maximum(ci, 0).to(tl.int64)
            base = DINIT + (idx * H + h) * P * N + offs_p[:, None] * N
            tl.store(base + col1[None, :], dH1, mask=hm & ok[None, :])
            tl.store(base + col2[None, :], dH2, mask=hm & ok[None, :])


@triton.jit
def chunk_bwd_kernel(X, DY, Z, YPRE, DT, AA, TRAP, Bm, Cm, BIAS_B, BIAS_C, ANG, D, CFINAL, HS, THS, DHS,
                     DX, DZ, DBH, DCH, DW, DG, DA, DPHI, DTH_TOT, DD,
                     L, NC, H, HPG, P, NH, NA,
                     sxb, sxt, sxh, sxp, sdb, sdt, sdh, sbb, sbt, sbg, sbn, scb, sct, scg, scn,
                     sab, sat, sah, saa, syb, syt, syh, syp, szb, szt, szh, szp, sgb, sgt, sgh, spb, spt, sph,
                     T: tl.constexpr, BH: tl.constexpr, BP: tl.constexpr, HALVED: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    g = h // HPG
    N = 2 * NH
    offs_t = tl.arange(0, T)
    offs_p = tl.arange(0, BP)
    offs_j = tl.arange(0, BH)
    pm, jm, am = offs_p < P, offs_j < NH, offs_j < NA
    col1, col2 = pair_columns(offs_j, N, HALVED)
    dtype = X.dtype.element_ty

    cf = tl.load(CFINAL + b * NC + c)
    t = c * T + offs_t
    valid = t < L
    next_ok = (t + 1 < L) & ((offs_t < T - 1) | (offs_t * 0 + cf == -2))
    scal = b * sdb + h * sdh
    dt, la, gamma, w = token_scalars(DT + scal, AA + scal, TRAP + scal, sdt, t, valid, next_ok)
    cs = tl.cumsum(la, 0)
    tot = tl.sum(la, 0)
    th_c = tl.load(THS + ((b * H + h) * NC + c) * NA + offs_j, mask=am, other=0.0)
    om = tl.load(ANG + b * sab + h * sah + t[:, None] * sat + offs_j[None, :] * saa,
                 mask=valid[:, None] & am[None, :], other=0.0).to(tl.float32)
    th_t = th_c[None, :] + tl.cumsum(om * dt[:, None], 0)
    cos, sin = tl.cos(th_t), tl.sin(th_t)
    c1, c2 = load_pairs(Cm + b * scb + g * scg, sct, scn, t, valid, col1, col2, jm)
    b1, b2 = load_pairs(Bm + b * sbb + g * sbg, sbt, sbn, t, valid, col1, col2, jm)
    if HAS_BIAS:
        c1 += tl.load(BIAS_C + h * N + col1, mask=jm, other=0.0).to(tl.float32)[None, :]
        c2 += tl.load(BIAS_C + h * N + col2, mask=jm, other=0.0).to(tl.float32)[None, :]
        b1 += tl.load(BIAS_B + h * N + col1, mask=jm, other=0.0).to(tl.float32)[None, :]
        b2 += tl.load(BIAS_B + h * N + col2, mask=jm, other=0.0).to(tl.float32)[None, :]
    q1, q2 = rotate_pairs(c1, c2, cos, sin)
    k1, k2 = rotate_pairs(b1, b2, cos, sin)
    q1d, q2d, k1d, k2d = q1.to(dtype), q2.to(dtype), k1.to(dtype), k2.to(dtype)

    xm = valid[:, None] & pm[None, :]
    xoff = b * sxb + h * sxh + t[:, None] * sxt + offs_p[None, :] * sxp
    yoff = b * syb + h * syh + t[:, None] * syt + offs_p[None, :] * syp  # dy, ypre, dx, dz: contiguous alike
    xv = tl.load(X + xoff, mask=xm, other=0.0)
    xd = xv.to(dtype)
    dy, dz = _gated(DY, Z, YPRE, yoff, b * szb + h * szh + t[:, None] * szt + offs_p[None, :] * szp, xm, HAS_Z)
    if HAS_Z:
        tl.store(DZ + yoff, dz.to(DZ.dtype.element_ty), mask=xm)
    dyd = dy.to(dtype)

    ii = offs_t[:, None]
    jj = offs_t[None, :]
    strict = ii > jj
    diag = ii == jj
    E = tl.exp(tl.where(strict, cs[:, None] - cs[None, :], float("-inf")))
    W = E * w[None, :] + tl.where(diag, gamma[:, None], 0.0)
    S = tl.dot(q1d, tl.trans(k1d), input_precision=PREC) + tl.dot(q2d, tl.trans(k2d), input_precision=PREC)
    G = tl.dot(dyd, tl.trans(xd), input_precision=PREC)  # G_ij = dy_i . x_j
    V = S * G
    coef = tl.exp(tot - cs) * w  # token j's weight in the state leaving the chunk

    hs = ((b * H + h) * NC + c) * P * N + offs_p[:, None] * N
    hm = pm[:, None] & jm[None, :]
    H1 = tl.load(HS + hs + col1[None, :], mask=hm, other=0.0).to(tl.float32)
    H2 = tl.load(HS + hs + col2[None, :], mask=hm, other=0.0).to(tl.float32)
    dH1 = tl.load(DHS + hs + col1[None, :], mask=hm, other=0.0).to(tl.float32)
    dH2 = tl.load(DHS + hs + col2[None, :], mask=hm, other=0.0).to(tl.float32)

    # dx: through the chunk's outputs, D, and the state leaving the chunk
    dx = tl.dot(tl.trans(S * W).to(dtype), dyd, input_precision=PREC)
    dx += coef[:, None] * (tl.dot(k1d, tl.trans(dH1.to(dtype)), input_precision=PREC)
                           + tl.dot(k2d, tl.trans(dH2.to(dtype)), input_precision=PREC))
    if HAS_D:
        dx += tl.load(D + h).to(tl.float32) * dy
        tl.store(DD + (b * H + h) * NC + c, tl.sum(tl.sum(dy * xv.to(tl.float32), 1), 0))
    tl.store(DX + yoff, dx.to(DX.dtype.element_ty), mask=xm)

    # dq, dk (of the rotated vectors)
    PW = (G * W).to(dtype)
    dyH1 = tl.dot(dyd, H1.to(dtype), input_precision=PREC)  # (T, BH)
    dyH2 = tl.dot(dyd, H2.to(dtype), input_precision=PREC)
    ecs = tl.exp(cs)
    dq1 = tl.dot(PW, k1d, input_precision=PREC) + ecs[:, None] * dyH1
    dq2 = tl.dot(PW, k2d, input_precision=PREC) + ecs[:, None] * dyH2
    xdH1 = tl.dot(xd, dH1.to(dtype), input_precision=PREC)
    xdH2 = tl.dot(xd, dH2.to(dtype), input_precision=PREC)
    dk1 = tl.dot(tl.trans(PW), q1d, input_precision=PREC) + coef[:, None] * xdH1
    dk2 = tl.dot(tl.trans(PW), q2d, input_precision=PREC) + coef[:, None] * xdH2

    # per-token scalars: the trapezoid weights and the decay's log
    EV = tl.where(strict, E * V, 0.0)
    Zs = tl.sum(xdH1 * k1 + xdH2 * k2, 1)  # x_j^T dH k_j
    dw = tl.sum(EV, 0) + tl.exp(tot - cs) * Zs
    dg = tl.sum(tl.where(diag, V, 0.0), 1)
    R = EV * w[None, :]
    dcs = tl.sum(R, 1) - tl.sum(R, 0) + ecs * tl.sum(q1 * dyH1 + q2 * dyH2, 1) - coef * Zs
    dtot = tl.exp(tot) * tl.sum(tl.sum(dH1 * H1 + dH2 * H2, 1), 0) + tl.sum(coef * Zs, 0)
    dcs += tl.where(offs_t == T - 1, dtot, 0.0)
    da = tl.sum(dcs, 0) - tl.cumsum(dcs, 0) + dcs  # d(dt A)_t = sum_{i >= t} dcs_i
    soff = b * sdb + h * sdh + t * sdt
    tl.store(DW + soff, dw, mask=valid)
    tl.store(DG + soff, dg, mask=valid)
    tl.store(DA + soff, da, mask=valid)

    # the rotation: the phase, and B / C before it
    dth = q1 * dq2 - q2 * dq1 + k1 * dk2 - k2 * dk1
    pm2 = valid[:, None] & am[None, :]
    tl.store(DPHI + b * spb + h * sph + t[:, None] * spt + offs_j[None, :],
             tl.sum(dth, 0)[None, :] - tl.cumsum(dth, 0) + dth, mask=pm2)
    tl.store(DTH_TOT + ((b * H + h) * NC + c) * NA + offs_j, tl.sum(dth, 0), mask=am)
    nm = valid[:, None] & jm[None, :]
    noff = b * sgb + h * sgh + t[:, None] * sgt  # DBH / DCH: (rows, L, H, N) fp32, per head
    tl.store(DCH + noff + col1[None, :], dq1 * cos + dq2 * sin, mask=nm)
    tl.store(DCH + noff + col2[None, :], dq2 * cos - dq1 * sin, mask=nm)
    tl.store(DBH + noff + col1[None, :], dk1 * cos + dk2 * sin, mask=nm)
    tl.store(DBH + noff + col2[None, :], dk2 * cos - dk1 * sin, mask=nm)
