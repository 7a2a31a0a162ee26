"""The Mamba-1 selective scan in plain PyTorch (the specification; fp32 math, differentiable by autograd).

``selective_scan`` runs the recurrence as a Python loop over the L tokens, each step vectorised over batch,
channels and state (b * d * n elements): exact, memory O(b d n L) for autograd, fine on CPU for the lengths the
reference serves. ``selective_scan_sequential`` is a slower, independent formulation for tests: one sequence at
a time, the segments of seq_idx / cu_seqlens split explicitly in Python.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_parallel.ops._common import compute_dtype, fp32_math, process_dt
from mamba_parallel.ops._packing import gather_seq, row_segments, scatter_seq, segment_start_state, \
    unpack_index


def _finish(y, u, D, z, ct):
    """y (b, d, L) + D u, gated by silu(z)."""
    if D is not None:
        y = y + D.to(ct)[:, None] * u.to(ct)
    if z is not None:
        y = y * F.silu(z.to(ct))
    return y


def _scan(u, dl, A, B, C, h0, seq_idx, ct):
    """Core recurrence with delta already processed. u, dl (b, d, L); B, C (b, g, n, L); h0 (b, d, n) or None
    -> (y (b, d, L) without the D / z terms, last state (b, d, n))."""
    b, d, L = u.shape
    g, n = B.shape[1], B.shape[2]
    Ag = A.to(ct).view(g, d // g, n)
    dl = dl.view(b, g, d // g, L)
    du = dl * u.to(ct).view(b, g, d // g, L)
    Bg, Cg = B.to(ct).unsqueeze(2), C.to(ct).unsqueeze(2)  # (b, g, 1, n, L)
    h = u.new_zeros(b, g, d // g, n, dtype=ct) if h0 is None else h0.to(ct).view(b, g, d // g, n)
    keep = None if seq_idx is None or L < 2 else (seq_idx[:, 1:] == seq_idx[:, :-1]).to(ct).view(b, 1, 1, 1, L - 1)
    # unbind once: indexing [..., t] every step would make autograd build a full-size gradient per step (O(L^2))
    dl_t, du_t, B_t, C_t = dl.unsqueeze(-1).unbind(-2), du.unsqueeze(-1).unbind(-2), Bg.unbind(-1), Cg.unbind(-1)
    keep_t = None if keep is None else keep.unbind(-1)
    ys = []
    for t in range(L):
        if keep_t is not None and t > 0:
            h = h * keep_t[t - 1]  # a new sequence starts from a zero state
        h = torch.exp(dl_t[t] * Ag) * h + du_t[t] * B_t[t]
        ys.append((h * C_t[t]).sum(-1))
    y = torch.stack(ys, -1).view(b, d, L) if L else u.new_zeros(b, d, 0, dtype=ct)
    return y, h.reshape(b, d, n)


def _grouped(t):
    return t if t.dim() == 4 else t.unsqueeze(1)


@fp32_math
def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
                   return_last_state=False, seq_idx=None, cu_seqlens=None):
    """u/delta/z (b, d, L); A (d, n); B/C (b, n, L) or (b, g, n, L); D, delta_bias (d,); initial_state (b, d, n)
    (or (nseq, d, n) with cu_seqlens) -> y (b, d, L) in u.dtype [, last_state fp32 (b | nseq, d, n)]."""
    ct = compute_dtype(u, delta, A, B, C, D, z, initial_state)
    dl = process_dt(delta.transpose(1, 2), delta_bias, delta_softplus, dtype=ct).transpose(1, 2)
    Bg, Cg = _grouped(B), _grouped(C)
    if cu_seqlens is None:
        y, last = _scan(u, dl, A, Bg, Cg, initial_state, seq_idx, ct)
    else:
        index, valid = unpack_index(cu_seqlens, u.shape[-1], "selective_scan")
        y, last = _scan(gather_seq(u, index, valid, 2), gather_seq(dl, index, valid, 2), A,
                        gather_seq(Bg, index, valid, 3), gather_seq(Cg, index, valid, 3), initial_state, None, ct)
        y = scatter_seq(y, valid, 2)
    y = _finish(y, u, D, z, ct).to(u.dtype)
    return (y, last) if return_last_state else y


@fp32_math
def selective_scan_sequential(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              initial_state=None, return_last_state=False, seq_idx=None, cu_seqlens=None):
    """Same contract as ``selective_scan``; token by token, one (row, segment) at a time. For tests only."""
    ct = compute_dtype(u, delta, A, B, C, D, z, initial_state)
    b, d, L = u.shape
    n = A.shape[1]
    dl = process_dt(delta.transpose(1, 2), delta_bias, delta_softplus, dtype=ct).transpose(1, 2)
    Bg, Cg = _grouped(B).to(ct), _grouped(C).to(ct)
    Bd = Bg.repeat_interleave(d // Bg.shape[1], dim=1)  # (b, d, n, L)
    Cd = Cg.repeat_interleave(d // Cg.shape[1], dim=1)
    Af, uf = A.to(ct), u.to(ct)
    zero = u.new_zeros(d, n, dtype=ct)
    outs = [[None] * L for _ in range(b)]
    lasts = []
    packed = cu_seqlens is not None
    for r in range(b):
        segs = row_segments(L, r, seq_idx, cu_seqlens)
        for k, (s, e) in enumerate(segs):
            h = segment_start_state(initial_state, r, k, packed, zero)
            for t in range(s, e):
                h = torch.exp(dl[r, :, t, None] * Af) * h + (dl[r, :, t] * uf[r, :, t])[:, None] * Bd[r, :, :, t]
                outs[r][t] = (h * Cd[r, :, :, t]).sum(-1)
            if packed:
                lasts.append(h)
        if not packed:
            lasts.append(h if segs else segment_start_state(initial_state, r, 0, False, zero))
    y = torch.stack([torch.stack(row, -1) if L else u.new_zeros(d, 0, dtype=ct) for row in outs])
    y = _finish(y, u, D, z, ct).to(u.dtype)
    return (y, torch.stack(lasts)) if return_last_state else y
