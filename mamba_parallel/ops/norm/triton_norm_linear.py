"""Gated RMSNorm followed by a linear layer as ONE autograd node (Mamba-2's norm + out_proj) that keeps no norm output.

The linear's input gradient needs only its weight (dy = dout @ W); its weight gradient needs the norm's output y,
which the norm's backward kernel computes anyway: it stores it (one more write of (M, d)), then dW = dout^T @ y.
So the forward keeps what the norm's backward reads (x, z, rstd) and the linear's weight as given: an fp32
parameter under autocast is cast again in the backward, as the forward casts it, so neither the norm output nor the
cast copy lives from the forward to the backward. Same GEMMs as nn.Linear's forward and backward (same operands,
dtypes and transposes), so the values are those of the norm followed by nn.Linear.
"""

from __future__ import annotations

from typing import Optional

import torch

from mamba_parallel.ops._common import linear_dtype, linear_in
from mamba_parallel.ops.eager_fastpath import eager, fastpath
from mamba_parallel.ops.grad_arena import grad_slot
from mamba_parallel.ops.norm import naive
from mamba_parallel.ops.norm.triton_impl import _fp64, _launch_bwd, _norm_fwd_impl, _tagged_rows


# ---------------------------------------------------------------------------------------------------- forward op

def _fwd_impl(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, out_weight: torch.Tensor,
              out_bias: Optional[torch.Tensor], eps: float, group_size: int, norm_before_gate: bool,
              mm_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x/z (M, d) -> out (M, e) mm_dtype, rstd (G, M) fp32; the norm output lives only inside this call."""
    y, _, rstd = _norm_fwd_impl(x, z, None, weight, eps, group_size, norm_before_gate, False, x.dtype)
    out = linear_in(y, out_weight, out_bias, mm_dtype)
    return out, rstd


_fwd = torch.library.custom_op("mamba_parallel::gated_norm_linear_fwd", mutates_args=())(_fwd_impl)


@_fwd.register_fake
def _(x, z, weight, out_weight, out_bias, eps, group_size, norm_before_gate, mm_dtype):
    m, d = x.shape
    return (x.new_empty((m, out_weight.shape[0]), dtype=mm_dtype),
            x.new_empty((d // group_size, m), dtype=torch.float32))


# --------------------------------------------------------------------------------------------------- backward op

def _norm_bwd_impl(dy: torch.Tensor, xin: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor,
                   rstd: torch.Tensor, group_size: int, norm_before_gate: bool, store_y: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm's backward, also writing its forward output: -> dx (M, d) x.dtype, dz (M, d) (or empty),
    dweight (d,), y (M, d) x.dtype (empty without ``store_y``)."""
    m, d = xin.shape
    dx = torch.empty((m, d), dtype=xin.dtype, device=xin.device)
    dz = torch.empty((m, d) if z is not None else (0, d), dtype=z.dtype if z is not None else xin.dtype,
                     device=xin.device)
    y = torch.empty((m, d) if store_y else (0, d), dtype=xin.dtype, device=xin.device)
    dw = _launch_bwd(dy, None, xin, z, weight, rstd, group_size, norm_before_gate, dx, dx.new_empty((0, d)), dz,
                     y if store_y else None)
    return dx, dz, dw, y


_norm_bwd = torch.library.custom_op("mamba_parallel::gated_norm_bwd_rebuild", mutates_args=())(_norm_bwd_impl)
fastpath(_norm_bwd, _norm_bwd_impl)


@_norm_bwd.register_fake
def _(dy, xin, z, weight, rstd, group_size, norm_before_gate, store_y):
    m, d = xin.shape
    return (xin.new_empty((m, d)),
            xin.new_empty((m, d) if z is not None else (0, d), dtype=z.dtype if z is not None else xin.dtype),
            torch.empty_like(weight), xin.new_empty((m, d) if store_y else (0, d)))


def _setup_context(ctx, inputs, output):
    x, z, weight, out_weight, out_bias, eps, group_size, norm_before_gate, mm_dtype = inputs
    _, rstd = output
    ctx.save_for_backward(x, z, weight, rstd, out_weight)  # out_weight as given: no cast copy is kept
    ctx.group_size, ctx.norm_before_gate, ctx.mm_dtype = group_size, norm_before_gate, mm_dtype
    ctx.bias_dtype = out_bias.dtype if out_bias is not None else None
    # Gradient-arena slots (ops/grad_arena.py): dx / dz written straight into a split's gradient buffer
    ctx.x_slot = grad_slot(x)
    ctx.z_slot = grad_slot(z) if z is not None else None


def _backward(ctx, dout, _drstd):
    x, z, weight, rstd, out_weight = ctx.saved_tensors
    need_w, need_b = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
    mm = ctx.mm_dtype
    m, d = x.shape
    if dout is None:  # only rstd reached the loss (eager fast path: unused gradients are None)
        dout = torch.zeros((m, out_weight.shape[0]), dtype=mm, device=x.device)
    # the linear's input gradient (nn.Linear's GEMM), in the norm output's dtype as autocast's cast would give it
    dy = dout.mm(out_weight.to(mm)).to(x.dtype)
    if ctx.x_slot is not None or ctx.z_slot is not None:  # eager only: slots are never made while compiling
        dx = ctx.x_slot.get() if ctx.x_slot is not None else torch.empty((m, d), dtype=x.dtype, device=x.device)
        dz = None
        if z is not None:
            dz = ctx.z_slot.get() if ctx.z_slot is not None else torch.empty_like(z)
        y = torch.empty((m, d), dtype=x.dtype, device=x.device) if need_w else None
        dw = _launch_bwd(dy, None, x, z, weight, rstd, ctx.group_size, ctx.norm_before_gate, dx, dx.new_empty((0, d)),
                         dz if dz is not None else dx.new_empty((0, d)), y)
    else:
        dx, dz, dw, y = eager(_norm_bwd)(dy, x, z, weight, rstd, ctx.group_size, ctx.norm_before_gate, need_w)
    del dy
    # out_weight's gradient from the rebuilt norm output (nn.Linear's GEMM: dout^T @ input), in its own dtype
    d_out_w = dout.t().mm(y.to(mm)).to(out_weight.dtype) if need_w else None
    del y
    d_out_b = dout.sum(0).to(ctx.bias_dtype) if need_b else None
    return (dx, dz if z is not None else None, dw, d_out_w, d_out_b, None, None, None, None)


_fwd.register_autograd(_backward, setup_context=_setup_context)
fastpath(_fwd, _fwd_impl, setup_context=_setup_context, backward=_backward)


# -------------------------------------------------------------------------------------------- public-named entry

def gated_rms_norm_linear(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, out_weight: torch.Tensor,
                          out_bias: Optional[torch.Tensor] = None, eps: float = 1e-5,
                          group_size: Optional[int] = None, norm_before_gate: bool = False) -> torch.Tensor:
    """x/z (..., d), weight (d,), out_weight (e, d), out_bias (e,) or None -> (..., e) in ``linear_dtype``."""
    if _fp64(x, z, weight, out_weight, out_bias):  # the kernels compute in fp32; fp64 keeps the exact reference
        return naive.gated_rms_norm_linear(x, z, weight, out_weight, out_bias, eps, group_size, norm_before_gate)
    d = x.shape[-1]
    gs = d if group_size is None else int(group_size)
    out, _ = eager(_fwd)(_tagged_rows(x, d), _tagged_rows(z, d), weight, out_weight, out_bias, float(eps), gs,
                         bool(norm_before_gate), linear_dtype(x, out_weight))
    return out.view(*x.shape[:-1], out_weight.shape[0])
