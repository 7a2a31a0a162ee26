"""Context parallel Mamba-3 scan: each cp rank passes ITS slice of the sequence (rank 0 the first).

Four things cross a rank boundary, all in a ``Mamba3State``: the SSM state, the rotary phase, and the trapezoid's
previous token (its rotated B and its x, which the next rank's first token reads). Each rank scans its slice from
zero once, and ONE all-gather shares every rank's (final state, total decay, first token's half-step weight). Each
rank then folds the earlier ranks' contributions into its true entering state, in the global frame:

    E_{j+1} = decay_j (E_j + beta0_j v_j-1 k_j-1^T) + rot(S_j, theta_j)      S_j: rank j's state from zero
    theta_{j+1} = theta_j + phi_j,   k_j = rot(k_local_j, theta_j),   v_j = x of rank j's last token

(a rotation by the entering phase turns a slice scanned from phase 0 into the global frame), and ranks > 0 scan
again from it. The collective and every step are differentiable, so every gradient is the single-process one.
Packed sequences (seq_idx): a sequence that starts at a rank boundary or inside a slice resets what crosses.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from mamba_parallel.distributed.collectives import all_gather
from mamba_parallel.distributed.cp_exchange import SeqMeta, attach
from mamba_parallel.layers.mamba3 import Mamba3Ops
from mamba_parallel.ops.mamba3 import Mamba3State, mamba3_chunk_scan
from mamba_parallel.ops.mamba3.naive import rope_pairs, rotate


def _rank_size(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    """A (b,) mask viewed to broadcast over ``like`` (b, ...)."""
    return mask.view(-1, *([1] * (like.dim() - 1)))


def cp_mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, D=None, z=None, B_bias=None, C_bias=None,
                         mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved", initial_states=None,
                         seq_idx=None, return_final_states=False, group=None, meta: SeqMeta | None = None):
    """``ops.mamba3.mamba3_chunk_scan`` over this rank's slice (same arguments; no cu_seqlens: pass packed
    sequences as this rank's slice of the global seq_idx). initial_states: the global ones (they enter rank 0).
    Returns this rank's slice of y [, the whole sequence's final ``Mamba3State``, on every rank]."""
    rank, size = _rank_size(group)
    kw = dict(D=D, z=z, B_bias=B_bias, C_bias=C_bias, mimo_x=mimo_x, mimo_z=mimo_z, mimo_o=mimo_o, rope=rope,
              seq_idx=seq_idx)
    if size == 1:
        return mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, initial_states=initial_states,
                                 return_final_states=return_final_states, **kw)
    if meta is None and seq_idx is not None:
        meta = SeqMeta(seq_idx, 1, group, rank)
    rerun = rank > 0 or initial_states is not None
    y, local = mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, return_final_states=True, **kw)
    mimo = B.dim() == 5
    first, second = rope_pairs(B.shape[-1], angles.shape[-1], rope, x.device)
    rot_ssm = lambda S, th: rotate(S, th[:, :, None], first, second)  # noqa: E731  (b, h, p, n)
    rot_k = lambda k, th: rotate(k, th[:, None] if mimo else th, first, second)  # noqa: E731  (b, [R,] h, n)

    with torch.autocast(x.device.type, enabled=False):
        decay = torch.exp((A.float() * dt.float()).sum(1))  # (b, h): the slice's total decay
        beta0 = (1 - trap[:, 0].float()) * dt[:, 0].float()  # (b, h): its first token's half-step weight
        parts = (local.angle, local.ssm, local.k, local.v.float(), decay, beta0)
        shapes = [t.shape for t in parts]
        flat = torch.cat([t.reshape(t.shape[0], -1) for t in parts], dim=1)
        gathered = all_gather(flat[None], group, dim=0)  # (cp, b, total)
        sizes = [math.prod(s[1:]) for s in shapes]
        per_rank = [[piece.reshape(s) for piece, s in zip(g.split(sizes, dim=1), shapes)] for g in gathered]

        b, h, p, n = local.ssm.shape
        if initial_states is not None:
            theta, E, k_prev, v_prev = (s.float() for s in initial_states)
        else:
            E, theta = local.ssm.new_zeros(b, h, p, n), local.angle.new_zeros(local.angle.shape)
            k_prev, v_prev = local.k.new_zeros(local.k.shape), local.v.new_zeros(local.v.shape).float()
        mx = mimo_x.float().transpose(0, 1) if mimo_x is not None else None
        entering = None
        for j, (phi_j, S_j, k_j, v_j, decay_j, beta0_j) in enumerate(per_rank):
            if meta is not None:  # the sequence entering rank j stops at a boundary exactly there
                E, theta, k_prev, v_prev = (t * _rows(meta.cont[j], t) for t in (E, theta, k_prev, v_prev))
            if j == rank:
                entering = Mamba3State(theta, E, k_prev, v_prev)
            u_prev = v_prev.unsqueeze(1) * mx if mx is not None else v_prev.unsqueeze(1)
            outer = torch.einsum("brhp,brhn->bhpn", u_prev, k_prev if mimo else k_prev.unsqueeze(1))
            carried = Mamba3State(theta + phi_j, decay_j[..., None, None] * (E + beta0_j[..., None, None] * outer)
                                  + rot_ssm(S_j, theta), rot_k(k_j, theta), v_j)
            if meta is not None:  # a boundary inside rank j: its last sequence started there, from zero
                own = Mamba3State(phi_j, S_j, k_j, v_j)
                carried = Mamba3State(*(torch.where(_rows(meta.inside[j], a), a, o) for a, o in zip(carried, own)))
            theta, E, k_prev, v_prev = carried
    if rerun:
        init = Mamba3State(entering.angle, entering.ssm, entering.k, entering.v.to(x.dtype))
        y = mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, initial_states=init, **kw)
    # every rank runs the gather's backward (its reduce-scatter), also rank 0 whose outputs do not read it
    y = attach(y, gathered)
    if not return_final_states:
        return y
    return y, Mamba3State(torch.remainder(theta, 2 * math.pi), E, k_prev, v_prev.to(x.dtype))


class CPMamba3Ops(Mamba3Ops):
    """Mamba3's sequence op over this rank's slice (the parallel seam, ``mixer.seq_ops``): the state-passing scan.
    ``ctx``: the model's cp context (its group, and the packed-sequence metadata shared by the layers)."""

    local = False

    def __init__(self, ctx):
        self.ctx = ctx

    def scan(self, x, dt, A, B, C, trap, angles, chunk_size, seq_idx=None, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None:
            raise ValueError("context parallel: pass packed sequences as this rank's slice of the global seq_idx, "
                             "not cu_seqlens (its offsets would be local to the slice)")
        return cp_mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, seq_idx=seq_idx, group=self.ctx.group,
                                    meta=self.ctx.meta(seq_idx, 1), **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp={self.ctx.size})"
