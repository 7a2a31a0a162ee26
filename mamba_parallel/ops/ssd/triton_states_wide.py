"""SSD forward states for few (batch row, head) pairs: every chunk's own state in parallel, then a light pass that
chains them. The one-sweep kernel of triton_states runs one program per (p, n) tile of a (row, head), each walking
all chunks in turn; with fewer (row, head) pairs than SMs and many chunks (one long sequence) that walk is the
critical path. Here the heavy part (one matmul per chunk) spreads over rows x chunks x heads programs, at the price
of the per-chunk states' round trip through memory (fp32, written once and read once).

Same inputs and outputs as ``triton_states.chunk_state_pass``; ``seg`` as described there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.ssd.triton_states import _enter_chunk, _pn_tile, _seg_codes, final_states_buffer
from mamba_parallel.ops.ssd.triton_tuning import dot_precision, tuned


@triton.jit
def _chunk_states_kernel(x_ptr, B_ptr, dtp_ptr, acs_ptr, out_ptr, L, H, NC, P, N, HPG,
                         sx_b, sx_l, sx_h, sx_p, sb_b, sb_l, sb_g, sb_n,
                         CHUNK: tl.constexpr, PREC: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[b, c, h] = sum_t exp(dA_cs[last] - dA_cs[t]) dt_t x_t^T B_t over chunk c (p, n), fp32."""
    pid_h, pid_pn, pid_bc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_b = pid_bc // NC
    c = pid_bc % NC
    g = pid_h // HPG
    offs_p, offs_n, mp, mn, tile, mt = _pn_tile(pid_pn, P, N, BLOCK_P, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    chunk_len = tl.minimum(CHUNK, L - c * CHUNK)
    a_base = ((pid_b * H + pid_h) * NC + c) * CHUNK
    x_base = x_ptr + pid_b * sx_b + c * CHUNK * sx_l + pid_h * sx_h
    b_base = B_ptr + pid_b * sb_b + c * CHUNK * sb_l + g * sb_g
    a_last = tl.load(acs_ptr + a_base + CHUNK - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, chunk_len, BLOCK_K):
        kk = k0 + offs_k
        mk = kk < chunk_len
        u = tl.load(x_base + kk[None, :] * sx_l + offs_p[:, None] * sx_p, mask=mp[:, None] & mk[None, :], other=0.0)
        v = tl.load(b_base + kk[:, None] * sb_l + offs_n[None, :] * sb_n, mask=mk[:, None] & mn[None, :], other=0.0)
        w = tl.exp(a_last - tl.load(acs_ptr + a_base + kk, mask=mk, other=0.0)) * \
            tl.load(dtp_ptr + a_base + kk, mask=mk, other=0.0)
        acc = tl.dot(u, (v.to(tl.float32) * w[:, None]).to(u.dtype), acc=acc, input_precision=PREC)
    tl.store(out_ptr + ((pid_b * NC + c) * H + pid_h) * P * N + tile, acc, mask=mt)


@triton.jit
def _chain_kernel(s_ptr, acs_ptr, init_ptr, seg_ptr, hin_ptr, final_ptr, H, NC, PN,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEG: tl.constexpr):
    """hin[c] = the state entering chunk c; the state after chunk c = exp(dA_cs[c, last]) hin[c] + s[c]."""
    pid_blk, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = pid_blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < PN
    zero = offs * 0  # vector-shaped scalars in masks: the interpreter mistypes vector & scalar
    h = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(NC):
        icode, fcode = _seg_codes(seg_ptr, pid_b, c, NC, HAS_SEG)
        h = _enter_chunk(h, icode, init_ptr, pid_h, H, PN, offs, m, HAS_INIT)
        idx = ((pid_b * NC + c) * H + pid_h) * PN + offs
        tl.store(hin_ptr + idx, h.to(hin_ptr.dtype.element_ty), mask=m)
        a_last = tl.load(acs_ptr + ((pid_b * H + pid_h) * NC + c) * CHUNK + CHUNK - 1)
        h = tl.exp(a_last) * h + tl.load(s_ptr + idx, mask=m, other=0.0)
        tl.store(final_ptr + (tl.maximum(fcode, 0) * H + pid_h) * PN + offs, h.to(final_ptr.dtype.element_ty),
                 mask=m & (zero + fcode >= 0))


_CHAIN_BLOCK = 512


def chunk_states_then_chain(x, B, dtp, acs, init, seg, nstates, state_dtype, hpg, final_out=None):
    """x (b, L, h, p), B (b, L, g, n), dtp / acs (b, h, nc, chunk) fp32 -> (hin (b, nc, h, p, n) state_dtype,
    final (nstates, h, p, n) fp32 or ``final_out``), as ``triton_states.chunk_state_pass``."""
    b, L, H, P = x.shape
    N = B.shape[-1]
    nc, chunk = acs.shape[2], acs.shape[3]
    states = torch.empty(b, nc, H, P, N, device=x.device, dtype=torch.float32)
    fn = tuned(_chunk_states_kernel, "chunk_states", x.dtype)
    grid = lambda meta: (H, triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(N, meta["BLOCK_N"]), b * nc)  # noqa: E731
    fn[grid](x, B, dtp, acs, states, L, H, nc, P, N, hpg, *x.stride(), *B.stride(),
             CHUNK=chunk, PREC=dot_precision(x.dtype))
    hin = torch.empty(b, nc, H, P, N, device=x.device, dtype=state_dtype)
    final = final_states_buffer(final_out, nstates, H, P, N, nc, x.device)
    block = min(_CHAIN_BLOCK, triton.next_power_of_2(P * N))
    _chain_kernel[(triton.cdiv(P * N, block), b, H)](
        states, acs, init if init is not None else states, seg if seg is not None else acs, hin, final, H, nc, P * N,
        CHUNK=chunk, BLOCK=block, HAS_INIT=init is not None, HAS_SEG=seg is not None, num_warps=4)
    return hin, final
