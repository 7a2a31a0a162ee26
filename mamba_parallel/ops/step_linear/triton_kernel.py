"""The one-token linear kernel of a decode step: out = linear(prologue(x), W) [-> conv update + silu on some columns].

A decode step reads every weight once and does little else, so each linear is a skinny GEMM bound by the weight's
bytes, and the small ops around it are worth doing in the same pass instead of in kernels of their own:

- prologue NORM = 1: the block's pre-norm, v = x + residual (the new residual is written once, by the first column
  block), rmsnorm(v) * norm_weight; NORM = 2: Mamba-2's gated norm, rmsnorm(x * silu(z)) * norm_weight per group of
  ``group_size`` channels (or rmsnorm(x) * norm_weight * silu(z), NORM_BEFORE_GATE); NORM = 0: x as given.
  One sweep over K: a norm is a per-row scale, so W (v * norm_weight) and the sum of v^2 accumulate together and
  the group's 1 / rms multiplies the product at the group's end (v * norm_weight is rounded to x's dtype for the
  tensor cores, where the unfused norm rounds its normalised output: the same relative rounding).
- epilogue CONV: output columns [conv_start, conv_start + conv channels) are a causal depthwise conv's input: the
  program that computes them also runs the conv's one-token update (state shifted in place, silu after), as
  ``causal_conv1d_update`` does, so the mixer's conv costs no launch of its own.
- SPLIT_K > 1: each program sums one slice of K and writes fp32 partials (SPLIT_K, M, N); the caller's next kernel
  sums them (a GEMV with few columns, like Mamba-1's x_proj, would otherwise run on a handful of programs).

Grid: (column blocks, K slices, row blocks); the rows (a decode batch) are padded to the tensor cores' 16.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def step_linear_kernel(
    x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, rout_ptr, cs_ptr, cw_ptr, cb_ptr,
    M, N, K, eps, group_size, k_per_split, conv_start, conv_channels,
    sxm, srm, szm, swn, som, srom, spart, scs_m, scs_c, scs_w, scw_c, scw_w,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr, CONV: tl.constexpr, CONV_BIAS: tl.constexpr, W: tl.constexpr, SPLIT_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mrow = rows < M
    mcol = cols < N
    x_ty = x_ptr.dtype.element_ty
    w_ty = w_ptr.dtype.element_ty
    res_ty = rout_ptr.dtype.element_ty
    res_rows = rows < tl.where(pid_n == 0, M, 0)  # the first column block writes the new residual

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if NORM == 2:
        g_len = group_size
    else:
        g_len = tl.maximum(k_hi - k_lo, 1)  # one group: the K slice (the whole row for NORM = 1)
    for g0 in range(k_lo, k_hi, g_len):
        g_end = tl.minimum(g0 + g_len, k_hi)
        part = tl.zeros((BM, BN), dtype=tl.float32)
        ss = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(g0, g_end, BK):
            kk = k0 + offs_k
            mk = kk < g_end
            m2 = mrow[:, None] & mk[None, :]
            v = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            if NORM == 1:
                if HAS_RES:
                    v += tl.load(r_ptr + rows[:, None] * srm + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                v = v.to(res_ty).to(tl.float32)  # the residual as stored
                tl.store(rout_ptr + rows[:, None] * srom + kk[None, :], v.to(res_ty),
                         mask=res_rows[:, None] & mk[None, :])
            if NORM == 2:
                if HAS_Z:
                    z = tl.load(z_ptr + rows[:, None] * szm + kk[None, :], mask=m2, other=0.0).to(tl.float32)
                    gate = z * tl.sigmoid(z)
                    if not NORM_BEFORE_GATE:
                        v = v * gate
            if NORM != 0:
                ss += tl.sum(v * v, axis=1)
                v = v * tl.load(nw_ptr + kk, mask=mk, other=0.0).to(tl.float32)[None, :]
                if NORM == 2:
                    if HAS_Z and NORM_BEFORE_GATE:
                        v = v * gate
            a = v.to(x_ty).to(w_ty)
            w = tl.load(w_ptr + cols[:, None] * swn + kk[None, :], mask=mcol[:, None] & mk[None, :], other=0.0)
            if w_ty == tl.float32:
                part = tl.dot(a, tl.trans(w), part, input_precision="ieee")
            else:
                part = tl.dot(a, tl.trans(w), part)
        if NORM != 0:
            part = part * (1.0 / tl.sqrt(ss / g_len + eps))[:, None]
        acc += part

    m2 = mrow[:, None] & mcol[None, :]
    if SPLIT_K > 1:
        tl.store(out_ptr + pid_k * spart + rows[:, None] * som + cols[None, :], acc, mask=m2)
        return
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mcol, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    if CONV:
        # y = silu(bias + w . [state, x]); the state shifts left by one and takes x (x: the linear's output, as
        # stored). Each thread reads slot j before it overwrites slot j (with slot j + 1) one iteration later.
        ch = cols - conv_start
        is_conv = (ch >= 0) & (ch < conv_channels) & mcol
        mc = mrow[:, None] & is_conv[None, :]
        c = tl.load(cw_ptr + ch * scw_c + (W - 1) * scw_w, mask=is_conv, other=0.0).to(tl.float32)[None, :] \
            * out.to(tl.float32)
        if CONV_BIAS:
            c += tl.load(cb_ptr + ch, mask=is_conv, other=0.0).to(tl.float32)[None, :]
        st = cs_ptr + rows[:, None] * scs_m + ch[None, :] * scs_c
        for j in tl.static_range(W - 1):
            s = tl.load(st + j * scs_w, mask=mc, other=0.0)
            c += tl.load(cw_ptr + ch * scw_c + j * scw_w, mask=is_conv, other=0.0).to(tl.float32)[None, :] \
                * s.to(tl.float32)
            if j > 0:
                tl.store(st + (j - 1) * scs_w, s, mask=mc)
        if W > 1:
            tl.store(st + (W - 2) * scs_w, out.to(cs_ptr.dtype.element_ty), mask=mc)
        c = c * tl.sigmoid(c)
        out = tl.where(is_conv[None, :], c.to(out_ptr.dtype.element_ty), out)
    tl.store(out_ptr + rows[:, None] * som + cols[None, :], out, mask=m2)
