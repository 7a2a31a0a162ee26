"""Mamba-3 one-token decode kernels (SISO and MIMO). ``step_kernel``: one program per (batch row, head, block of
headdim rows) advances its rows of the cached state and previous-token x in place and writes y; every program
reads the cached phase and previous-token k. When a head's rows span several programs, none of them may write
those two before all have read them, so ``step_shared_kernel`` (one program per batch row and head) writes them
after; with one block per head the step kernel writes them itself. MIMO's R ranks are broadcast sums over a
leading axis of R rows (R is small)."""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.mamba3.triton_common import pair_columns, rotate_pairs, wrap_angle
from mamba_parallel.ops.triton_math import softplus, tanh


@triton.jit
def _rank_rows(ptr, offs_r, cols, ncols, cmask):
    """(R, len(cols)) of a per-head (R, ncols) parameter, fp32."""
    return tl.load(ptr + offs_r[:, None] * ncols + cols[None, :], mask=cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _step_dt(DT, DT_BIAS, b, h, sdb, sdh, RAW: tl.constexpr):
    """This token's dt; RAW: from the raw projection, softplus(dt + dt_bias)."""
    dt = tl.load(DT + b * sdb + h * sdh).to(tl.float32)
    if RAW:
        dt = softplus(dt + tl.load(DT_BIAS + h).to(tl.float32))
    return dt


@triton.jit
def _phase_and_k(dt, ANG, Bm, BIAS_B, S_ANG, b, h, g, offs_r, offs_j, col1, col2, jm, am, N, sbb, sbr,
                 sbg, sbn, sab, sah, saa, s_ab, s_ah, s_aa, HAS_BIAS: tl.constexpr, R: tl.constexpr,
                 RAW: tl.constexpr):
    """This token's phase (BH,) and rotated k halves (R, BH), from the cached phase, angles, dt and B (+ bias);
    RAW: the angles are the raw projection (pi tanh of it is the rotation speed)."""
    om = tl.load(ANG + b * sab + h * sah + offs_j * saa, mask=am, other=0.0).to(tl.float32)
    if RAW:
        om = 3.141592653589793 * tanh(om)
    th = tl.load(S_ANG + b * s_ab + h * s_ah + offs_j * s_aa, mask=am, other=0.0) + om * dt
    cos, sin = tl.cos(th)[None, :], tl.sin(th)[None, :]
    jm2 = jm[None, :]
    b_ptr = Bm + b * sbb + g * sbg + offs_r[:, None] * sbr
    b1 = tl.load(b_ptr + col1[None, :] * sbn, mask=jm2, other=0.0).to(tl.float32)  # (R, BH)
    b2 = tl.load(b_ptr + col2[None, :] * sbn, mask=jm2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b1 += _rank_rows(BIAS_B + h * R * N, offs_r, col1, N, jm)
        b2 += _rank_rows(BIAS_B + h * R * N, offs_r, col2, N, jm)
    k1, k2 = rotate_pairs(b1, b2, cos, sin)
    return th, k1, k2, cos, sin


@triton.jit
def step_shared_kernel(DT, DT_BIAS, ANG, Bm, BIAS_B, S_ANG, S_K, H, HPG, NH, NA,
                       sdb, sdh, sbb, sbr, sbg, sbn, sab, sah, saa, s_ab, s_ah, s_aa, skb, skr, skh, skn,
                       R: tl.constexpr, BH: tl.constexpr, HALVED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       RAW: tl.constexpr):
    """The cached phase and previous-token k of one (batch row, head), after ``step_kernel`` has read them."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    offs_r = tl.arange(0, R)
    offs_j = tl.arange(0, BH)
    jm, am = offs_j < NH, offs_j < NA
    col1, col2 = pair_columns(offs_j, 2 * NH, HALVED)
    dt = _step_dt(DT, DT_BIAS, b, h, sdb, sdh, RAW)
    th, k1, k2, _, _ = _phase_and_k(dt, ANG, Bm, BIAS_B, S_ANG, b, h, h // HPG, offs_r, offs_j, col1, col2, jm, am,
                                    2 * NH, sbb, sbr, sbg, sbn, sab, sah, saa, s_ab, s_ah, s_aa, HAS_BIAS, R, RAW)
    k_ptr = S_K + b * skb + h * skh + offs_r[:, None] * skr
    tl.store(k_ptr + col1[None, :] * skn, k1.to(S_K.dtype.element_ty), mask=jm[None, :])
    tl.store(k_ptr + col2[None, :] * skn, k2.to(S_K.dtype.element_ty), mask=jm[None, :])
    tl.store(S_ANG + b * s_ab + h * s_ah + offs_j * s_aa, wrap_angle(th), mask=am)


@triton.jit
def step_kernel(X, DT, AA, TRAP, Bm, Cm, BIAS_B, BIAS_C, ANG, D, Z, MX, MZ, MO, S_ANG, S_SSM, S_K, S_V, Y,
                DT_BIAS, A_FLOOR, H, HPG, P, NH, NA,
                sxb, sxh, sxp, sdb, sdh, sbb, sbr, sbg, sbn, scb, scr, scg, scn, sab, sah, saa, szb, szh, szp,
                s_ab, s_ah, s_aa, ssb, ssh, ssp, ssn, skb, skr, skh, skn, svb, svh, svp, syb, syr, syh, syp,
                R: tl.constexpr, BH: tl.constexpr, BP: tl.constexpr, HALVED: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_MX: tl.constexpr, HAS_MZ: tl.constexpr,
                HAS_MO: tl.constexpr, WRITE_SHARED: tl.constexpr, RAW: tl.constexpr):
    """RAW: dt, A, trap and the angles are a layer's raw projections, discretized here (``naive.discretize``)."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    g = h // HPG
    N = 2 * NH
    offs_r = tl.arange(0, R)
    offs_p = tl.program_id(1) * BP + tl.arange(0, BP)
    offs_j = tl.arange(0, BH)
    pm, jm, am = offs_p < P, offs_j < NH, offs_j < NA
    col1, col2 = pair_columns(offs_j, N, HALVED)

    dt = _step_dt(DT, DT_BIAS, b, h, sdb, sdh, RAW)
    a = tl.load(AA + b * sdb + h * sdh).to(tl.float32)
    lam = tl.load(TRAP + b * sdb + h * sdh).to(tl.float32)
    if RAW:
        a = -tl.maximum(softplus(a), A_FLOOR)
        lam = tl.sigmoid(lam)
    alpha = tl.exp(a * dt)
    beta, gamma = (1.0 - lam) * dt, lam * dt
    th, k1, k2, cos, sin = _phase_and_k(dt, ANG, Bm, BIAS_B, S_ANG, b, h, g, offs_r, offs_j, col1, col2, jm, am,
                                        N, sbb, sbr, sbg, sbn, sab, sah, saa, s_ab, s_ah, s_aa, HAS_BIAS, R, RAW)
    jm2 = jm[None, :]
    c_ptr = Cm + b * scb + g * scg + offs_r[:, None] * scr
    c1 = tl.load(c_ptr + col1[None, :] * scn, mask=jm2, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + col2[None, :] * scn, mask=jm2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        c1 += _rank_rows(BIAS_C + h * R * N, offs_r, col1, N, jm)
        c2 += _rank_rows(BIAS_C + h * R * N, offs_r, col2, N, jm)
    q1, q2 = rotate_pairs(c1, c2, cos, sin)

    k_ptr = S_K + b * skb + h * skh + offs_r[:, None] * skr
    kp1 = tl.load(k_ptr + col1[None, :] * skn, mask=jm2, other=0.0).to(tl.float32)
    kp2 = tl.load(k_ptr + col2[None, :] * skn, mask=jm2, other=0.0).to(tl.float32)
    v_ptr = S_V + b * svb + h * svh + offs_p * svp
    vp = tl.load(v_ptr, mask=pm, other=0.0).to(tl.float32)
    xr = tl.load(X + b * sxb + h * sxh + offs_p * sxp, mask=pm, other=0.0)
    xv = xr.to(tl.float32)
    u, u_prev = xv[None, :], vp[None, :]  # (1 or R, BP)
    if HAS_MX:
        mx = _rank_rows(MX + h * R * P, offs_r, offs_p, P, pm)
        u, u_prev = u * mx, u_prev * mx
    s_ptr = S_SSM + b * ssb + h * ssh + offs_p[:, None] * ssp
    hm = pm[:, None] & jm[None, :]
    H1 = tl.load(s_ptr + col1[None, :] * ssn, mask=hm, other=0.0).to(tl.float32)
    H2 = tl.load(s_ptr + col2[None, :] * ssn, mask=hm, other=0.0).to(tl.float32)
    prev = (alpha * beta) * u_prev
    cur = gamma * u
    H1 = alpha * H1 + tl.sum(prev[:, :, None] * kp1[:, None, :] + cur[:, :, None] * k1[:, None, :], 0)
    H2 = alpha * H2 + tl.sum(prev[:, :, None] * kp2[:, None, :] + cur[:, :, None] * k2[:, None, :], 0)
    y = tl.sum(H1[None, :, :] * q1[:, None, :] + H2[None, :, :] * q2[:, None, :], 2)  # (R, BP)
    if HAS_D:
        y += tl.load(D + h).to(tl.float32) * u
    if HAS_Z:
        zv = tl.load(Z + b * szb + h * szh + offs_p * szp, mask=pm, other=0.0).to(tl.float32)[None, :]
        if HAS_MZ:
            zv = zv * _rank_rows(MZ + h * R * P, offs_r, offs_p, P, pm)
        y = y * zv * tl.sigmoid(zv)
    y_ptr = Y + b * syb + h * syh + offs_p[None, :] * syp
    if HAS_MO:
        y = tl.sum(y * _rank_rows(MO + h * R * P, offs_r, offs_p, P, pm), 0)
        tl.store(Y + b * syb + h * syh + offs_p * syp, y.to(Y.dtype.element_ty), mask=pm)
    else:
        tl.store(y_ptr + offs_r[:, None] * syr, y.to(Y.dtype.element_ty), mask=pm[None, :])
    tl.store(s_ptr + col1[None, :] * ssn, H1.to(S_SSM.dtype.element_ty), mask=hm)
    tl.store(s_ptr + col2[None, :] * ssn, H2.to(S_SSM.dtype.element_ty), mask=hm)
    tl.store(v_ptr, xr.to(S_V.dtype.element_ty), mask=pm)
    if WRITE_SHARED:
        tl.store(k_ptr + col1[None, :] * skn, k1.to(S_K.dtype.element_ty), mask=jm2)
        tl.store(k_ptr + col2[None, :] * skn, k2.to(S_K.dtype.element_ty), mask=jm2)
        tl.store(S_ANG + b * s_ab + h * s_ah + offs_j * s_aa, wrap_angle(th), mask=am)
