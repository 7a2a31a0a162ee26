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

from mamba_parallel.ops.chunk_segments import chunk_segments


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


def strides(t, n=4):
    """t's strides, zeros (n of them) for None."""
    return tuple(t.stride()) if t is not None else (0,) * n


def bc_strides(t):
    """B / C (b, L, [R,] g, n) -> (sb, st, sr, sg, sn) (sr = 0 for SISO)."""
    if t.dim() == 5:
        return tuple(t.stride())
    sb, st, sg, sn = t.stride()
    return sb, st, 0, sg, sn


def row_strides(t):
    """Per-row outputs (b, L, [R,] h, p) -> (sb, st, sr, sh, sp) (sr = 0 for SISO); zeros for None."""
    if t is None:
        return (0,) * 5
    if t.dim() == 5:
        return tuple(t.stride())
    sb, st, sh, sp = t.stride()
    return sb, st, 0, sh, sp


def make_layout(b: int, L: int, chunk: int, seq_idx: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                device) -> Layout:
    """The layout of (b, L) tokens for chunks of ``chunk``. Packed input syncs with the host once (the packed
    length decides the launch grids)."""
    if seq_idx is None and cu_seqlens is None:
        key = (b, L, chunk, torch.device(device))
        lay = _plain.get(key)
        if lay is None:
            lay = _plain_layout(b, L, chunk, device)
            # kept for the next call of the same shape (its tensors are only read), except those made while a
            # CUDA graph is captured: they live in the graph's memory pool
            if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                if len(_plain) >= 64:
                    _plain.pop(next(iter(_plain)))
                _plain[key] = lay
        return lay

    i32 = dict(dtype=torch.int32, device=device)
    segs = chunk_segments(b, L, chunk, seq_idx, cu_seqlens, device)
    nc = segs.n_chunks
    init = torch.full((nc,), -2, **i32)
    final = torch.full((nc,), -2, **i32)
    init[segs.chunk_first] = segs.init_id.to(torch.int32)
    final[segs.chunk_last] = segs.final_id.to(torch.int32)
    chunk_seq = torch.repeat_interleave(torch.arange(segs.init_id.numel(), device=device), segs.nchunks_seg)
    return Layout(1, nc * chunk, nc, init[None], final[None], chunk_seq, segs.final_id, segs.init_id, segs.nstates,
                  segs.dst, segs.empty)


_plain: dict = {}  # (b, L, chunk, device) -> Layout of unpacked input


def _plain_layout(b: int, L: int, chunk: int, device) -> Layout:
    """Unpacked rows: every row one sequence, its initial and final state numbered by the row."""
    i32 = dict(dtype=torch.int32, device=device)
    nc = triton.cdiv(L, chunk)
    init = torch.full((b, nc), -2, **i32)
    final = torch.full((b, nc), -2, **i32)
    rows = torch.arange(b, **i32)
    init[:, 0], final[:, -1] = rows, rows
    seqs = torch.arange(b, device=device)
    return Layout(b, L, nc, init, final, seqs.repeat_interleave(nc), seqs, seqs, b)
