"""The Mamba-2 SSD scan in plain PyTorch (the specification; fp32 math, differentiable by autograd).

``ssd_chunk_scan`` is the chunked form of the Mamba-2 paper: within a chunk of T tokens the output is a masked
(T x T) attention-like matmul with decays exp(segsum(dt A)); across chunks the (h, p, n) states are passed by a
short Python loop over the L / T chunks. No loop over tokens. ``ssd_sequential`` is the plain token-by-token
recurrence (one row and segment at a time), an independent formulation for tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mamba_parallel.ops._common import compute_dtype, fp32_math, process_dt
from mamba_parallel.ops._packing import gather_seq, row_segments, scatter_seq, segment_start_state, \
    unpack_index


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a (..., T) -> (..., T, T) with out[..., l, s] = a[s+1] + ... + a[l] for l >= s and -inf above the diagonal.

    Built by a masked cumsum rather than a difference of cumsums, which would lose precision and give NaN.
    """
    T = a.shape[-1]
    rep = a[..., :, None].expand(*a.shape, T)  # rep[..., l, s] = a[l]
    strict = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    out = rep.masked_fill(~strict, 0).cumsum(dim=-2)
    above = torch.ones(T, T, dtype=torch.bool, device=a.device).triu(1)
    return out.masked_fill(above, -math.inf)


def _chunk_scan(x, dt, A, B, C, T, h0, seq_idx, ct):
    """dt already processed. x (b, L, h, p); dt (b, L, h); B, C (b, L, g, n); h0 (b, h, p, n) or None
    -> (y (b, L, h, p) without the D / z terms, final state (b, h, p, n))."""
    b, L, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    j = h // g
    final = x.new_zeros(b, h, p, n, dtype=ct) if h0 is None else h0.to(ct)
    if L == 0:
        return x.new_zeros(b, 0, h, p, dtype=ct), final
    pad = (-L) % T  # padded tokens get dt = 0: no decay, no input, so the final state is unchanged
    x, dt, B, C = (F.pad(t.to(ct), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    if seq_idx is not None and pad:
        seq_idx = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], dim=1)
    c = (L + pad) // T
    dtc = dt.view(b, c, T, h)
    xdt = (x * dt.unsqueeze(-1)).view(b, c, T, g, j, p)  # dt_s x_s, the input each token feeds the state
    Bc, Cc = B.view(b, c, T, g, n), C.view(b, c, T, g, n)
    dA = (dtc * A.to(ct)).permute(0, 3, 1, 2)  # (b, h, c, T)
    ss = segsum(dA)  # (b, h, c, T, T)
    sc = None if seq_idx is None else seq_idx.view(b, c, T)

    # 1. within each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(dA_{s+1} + ... + dA_l) dt_s x_s
    decay = torch.exp(ss).permute(0, 2, 1, 3, 4)  # (b, c, h, T, T)
    if sc is not None:
        decay = decay * (sc[..., :, None] == sc[..., None, :]).unsqueeze(2).to(ct)
    CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)
    scores = CB.unsqueeze(3) * decay.view(b, c, g, j, T, T)
    y = torch.einsum("bcgjls,bcsgjp->bclgjp", scores, xdt)

    # 2. the state each chunk adds, as seen at its last token
    to_end = torch.exp(ss[..., -1, :])  # (b, h, c, T)
    if sc is not None:
        to_end = to_end * (sc[..., -1:] == sc).unsqueeze(1).to(ct)
    w = to_end.permute(0, 2, 3, 1).reshape(b, c, T, g, j, 1)
    states = torch.einsum("bctgjp,bctgn->bcgjpn", xdt * w, Bc).reshape(b, c, h, p, n)

    # 3. pass states across chunks (a state flows on only inside one sequence of seq_idx)
    Acs = dA.cumsum(-1)  # (b, h, c, T)
    chunk_decay = torch.exp(Acs[..., -1])  # (b, h, c)
    if sc is not None:
        prev_end = torch.cat([sc[:, :1, 0], sc[:, :-1, -1]], dim=1)  # sequence of the token before each chunk
        chunk_decay = chunk_decay * (sc[:, :, -1] == prev_end).unsqueeze(1).to(ct)
    s, entering = final, []
    for decay_c, state_c in zip(chunk_decay[..., None, None].unbind(2), states.unbind(1)):
        entering.append(s)
        s = decay_c * s + state_c
    S_in = torch.stack(entering, dim=1).view(b, c, g, j, p, n)

    # 4. what the state entering a chunk contributes to its outputs
    y_in = torch.einsum("bclgn,bcgjpn->bclgjp", Cc, S_in)
    y_in = y_in * torch.exp(Acs).permute(0, 2, 3, 1).reshape(b, c, T, g, j, 1)
    if sc is not None:
        y_in = y_in * (sc == prev_end[..., None]).view(b, c, T, 1, 1, 1).to(ct)
    y = (y + y_in).reshape(b, c * T, h, p)[:, :L]
    return y, s


def _finish(y, x, D, z, ct):
    """y (b, L, h, p) + D x, gated by silu(z)."""
    if D is not None:
        Df = D.to(ct)
        y = y + (Df if Df.dim() == 2 else Df[:, None]) * x.to(ct)
    if z is not None:
        y = y * F.silu(z.to(ct))
    return y


def _deliver(y, final, return_final_states, final_states_out):
    """The op's result; ``final_states_out`` (when given) receives the final states (rounded to its dtype) and is
    returned as them. Written after the whole scan: it may be the initial states the scan read."""
    if final_states_out is not None:
        final = final_states_out.copy_(final)
    return (y, final) if return_final_states else y


@fp32_math
def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, cu_seqlens=None,
                   return_final_states=False, final_states_out=None):
    """x (b, L, h, p); dt (b, L, h); A (h,); B/C (b, L, g, n); D (h,)/(h, p); z like x; dt_bias (h,);
    initial_states (b | nseq, h, p, n) -> y (b, L, h, p) in x.dtype [, final_states fp32 (b | nseq, h, p, n)].
    final_states_out (b | nseq, h, p, n): where the final states are written (then returned as them)."""
    ct = compute_dtype(x, dt, A, B, C, D, z, initial_states)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype=ct)
    if cu_seqlens is None:
        y, final = _chunk_scan(x, dtp, A, B, C, chunk_size, initial_states, seq_idx, ct)
    else:
        index, valid = unpack_index(cu_seqlens, x.shape[1], "ssd_chunk_scan")
        y, final = _chunk_scan(*(gather_seq(t, index, valid, 1) for t in (x, dtp)), A,
                               *(gather_seq(t, index, valid, 1) for t in (B, C)), chunk_size, initial_states,
                               None, ct)
        y = scatter_seq(y, valid, 1)
    y = _finish(y, x, D, z, ct).to(x.dtype)
    return _deliver(y, final, return_final_states, final_states_out)


@fp32_math
def ssd_sequential(x, dt, A, B, C, chunk_size=None, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None, cu_seqlens=None,
                   return_final_states=False, final_states_out=None):
    """Same contract as ``ssd_chunk_scan`` (chunk_size ignored); token by token. For tests only."""
    ct = compute_dtype(x, dt, A, B, C, D, z, initial_states)
    b, L, h, p = x.shape
    n = B.shape[3]
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype=ct)
    Bh = B.to(ct).repeat_interleave(h // B.shape[2], dim=2)  # (b, L, h, n)
    Ch = C.to(ct).repeat_interleave(h // C.shape[2], dim=2)
    Af, xf = A.to(ct), x.to(ct)
    zero = x.new_zeros(h, p, n, dtype=ct)
    outs = [[None] * L for _ in range(b)]
    finals = []
    packed = cu_seqlens is not None
    for r in range(b):
        segs = row_segments(L, r, seq_idx, cu_seqlens)
        s = segment_start_state(initial_states, r, 0, False, zero) if not packed else zero
        for k, (start, end) in enumerate(segs):
            s = segment_start_state(initial_states, r, k, packed, zero)
            for t in range(start, end):
                a = torch.exp(dtp[r, t] * Af)[:, None, None]
                s = a * s + (dtp[r, t, :, None] * xf[r, t])[..., None] * Bh[r, t, :, None, :]
                outs[r][t] = (s * Ch[r, t, :, None, :]).sum(-1)
            if packed:
                finals.append(s)
        if not packed:
            finals.append(s)
    y = torch.stack([torch.stack(row, 0) if L else x.new_zeros(0, h, p, dtype=ct) for row in outs])
    y = _finish(y, x, D, z, ct).to(x.dtype)
    return _deliver(y, torch.stack(finals), return_final_states, final_states_out)
