"""The block's residual add + RMSNorm followed by the mixer's in_proj as ONE autograd node that keeps no norm output.

As for the gated norm + out_proj node (triton_norm_linear.py): in_proj's input gradient needs only its weight, and
its weight gradient needs the norm's output y, which the norm's backward kernel rebuilds from what it reads anyway
(the new residual and rstd) with one more store. The node keeps the new residual, rstd, the norm weight and
in_proj's weight as given (an fp32 parameter under autocast is cast again in the backward), so neither y nor
autocast's bf16 copy of in_proj's weight lives from the forward to the backward. The GEMMs are nn.Linear's (same
operands, dtypes and transposes), and y is rebuilt from the same fp32 products in the same order: the values are
those of add_rms_norm followed by nn.Linear. That needs the kept residual in fp32 (``residual_in_fp32``, or fp32
inputs), from which the forward's y came; with a narrower residual the op is add_rms_norm followed by F.linear.
"""

from __future__ import annotations

from typing import Optional

import torch

from mamba_parallel.ops._common import linear_dtype, linear_in
from mamba_parallel.ops.eager_fastpath import eager, fastpath
from mamba_parallel.ops.norm import naive
from mamba_parallel.ops.norm.triton_impl import _fp64, _launch_bwd, _norm_fwd_impl, _rows, add_rms_norm


def _fwd_impl(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, lin_weight: torch.Tensor,
              lin_bias: Optional[torch.Tensor], eps: float, residual_dtype: torch.dtype, mm_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x/residual (M, d) -> out (M, e) mm_dtype, new residual (M, d) residual_dtype, rstd (1, M) fp32."""
    y, res_out, rstd = _norm_fwd_impl(x, None, residual, weight, eps, x.shape[1], False, True, residual_dtype)
    out = linear_in(y, lin_weight, lin_bias, mm_dtype)
    return out, res_out, rstd


_fwd = torch.library.custom_op("mamba_parallel::add_norm_linear_fwd", mutates_args=())(_fwd_impl)


@_fwd.register_fake
def _(x, residual, weight, lin_weight, lin_bias, eps, residual_dtype, mm_dtype):
    m, d = x.shape
    return (x.new_empty((m, lin_weight.shape[0]), dtype=mm_dtype), x.new_empty((m, d), dtype=residual_dtype),
            x.new_empty((1, m), dtype=torch.float32))


def _bwd_impl(dy: torch.Tensor, dres_out: Optional[torch.Tensor], res: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor, x_dtype: torch.dtype, dres_dtype: Optional[torch.dtype], store_y: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The norm's backward, also writing its forward output: -> dx (M, d) x_dtype, dresidual (M, d) dres_dtype (or
    empty), dweight (d,), y (M, d) x_dtype (empty without ``store_y``)."""
    m, d = res.shape
    dx = torch.empty((m, d), dtype=x_dtype, device=res.device)
    dres = torch.empty((m, d) if dres_dtype is not None else (0, d), dtype=dres_dtype or x_dtype, device=res.device)
    y = torch.empty((m, d) if store_y else (0, d), dtype=x_dtype, device=res.device)
    dw = _launch_bwd(dy, dres_out, res, None, weight, rstd, d, False, dx, dres, dx.new_empty((0, d)),
                     y if store_y else None)
    return dx, dres, dw, y


_bwd = torch.library.custom_op("mamba_parallel::add_norm_linear_bwd", mutates_args=())(_bwd_impl)
fastpath(_bwd, _bwd_impl)


@_bwd.register_fake
def _(dy, dres_out, res, weight, rstd, x_dtype, dres_dtype, store_y):
    m, d = res.shape
    return (res.new_empty((m, d), dtype=x_dtype),
            res.new_empty((m, d) if dres_dtype is not None else (0, d), dtype=dres_dtype or x_dtype),
            torch.empty_like(weight), res.new_empty((m, d) if store_y else (0, d), dtype=x_dtype))


def _setup_context(ctx, inputs, output):
    x, residual, weight, lin_weight, lin_bias, eps, residual_dtype, mm_dtype = inputs
    _, res_out, rstd = output
    ctx.save_for_backward(res_out, weight, rstd, lin_weight)  # lin_weight as given: no cast copy is kept
    ctx.x_dtype, ctx.mm_dtype = x.dtype, mm_dtype
    ctx.res_dtype = residual.dtype if residual is not None else None
    ctx.bias_dtype = lin_bias.dtype if lin_bias is not None else None


def _backward(ctx, dout, dres_out, _drstd):
    res, weight, rstd, lin_weight = ctx.saved_tensors
    need_w, need_b = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
    mm = ctx.mm_dtype
    if dout is None:  # only the residual reached the loss (eager fast path: unused gradients are None)
        dout = torch.zeros((res.shape[0], lin_weight.shape[0]), dtype=mm, device=res.device)
    # in_proj's input gradient (nn.Linear's GEMM), in the norm output's dtype as autocast's cast would give it
    dy = dout.mm(lin_weight.to(mm)).to(ctx.x_dtype)
    dres_out = None if dres_out is None else dres_out.contiguous()
    dx, dres, dw, y = eager(_bwd)(dy, dres_out, res, weight, rstd, ctx.x_dtype, ctx.res_dtype, need_w)
    del dy
    # in_proj's weight gradient from the rebuilt norm output (nn.Linear's GEMM: dout^T @ input), in its own dtype
    d_lin_w = dout.t().mm(y.to(mm)).to(lin_weight.dtype) if need_w else None
    del y
    d_lin_b = dout.sum(0).to(ctx.bias_dtype) if need_b else None
    return dx, (dres if ctx.res_dtype is not None else None), dw, d_lin_w, d_lin_b, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)
fastpath(_fwd, _fwd_impl, setup_context=_setup_context, backward=_backward)


def add_rms_norm_linear(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                        lin_weight: torch.Tensor, lin_bias: Optional[torch.Tensor] = None, eps: float = 1e-5,
                        residual_in_fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d), residual (..., d) or None, weight (d,), lin_weight (e, d), lin_bias (e,) or None ->
    (out (..., e) in ``linear_dtype``, new residual (..., d))."""
    if _fp64(x, residual, weight, lin_weight, lin_bias):  # the kernels compute in fp32; fp64 keeps the reference
        return naive.add_rms_norm_linear(x, residual, weight, lin_weight, lin_bias, eps, residual_in_fp32)
    d = x.shape[-1]
    res_dtype = torch.float32 if residual_in_fp32 else x.dtype
    if res_dtype != torch.float32:  # y comes from the fp32 sum, which a narrower kept residual could not rebuild
        y, new_res = add_rms_norm(x, residual, weight, eps, residual_in_fp32)
        return linear_in(y, lin_weight, lin_bias, linear_dtype(y, lin_weight)), new_res
    out, res_out, _ = eager(_fwd)(_rows(x, d), _rows(residual, d), weight, lin_weight, lin_bias, float(eps),
                                  res_dtype, linear_dtype(x, lin_weight))
    return out.view(*x.shape[:-1], lin_weight.shape[0]), res_out.view(x.shape)
