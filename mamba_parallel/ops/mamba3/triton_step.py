"""Mamba-3 one-token decode kernel (SISO): one program per (row, head) advances the cached phase, state, and
previous-token k / x in place, and writes y (the cache is read before it is written, by the same program)."""

from __future__ import annotations

import triton.language as tl
import triton

from mamba_parallel.ops.mamba3.triton_common import TWO_PI, pair_columns, rotate_pairs


@triton.jit
def step_kernel(X, DT, AA, TRAP, Bm, Cm, BIAS_B, BIAS_C, ANG, D, Z, S_ANG, S_SSM, S_K, S_V, Y,
                H, HPG, P, NH, NA,
                sxb, sxh, sxp, sdb, sdh, sbb, sbg, sbn, scb, scg, scn, sab, sah, saa, szb, szh, szp,
                s_ab, s_ah, s_aa, ssb, ssh, ssp, ssn, skb, skh, skn, svb, svh, svp, syb, syh, syp,
                BH: tl.constexpr, BP: tl.constexpr, HALVED: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    g = h // HPG
    N = 2 * NH
    offs_p = tl.arange(0, BP)
    offs_j = tl.arange(0, BH)
    pm, jm, am = offs_p < P, offs_j < NH, offs_j < NA
    col1, col2 = pair_columns(offs_j, N, HALVED)

    dt = tl.load(DT + b * sdb + h * sdh).to(tl.float32)
    alpha = tl.exp(tl.load(AA + b * sdb + h * sdh).to(tl.float32) * dt)
    lam = tl.load(TRAP + b * sdb + h * sdh).to(tl.float32)
    beta, gamma = (1.0 - lam) * dt, lam * dt
    a_ptr = S_ANG + b * s_ab + h * s_ah + offs_j * s_aa
    om = tl.load(ANG + b * sab + h * sah + offs_j * saa, mask=am, other=0.0).to(tl.float32)
    th = tl.load(a_ptr, mask=am, other=0.0) + om * dt
    cos, sin = tl.cos(th), tl.sin(th)
    b1 = tl.load(Bm + b * sbb + g * sbg + col1 * sbn, mask=jm, other=0.0).to(tl.float32)
    b2 = tl.load(Bm + b * sbb + g * sbg + col2 * sbn, mask=jm, other=0.0).to(tl.float32)
    c1 = tl.load(Cm + b * scb + g * scg + col1 * scn, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(Cm + b * scb + g * scg + col2 * scn, mask=jm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b1 += tl.load(BIAS_B + h * N + col1, mask=jm, other=0.0).to(tl.float32)
        b2 += tl.load(BIAS_B + h * N + col2, mask=jm, other=0.0).to(tl.float32)
        c1 += tl.load(BIAS_C + h * N + col1, mask=jm, other=0.0).to(tl.float32)
        c2 += tl.load(BIAS_C + h * N + col2, mask=jm, other=0.0).to(tl.float32)
    k1, k2 = rotate_pairs(b1, b2, cos, sin)
    q1, q2 = rotate_pairs(c1, c2, cos, sin)

    k_ptr = S_K + b * skb + h * skh
    kp1 = tl.load(k_ptr + col1 * skn, mask=jm, other=0.0).to(tl.float32)
    kp2 = tl.load(k_ptr + col2 * skn, mask=jm, other=0.0).to(tl.float32)
    v_ptr = S_V + b * svb + h * svh + offs_p * svp
    vp = tl.load(v_ptr, mask=pm, other=0.0).to(tl.float32)
    xr = tl.load(X + b * sxb + h * sxh + offs_p * sxp, mask=pm, other=0.0)
    xv = xr.to(tl.float32)
    s_ptr = S_SSM + b * ssb + h * ssh + offs_p[:, None] * ssp
    hm = pm[:, None] & jm[None, :]
    H1 = tl.load(s_ptr + col1[None, :] * ssn, mask=hm, other=0.0).to(tl.float32)
    H2 = tl.load(s_ptr + col2[None, :] * ssn, mask=hm, other=0.0).to(tl.float32)
    prev = (alpha * beta) * vp[:, None]
    cur = gamma * xv[:, None]
    H1 = alpha * H1 + prev * kp1[None, :] + cur * k1[None, :]
    H2 = alpha * H2 + prev * kp2[None, :] + cur * k2[None, :]
    y = tl.sum(H1 * q1[None, :] + H2 * q2[None, :], 1)
    if HAS_D:
        y += tl.load(D + h).to(tl.float32) * xv
    if HAS_Z:
        zv = tl.load(Z + b * szb + h * szh + offs_p * szp, mask=pm, other=0.0).to(tl.float32)
        y = y * zv * tl.sigmoid(zv)
    tl.store(Y + b * syb + h * syh + offs_p * syp, y.to(Y.dtype.element_ty), mask=pm)
    tl.store(s_ptr + col1[None, :] * ssn, H1.to(S_SSM.dtype.element_ty), mask=hm)
    tl.store(s_ptr + col2[None, :] * ssn, H2.to(S_SSM.dtype.element_ty), mask=hm)
    tl.store(k_ptr + col1 * skn, k1.to(S_K.dtype.element_ty), mask=jm)
    tl.store(k_ptr + col2 * skn, k2.to(S_K.dtype.element_ty), mask=jm)
    tl.store(v_ptr, xr.to(S_V.dtype.element_ty), mask=pm)
    tl.store(a_ptr, th - TWO_PI * tl.floor(th / TWO_PI), mask=am)
