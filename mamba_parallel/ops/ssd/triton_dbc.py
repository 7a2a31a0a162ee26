"""SSD backward for B and C (shared by the h/g heads of a group), and the y side of the dA_cs gradient.

Per chunk, with a = dA_cs of a head:
  dC_t = sum_h e^{a_t} dy_t hin_h + sum_{s<=t} M_ts B_s,
  dB_s = sum_h e^{a_last-a_s} dt_s x_s ds_h + sum_{t>=s} M_ts C_t,
  M_ts = sum_h e^{a_t-a_s} dt_s (dy_t . x_s)   (s <= t; one (chunk x chunk) matrix per group, summed over heads).
Summing the heads into M first leaves one (chunk x chunk) @ (chunk x n) product per group instead of one per head.
The dA_cs gradient is C_t . dC_t - B_t . dB_t per head (plus a last-slot term from the state pass). Its
within-chunk part is rowsum(W_h o CB) - colsum(W_h o CB) (W_h = head h's term of M, CB = C B^T once per tile):
both sides from the same fp32 products, so pairs that cancel in exact arithmetic cancel here too (dA sums many
such nearly cancelling terms; rounding them differently on the two sides would show in dA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.ssd.triton_tuning import block_pow2, dot_precision, tuned


@triton.jit
def _batch_chunk_group_split(pid_bc, pid_gs, NC, HPG, HS):
    """Program ids -> (batch row, chunk, group, head split): axis 2 runs over b * nc, axis 1 over g * splits."""
    nsplit = tl.cdiv(HPG, HS)
    return pid_bc // NC, pid_bc % NC, pid_gs // nsplit, pid_gs % nsplit


@triton.jit
def _intra_kernel(dy_ptr, x_ptr, B_ptr, C_ptr, dtp_ptr, acs_ptr, m_ptr, dar_ptr, dac_ptr, cb_ptr,
                  BATCH, L, H, NC, P, N, HPG, HS,
                  sd_b, sd_l, sd_h, sd_p, sx_b, sx_l, sx_h, sx_p, sb_b, sb_l, sb_g, sb_n, sc_b, sc_l, sc_g, sc_n,
                  CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """One (rows t, columns s) tile of M for HS heads of a group (stored in M's dtype), and each head's rowsum /
    colsum of W_h o CB (partials per tile column / row block, written only for tiles on or below the diagonal:
    their reader masks the rest). Tiles above the diagonal store zeros in M (the matmuls read the whole square).
    The first head split also stores the CB tile (fp32) for the dx kernel."""
    pid_mk, pid_gs, pid_bc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    nkb = tl.cdiv(CHUNK, BLOCK_M)
    pid_m = pid_mk // nkb
    pid_k = pid_mk % nkb
    b, c, g, split = _batch_chunk_group_split(pid_bc, pid_gs, NC, HPG, HS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_M + tl.arange(0, BLOCK_M)
    tile = ((b * NC + c) * (H // HPG) + g) * CHUNK * CHUNK + offs_m[:, None] * CHUNK + offs_k[None, :]
    in_tile = (offs_m < CHUNK)[:, None] & (offs_k < CHUNK)[None, :]
    m_split = m_ptr + split * BATCH * NC * (H // HPG) * CHUNK * CHUNK
    if pid_k > pid_m:
        tl.store(m_split + tile, tl.zeros((BLOCK_M, BLOCK_M), dtype=m_ptr.dtype.element_ty), mask=in_tile)
    else:
        offs_p = tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        chunk_len = tl.minimum(CHUNK, L - c * CHUNK)
        mm = offs_m < chunk_len
        mk = offs_k < chunk_len
        mp = offs_p < P
        mn = offs_n < N
        c_m = tl.load(C_ptr + b * sc_b + (c * CHUNK + offs_m[:, None]) * sc_l + g * sc_g + offs_n[None, :] * sc_n,
                      mask=mm[:, None] & mn[None, :], other=0.0)
        b_k = tl.load(B_ptr + b * sb_b + (c * CHUNK + offs_k[None, :]) * sb_l + g * sb_g + offs_n[:, None] * sb_n,
                      mask=mn[:, None] & mk[None, :], other=0.0)
        cb = tl.dot(c_m, b_k, input_precision=PREC)
        if split == 0:
            tl.store(cb_ptr + tile, cb, mask=in_tile)
        # rows past the chunk end (BLOCK_M > chunk) load a_m = 0: keep them out of the exponent (exp(+big) * 0)
        causal = (offs_m[:, None] >= offs_k[None, :]) & mk[None, :] & mm[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        h0 = g * HPG + split * HS
        for hh in range(0, tl.minimum(HS, HPG - split * HS)):
            h = h0 + hh
            a_base = ((b * H + h) * NC + c) * CHUNK
            a_m = tl.load(acs_ptr + a_base + offs_m, mask=offs_m < CHUNK, other=0.0)
            a_k = tl.load(acs_ptr + a_base + offs_k, mask=offs_k < CHUNK, other=0.0)
            dt_k = tl.load(dtp_ptr + a_base + offs_k, mask=offs_k < CHUNK, other=0.0)
            dy_m = tl.load(dy_ptr + b * sd_b + (c * CHUNK + offs_m[:, None]) * sd_l + h * sd_h + offs_p[None, :] * sd_p,
                           mask=mm[:, None] & mp[None, :], other=0.0)
            x_k = tl.load(x_ptr + b * sx_b + (c * CHUNK + offs_k[None, :]) * sx_l + h * sx_h + offs_p[:, None] * sx_p,
                          mask=mp[:, None] & mk[None, :], other=0.0)
            w = tl.dot(dy_m, x_k, input_precision=PREC)
            w *= tl.exp(tl.where(causal, a_m[:, None] - a_k[None, :], float("-inf"))) * dt_k[None, :]
            acc += w
            wcb = w * cb
            tl.store(dar_ptr + (a_base * nkb + pid_k * CHUNK) + offs_m, tl.sum(wcb, axis=1), mask=offs_m < CHUNK)
            tl.store(dac_ptr + (a_base * nkb + pid_m * CHUNK) + offs_k, tl.sum(wcb, axis=0), mask=offs_k < CHUNK)
        tl.store(m_split + tile, acc.to(m_ptr.dtype.element_ty), mask=in_tile)


@triton.jit
def _carried_kernel(u_ptr, sm_ptr, self_ptr, dtp_ptr, acs_ptr, out_ptr, da_ptr, dac_in_ptr, dar_ptr, dacol_ptr,
                    BATCH, L, H, NC, P, N, HPG, HS,
                    su_b, su_l, su_h, su_p, ss_b, ss_l, ss_g, ss_n,
                    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, REVERSE: tl.constexpr,
                    PREC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_M: tl.constexpr):
    """The state parts, summed over HS heads of a group into a (nsplit, b, L, g, n) fp32 partial, and each
    head's self_t . part_t:
    dC (REVERSE=False): u = dy, sm = hin, self = C, row weight e^{a_t}; da = C_t . (C part);
    dB (REVERSE=True):  u = x,  sm = ds,  self = B, row weight e^{a_last-a_s} dt_s; da = the whole dA_cs gradient
    but for the state pass's last-slot term: dac_in (the C launch's) - B_t . (B part) + the intra kernel's row
    partials (blocks k <= t's, dar) - its column partials (blocks m >= t's, dacol), BLOCK_I its tile."""
    pid_m, pid_gs, pid_bc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, c, g, split = _batch_chunk_group_split(pid_bc, pid_gs, NC, HPG, HS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    chunk_len = tl.minimum(CHUNK, L - c * CHUNK)
    mm = offs_m < chunk_len
    mp = offs_p < P
    mn = offs_n < N
    in_chunk = offs_m < CHUNK
    self_m = tl.load(self_ptr + b * ss_b + (c * CHUNK + offs_m[:, None]) * ss_l + g * ss_g
                     + offs_n[None, :] * ss_n, mask=mm[:, None] & mn[None, :], other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h0 = g * HPG + split * HS
    for hh in range(0, tl.minimum(HS, HPG - split * HS)):
        h = h0 + hh
        a_base = ((b * H + h) * NC + c) * CHUNK
        a_m = tl.load(acs_ptr + a_base + offs_m, mask=in_chunk, other=0.0)
        u_m = tl.load(u_ptr + b * su_b + (c * CHUNK + offs_m[:, None]) * su_l + h * su_h + offs_p[None, :] * su_p,
                      mask=mm[:, None] & mp[None, :], other=0.0)
        sm = tl.load(sm_ptr + ((b * NC + c) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
                     mask=mp[:, None] & mn[None, :], other=0.0)
        if REVERSE:
            dt_m = tl.load(dtp_ptr + a_base + offs_m, mask=in_chunk, other=0.0)
            row = tl.exp(tl.load(acs_ptr + a_base + CHUNK - 1) - a_m) * dt_m
        else:
            row = tl.exp(a_m)
        # the row weight is applied in fp32 after the product (rounding u * row would show in dA)
        part = tl.dot(u_m, sm.to(u_m.dtype), input_precision=PREC) * row[:, None]
        da = tl.sum(part * self_m, axis=1)
        if REVERSE:
            blk = offs_m // BLOCK_I
            rows = tl.zeros((BLOCK_M,), dtype=tl.float32)
            cols = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k in range(0, tl.cdiv(CHUNK, BLOCK_I)):
                at = a_base * tl.cdiv(CHUNK, BLOCK_I) + k * CHUNK + offs_m
                rows += tl.load(dar_ptr + at, mask=in_chunk & (blk >= k), other=0.0)
                cols += tl.load(dacol_ptr + at, mask=in_chunk & (blk <= k), other=0.0)
            # the row and column sums nearly cancel: their difference first, as exact as their own sums allow
            da = (tl.load(dac_in_ptr + a_base + offs_m, mask=in_chunk, other=0.0) - da) + (rows - cols)
        tl.store(da_ptr + a_base + offs_m, da, mask=in_chunk)
        acc += part
    row_off = ((split * BATCH + b) * L + c * CHUNK + offs_m[:, None]) * (H // HPG) + g
    tl.store(out_ptr + row_off * N + offs_n[None, :], acc, mask=mm[:, None] & mn[None, :])


def _head_split(programs: int, hpg: int) -> int:
    """Heads per program: split a group's heads until there are enough programs to fill the GPU."""
    nsplit = 1
    while nsplit < hpg and programs * nsplit < 1024:
        nsplit *= 2
    return triton.cdiv(hpg, min(nsplit, hpg))


def _chunked(t, nc, chunk):
    """(b, L, g, n) -> (b, nc, g, chunk, n), zero-padded to nc * chunk tokens (a view when L is nc * chunk)."""
    b, L, G, N = t.shape
    if L == nc * chunk:
        return t.view(b, nc, chunk, G, N).transpose(2, 3)
    out = t.new_zeros(b, nc * chunk, G, N)
    out[:, :L] = t
    return out.view(b, nc, chunk, G, N).transpose(2, 3)


def dbc_bwd(x, dy, B, C, hin, ds, dtp, acs, hpg, dB_out=None, dC_out=None):
    """x, dy (b, L, h, p); B, C (b, L, g, n); hin, ds (b, nc, h, p, n); dtp, acs (b, h, nc, chunk)
    -> dB, dC (b, L, g, n) in B.dtype / C.dtype, da (b, h, nc, chunk) fp32 = C_t . dC_t - B_t . dB_t of each
    head (the dA_cs gradient but for the state pass's last-slot term), cb (b, nc, g, chunk, chunk) fp32 = C_t . B_s
    (lower block triangle only). dB_out / dC_out: where to write dB / dC (any strides, B's / C's shape and
    dtype), else fresh tensors."""
    b, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    nc, chunk = acs.shape[2], acs.shape[3]
    dev = x.device
    prec = dot_precision(x.dtype)
    bp, bn = block_pow2(P), block_pow2(N)

    # within-chunk part: M per group (summed over heads) and each head's share of da
    intra = tuned(_intra_kernel, "dbc_intra")
    bm = intra.configs[0].kwargs["BLOCK_M"]  # every candidate shares it: the partial buffers are laid out by it
    nkb = triton.cdiv(chunk, bm)
    hs = _head_split(b * nc * G * nkb * (nkb + 1) // 2, hpg)
    nsplit = triton.cdiv(hpg, hs)
    mm_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32  # fp16 could overflow in M
    # one head split stores M in the matmuls' dtype; several store fp32 partials that are summed first
    m_part = torch.empty(nsplit, b, nc, G, chunk, chunk, device=dev,
                         dtype=mm_dtype if nsplit == 1 else torch.float32)
    da_rows = torch.empty(b, H, nc, nkb, chunk, device=dev, dtype=torch.float32)  # written where read
    da_cols = torch.empty_like(da_rows)
    cb = torch.empty(b, nc, G, chunk, chunk, device=dev, dtype=torch.float32)
    intra[(nkb * nkb, G * nsplit, b * nc)](
        dy, x, B, C, dtp, acs, m_part, da_rows, da_cols, cb, b, L, H, nc, P, N, hpg, hs,
        *dy.stride(), *x.stride(), *B.stride(), *C.stride(), CHUNK=chunk, BLOCK_P=bp, BLOCK_N=bn, PREC=prec)
    M = m_part.sum(0).to(mm_dtype) if nsplit > 1 else m_part[0]  # (b, nc, g, chunk, chunk), rows t, columns s
    dC_in = torch.matmul(M, _chunked(B, nc, chunk).to(mm_dtype))
    dB_in = torch.matmul(M.transpose(-1, -2), _chunked(C, nc, chunk).to(mm_dtype))

    # carried-in / carried-out state part, summed over heads
    carried = tuned(_carried_kernel, "dbc_state")
    hs2 = _head_split(b * nc * G * triton.cdiv(chunk, 64), hpg)
    nsplit2 = triton.cdiv(hpg, hs2)
    grads = []
    da_c, da = torch.empty_like(acs), torch.empty_like(acs)
    for reverse, u, sm, me, intra_part, out in ((False, dy, hin, C, dC_in, dC_out), (True, x, ds, B, dB_in, dB_out)):
        part = torch.empty(nsplit2, b, L, G, N, device=dev, dtype=torch.float32)
        grid = lambda meta: (triton.cdiv(chunk, meta["BLOCK_M"]), G * nsplit2, b * nc)  # noqa: E731
        carried[grid](u, sm, me, dtp, acs, part, da if reverse else da_c, da_c, da_rows, da_cols,
                      b, L, H, nc, P, N, hpg, hs2, *u.stride(), *me.stride(),
                      CHUNK=chunk, BLOCK_P=bp, BLOCK_N=bn, REVERSE=reverse, PREC=prec, BLOCK_I=bm)
        total = part.sum(0) if nsplit2 > 1 else part[0]
        intra_part = intra_part.transpose(2, 3).reshape(b, nc * chunk, G, N)[:, :L]
        if out is not None:  # one pass: sum, cast to the input dtype and store into the caller's (strided) buffer
            grads.append(torch.add(total, intra_part, out=out))
        else:
            total += intra_part
            grads.append(total.to(me.dtype))
    dC, dB = grads
    return dB, dC, da, cb
