"""Sparser checkpoints for the scan backward (``MAMBA_PARALLEL_SCAN_CKPT_EVERY=K``): memory for compute.

The forward keeps the state entering every K-th chunk only ((b, ceil(nchunks / K), n, d) fp32: 4 n / (K S) bytes
per (b, d, L) element instead of 4 n / S). The backward walks a segment of K chunks in reverse; before its first
(last in time) chunk it reruns the forward over the segment's earlier chunks from the checkpoint, keeping each
chunk's entering state in a small per-program scratch (b, K, n, d). That is one more exp2 and scan per element for
(K - 1) / K of the elements.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, segment_flags
from mamba_parallel.ops.selective_scan.triton_tiles import delta_tile, last_token, load_tile, scan_forward, state_row


@triton.jit
def segment_states(u_ptr, dt_ptr, B_base, A_ptr, dtb_ptr, h0_ptr, sid_ptr, ck_in, scratch, c_first, nfill,
                   pid_b, c0, offs_d, s_row, drow, first_row, L, dim, dstate, nh,
                   su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sB_n, sB_l, ssid_b,
                   HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_H0: tl.constexpr, HAS_SID: tl.constexpr,
                   VARLEN: tl.constexpr, FAST_EXP: tl.constexpr, BD: tl.constexpr, P: tl.constexpr,
                   V: tl.constexpr, R: tl.constexpr, LANES: tl.constexpr):
    """Forward over chunks c_first .. c_first + nfill - 1 from the states at ck_in (+ n dim, row offsets
    included); the state entering chunk c_first + j (j = 1 .. nfill) goes to scratch + j dim dstate (+ n dim)."""
    dn = dim * dstate
    tok = tl.arange(0, P)[:, None, None] * V + tl.arange(0, V)[None, None, :]
    tok2 = tl.arange(0, P)[:, None] * V + tl.arange(0, V)[None, :]
    v_idx = tl.arange(0, V)[None, None, :]
    p_idx = tl.arange(0, P)[:, None]
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)[None, :, None]
    else:
        bias = 0.0
    for j in range(nfill):
        c = c_first + j
        t = c * (P * V) + tok
        mt = t < L
        t2 = c * (P * V) + tok2
        mt2 = t2 < L
        t0 = c * (P * V)
        u = load_tile(u_ptr + pid_b * su_b, c0, su_d, su_l, t0, L, P, BD * R, V, R)
        _, dt = delta_tile(dt_ptr + pid_b * sdt_b, c0, sdt_d, sdt_l, t0, L, mt, bias, P, BD * R, V, R, HAS_DTB,
                           SOFTPLUS)
        dtu = dt * u
        if HAS_SID:
            s_cur, start, _ = segment_flags(sid_ptr + pid_b * ssid_b, t, mt, L, mt, VARLEN)
        if j == 0:
            src = ck_in
        else:
            src = scratch + j * dn
        dst = scratch + (j + 1) * dn
        for n in range(nh):
            A_n = (tl.load(A_ptr + s_row + n * dim).to(tl.float32) * LOG2E)[None, :, None]
            B_n = state_row(B_base, n, nh, sB_n, sB_l, t2, mt2, first_row, R)
            a = exp2(dt * A_n, FAST_EXP)
            bx = dtu * B_n
            if HAS_SID:
                if VARLEN and HAS_H0:
                    hin = tl.load(h0_ptr + s_cur * dn + drow + n, mask=start, other=0.0).to(tl.float32)
                    bx += a * hin
                a = tl.where(start, 0.0, a)
            hs = scan_forward(a, bx, tl.load(src + n * dim), v_idx, p_idx, P, V, LANES)
            tl.store(dst + n * dim, last_token(hs, v_idx, p_idx, P, V))
        if not LANES:  # the next chunk reads what other threads may have stored
            tl.debug_barrier()
