"""One-token decode kernels: the Mamba-1 and Mamba-2 state updates, in place on the selected state rows.

Memory bound: each program reads and writes a (channels, n) slab of the fp32 state once; everything else is a few
vectors. dt bias + softplus (+ the Mamba-2 dt clamp), D and the z gate are fused.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def mamba1_step_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, idx_ptr, y_ptr,
    dim, dstate, d_per_group,
    ss_b, ss_d, ss_n, sx_b, sx_d, sdt_b, sdt_d, sA_d, sA_n, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
    sz_b, sz_d, sy_b,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_IDX: tl.constexpr, BD: tl.constexpr, NS: tl.constexpr,
):
    """Program (channel block, sequence): state[row, d-block, :] <- exp(dt A) state + dt x B; y = state C + D x."""
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    row = tl.load(idx_ptr + pid_b).to(tl.int64) if HAS_IDX else pid_b
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, NS)
    md = offs_d < dim
    mn = offs_n < dstate
    m2 = md[:, None] & mn[None, :]
    grp = offs_d // d_per_group  # B / C group of each channel

    s_ptrs = state_ptr + row * ss_b + offs_d[:, None] * ss_d + offs_n[None, :] * ss_n
    s = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * sx_b + offs_d * sx_d, mask=md, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * sdt_b + offs_d * sdt_d, mask=md, other=0.0).to(tl.float32)
    if HAS_DTB:
        dt += tl.load(dtb_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    A = tl.load(A_ptr + offs_d[:, None] * sA_d + offs_n[None, :] * sA_n, mask=m2, other=0.0).to(tl.float32)
    bc_off = grp[:, None] * sB_g + offs_n[None, :] * sB_n
    Bv = tl.load(B_ptr + pid_b * sB_b + bc_off, mask=m2, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * sC_b + grp[:, None] * sC_g + offs_n[None, :] * sC_n, mask=m2,
                 other=0.0).to(tl.float32)
    s = tl.exp(dt[:, None] * A) * s + (dt * x)[:, None] * Bv
    tl.store(s_ptrs, s, mask=m2)
    y = tl.sum(s * Cv, axis=1)
    if HAS_D:
        y += tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32) * x
    if HAS_Z:
        zv = tl.load(z_ptr + pid_b * sz_b + offs_d * sz_d, mask=md, other=0.0).to(tl.float32)
        y *= zv * tl.sigmoid(zv)
    tl.store(y_ptr + pid_b * sy_b + offs_d, y, mask=md)


@triton.jit
def mamba2_step_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, idx_ptr, y_ptr,
    headdim, dstate, heads_per_group, dt_min, dt_max,
    ss_b, ss_h, ss_p, ss_n, sx_b, sx_h, sx_p, sdt_b, sdt_h, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
    sz_b, sz_h, sz_p, sD_h, sD_p, sy_b, sy_h,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    CLAMP: tl.constexpr, HAS_IDX: tl.constexpr, BP: tl.constexpr, NS: tl.constexpr,
):
    """Program (headdim block, head, sequence): state[row, h, p-block, :] <- exp(dt A) state + dt x B^T."""
    pid_p = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)
    pid_b = tl.program_id(2).to(tl.int64)
    row = tl.load(idx_ptr + pid_b).to(tl.int64) if HAS_IDX else pid_b
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, NS)
    mp = offs_p < headdim
    mn = offs_n < dstate
    m2 = mp[:, None] & mn[None, :]
    grp = pid_h // heads_per_group

    s_ptrs = state_ptr + row * ss_b + pid_h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n
    s = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * sx_b + pid_h * sx_h + offs_p * sx_p, mask=mp, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * sdt_b + pid_h * sdt_h).to(tl.float32)
    if HAS_DTB:
        dt += tl.load(dtb_ptr + pid_h).to(tl.float32)
    if SOFTPLUS:
        dt = _softplus(dt)
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(A_ptr + pid_h).to(tl.float32))
    Bv = tl.load(B_ptr + pid_b * sB_b + grp * sB_g + offs_n * sB_n, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * sC_b + grp * sC_g + offs_n * sC_n, mask=mn, other=0.0).to(tl.float32)
    s = decay * s + (dt * x)[:, None] * Bv[None, :]
    tl.store(s_ptrs, s, mask=m2)
    y = tl.sum(s * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + pid_h * sD_h + offs_p * sD_p, mask=mp, other=0.0).to(tl.float32) * x
    if HAS_Z:
        zv = tl.load(z_ptr + pid_b * sz_b + pid_h * sz_h + offs_p * sz_p, mask=mp, other=0.0).to(tl.float32)
        y *= zv * tl.sigmoid(zv)
    tl.store(y_ptr + pid_b * sy_b + pid_h * sy_h + offs_p, y, mask=mp)
