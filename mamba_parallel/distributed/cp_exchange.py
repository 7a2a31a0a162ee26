"""What crosses a context-parallel rank boundary, exchanged with ONE all-gather per quantity (no rank-by-rank chain).

Each cp rank holds a contiguous slice of every sequence (rank 0 the first). Three things cross a boundary:

- the conv halo: the last ``w - 1`` conv inputs of the previous rank (``conv_halo``);
- the SSM state: every rank's final state from a zero start ``S_loc`` and the total decay of its slice ``a``
  (``gather_states``), which each rank folds into its true initial state (``combine_states``):
  ``S_in_r = sum_{j<r} (prod_{j<k<r} a_k) S_loc_j``;
- packed-sequence boundaries (``SeqMeta``): a sequence that ends inside a slice or exactly at a rank boundary
  stops the state and the halo there.

The collectives are autograd functions (all-gather forward, reduce-scatter backward): the gradient of a rank's
``S_in`` / halo flows back to the earlier ranks' ``S_loc``, ``a`` and conv inputs, so every parameter gradient is
the single-process one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mamba_parallel.distributed.collectives import all_gather, all_gather_raw


class SeqMeta:
    """Packed-sequence boundaries of every cp rank's slice, from one all-gather of a few ints per row.

    ``first`` (cp, b): seq_idx of each slice's first token; ``tails`` (cp, b, k): its last ``k`` seq_idx values.
    ``cont[r]`` (b,): rank r's first token continues the sequence of rank r-1's last token (True for r = 0: an
    initial state belongs to the first token's sequence). ``inside[r]`` (b,): no boundary inside rank r's slice.
    """

    def __init__(self, seq_idx: Tensor, k: int, group, rank: int):
        b, L = seq_idx.shape
        if L < k:
            raise ValueError(f"context parallel: a rank's slice has {L} tokens, fewer than the {k} that cross a rank "
                             f"boundary (d_conv - 1): use a longer sequence or a smaller --cp")
        local = torch.cat([seq_idx[:, :1], seq_idx[:, L - k:]], dim=1).to(torch.int64)  # (b, 1 + k)
        gathered = all_gather_raw(local[None], group)[0]  # (cp, b, 1 + k)
        self.rank = rank
        self.first, self.tails = gathered[:, :, 0], gathered[:, :, 1:]
        last = gathered[:, :, -1]
        self.inside = self.first == last
        self.cont = torch.ones_like(self.inside)
        self.cont[1:] = self.first[1:] == last[:-1]

    def halo_mask(self) -> Tensor:
        """(b, k) bool: which of the previous rank's last k inputs belong to this rank's first sequence."""
        return self.tails[self.rank - 1] == self.first[self.rank][:, None]

    def carry(self, k: int) -> Tensor:
        """(b,) bool: state entering rank k's slice reaches its end (no boundary at or inside the slice)."""
        return self.inside[k] & self.cont[k]

    def last_seq_mask(self) -> Tensor:
        """(b, k) bool: the last rank's tail inputs that belong to its last sequence (for a final conv state)."""
        tails = self.tails[-1]
        return tails == tails[:, -1:]


class _Attach(torch.autograd.Function):
    """y, t -> y; backward: t receives zeros. Puts a collective's output t into the graph on ranks that do not use
    it, so that its backward collective runs on EVERY rank of the group (otherwise the ranks would mismatch)."""

    @staticmethod
    def forward(ctx, y, t):
        ctx.t_shape, ctx.t_dtype = t.shape, t.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.t_shape, dtype=ctx.t_dtype)


def attach(y: Tensor, t: Tensor) -> Tensor:
    """y unchanged, with t's backward triggered on this rank (zero gradient) when y's is."""
    return _Attach.apply(y, t) if torch.is_grad_enabled() and t.requires_grad else y


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    """(b,) bool -> like's dtype, shaped (b, 1, ..., 1) to broadcast over like (b, ...)."""
    return mask.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def conv_halo(x: Tensor, w: int, group, rank: int, size: int, meta: SeqMeta | None,
              initial_state: Tensor | None = None, return_final_state: bool = False):
    """x (b, d, L) conv inputs of this rank's slice -> (halo (b, d, w-1) or None, final (b, d, w-1) or None,
    the gathered tails (cp, b, d, w-1) or None: ``attach`` them to the output).

    halo: the w-1 inputs before this slice (rank 0: ``initial_state``, the global one, or None), zeroed where they
    belong to another sequence than the slice's first token. final (when asked): the whole sequence's last w-1
    inputs (the last rank's tail), the same on every rank, for a decoding cache.
    """
    b, d, L = x.shape
    if w <= 1:
        return initial_state, (x.new_zeros(b, d, 0) if return_final_state else None), None
    if L < w - 1:
        raise ValueError(f"context parallel: a rank's slice has {L} tokens, fewer than d_conv - 1 = {w - 1} (the "
                         f"conv halo): use a longer sequence or a smaller --cp")
    tails = all_gather(x[:, :, L - (w - 1):].contiguous()[None], group, 0)  # (cp, b, d, w-1)
    if rank == 0:
        halo = initial_state
    else:
        halo = tails[rank - 1]
        if meta is not None:
            halo = halo * meta.halo_mask()[:, None, :].to(halo.dtype)
    final = None
    if return_final_state:
        final = tails[size - 1]
        if meta is not None:
            final = final * meta.last_seq_mask()[:, None, :].to(final.dtype)
    return halo, final, tails


def gather_states(S_loc: Tensor, a: Tensor, group) -> tuple[Tensor, Tensor, Tensor]:
    """S_loc (b, ...) and a (b, ...) fp32 -> (cp, b, ...) each, and the raw gathered tensor (to ``attach``): one
    all-gather of both (reduce-scatter backward)."""
    n = S_loc.numel()
    flat = torch.cat([S_loc.reshape(-1), a.reshape(-1).to(S_loc.dtype)])
    g = all_gather(flat[None], group, 0)  # (cp, n + a.numel())
    cp = g.shape[0]
    return g[:, :n].view(cp, *S_loc.shape), g[:, n:].view(cp, *a.shape), g


def combine_states(S_all: Tensor, a_all: Tensor, rank: int, meta: SeqMeta | None,
                   initial_state: Tensor | None = None, want_final: bool = False):
    """Fold the gathered slices into this rank's true initial state (and, if asked, the whole sequence's final one).

    S_all (cp, b, *s) final states from zero starts; a_all (cp, b, *t) decays, t broadcastable to s (Mamba-2:
    (h, 1, 1); Mamba-1: (d, n)); initial_state (b, *s) the global one (enters rank 0) or None.
    -> (S_in (b, *s) or None when it is zero by construction (rank 0, no initial state), final (b, *s) or None).
    E_k, the state at the end of slice k: E_k = carry_k * a_k * E_{k-1} + S_loc_k, E_{-1} = initial_state.
    """
    cp = S_all.shape[0]
    E = initial_state.to(S_all.dtype) if initial_state is not None else None
    S_in = E if rank == 0 else None
    for k in range(cp if want_final else rank):
        if E is None:
            E = S_all[k]
        else:
            m = a_all[k]
            if meta is not None:
                m = m * _rows(meta.carry(k), m)
            E = m * E + S_all[k]
        if k == rank - 1:
            S_in = E if meta is None else E * _rows(meta.cont[rank], E)
    return S_in, (E if want_final else None)
