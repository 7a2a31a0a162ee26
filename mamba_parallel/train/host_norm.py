"""Gradient norms of host-resident tensors (CPU offload) on every core.

torch's foreach norm runs on one CPU thread: over a 7B model's bf16 gradients that is seconds of every offloaded
step. Here the tensors are cut into fixed-size pieces whose norms a thread pool computes (torch releases the GIL
in its kernels); the pieces do not depend on the number of threads, so neither does the result.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

PIECE = 1 << 22  # elements per piece
_POOL: dict[int, ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    if workers not in _POOL:
        _POOL[workers] = ThreadPoolExecutor(workers, thread_name_prefix="host-norm")
    return _POOL[workers]


def squared_norm(tensors: list[torch.Tensor], workers: int | None = None) -> torch.Tensor:
    """Sum of squares of all elements of ``tensors`` (same device and dtype), a 0-d fp32 tensor on their device.
    CPU tensors: each piece's 2-norm (in the tensors' dtype, as torch's foreach norm gives it) on a pool of
    ``workers`` threads (default: torch's intra-op thread count); other devices: one foreach norm."""
    if not tensors:
        raise ValueError("squared_norm: no tensors")
    if tensors[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(tensors, 2)).float().pow(2).sum()
    pieces = [p for t in tensors for p in (t.reshape(-1).split(PIECE) if t.numel() > PIECE else (t,))]
    workers = max(1, min(workers or torch.get_num_threads() or os.cpu_count() or 1, len(pieces)))
    if workers == 1:
        norms = torch._foreach_norm(pieces, 2)
    else:
        shares = [pieces[i::workers] for i in range(workers)]
        done = list(_pool(workers).map(lambda share: torch._foreach_norm(share, 2), shares))
        norms = [None] * len(pieces)
        for i, share in enumerate(done):
            norms[i::workers] = share
    return torch.stack(norms).float().pow(2).sum()
