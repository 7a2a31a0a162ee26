"""seq_idx / cu_seqlens -> segments laid out on whole chunks: the host-side layout the SSD and Mamba-3 kernels
share, so a scan never meets a sequence reset inside a chunk.

A segment is a run of equal seq_idx in one row, or one cu_seqlens sequence. Each segment is given its own whole
number of chunks in one packed row; the rest of its last chunk is padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkSegments:
    dst: torch.Tensor  # (b * L,) int64: packed slot of each token
    n_chunks: int  # chunks of the packed row
    chunk_first: torch.Tensor  # (nseg,) int64: first chunk of each segment
    nchunks_seg: torch.Tensor  # (nseg,) int64: chunks of each segment
    init_id: torch.Tensor  # (nseg,) int64: initial-state index of each segment, -1 when it starts from zero
    final_id: torch.Tensor  # (nseg,) int64: final-state index, -1 when its final state is not returned
    empty: torch.Tensor | None  # (k,) int64: cu_seqlens sequences with no token (their final = their initial)
    nstates: int  # initial / final states: sequences of cu_seqlens, else rows

    @property
    def chunk_last(self) -> torch.Tensor:
        return self.chunk_first + self.nchunks_seg - 1


def chunk_segments(batch: int, L: int, chunk: int, seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                   device) -> ChunkSegments:
    """seq_idx (batch, L) or cu_seqlens (nseq + 1,) with batch == 1 -> ChunkSegments.

    Syncs with the host once: the packed length decides the launch grids. With seq_idx a row's first segment
    starts from that row's initial state and its last one returns the row's final state."""
    n_tok = batch * L
    pos = torch.arange(n_tok, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        tok_seq = torch.searchsorted(cu[1:], pos, right=True)
        new = torch.ones(n_tok, dtype=torch.bool, device=device)
        new[1:] = tok_seq[1:] != tok_seq[:-1]
    else:
        s = seq_idx.to(device)
        new_rows = torch.ones(batch, L, dtype=torch.bool, device=device)
        new_rows[:, 1:] = s[:, 1:] != s[:, :-1]
        new = new_rows.reshape(-1)
    starts = new.nonzero().squeeze(-1)  # (nseg,) first token of each segment
    seg_of_tok = torch.cumsum(new.to(torch.int64), 0) - 1
    lengths = torch.diff(starts, append=torch.tensor([n_tok], device=device))
    nchunks_seg = (lengths + chunk - 1) // chunk
    chunk_end = torch.cumsum(nchunks_seg, 0)
    chunk_first = chunk_end - nchunks_seg
    n_chunks = int(chunk_end[-1])  # the host sync
    dst = chunk_first[seg_of_tok] * chunk + (pos - starts[seg_of_tok])
    if cu_seqlens is not None:
        init_id = final_id = tok_seq[starts]
        counts = torch.bincount(tok_seq, minlength=cu.numel() - 1)
        empty, nstates = (counts == 0).nonzero().squeeze(-1), cu.numel() - 1
    else:
        row = starts // L
        init_id = torch.where(starts % L == 0, row, torch.full_like(row, -1))
        final_id = torch.where((starts + lengths) % L == 0, row, torch.full_like(row, -1))
        empty, nstates = None, batch
    return ChunkSegments(dst, n_chunks, chunk_first, nchunks_seg, init_id, final_id, empty, nstates)
