"""Packed (cu_seqlens) sequences <-> a zero-padded batch, used by the reference scans.

The scans pad each sequence at its END with dt = 0: a token with dt = 0 neither decays nor feeds the state, so
the state at the end of the padded row is the state after the sequence's last real token.
"""

from __future__ import annotations

import torch


def unpack_index(cu_seqlens: torch.Tensor, total: int, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens (nseq+1,) -> (index (nseq, Lmax) into the packed axis, valid (nseq, Lmax) bool).

    Padding slots point at position 0 (any valid index); ``valid`` says which slots are real tokens.
    """
    cu = cu_seqlens.long()
    first, last = int(cu[0]), int(cu[-1])
    lengths = cu[1:] - cu[:-1]
    if first != 0 or last != total or bool((lengths < 0).any()):
        raise ValueError(f"{op}: cu_seqlens must rise from 0 to L = {total}, got {cu_seqlens.tolist()}")
    lmax = int(lengths.max()) if lengths.numel() else 0
    pos = torch.arange(lmax, device=cu.device)
    valid = pos[None, :] < lengths[:, None]
    index = torch.where(valid, cu[:-1, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    return index, valid


def gather_seq(t: torch.Tensor | None, index: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Packed t with batch 1 and the sequence on ``dim`` -> (nseq, ..., Lmax, ...), padding slots zeroed."""
    if t is None:
        return None
    src = t[0]
    dim = dim - 1 if dim > 0 else dim + t.dim() - 1
    out = src.index_select(dim, index.reshape(-1)).unflatten(dim, index.shape)  # (..., nseq, Lmax, ...)
    shape = [1] * out.dim()
    shape[dim], shape[dim + 1] = valid.shape
    out = out * valid.view(shape).to(out.dtype)
    return out.movedim(dim, 0)


def scatter_seq(y: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """(nseq, ..., Lmax on ``dim``, ...) -> packed (1, ..., L, ...): the valid slots in sequence order."""
    moved = y.movedim(0, dim - 1)  # (..., nseq, Lmax, ...)
    dim = dim - 1
    flat = moved.flatten(dim, dim + 1)
    keep = valid.reshape(-1).nonzero().squeeze(-1)
    return flat.index_select(dim, keep).unsqueeze(0)


def row_segments(L: int, r: int, seq_idx, cu_seqlens) -> list[tuple[int, int]]:
    """[start, end) spans of the sequences in batch row ``r``: from ``cu_seqlens`` (packed, b == 1), else where
    ``seq_idx`` changes, else the whole row. Used by the token-by-token references."""
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))
    if seq_idx is None:
        return [(0, L)]
    row = seq_idx[r].tolist()
    cuts = [0] + [t for t in range(1, L) if row[t] != row[t - 1]] + [L]
    return list(zip(cuts[:-1], cuts[1:]))


def segment_start_state(initial, r: int, k: int, packed: bool, zero: torch.Tensor) -> torch.Tensor:
    """The state entering segment ``k`` of row ``r``: per sequence when packed, else row ``r``'s initial state for
    the first segment only (seq_idx boundaries reset to zero)."""
    if initial is None:
        return zero
    if packed:
        return initial[k].to(zero.dtype)
    return initial[r].to(zero.dtype) if k == 0 else zero
