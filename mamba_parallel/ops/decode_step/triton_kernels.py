"""Kernels of the fused Mamba-2 decode step (the specification: naive.py).

The two matmuls are GEMVs of one row per program column block: each program streams a (BN, K) slab of the weight
in (BN, BK) tiles and keeps a (BN, BK) fp32 accumulator that it reduces once at the end, the form that matched
cuBLAS's GEMV at the decode shapes (docs/kernels/decode.md). What each folds in is O(1) per row or per column:
in_proj's input norm is a scale per row (its sum of squares accumulates in the same K loop, the scale applies to
the result), its conv update is per output column (each column's program owns its conv state: no race);
out_proj's norm scale is one per norm group, from partial sums the state update leaves.

Where a kernel reads and then overwrites the same memory (the conv state, the SSM state, the residual), a
barrier separates the reads from the writes: a small tile's elements are held by several threads of the program,
and without it one thread could store before another has loaded.

On Hopper and later the kernels launch as programmatic dependents (``PDL``): a kernel's programs may start while
the previous kernel's last ones still run. Before ``_wait_for_previous`` a kernel reads only what no kernel of the
step writes (weights, parameters, and the SSM state, which only this layer's own kernel wrote a step ago); every
other load and every store comes after it. Each kernel waits unconditionally, so a finished kernel implies that
all before it have finished too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.triton_math import softplus


@triton.jit
def _let_next_start(PDL: tl.constexpr):
    """Allow the next kernel's programs to be scheduled (they wait for this kernel's results themselves)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _wait_for_previous(PDL: tl.constexpr):
    """Block until the previous kernel has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _weight_tile(w_ptr, offs_n, mn, k0, K, s_w_n, BK: tl.constexpr):
    """The (BN, BK) tile of W at columns [k0, k0 + BK), zeros outside (N, K)."""
    kk = k0 + tl.arange(0, BK)
    return tl.load(w_ptr + offs_n[:, None] * s_w_n + kk[None, :], mask=mn[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def norm_in_proj_conv_kernel(
    res_ptr, nw_ptr, w_ptr, bias_ptr, cw_ptr, cb_ptr, cs_ptr, out_ptr,
    K, N, eps, conv_start, conv_dim,
    s_res_b, s_w_n, s_cw_c, s_cw_j, s_cs_b, s_cs_c, s_cs_j, s_out_b,
    HAS_BIAS: tl.constexpr, HAS_CB: tl.constexpr, DC: tl.constexpr, DCP: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):
    """Program (column block, row): out[row, n] = rstd (W[n] . (res w_pre)) (+ bias), rounded to out's dtype; the
    conv columns [conv_start, conv_start + conv_dim) then take silu(conv(state, value)) and shift their state."""
    _let_next_start(PDL)
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mn = offs_n < N
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    ss = tl.zeros((BK,), dtype=tl.float32)
    w_next = _weight_tile(w_ptr, offs_n, mn, 0, K, s_w_n, BK)  # the weights stream while the previous kernel ends
    _wait_for_previous(PDL)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        mk = kk < K
        w = w_next
        w_next = _weight_tile(w_ptr, offs_n, mn, k0 + BK, K, s_w_n, BK)  # in flight during this tile's products
        r = tl.load(res_ptr + row * s_res_b + kk, mask=mk, other=0.0).to(tl.float32)
        ss += r * r
        a = r * tl.load(nw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
    y = tl.sum(acc, axis=1) * rstd
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # in_proj's output as the unfused step holds it
    c = offs_n - conv_start
    conv = mn & (c >= 0) & (c < conv_dim)
    if tl.sum(conv.to(tl.int32), axis=0) > 0:  # the block holds conv columns
        j = tl.arange(0, DCP)
        held = conv[:, None] & (j < DC - 1)[None, :]
        st_ptrs = cs_ptr + row * s_cs_b + c[:, None] * s_cs_c + j[None, :] * s_cs_j
        st = tl.load(st_ptrs, mask=held, other=0.0).to(tl.float32)
        cw = tl.load(cw_ptr + c[:, None] * s_cw_c + j[None, :] * s_cw_j, mask=held, other=0.0).to(tl.float32)
        x = tl.sum(st * cw, axis=1)
        x += tl.load(cw_ptr + c * s_cw_c + (DC - 1) * s_cw_j, mask=conv, other=0.0).to(tl.float32) * y
        if HAS_CB:
            x += tl.load(cb_ptr + c, mask=conv, other=0.0).to(tl.float32)
        # the state shifts by one token: slot j takes slot j + 1, the last slot the new value
        nxt = tl.load(st_ptrs + s_cs_j, mask=conv[:, None] & (j < DC - 2)[None, :], other=0.0)
        nxt = tl.where((j == DC - 2)[None, :], y[:, None], nxt.to(tl.float32))
        tl.debug_barrier()  # every old slot read before any is overwritten
        tl.store(st_ptrs, nxt.to(cs_ptr.dtype.element_ty), mask=held)
        y = tl.where(conv, x * tl.sigmoid(x), y)
    tl.store(out_ptr + row * s_out_b + offs_n, y.to(out_ptr.dtype.element_ty), mask=mn)


@triton.jit
def state_update_gate_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, nw_ptr, gw_ptr, ss_ptr,
    headdim, dstate, heads_per_group, dt_min, dt_max, nblk,
    ss_b, ss_h, ss_p, ss_n, sx_b, sx_h, sx_p, sdt_b, sdt_h, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
    sz_b, sz_h, sz_p, sD_h, sD_p, s_gw_b, s_ss_b,
    HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, CLAMP: tl.constexpr, BP: tl.constexpr, NS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (headdim block, head, row): the state update of ``ssd_state_update`` (softplus dt), then
    g = y silu(z) (y rounded to x's dtype), gw = g w_norm (fp32) and the block's sum of g^2 into
    ss[row, head * nblk + block] (the norm groups are whole heads: out_proj sums a group's slots)."""
    _let_next_start(PDL)
    pid_p = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)
    row = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, NS)
    mp = offs_p < headdim
    mn = offs_n < dstate
    m2 = mp[:, None] & mn[None, :]
    grp = pid_h // heads_per_group
    s_ptrs = state_ptr + row * ss_b + pid_h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n
    s = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + pid_h).to(tl.float32)
    ch = pid_h * headdim + offs_p
    nw = tl.load(nw_ptr + ch, mask=mp, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + pid_h * sD_h + offs_p * sD_p, mask=mp, other=0.0).to(tl.float32)
    _wait_for_previous(PDL)  # x, dt, B, C, z are in_proj's output
    x = tl.load(x_ptr + row * sx_b + pid_h * sx_h + offs_p * sx_p, mask=mp, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * sdt_b + pid_h * sdt_h).to(tl.float32)
    if HAS_DTB:
        dt += tl.load(dtb_ptr + pid_h).to(tl.float32)
    dt = softplus(dt)
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * A)
    Bv = tl.load(B_ptr + row * sB_b + grp * sB_g + offs_n * sB_n, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + row * sC_b + grp * sC_g + offs_n * sC_n, mask=mn, other=0.0).to(tl.float32)
    s = decay * s + (dt * x)[:, None] * Bv[None, :]
    tl.debug_barrier()  # the old state read before it is overwritten
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m2)
    y = tl.sum(s * Cv[None, :], axis=1)
    if HAS_D:
        y += Dv * x
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # y as the unfused step holds it
    zv = tl.load(z_ptr + row * sz_b + pid_h * sz_h + offs_p * sz_p, mask=mp, other=0.0).to(tl.float32)
    g = tl.where(mp, y * zv * tl.sigmoid(zv), 0.0)
    tl.store(gw_ptr + row * s_gw_b + ch, g * nw, mask=mp)
    tl.store(ss_ptr + row * s_ss_b + pid_h * nblk + pid_p, tl.sum(g * g, axis=0))


@triton.jit
def gated_out_proj_residual_kernel(
    gw_ptr, ss_ptr, w_ptr, bias_ptr, res_ptr,
    K, N, eps, group_size, slots, s_gw_b, s_ss_b, s_w_n, s_res_b,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (column block, row): res[row, n] += round(W[n] . (gw rstd) (+ bias)) with rstd per norm group of
    ``group_size`` channels from its ``slots`` partial sums of squares (BK divides group_size: one group per tile);
    without NORM, rstd = 1 (Mamba-1's out_proj)."""
    _let_next_start(PDL)
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mn = offs_n < N
    offs_k = tl.arange(0, BK)
    offs_s = tl.arange(0, SP)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    w_next = _weight_tile(w_ptr, offs_n, mn, 0, K, s_w_n, BK)
    _wait_for_previous(PDL)
    for k0 in range(0, K, BK):
        kk = k0 + offs_k
        mk = kk < K
        w = w_next
        w_next = _weight_tile(w_ptr, offs_n, mn, k0 + BK, K, s_w_n, BK)
        a = tl.load(gw_ptr + row * s_gw_b + kk, mask=mk, other=0.0).to(tl.float32)
        if NORM:
            grp = k0 // group_size
            part = tl.load(ss_ptr + row * s_ss_b + grp * slots + offs_s, mask=offs_s < slots, other=0.0)
            a *= 1.0 / tl.sqrt(tl.sum(part, axis=0) / group_size + eps)
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
    y = y.to(w_ptr.dtype.element_ty).to(tl.float32)  # out_proj's output as the unfused step holds it
    r_ptrs = res_ptr + row * s_res_b + offs_n
    r = tl.load(r_ptrs, mask=mn, other=0.0)
    tl.debug_barrier()  # the old residual read before it is overwritten
    tl.store(r_ptrs, r + y, mask=mn)


@triton.jit
def x_proj_partials_kernel(
    x_ptr, w_ptr, part_ptr, K, N, k_slice, s_x_b, s_w_n, s_p_b, s_p_s,
    BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
):
    """Program (column block, K slice, row): part[row, slice, n] = W[n, slice] . x[row, slice] (fp32). Mamba-1's
    x_proj has few outputs (dt_rank + 2 d_state) and a long K (d_inner): split over K, it fills the GPU."""
    _let_next_start(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mn = offs_n < N
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    k_end = tl.minimum(K, (pid_s + 1) * k_slice)
    w_next = _weight_tile(w_ptr, offs_n, mn, pid_s * k_slice, k_end, s_w_n, BK)
    _wait_for_previous(PDL)
    for k0 in range(pid_s * k_slice, k_end, BK):
        kk = k0 + offs_k
        mk = kk < k_end
        w = w_next
        w_next = _weight_tile(w_ptr, offs_n, mn, k0 + BK, k_end, s_w_n, BK)
        a = tl.load(x_ptr + row * s_x_b + kk, mask=mk, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[None, :]
    tl.store(part_ptr + row * s_p_b + pid_s * s_p_s + offs_n, tl.sum(acc, axis=1), mask=mn)


@triton.jit
def mamba1_state_update_gate_kernel(
    state_ptr, x_ptr, z_ptr, part_ptr, wdt_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr,
    dim, dstate, rank, slices, bcdt_eps,
    ss_b, ss_d, ss_n, s_x_b, s_z_b, s_p_b, s_p_s, s_wdt_d, s_A_d, s_A_n, s_y_b,
    HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, BCDT: tl.constexpr, SP: tl.constexpr, RP: tl.constexpr,
    NS: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr,
):
    """Program (channel block, row): x_dbl = the sum of x_proj's partials, rounded to x's dtype (BCDT: dt_low, B
    and C each divided by their root mean square, rounded again: Falcon-Mamba); dt = dt_proj(dt_low) rounded
    likewise, + bias, softplus; the state update of ``selective_state_update``; y = (state . C + D x) silu(z),
    stored in y's dtype."""
    _let_next_start(PDL)
    pid_d = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_d = pid_d * BD + tl.arange(0, BD)
    md = offs_d < dim
    offs_s = tl.arange(0, SP)[:, None]
    ms = offs_s < slices
    base = part_ptr + row * s_p_b + offs_s * s_p_s
    rr = tl.arange(0, RP)
    nn_ = tl.arange(0, NS)
    mn = nn_ < dstate
    m2 = md[:, None] & mn[None, :]
    wdt = tl.load(wdt_ptr + offs_d[:, None] * s_wdt_d + rr[None, :], mask=md[:, None] & (rr < rank)[None, :],
                  other=0.0).to(tl.float32)
    s_ptrs = state_ptr + row * ss_b + offs_d[:, None] * ss_d + nn_[None, :] * ss_n
    s = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + offs_d[:, None] * s_A_d + nn_[None, :] * s_A_n, mask=m2, other=0.0).to(tl.float32)
    _wait_for_previous(PDL)  # the partials, x and z come from the kernels before
    low = tl.sum(tl.load(base + rr[None, :], mask=ms & (rr < rank)[None, :], other=0.0), axis=0)
    low = low.to(x_ptr.dtype.element_ty).to(tl.float32)  # x_proj's output as the unfused step holds it
    Bv = tl.sum(tl.load(base + rank + nn_[None, :], mask=ms & mn[None, :], other=0.0), axis=0)
    Cv = tl.sum(tl.load(base + rank + dstate + nn_[None, :], mask=ms & mn[None, :], other=0.0), axis=0)
    Bv = Bv.to(x_ptr.dtype.element_ty).to(tl.float32)
    Cv = Cv.to(x_ptr.dtype.element_ty).to(tl.float32)
    if BCDT:  # the masked lanes are zeros: the sums of squares cover the pieces' own entries
        low = (low / tl.sqrt(tl.sum(low * low, axis=0) / rank + bcdt_eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        Bv = (Bv / tl.sqrt(tl.sum(Bv * Bv, axis=0) / dstate + bcdt_eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        Cv = (Cv / tl.sqrt(tl.sum(Cv * Cv, axis=0) / dstate + bcdt_eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    dt = tl.sum(wdt * low[None, :], axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)  # dt_proj's output
    if HAS_DTB:
        dt += tl.load(dtb_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    dt = softplus(dt)
    x = tl.load(x_ptr + row * s_x_b + offs_d, mask=md, other=0.0).to(tl.float32)
    s = tl.exp(dt[:, None] * A) * s + (dt * x)[:, None] * Bv[None, :]
    tl.debug_barrier()  # the old state read before it is overwritten
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m2)
    y = tl.sum(s * Cv[None, :], axis=1)
    if HAS_D:
        y += tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32) * x
    zv = tl.load(z_ptr + row * s_z_b + offs_d, mask=md, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y_b + offs_d, (y * zv * tl.sigmoid(zv)).to(y_ptr.dtype.element_ty), mask=md)
