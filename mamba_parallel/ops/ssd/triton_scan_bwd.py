"""SSD backward through the chunk outputs and chunk states: the gate, dx, dD and the B side of the dt gradient
(dB and dC are in triton_dbc).

Notation per chunk and head: a = dA_cs, dy = gradient of y before the gate, ds = gradient of the state after the
chunk, hin = state entering it. With G_s = e^{a_last-a_s} ds B_s + sum_{t>=s} (B_s.C_t) e^{a_t-a_s} dy_t (p,):
  dx_s = dt_s G_s + D dy_s,   d dt_s (direct part) = x_s . G_s,
  dC_t = e^{a_t} dy_t hin + sum_{s<=t} e^{a_t-a_s} dt_s (dy_t.x_s) B_s   (summed over the heads of a group),
  dB_s = e^{a_last-a_s} dt_s x_s ds + sum_{t>=s} e^{a_t-a_s} dt_s (x_s.dy_t) C_t.
The gradient of a_t is C_t.dC_t(head) - B_t.dB_t(head) (= C_t.dC_t - dt_t x_t.G_t), plus <ds, state after chunk>
at the last slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.ssd.triton_tuning import block_pow2, dot_precision, tuned


@triton.jit
def _dx_kernel(x_ptr, dy_ptr, B_ptr, cb_ptr, ds_ptr, dtp_ptr, acs_ptr, D_ptr, dx_ptr, ddir_ptr, dD_ptr,
               L, H, NC, P, N, HPG,
               sx_b, sx_l, sx_h, sx_p, sd_b, sd_l, sd_h, sd_p, sb_b, sb_l, sb_g, sb_n, so_b, so_l, so_h, so_p,
               CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr,
               D_HAS_P: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_h, pid_m, pid_bc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = pid_bc // NC
    c = pid_bc % NC
    g = pid_h // HPG
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    chunk_len = tl.minimum(CHUNK, L - c * CHUNK)
    mm = offs_m < chunk_len
    mp = offs_p < P
    mn = offs_n < N
    a_base = ((b * H + pid_h) * NC + c) * CHUNK
    in_chunk = offs_m < CHUNK
    a_m = tl.load(acs_ptr + a_base + offs_m, mask=in_chunk, other=0.0)
    a_last = tl.load(acs_ptr + a_base + CHUNK - 1)

    b_m = tl.load(B_ptr + b * sb_b + (c * CHUNK + offs_m[:, None]) * sb_l + g * sb_g + offs_n[None, :] * sb_n,
                  mask=mm[:, None] & mn[None, :], other=0.0)
    ds = tl.load(ds_ptr + ((b * NC + c) * H + pid_h) * P * N + offs_p[None, :] * N + offs_n[:, None],
                 mask=mn[:, None] & mp[None, :], other=0.0)
    acc = tl.dot(b_m, ds.to(b_m.dtype), input_precision=PREC) * tl.exp(a_last - a_m)[:, None]

    # C_t . B_s comes from the (chunk x chunk) fp32 CB of the group that the dB/dC pass stored (its lower block
    # triangle): shared by every head, so it is read from cache instead of recomputed per head
    cb_base = cb_ptr + ((b * NC + c) * (H // HPG) + g) * CHUNK * CHUNK
    dy_base = dy_ptr + b * sd_b + c * CHUNK * sd_l + pid_h * sd_h
    for k0 in range(pid_m * BLOCK_M, chunk_len, BLOCK_K):
        kk = k0 + offs_k
        mk = kk < chunk_len
        keep = (kk[None, :] >= offs_m[:, None]) & mk[None, :] & mm[:, None]
        bc = tl.load(cb_base + kk[None, :] * CHUNK + offs_m[:, None], mask=keep, other=0.0)
        a_k = tl.load(acs_ptr + a_base + kk, mask=mk, other=0.0)
        bc *= tl.exp(tl.where(keep, a_k[None, :] - a_m[:, None], float("-inf")))
        dy_k = tl.load(dy_base + kk[:, None] * sd_l + offs_p[None, :] * sd_p, mask=mk[:, None] & mp[None, :],
                       other=0.0)
        acc += tl.dot(bc.to(dy_k.dtype), dy_k, input_precision=PREC)

    tile = mm[:, None] & mp[None, :]
    x_m = tl.load(x_ptr + b * sx_b + (c * CHUNK + offs_m[:, None]) * sx_l + pid_h * sx_h + offs_p[None, :] * sx_p,
                  mask=tile, other=0.0).to(tl.float32)
    dt_m = tl.load(dtp_ptr + a_base + offs_m, mask=in_chunk, other=0.0)
    dx = acc * dt_m[:, None]
    if HAS_D:
        dy_m = tl.load(dy_base + offs_m[:, None] * sd_l + offs_p[None, :] * sd_p, mask=tile, other=0.0).to(tl.float32)
        if D_HAS_P:
            d = tl.load(D_ptr + pid_h * P + offs_p, mask=mp, other=0.0).to(tl.float32)[None, :]
        else:
            d = tl.load(D_ptr + pid_h).to(tl.float32)
        dx += d * dy_m
        # every autotune candidate has the same BLOCK_M, so all write the same slots of the partial buffer
        n_mb = tl.cdiv(CHUNK, BLOCK_M)
        tl.store(dD_ptr + ((pid_bc * n_mb + pid_m) * H + pid_h) * P + offs_p, tl.sum(dy_m * x_m, axis=0), mask=mp)

    # dx may be a strided slice of a wider gradient buffer (ops/grad_arena.py): its own strides so_*
    tl.store(dx_ptr + b.to(tl.int64) * so_b + (c * CHUNK + offs_m[:, None]) * so_l + pid_h * so_h
             + offs_p[None, :] * so_p, dx.to(dx_ptr.dtype.element_ty), mask=tile)
    tl.store(ddir_ptr + a_base + offs_m, tl.sum(acc * x_m, axis=1), mask=in_chunk)


@triton.jit
def _gate_bwd_kernel(dy_ptr, z_ptr, ypre_ptr, dyp_ptr, dz_ptr, numel, L, H, P, sz_b, sz_l, sz_h, sz_p,
                     BLOCK: tl.constexpr, DZ_CONTIGUOUS: tl.constexpr):
    """y = ypre * silu(z): dypre = dy * silu(z), dz = dy * ypre * sigmoid(z) * (1 + z * (1 - sigmoid(z))).
    dy, z, ypre, dypre contiguous (b, L, h, p); dz contiguous or strided (sz_*: a slice of a gradient arena)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32)
    yp = tl.load(ypre_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sg = tl.sigmoid(z)
    tl.store(dyp_ptr + offs, (dy * z * sg).to(dyp_ptr.dtype.element_ty), mask=m)
    if DZ_CONTIGUOUS:
        dz_offs = offs
    else:
        dz_offs = ((offs // (P * H * L)) * sz_b + (offs // (P * H) % L) * sz_l + (offs // P % H) * sz_h
                   + (offs % P) * sz_p)
    tl.store(dz_ptr + dz_offs, (dy * yp * sg * (1.0 + z * (1.0 - sg))).to(dz_ptr.dtype.element_ty), mask=m)


def gate_bwd(dy, z, ypre, dz=None):
    """dy, z, ypre (b, L, h, p) -> (d ypre contiguous in dy.dtype, dz in z.dtype). dz: where to write dz (any
    strides, z's shape and dtype), else a fresh contiguous tensor."""
    dy, z, ypre = dy.contiguous(), z.contiguous(), ypre.contiguous()
    dyp = torch.empty_like(dy)
    if dz is None:
        dz = torch.empty_like(z)
    block = 1024
    _gate_bwd_kernel[(triton.cdiv(dy.numel(), block),)](dy, z, ypre, dyp, dz, dy.numel(), *z.shape[1:],
                                                        *dz.stride(), BLOCK=block,
                                                        DZ_CONTIGUOUS=dz.is_contiguous(), num_warps=4)
    return dyp, dz


def dx_bwd(x, dy, B, cb, ds, dtp, acs, D, hpg, dx=None):
    """cb (b, nc, g, chunk, chunk) fp32 from ``dbc_bwd`` -> dx (b, L, h, p) in x.dtype,
    ddir (b, h, nc, chunk) fp32 = x_t . G_t, dD (D's shape, fp32) or None.
    dx: where to write dx (any strides, x's shape and dtype), else a fresh contiguous tensor."""
    b, L, H, P = x.shape
    N = B.shape[-1]
    nc, chunk = acs.shape[2], acs.shape[3]
    if dx is None:
        dx = torch.empty(b, L, H, P, device=x.device, dtype=x.dtype)
    ddir = torch.empty_like(acs)
    fn = tuned(_dx_kernel, "dx")
    n_mb = triton.cdiv(chunk, fn.configs[0].kwargs["BLOCK_M"])  # every candidate's row block: each slot written
    dD_part = torch.empty(b * nc, n_mb, H, P, device=x.device, dtype=torch.float32) if D is not None else None
    grid = lambda meta: (H, triton.cdiv(chunk, meta["BLOCK_M"]), b * nc)  # noqa: E731
    fn[grid](x, dy, B, cb, ds, dtp, acs, D if D is not None else x, dx, ddir, dD_part if D is not None else ddir,
             L, H, nc, P, N, hpg, *x.stride(), *dy.stride(), *B.stride(), *dx.stride(),
             CHUNK=chunk, BLOCK_P=block_pow2(P), BLOCK_N=block_pow2(N), HAS_D=D is not None,
             D_HAS_P=D is not None and D.dim() == 2, PREC=dot_precision(x.dtype))
    dD = None
    if D is not None:
        dD = dD_part.sum((0, 1))
        if D.dim() == 1:
            dD = dD.sum(-1)
    return dx, ddir, dD
