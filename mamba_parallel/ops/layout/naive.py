"""The layout ops in plain PyTorch (the specification; no kernel, torch chooses the copies)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_major(x: torch.Tensor) -> torch.Tensor:
    """x (b, d, L) any strides -> the same values with unit token stride (b, d, L)."""
    return x.contiguous()


def silu_gate(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y, z (b, d, L) -> y * silu(z) computed in fp32 (fp64 for fp64 inputs), as (b, L, d) in y.dtype (a
    transposed view)."""
    ct = torch.promote_types(torch.promote_types(y.dtype, z.dtype), torch.float32)
    return (y.to(ct) * F.silu(z.to(ct))).to(y.dtype).transpose(1, 2)
