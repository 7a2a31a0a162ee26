"""Layout glue of the Mamba-1 layer: no transposing copy and no concatenation by torch, forward or backward.

in_proj writes [x | z] as (b, L, 2 d_inner). The layer keeps both halves there as channels-last (b, d_inner, L)
views; the conv reads x through its strides, and

- ``token_major(x)`` turns the conv's channels-last output into the unit-token-stride (b, d_inner, L) that x_proj
  and the scan stream along, in one Triton copy; its backward passes the gradient through untouched (the conv's
  backward reads any strides);
- ``gate_to_token_last(y, z, grads)`` applies the gate outside the scan: out = y * silu(z) written as a contiguous
  (b, L, d_inner) for out_proj. Its backward writes dz straight into the z half of in_proj's output gradient
  (a buffer held by ``grads``) and dy token-major for the scan;
- the backward of ``split_xz`` then copies only dx (from the conv) into the x half and hands the whole buffer to
  in_proj.

On the Triton path (CUDA, or MAMBA_PARALLEL_BACKEND=triton) these run Triton kernels at copy bandwidth; otherwise
they are the plain torch expressions, with the same results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from mamba_parallel.ops.backend import triton_available, use_triton

_K = None
if triton_available():
    from mamba_parallel.layers import mamba1_layout_kernels as _K

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fast(*ts: torch.Tensor) -> bool:
    if _K is None or not use_triton(*ts, op="mamba1 layout"):
        return False
    return all(t.dtype == ts[0].dtype and t.dtype in _KERNEL_DTYPES for t in ts)


class GradBuffer:
    """in_proj's output gradient (b, L, 2 d_inner) while the backward fills it: the gate's backward allocates it and
    writes the z half; the split's backward writes the x half and returns it."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class _SplitXZ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xz, d_inner: int, grads: GradBuffer):
        ctx.set_materialize_grads(False)
        ctx.d_inner, ctx.grads, ctx.meta = d_inner, grads, (xz.shape, xz.dtype, xz.device)
        return xz[..., :d_inner].transpose(1, 2), xz[..., d_inner:].transpose(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx, dx, dz):
        shape, dtype, device = ctx.meta
        d = ctx.d_inner
        dxz, ctx.grads.tensor = ctx.grads.tensor, None
        if dxz is None or dxz.shape != shape or dxz.dtype != dtype:
            dxz = torch.empty(shape, dtype=dtype, device=device)
        for half, g in ((dxz[..., :d].transpose(1, 2), dx), (dxz[..., d:].transpose(1, 2), dz)):
            if g is None:
                half.zero_()
            elif not _same_view(g, half):  # the gate's dz is normally there already
                _K.copy_(g, half)
        return dxz, None, None


def _token_major_copy(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _K.copy_(x, out)
    return out


class _TokenMajor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _token_major_copy(x)

    @staticmethod
    def backward(ctx, g):
        return g  # same values, any layout: the producer's backward (the conv) reads strides


class _GateTokenLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, z, grads: GradBuffer | None):
        ctx.save_for_backward(y, z)
        ctx.grads = grads
        return _K.gate_fwd(y, z)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        y, z = ctx.saved_tensors
        b, d, L = z.shape
        want_dz = ctx.needs_input_grad[1]
        if want_dz and ctx.grads is not None:
            dxz = torch.empty((b, L, 2 * d), dtype=z.dtype, device=z.device)
            ctx.grads.tensor = dxz
            dz = dxz[..., d:].transpose(1, 2)
        else:
            dz = torch.empty_like(z)
        dy = _K.gate_bwd(dout, y, z, dz)
        return dy, dz if want_dz else None, None


def _needs_graph(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


@torch.compiler.disable  # GradBuffer is shared Python state between two backward nodes: keep it out of graphs
def split_xz(xz: torch.Tensor, d_inner: int) -> tuple[torch.Tensor, torch.Tensor, GradBuffer | None]:
    """xz (b, L, 2 d_inner) -> x, z (b, d_inner, L) channels-last views of it, and the GradBuffer to hand to
    ``gate_to_token_last`` (None off the Triton path or without autograd)."""
    if _fast(xz) and _needs_graph(xz) and xz.shape[-1] == 2 * d_inner:
        grads = GradBuffer()
        x, z = _SplitXZ.apply(xz, d_inner, grads)
        return x, z, grads
    return xz[..., :d_inner].transpose(1, 2), xz[..., d_inner:].transpose(1, 2), None


@torch.compiler.disable
def token_major(x: torch.Tensor) -> torch.Tensor:
    """x (b, d, L) any strides -> the same values with unit token stride (x itself when it has one)."""
    if x.stride(2) == 1 or x.shape[2] <= 1:
        return x
    if not _fast(x):
        return x.contiguous()
    return _TokenMajor.apply(x) if _needs_graph(x) else _token_major_copy(x)


@torch.compiler.disable
def gate_to_token_last(y: torch.Tensor, z: torch.Tensor, grads: GradBuffer | None = None) -> torch.Tensor:
    """y, z (b, d, L) any strides -> y * silu(z) (computed in fp32) as a contiguous (b, L, d) in y.dtype.

    ``grads`` (from ``split_xz``) receives dz in backward, so in_proj's output gradient needs no concatenation.
    """
    if not _fast(y, z):
        ct = torch.promote_types(torch.promote_types(y.dtype, z.dtype), torch.float32)
        return (y.to(ct) * F.silu(z.to(ct))).to(y.dtype).transpose(1, 2)
    if _needs_graph(y, z):
        return _GateTokenLast.apply(y, z, grads)
    return _K.gate_fwd(y, z)
