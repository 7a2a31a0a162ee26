"""Packed-sequence bookkeeping without host syncs: cu_seqlens -> seq_idx -> per-sequence positions."""

from __future__ import annotations

import torch


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, seqlen: int) -> torch.Tensor:
    """cu_seqlens (nseq + 1,) int (starts at 0, ends at seqlen) -> seq_idx (1, seqlen) int32.

    Token t belongs to sequence i when cu_seqlens[i] <= t < cu_seqlens[i + 1].
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D (nseq + 1,), got shape {tuple(cu_seqlens.shape)}")
    t = torch.arange(seqlen, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.bucketize(t, cu_seqlens[1:], right=True).to(torch.int32)[None]


def position_ids_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """seq_idx (b, L) -> position of each token inside its own sequence (b, L) int64 (0 at every start)."""
    b, L = seq_idx.shape
    t = torch.arange(L, device=seq_idx.device).expand(b, L)
    is_start = torch.ones_like(seq_idx, dtype=torch.bool)
    is_start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    start = torch.where(is_start, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - start


def resolve_seq_idx(seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None, seqlen: int):
    """The seq_idx (b, L) int32 a mixer's conv / attention mask needs: the given one, else derived from cu_seqlens
    (so a mixer called directly with only cu_seqlens still keeps the sequences apart); None when unpacked."""
    if seq_idx is None and cu_seqlens is not None:
        return seq_idx_from_cu_seqlens(cu_seqlens, seqlen)
    return seq_idx
