"""Layout ops of the Mamba-1 layer: (b, d, L) tensors moved between layouts at copy bandwidth.

in_proj writes [x | z] as (b, L, 2 d_inner): x and z are channels-last (b, d_inner, L) views; the conv and scan
kernels stream along L; out_proj reads (b, L, d_inner). Torch's transposing copies run far below bandwidth; here
each layout change is one read and one write: ``token_major(x)`` (the conv's output for x_proj and the scan; the
gradient passes through) and ``silu_gate(y, z)`` (y * silu(z) written as out_proj's input; dz goes straight into
z's gradient-arena slot, ops/grad_arena.py). triton_impl.py and naive.py give the same values.
"""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import check_ndim, check_shape, kernel_module
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.layout import naive

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernel():
    return kernel_module(__name__)


def _on_kernel(op: str, *ts: torch.Tensor) -> bool:
    """The Triton path: the backend picks it and every tensor has one of the kernels' dtypes (the same one)."""
    if not use_triton(*ts, op=op, has_kernel=_kernel() is not None):
        return False
    return all(t.dtype == ts[0].dtype and t.dtype in _KERNEL_DTYPES for t in ts)


@torch.compiler.disable  # the kernels' autograd wiring (gradient slots) is eager-only
def token_major(x: torch.Tensor) -> torch.Tensor:
    """x (b, d, L) any strides -> the same values with unit token stride (x itself when it has one)."""
    check_ndim("token_major", "x", x, (3,), "(b, d, L)")
    if x.stride(2) == 1 or x.shape[2] <= 1:
        return x
    if _on_kernel("token_major", x):
        return _kernel().token_major(x)
    return naive.token_major(x)


@torch.compiler.disable
def silu_gate(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y, z (b, d, L) any strides -> y * silu(z) (computed in fp32) as (b, L, d) in y.dtype: contiguous on the
    Triton path (a transposed view on the reference path). dz goes to z's gradient-arena slot when it has one."""
    check_ndim("silu_gate", "y", y, (3,), "(b, d, L)")
    check_shape("silu_gate", "z", z, *zip(("b", "d", "L"), y.shape))
    if _on_kernel("silu_gate", y, z):
        return _kernel().silu_gate(y, z)
    return naive.silu_gate(y, z)


__all__ = ["token_major", "silu_gate"]
