"""Attention layers of hybrid stacks under context parallelism: keys / values all-gathered over the cp group.

``CPAttentionOps`` is MHA's sequence ops (layers/seq_ops.py) for this rank's slice: each rank keeps its queries
and attends to the keys / values of the whole sequence with the causal offset of its slice; rotary positions are
global (offset by the slices before this one, or restarting per packed sequence). Memory for K/V is that of the
full sequence on every rank (fine for the few attention layers of a hybrid; a ring would be needed for
attention-heavy stacks). Slices must be of equal length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mamba_parallel.distributed.collectives import all_gather, all_gather_raw
from mamba_parallel.layers.attention import AttentionOps, attention_mask, sdpa
from mamba_parallel.layers.packing import position_ids_from_seq_idx


class CPAttentionOps(AttentionOps):
    local = local_conv = False

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self._seq = (None, None)  # (this slice's seq_idx, the gathered global one): one all-gather per forward

    def _global_seq_idx(self, seq_idx: Tensor | None) -> Tensor | None:
        """seq_idx (b, L) of this slice -> (b, L * cp) of the whole sequence."""
        if seq_idx is None:
            return None
        if self._seq[0] is not seq_idx:
            self._check_lengths(seq_idx.shape[1], seq_idx.device)
            self._seq = (seq_idx, all_gather_raw(seq_idx.t().contiguous(), self.group)[0].t())
        return self._seq[1]

    def _check_lengths(self, L: int, device) -> None:
        lengths = all_gather_raw(torch.tensor([L], device=device), self.group)[0]
        if (lengths != L).any():
            raise ValueError(f"context parallel: attention layers need equal slices on every cp rank, got lengths "
                             f"{lengths.tolist()}")

    def positions(self, seq_idx: Tensor | None, b: int, L: int, device) -> Tensor:
        """(b, L) int64 global positions of this slice's tokens (restarting per packed sequence)."""
        offset = self.rank * L
        if seq_idx is not None:
            return position_ids_from_seq_idx(self._global_seq_idx(seq_idx))[:, offset:offset + L]
        return torch.arange(offset, offset + L, device=device).expand(b, L)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, seq_idx: Tensor | None, causal: bool,
                  scale: float | None) -> Tensor:
        """q (b, L_local, h, d), k / v (b, L_local, h_kv, d) -> (b, L_local, h, d) over the whole sequence's keys."""
        L = q.shape[1]
        self._check_lengths(L, q.device)
        k, v = all_gather(k, self.group, 1), all_gather(v, self.group, 1)  # (b, L * cp, hkv, d); bwd: reduce-scatter
        q_pos = self.rank * L + torch.arange(L, device=q.device)  # query i sits at offset + i
        mask = attention_mask(seq_idx, causal, q_pos, self._global_seq_idx(seq_idx), L * self.size)
        return sdpa(q, k, v, mask, False, scale)

    def __repr__(self) -> str:
        return f"CPAttentionOps(cp={self.size})"
