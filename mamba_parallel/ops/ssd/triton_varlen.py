"""seq_idx / cu_seqlens -> a chunk-aligned packed layout, so the SSD kernels never see a reset inside a chunk.

Every segment (a run of equal seq_idx in a row, or one cu_seqlens sequence) is copied to its own whole number of
chunks in a single row of length Lp; padding slots are flagged invalid (dt = 0 there: no decay, no input). Each
chunk gets the (init, final) codes of ``triton_states`` describing where its segment starts and ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packing:
    dst: torch.Tensor  # (b * L,) int64: packed slot of each token
    valid: torch.Tensor  # (1, Lp) int8
    seg: torch.Tensor  # (1, nchunks, 2) int32 codes
    empty: torch.Tensor | None  # (k,) int64: cu_seqlens sequences with no token (their final = their initial)

    def pack(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """(b, L, ...) -> (1, Lp, ...) with zero padding."""
        if t is None:
            return None
        out = t.new_zeros((1, self.valid.shape[1]) + tuple(t.shape[2:]))
        out[0, self.dst] = t.reshape((-1,) + tuple(t.shape[2:]))
        return out

    def unpack(self, t: torch.Tensor | None, like: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
        """(1, Lp, ...) -> the (b, L, ...) layout of ``like``; gathered straight into ``out`` (like's shape, any
        strides whose (b, L) dimensions merge, e.g. a slice of a gradient arena) when given."""
        if t is None:
            return None
        shape = like.shape[:2] + t.shape[2:]
        if out is not None:
            try:
                rows = out.view((-1,) + tuple(t.shape[2:]))
            except RuntimeError:  # (b, L) do not merge in out: gather, then copy
                return out.copy_(t[0, self.dst].reshape(shape))
            torch.index_select(t[0], 0, self.dst, out=rows)
            return out
        return t[0, self.dst].reshape(shape)


def make_packing(batch: int, L: int, chunk: int, seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                 device) -> Packing:
    """seq_idx (b, L) or cu_seqlens (nseq + 1,) with b == 1 -> Packing.

    Syncs with the host once: the packed size is data-dependent."""
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
    n_chunks = int(chunk_end[-1])  # host sync: the packed size decides the launch grids
    dst = chunk_first[seg_of_tok] * chunk + (pos - starts[seg_of_tok])
    valid = torch.zeros(1, n_chunks * chunk, dtype=torch.int8, device=device)
    valid[0, dst] = 1

    if cu_seqlens is not None:
        init_id = final_id = tok_seq[starts]
        counts = torch.bincount(tok_seq, minlength=cu.numel() - 1)
        empty = (counts == 0).nonzero().squeeze(-1)
    else:
        row_start = starts % L == 0
        row_end = (starts + lengths) % L == 0
        row = starts // L
        init_id = torch.where(row_start, row, torch.full_like(row, -1))
        final_id = torch.where(row_end, row, torch.full_like(row, -1))
        empty = None
    seg = torch.full((n_chunks, 2), -2, dtype=torch.int32, device=device)
    seg[chunk_first, 0] = init_id.to(torch.int32)
    seg[chunk_end - 1, 1] = final_id.to(torch.int32)
    return Packing(dst=dst, valid=valid, seg=seg.unsqueeze(0), empty=empty)
