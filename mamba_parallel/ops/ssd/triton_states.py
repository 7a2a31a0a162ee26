"""SSD stages 2-3: the state each chunk produces on its own and the sequential pass that chains them, as one sweep
over the chunks per (p, n) tile with the running state in registers; the backward's state gradients likewise.
Per-chunk states never go through memory: only the state entering each chunk (hin) and its gradient (ds) do, in
the inputs' dtype.

States are (b, nchunks, h, p, n). ``seg`` (b, nchunks, 2) int32, when given, describes packed / seq_idx layouts
where one batch row holds several independent segments, each starting at a chunk boundary:
``seg[..., 0]`` = -2 (the chunk continues its segment), -1 (a segment starts from zero) or k (a segment starts
from initial state k); ``seg[..., 1]`` = -2 (not a segment's last chunk), -1 (last chunk, state dropped) or k
(last chunk, its state is final state k). Without ``seg``, row i is one segment using initial / final state i.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.ssd.triton_tuning import dot_precision, tuned


@triton.jit
def _seg_codes(seg_ptr, pid_b, c, NC, HAS_SEG: tl.constexpr):
    if HAS_SEG:
        icode = tl.load(seg_ptr + (pid_b * NC + c) * 2)
        fcode = tl.load(seg_ptr + (pid_b * NC + c) * 2 + 1)
    else:
        icode = tl.where(c == 0, pid_b, -2)
        fcode = tl.where(c == NC - 1, pid_b, -2)
    return icode, fcode


@triton.jit
def _enter_chunk(h, icode, init_ptr, pid_h, H, PN, offs, mask, HAS_INIT: tl.constexpr):
    """The running state h (offs: its flat offsets in a state, mask: which exist) as it enters a chunk: kept
    within a segment, initial state ``icode`` (or zeros, icode -1 or no initial states) where one starts."""
    if HAS_INIT:
        start_val = tl.load(init_ptr + (tl.maximum(icode, 0) * H + pid_h) * PN + offs,
                            mask=mask & (offs * 0 + icode >= 0), other=0.0).to(tl.float32)
    else:
        start_val = tl.zeros_like(h)
    return tl.where(icode > -2, start_val, h)


@triton.jit
def _pn_tile(pid_pn, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program id -> this program's (p, n) tile of a state: row / column offsets and masks, flat offsets, mask."""
    npn = tl.cdiv(N, BLOCK_N)
    offs_p = (pid_pn // npn) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (pid_pn % npn) * BLOCK_N + tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    return offs_p, offs_n, mp, mn, offs_p[:, None] * N + offs_n[None, :], mp[:, None] & mn[None, :]


@triton.jit
def _chunk_state_pass_fwd_kernel(x_ptr, B_ptr, dtp_ptr, acs_ptr, init_ptr, seg_ptr, hin_ptr, final_ptr,
                                 L, H, NC, P, N, HPG,
                                 sx_b, sx_l, sx_h, sx_p, sb_b, sb_l, sb_g, sb_n,
                                 CHUNK: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEG: tl.constexpr,
                                 PREC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr):
    """The chunk states and the pass that chains them, in one sweep over the chunks of a (p, n) tile: the state
    entering chunk c is stored (hin), then the chunk's own sum_t exp(dA_cs[last] - dA_cs[t]) dt_t x_t^T B_t is
    accumulated into the decayed state in registers. No per-chunk state goes through memory."""
    pid_pn, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = pid_h // HPG
    offs_p, offs_n, mp, mn, tile, mt = _pn_tile(pid_pn, P, N, BLOCK_P, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    zero = tile * 0  # vector-shaped scalars in masks: the interpreter mistypes vector & scalar
    PN = P * N
    h = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for c in range(NC):
        icode, fcode = _seg_codes(seg_ptr, pid_b, c, NC, HAS_SEG)
        h = _enter_chunk(h, icode, init_ptr, pid_h, H, PN, tile, mt, HAS_INIT)
        tl.store(hin_ptr + ((pid_b * NC + c) * H + pid_h) * PN + tile, h.to(hin_ptr.dtype.element_ty), mask=mt)
        chunk_len = tl.minimum(CHUNK, L - c * CHUNK)
        a_base = ((pid_b * H + pid_h) * NC + c) * CHUNK
        a_last = tl.load(acs_ptr + a_base + CHUNK - 1)
        h = h * tl.exp(a_last)
        x_base = x_ptr + pid_b * sx_b + c * CHUNK * sx_l + pid_h * sx_h
        b_base = B_ptr + pid_b * sb_b + c * CHUNK * sb_l + g * sb_g
        for k0 in range(0, chunk_len, BLOCK_K):
            kk = k0 + offs_k
            mk = kk < chunk_len
            u = tl.load(x_base + kk[None, :] * sx_l + offs_p[:, None] * sx_p, mask=mp[:, None] & mk[None, :],
                        other=0.0)
            v = tl.load(b_base + kk[:, None] * sb_l + offs_n[None, :] * sb_n, mask=mk[:, None] & mn[None, :],
                        other=0.0)
            w = tl.exp(a_last - tl.load(acs_ptr + a_base + kk, mask=mk, other=0.0)) * \
                tl.load(dtp_ptr + a_base + kk, mask=mk, other=0.0)
            h = tl.dot(u, (v.to(tl.float32) * w[:, None]).to(u.dtype), acc=h, input_precision=PREC)
        tl.store(final_ptr + (tl.maximum(fcode, 0) * H + pid_h) * PN + tile, h.to(final_ptr.dtype.element_ty),
                 mask=mt & (zero + fcode >= 0))


@triton.jit
def _state_grad_pass_kernel(dy_ptr, C_ptr, acs_ptr, hin_ptr, final_ptr, dfinal_ptr, seg_ptr, ds_ptr, dinit_ptr,
                            dlast_part_ptr, L, H, NC, P, N, HPG, NBLK,
                            sy_b, sy_l, sy_h, sy_p, sc_b, sc_l, sc_g, sc_n,
                            CHUNK: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr,
                            HAS_SEG: tl.constexpr, PREC: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The reverse state pass with each chunk's gradient through y (sum_t exp(dA_cs[t]) dy_t^T C_t) accumulated in
    registers: ds[c] = gradient of the state after chunk c, dlast_part = this tile's share of <ds[c], state after
    c> (the gradient of dA_cs[c, last]), dinit = gradient of the initial states."""
    pid_pn, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = pid_h // HPG
    offs_p, offs_n, mp, mn, tile, mt = _pn_tile(pid_pn, P, N, BLOCK_P, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    zero = tile * 0
    PN = P * N
    dh = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for i in range(NC):
        c = NC - 1 - i
        icode, fcode = _seg_codes(seg_ptr, pid_b, c, NC, HAS_SEG)
        fin = (tl.maximum(fcode, 0) * H + pid_h) * PN + tile
        if HAS_DFINAL:
            end_val = tl.load(dfinal_ptr + fin, mask=mt & (zero + fcode >= 0), other=0.0).to(tl.float32)
        else:
            end_val = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        is_end = fcode > -2
        dh = tl.where(is_end, end_val, dh)
        idx = ((pid_b * NC + c) * H + pid_h) * PN + tile
        h_next = tl.load(hin_ptr + idx + H * PN, mask=mt & (zero + fcode == -2), other=0.0).to(tl.float32)
        h_fin = tl.load(final_ptr + fin, mask=mt & (zero + fcode >= 0), other=0.0)
        h_out = tl.where(is_end, h_fin, h_next)
        a_base = ((pid_b * H + pid_h) * NC + c) * CHUNK
        tl.store(dlast_part_ptr + a_base // CHUNK * NBLK + pid_pn, tl.sum(tl.sum(dh * h_out, axis=1), axis=0))
        tl.store(ds_ptr + idx, dh.to(ds_ptr.dtype.element_ty), mask=mt)
        dh = dh * tl.exp(tl.load(acs_ptr + a_base + CHUNK - 1))
        chunk_len = tl.minimum(CHUNK, L - c * CHUNK)
        y_base = dy_ptr + pid_b * sy_b + c * CHUNK * sy_l + pid_h * sy_h
        c_base = C_ptr + pid_b * sc_b + c * CHUNK * sc_l + g * sc_g
        for k0 in range(0, chunk_len, BLOCK_K):
            kk = k0 + offs_k
            mk = kk < chunk_len
            u = tl.load(y_base + kk[None, :] * sy_l + offs_p[:, None] * sy_p, mask=mp[:, None] & mk[None, :],
                        other=0.0)
            v = tl.load(c_base + kk[:, None] * sc_l + offs_n[None, :] * sc_n, mask=mk[:, None] & mn[None, :],
                        other=0.0)
            w = tl.exp(tl.load(acs_ptr + a_base + kk, mask=mk, other=0.0))
            dh = tl.dot(u, (v.to(tl.float32) * w[:, None]).to(u.dtype), acc=dh, input_precision=PREC)
        if HAS_DINIT:
            tl.store(dinit_ptr + (tl.maximum(icode, 0) * H + pid_h) * PN + tile, dh,
                     mask=mt & (zero + icode >= 0))


def final_states_buffer(final_out, nstates, H, P, N, nc, device):
    """Where a forward state pass writes the final states: ``final_out`` (nstates, h, p, n) contiguous, any float
    dtype (rounded on store), e.g. an inference cache, which may also hold the initial states (each program reads
    its tile of an initial state before it writes that tile of the final one); else new fp32 zeros. Every final
    state is written by the pass, except with no chunk at all (zeros, as the new buffer holds) and the empty
    cu_seqlens sequences the caller fills."""
    if final_out is None:
        return torch.zeros(nstates, H, P, N, device=device, dtype=torch.float32)
    return final_out.zero_() if nc == 0 else final_out


def chunk_state_pass(x, B, dtp, acs, init, seg, nstates, state_dtype, hpg, final_out=None):
    """x (b, L, h, p), B (b, L, g, n), dtp / acs (b, h, nc, chunk) fp32 -> (hin (b, nc, h, p, n) state_dtype: the
    state entering each chunk, final (nstates, h, p, n) fp32, or ``final_out`` written in place
    (``final_states_buffer``))."""
    b, L, H, P = x.shape
    N = B.shape[-1]
    nc, chunk = acs.shape[2], acs.shape[3]
    hin = torch.empty(b, nc, H, P, N, device=x.device, dtype=state_dtype)
    final = final_states_buffer(final_out, nstates, H, P, N, nc, x.device)
    fn = tuned(_chunk_state_pass_fwd_kernel, "state_fwd", x.dtype)
    grid = lambda meta: (triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(N, meta["BLOCK_N"]), b, H)  # noqa: E731
    fn[grid](x, B, dtp, acs, init if init is not None else hin, seg if seg is not None else acs, hin, final,
             L, H, nc, P, N, hpg, *x.stride(), *B.stride(),
             CHUNK=chunk, HAS_INIT=init is not None, HAS_SEG=seg is not None, PREC=dot_precision(x.dtype))
    return hin, final


def state_grad_pass(dy, C, acs, hin, final, dfinal, seg, want_dinit, hpg):
    """dy (b, L, h, p), C (b, L, g, n), acs (b, h, nc, chunk), hin (b, nc, h, p, n), final / dfinal (nstates, h, p,
    n) fp32 or dfinal None -> (ds (b, nc, h, p, n) in dy.dtype: the gradient of the state after each chunk, dinit like
    final or None, dlast (b, h, nc) fp32: the gradient of each chunk's last dA_cs through the states)."""
    b, L, H, P = dy.shape
    N = C.shape[-1]
    nc, chunk = acs.shape[2], acs.shape[3]
    # ds in the dots' operand dtype: its readers (dbc_bwd, dx_bwd) round it to that dtype anyway
    ds = torch.empty(b, nc, H, P, N, device=dy.device, dtype=dy.dtype)
    dinit = torch.zeros_like(final) if want_dinit else None
    fn = tuned(_state_grad_pass_kernel, "state_bwd", dy.dtype)
    tile = fn.configs[0].kwargs  # every candidate shares it: the partial buffer is laid out by it
    nblk = triton.cdiv(P, tile["BLOCK_P"]) * triton.cdiv(N, tile["BLOCK_N"])
    dlast_part = torch.empty(b, H, nc, nblk, device=dy.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(N, meta["BLOCK_N"]), b, H)  # noqa: E731
    fn[grid](dy, C, acs, hin, final, dfinal if dfinal is not None else final, seg if seg is not None else acs, ds,
             dinit if dinit is not None else ds, dlast_part, L, H, nc, P, N, hpg, nblk, *dy.stride(), *C.stride(),
             CHUNK=chunk, HAS_DFINAL=dfinal is not None, HAS_DINIT=want_dinit, HAS_SEG=seg is not None,
             PREC=dot_precision(dy.dtype))
    return ds, dinit, dlast_part.sum(-1)
