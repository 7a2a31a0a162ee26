"""Context-parallel versions of the sequence ops: each cp rank passes ITS slice of the sequence (rank 0 the first).

Same signatures as ``mamba_parallel.ops`` plus ``group`` (the cp process group; None = world) and ``meta`` (a
``SeqMeta`` shared by the layers of one forward; built here when None and ``seq_idx`` is given). Outputs are this
rank's slice of the single-process outputs; final states (when asked) are the whole sequence's, on every rank.

- ``cp_causal_conv1d``: the previous rank's last w-1 inputs are this slice's initial state (halo).
- ``cp_ssd_chunk_scan`` (Mamba-2): local scan from zero, one all-gather of (final state, decay) per rank, then the
  initial-state term ``C_t exp(sum_{s<=t} dt_s A) S_in`` is added directly (one matmul, no second scan).
- ``cp_selective_scan`` (Mamba-1): the decay is per (channel, state), so the initial-state term would need a
  (b, d, n, L) tensor: ranks > 0 rerun the fused scan from ``S_in`` instead (a first pass gives the final state).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mamba_parallel import ops
from mamba_parallel.distributed.cp_exchange import SeqMeta, attach, combine_states, conv_halo, gather_states
from mamba_parallel.ops._common import process_dt


def _rank_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _meta(meta: SeqMeta | None, seq_idx: Tensor | None, k: int, group, rank: int) -> SeqMeta | None:
    if seq_idx is None:
        return None
    return meta if meta is not None else SeqMeta(seq_idx, max(k, 1), group, rank)


def _no_autocast(t: Tensor):
    """fp32 state math inside a caller's autocast region (decays and states must not drop to bf16)."""
    dev = t.device.type
    return torch.autocast(dev, enabled=False) if dev in ("cpu", "cuda") else contextlib.nullcontext()


class _SSDInitialStateTerm(torch.autograd.Function):
    """corr (b, L, h, p) fp32 = decay[b, l, h] * sum_n C[b, l, g(h), n] S[b, h, p, n]: what the state entering the
    slice adds to the outputs. Saves only C, S and decay (b, L, h); the (b, L, h, p) product is recomputed in
    backward, so a long slice does not keep an extra fp32 activation of the size of y per layer."""

    @staticmethod
    def _product(C, S):
        b, L, g, n = C.shape
        h, p = S.shape[1], S.shape[2]
        return torch.einsum("blgn,bgjpn->blgjp", C.float(), S.reshape(b, g, h // g, p, n)).reshape(b, L, h, p)

    @staticmethod
    def forward(ctx, C, S, decay):
        ctx.save_for_backward(C, S, decay)
        return _SSDInitialStateTerm._product(C, S).mul_(decay.unsqueeze(-1))

    @staticmethod
    def backward(ctx, grad):
        C, S, decay = ctx.saved_tensors
        b, L, g, n = C.shape
        h, p = S.shape[1], S.shape[2]
        grad = grad.float()
        d_decay = (grad * _SSDInitialStateTerm._product(C, S)).sum(-1)
        dP = (grad * decay.unsqueeze(-1)).view(b, L, g, h // g, p)
        dC = torch.einsum("blgjp,bgjpn->blgn", dP, S.reshape(b, g, h // g, p, n)).to(C.dtype)
        dS = torch.einsum("blgn,blgjp->bgjpn", C.float(), dP).reshape(b, h, p, n).to(S.dtype)
        return dC, dS, d_decay


def cp_causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None,
                     initial_state: Tensor | None = None, seq_idx: Tensor | None = None,
                     return_final_state: bool = False, group=None, meta: SeqMeta | None = None):
    """x (b, d, L_local) -> y (b, d, L_local) [, final_state (b, d, w-1): the whole sequence's last w-1 inputs].

    ``initial_state`` (b, d, w-1) is the global one (it enters rank 0). Needs L_local >= w - 1 on every rank.
    """
    rank, size = _rank_size(group)
    w = weight.shape[-1]
    meta = _meta(meta, seq_idx, w - 1, group, rank)
    halo, final, tails = conv_halo(x, w, group, rank, size, meta, initial_state, return_final_state)
    y = ops.causal_conv1d(x, weight, bias, activation=activation, initial_state=halo, seq_idx=seq_idx)
    if tails is not None:
        y = attach(y, tails)
    return (y, final) if return_final_state else y


def cp_ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                      D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                      dt_softplus: bool = False, dt_limit=(0.0, math.inf), initial_states: Tensor | None = None,
                      seq_idx: Tensor | None = None, return_final_states: bool = False, group=None,
                      meta: SeqMeta | None = None, recompute_states: bool = False):
    """Mamba-2 SSD over this rank's slice: x (b, L, h, p), dt (b, L, h), B/C (b, L, g, n), z like x,
    initial_states (b, h, p, n) global (enters rank 0) -> y (b, L, h, p) [, final_states (b, h, p, n) fp32]."""
    rank, _ = _rank_size(group)
    meta = _meta(meta, seq_idx, 1, group, rank)
    y, S_loc = ops.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                  dt_limit=dt_limit, seq_idx=seq_idx, return_final_states=True,
                                  recompute_states=recompute_states)
    with _no_autocast(x):
        # (b, L, h). Scanned along the innermost dim of a (b, h, L) copy: torch's scan along an outer dim runs one
        # thread per column (h of them) and took 13 ms per layer at L = 131072 on an H200, this form ~0.1 ms.
        dA = (process_dt(dt, dt_bias, dt_softplus, dt_limit) * A.float()).transpose(1, 2).contiguous()
        dA_cum = torch.cumsum(dA, dim=-1).transpose(1, 2)
        S_all, a_all, gathered = gather_states(S_loc.float(), torch.exp(dA_cum[:, -1]), group)
        S_in, final = combine_states(S_all, a_all[..., None, None], rank, meta, initial_states, return_final_states)
        if S_in is not None:
            decay = torch.exp(dA_cum)
            if seq_idx is not None:  # the entering state lives only in the slice's first sequence
                decay = decay * (seq_idx == seq_idx[:, :1]).unsqueeze(-1).to(decay.dtype)
            corr = _SSDInitialStateTerm.apply(C, S_in, decay)
            if z is not None:
                corr = corr * F.silu(z.float())
            y = (y.float() + corr).to(y.dtype)
    y = attach(y, gathered)
    return (y, final) if return_final_states else y


def cp_selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                      z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = False,
                      initial_state: Tensor | None = None, return_last_state: bool = False,
                      seq_idx: Tensor | None = None, group=None, meta: SeqMeta | None = None):
    """Mamba-1 selective scan over this rank's slice: u/delta/z (b, d, L), B/C (b, n, L) or (b, g, n, L),
    initial_state (b, d, n) global (enters rank 0) -> y (b, d, L) [, last_state (b, d, n) fp32]."""
    rank, _ = _rank_size(group)
    meta = _meta(meta, seq_idx, 1, group, rank)
    rerun = rank > 0 or initial_state is not None
    if rerun:  # this pass only gives the final state; D and z do not change it
        y, S_loc = None, ops.selective_scan(u, delta, A, B, C, delta_bias=delta_bias, delta_softplus=delta_softplus,
                                            seq_idx=seq_idx, return_last_state=True)[1]
    else:
        y, S_loc = ops.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, seq_idx=seq_idx,
                                      return_last_state=True)
    with _no_autocast(u):
        dl = delta.float() if delta_bias is None else delta.float() + delta_bias.float()[:, None]
        if delta_softplus:
            dl = F.softplus(dl)
        a = torch.exp(A.float()[None] * dl.sum(-1, keepdim=True))  # (b, d, n): total decay of the slice
        S_all, a_all, gathered = gather_states(S_loc.float(), a, group)
        S_in, final = combine_states(S_all, a_all, rank, meta, initial_state, return_last_state)
    if rerun:
        y = ops.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state=S_in,
                               seq_idx=seq_idx)
    y = attach(y, gathered)
    return (y, final) if return_last_state else y
