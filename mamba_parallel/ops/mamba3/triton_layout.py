"""The token layout of the Mamba-3 kernels: rows of whole chunks, every sequence starting on a chunk boundary.

Unpacked input keeps its (b, L) rows (the last chunk of a row may be partial). Packed input (seq_idx or cu_seqlens)
is copied into one row where each sequence owns a whole number of chunks; padding slots hold zeros (dt = 0 there:
no decay, no input, the phase holds). Each chunk carries two codes: ``init`` (>= 0: the sequence starts here from
initial state ``init``; -1: it starts here from zero; -2: not a start) and ``final`` (>= 0: the sequence ends here
and its final state is number ``final``; -1: it ends here, state not returned; -2: not an end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass
class Layout:
    rows: int
    length: int  # tokens per kernel row
    nchunks: int
    init: torch.Tensor  # (rows, nchunks) int32
    final: torch.Tensor  # (rows, nchunks) int32
    chunk_seq: torch.Tensor  # (rows * nchunks,) int64: sequence of each chunk (sequences numbered in order)
    seq_final: torch.Tensor  # (nseq_in_layout,) int64: final-state index of each sequence, -1 when not returned
    seq_init: torch.Tensor  # (nseq_in_layout,) int64: initial-state index, -1 when it starts from zero
    nstates: int
    dst: torch.Tensor | None = None  # packed: (b * L,) slot of each token in the single row
    empty: torch.Tensor | None = None  # cu_seqlens sequences without tokens (final state = initial state)

    def pack(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """(b, L, ...) -> (rows, length, ...) (a copy with zero padding when packed, else t itself)."""
        if t is None or self.dst is None:
            return t
        out = t.new_zeros((1, self.length) + tuple(t.shape[2:]))
        out[0, self.dst] = t.reshape((-1,) + tuple(t.shape[2:]))
        return out

    def unpack(self, t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        """(rows, length, ...) -> the (b, L, ...) layout of ``like``."""
        if t is None or self.dst is None:
            return t
        return t[0, self.dst].reshape(like.shape[:2] + t.shape[2:])

    def first_tokens(self, chunk: int) -> torch.Tensor:
        """(rows, length) bool: the first token of every sequence."""
        starts = torch.zeros(self.rows, self.nchunks, chunk, dtype=torch.bool, device=self.init.device)
        starts[:, :, 0] = self.init != -2
        return starts.flatten(1)[:, :self.length]


def make_layout(b: int, L: int, chunk: int, seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                device) -> Layout:
    """The layout of (b, L) tokens for chunks of ``chunk``. Packed input syncs with the host once (the packed
    length decides the launch grids)."""
    i32 = dict(dtype=torch.int32, device=device)
    if seq_idx is None and cu_seqlens is None:
        nc = triton.cdiv(L, chunk)
        init = torch.full((b, nc), -2, **i32)
        final = torch.full((b, nc), -2, **i32)
        rows = torch.arange(b, **i32)
        init[:, 0], final[:, -1] = rows, rows
        seqs = torch.arange(b, device=device)
        return Layout(b, L, nc, init, final, seqs.repeat_interleave(nc), seqs, seqs, b)

    n_tok = b * L
    pos = torch.arange(n_tok, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        tok_seq = torch.searchsorted(cu[1:], pos, right=True)
        new = torch.ones(n_tok, dtype=torch.bool, device=device)
        new[1:] = tok_seq[1:] != tok_seq[:-1]
    else:
        s = seq_idx.to(device)
        new = torch.ones(b, L, dtype=torch.bool, device=device)
        new[:, 1:] = s[:, 1:] != s[:, :-1]
        new = new.reshape(-1)
    starts = new.nonzero().squeeze(-1)  # first token of each sequence
    seq_of_tok = torch.cumsum(new.to(torch.int64), 0) - 1
    lengths = torch.diff(starts, append=torch.tensor([n_tok], device=device))
    nchunks_seq = (lengths + chunk - 1) // chunk
    chunk_end = torch.cumsum(nchunks_seq, 0)
    chunk_first = chunk_end - nchunks_seq
    nc = int(chunk_end[-1])
    dst = chunk_first[seq_of_tok] * chunk + (pos - starts[seq_of_tok])
    if cu_seqlens is not None:
        init_id = final_id = tok_seq[starts]
        counts = torch.bincount(tok_seq, minlength=cu.numel() - 1)
        empty = (counts == 0).nonzero().squeeze(-1)
        nstates = cu.numel() - 1
    else:
        row = starts // L
        init_id = torch.where(starts % L == 0, row, torch.full_like(row, -1))
        final_id = torch.where((starts + lengths) % L == 0, row, torch.full_like(row, -1))
        empty, nstates = None, b
    init = torch.full((nc,), -2, **i32)
    final = torch.full((nc,), -2, **i32)
    init[chunk_first] = init_id.to(torch.int32)
    final[chunk_end - 1] = final_id.to(torch.int32)
    chunk_seq = torch.repeat_interleave(torch.arange(starts.numel(), device=device), nchunks_seq)
    return Layout(1, nc * chunk, nc, init[None], final[None], chunk_seq, final_id, init_id, nstates, dst, empty)
