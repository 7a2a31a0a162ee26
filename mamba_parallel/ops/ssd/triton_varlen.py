"""seq_idx / cu_seqlens -> a chunk-aligned packed layout, so the SSD kernels never see a reset inside a chunk.

Every segment (a run of equal seq_idx in a row, or one cu_seqlens sequence) is copied to its own whole number of
chunks in a single row of length Lp; padding slots are flagged invalid (dt = 0 there: no decay, no input). Each
chunk gets the (init, final) codes of ``triton_states`` describing where its segment starts and ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mamba_parallel.ops.chunk_segments import chunk_segments


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
    segs = chunk_segments(batch, L, chunk, seq_idx, cu_seqlens, device)
    valid = torch.zeros(1, segs.n_chunks * chunk, dtype=torch.int8, device=device)
    valid[0, segs.dst] = 1
    seg = torch.full((segs.n_chunks, 2), -2, dtype=torch.int32, device=device)
    seg[segs.chunk_first, 0] = segs.init_id.to(torch.int32)
    seg[segs.chunk_last, 1] = segs.final_id.to(torch.int32)
    return Packing(dst=segs.dst, valid=valid, seg=seg.unsqueeze(0), empty=segs.empty)
