"""Triton causal depthwise conv1d (+ SiLU, initial state, seq_idx) and its decode update, as torch custom ops.

``causal_conv1d`` and ``causal_conv1d_update`` take the public functions' arguments (docs/API.md). The output
keeps the input's layout: a channels-last x (b, d, L) = (b, L, d).transpose(1, 2) gives a channels-last y, so the
Mamba-2 layer never copies to transpose. Tiles and the backward path (one_pass / two_pass) come from launch.py;
the forward picks the backward path once and saves it for its backward. When the input x carries a
gradient-arena slot (ops/grad_arena.py), the backward writes dx into it.

Layer-facing API (stable; the fused training path in layers/mamba1.py runs the conv inside its own autograd node):
``conv1d_into(out, x, weight, ...)`` writes act(conv(x)) into a tensor of any strides, ``conv1d_backward(...)``
is the backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from mamba_parallel.ops.backend import gpu_compiled
from mamba_parallel.ops.conv1d import launch, naive
from mamba_parallel.ops.conv1d.naive import final_state, final_state_mask as _final_state_mask
from mamba_parallel.ops.conv1d.triton_conv1d_bwd import conv1d_bwd_kernel
from mamba_parallel.ops.conv1d.triton_conv1d_bwd_scan import conv1d_bwd_scan_kernel
from mamba_parallel.ops.conv1d.triton_conv1d_fwd import conv1d_fwd_kernel
from mamba_parallel.ops.conv1d.triton_conv1d_update import conv1d_update_kernel
from mamba_parallel.ops.eager_fastpath import eager, fastpath
from mamba_parallel.ops.grad_arena import grad_slot


def _channels_last(x: torch.Tensor) -> bool:
    return x.stride(1) == 1 and x.shape[2] > 1 and x.stride(2) != 1


def _empty_like_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b, d, L) tensor laid out like x: channels-last when x is, else contiguous."""
    b, d, L = x.shape
    if _channels_last(x):
        return torch.empty((b, L, d), dtype=dtype, device=x.device).transpose(1, 2)
    return torch.empty((b, d, L), dtype=dtype, device=x.device)


def backward_path(x: torch.Tensor, w: int, path: str | None = None) -> str:
    """The backward path for x (b, d, L) and filter width w (launch.backward_path; None: by x's layout)."""
    return launch.backward_path(_channels_last(x), w, path)


def _strides(t: Optional[torch.Tensor], n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


# ---------------------------------------------------------------------------------------------------- forward op

def _conv_fwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   initial_state: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], silu: bool,
                   return_final_state: bool, bwd_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (b, d, L), weight (d, w) -> y (b, d, L) in x's layout, final_state (b, d, w-1) (or (b, d, 0) unless asked).
    bwd_path: what the backward of this call runs (saved for it)."""
    b, d, L = x.shape
    w = weight.shape[1]
    y = _empty_like_layout(x, x.dtype)
    final = (final_state(x, initial_state, seq_idx, w) if return_final_state
             else x.new_empty((b, d, 0)))
    if b * d * L == 0:
        return y, final
    _launch_fwd(x, weight, bias, initial_state, seq_idx, None, y, silu)
    return y, final


_conv_fwd = torch.library.custom_op("mamba_parallel::causal_conv1d_fwd", mutates_args=())(_conv_fwd_impl)


def _launch_fwd(x, weight, bias, initial_state, seq_idx, dy, out, silu):
    """out = act(conv(x)); with dy given, out = dy * silu'(conv(x)) (the gradient at the pre-activation)."""
    b, d, L = x.shape
    t = launch.forward_tiles(_channels_last(x), d, L)
    conv1d_fwd_kernel[(triton.cdiv(L, t.block_l), triton.cdiv(d, t.block_d), b)](
        x, weight, bias, initial_state, seq_idx, dy, out,
        d, L,
        *x.stride(), *weight.stride(), *_strides(initial_state, 3), *_strides(seq_idx, 2), *_strides(dy, 3),
        *out.stride(),
        W=weight.shape[1], HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, DPRE=dy is not None, BLOCK_L=t.block_l, BLOCK_D=t.block_d,
        num_warps=t.num_warps,
    )


def conv1d_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                initial_state: Optional[torch.Tensor] = None, seq_idx: Optional[torch.Tensor] = None,
                silu: bool = False) -> torch.Tensor:
    """out (b, d, L), any strides <- act(causal_conv1d(x)) for x (b, d, L) any strides (no autograd)."""
    if out.numel():
        _launch_fwd(x, weight, bias, initial_state, seq_idx, None, out, silu)
    return out


@_conv_fwd.register_fake
def _(x, weight, bias, initial_state, seq_idx, silu, return_final_state, bwd_path):
    b, d, _ = x.shape
    w = weight.shape[1]
    return _empty_like_layout(x, x.dtype), x.new_empty((b, d, w - 1 if return_final_state else 0))


# --------------------------------------------------------------------------------------------------- backward op

def _conv_bwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   initial_state: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], dy: torch.Tensor,
                   dfinal: Optional[torch.Tensor], silu: bool, dx_out: Optional[torch.Tensor], path: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx (b, d, L) x's layout, dweight (d, w), dbias (d,) or empty, dinitial_state (b, d, w-1) or empty.

    With dx_out (b, d, L) given (a gradient-arena slice, any strides), dx is written there and the returned dx is
    an empty placeholder (a custom op may not return an alias of its input). path: launch.BACKWARD_PATHS.
    """
    b, d, L = x.shape
    w = weight.shape[1]
    if dx_out is not None and (dx_out.shape != x.shape or dx_out.dtype != x.dtype):
        raise ValueError(f"causal_conv1d backward: dx_out {tuple(dx_out.shape)} {dx_out.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    dx = dx_out if dx_out is not None else _empty_like_layout(x, x.dtype)
    dinit = torch.empty_like(initial_state) if initial_state is not None else x.new_empty((0,))
    if b * d * L > 0:
        run = launch.backward_launch(_channels_last(x), d, L, backward_path(x, w, path), gpu_compiled(x))
        backward = _launch_bwd_one_pass if run.path == launch.ONE_PASS else _launch_bwd_two_pass
        dw_part, db_part = backward(run, x, weight, bias, initial_state, seq_idx, dy, dx, dinit, silu)
        dweight = dw_part.sum(0).to(weight.dtype)
        dbias = db_part.sum(0).to(bias.dtype) if bias is not None else x.new_empty((0,))
    else:
        dweight = torch.zeros_like(weight)
        dbias = torch.zeros_like(bias) if bias is not None else x.new_empty((0,))
        if initial_state is not None:
            dinit.zero_()
    if dfinal is not None and w > 1:
        # final_state[j] is input L-(w-1)+j: route its gradient to x, or to the initial state before position 0
        g = dfinal.float()
        if seq_idx is not None:
            g = g * _final_state_mask(seq_idx, L, w)[:, None, :]
        first = max(0, (w - 1) - L)  # slots that come from the initial state
        if L > 0:
            dx[:, :, L - (w - 1) + first:] += g[:, :, first:].to(dx.dtype)
        if initial_state is not None and first > 0:
            dinit[:, :, L:L + first] += g[:, :, :first].to(dinit.dtype)
    if dx_out is not None:
        dx = x.new_empty((0,))
    return dx, dweight, dbias, dinit


_conv_bwd = torch.library.custom_op("mamba_parallel::causal_conv1d_bwd", mutates_args=("dx_out",))(_conv_bwd_impl)
fastpath(_conv_bwd, _conv_bwd_impl)


def conv1d_backward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    initial_state: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], dy: torch.Tensor,
                    dfinal: Optional[torch.Tensor], silu: bool, dx_out: Optional[torch.Tensor] = None,
                    path: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's backward (no autograd) -> (dx, dweight, dbias, dinitial_state), as the backward op returns them;
    path None: by x's layout (backward_path)."""
    return _conv_bwd_impl(x, weight, bias, initial_state, seq_idx, dy, dfinal, silu, dx_out,
                          backward_path(x, weight.shape[1], path))


def _bwd_grid(run: launch.BackwardLaunch, x) -> tuple[tuple[int, int, int], int]:
    """-> (grid, number of weight-gradient partial rows)."""
    b, d, L = x.shape
    n_lprog = triton.cdiv(triton.cdiv(L, run.block_l), run.tiles_per_program)
    return (n_lprog, triton.cdiv(d, run.block_d), b), b * n_lprog


def _partials(x, d: int, w: int, n_parts: int, has_bias: bool):
    dw_part = torch.empty((n_parts, d, w), dtype=torch.float32, device=x.device)
    db_part = torch.empty((n_parts, d) if has_bias else (0,), dtype=torch.float32, device=x.device)
    return dw_part, db_part


def _launch_bwd_one_pass(run, x, weight, bias, initial_state, seq_idx, dy, dx, dinit, silu):
    """One pass, dpre recomputed in registers (triton_conv1d_bwd_scan.py). -> (dweight, dbias) partials."""
    d, L, w = x.shape[1], x.shape[2], weight.shape[1]
    grid, n_parts = _bwd_grid(run, x)
    dw_part, db_part = _partials(x, d, w, n_parts, bias is not None)
    conv1d_bwd_scan_kernel[grid](
        x, weight, bias, initial_state, seq_idx, dy,
        dx, dinit, dw_part, db_part,
        d, L, run.tiles_per_program,
        *x.stride(), *weight.stride(), *_strides(initial_state, 3), *_strides(seq_idx, 2), *dy.stride(),
        *dx.stride(), *_strides(dinit if initial_state is not None else None, 3),
        W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, HAS_SEQ=seq_idx is not None,
        SILU=silu, FAST_SIGMOID=run.fast_sigmoid, BLOCK_L=run.block_l, BLOCK_D=run.block_d,
        num_warps=run.num_warps,
    )
    return dw_part, db_part


def _launch_bwd_two_pass(run, x, weight, bias, initial_state, seq_idx, dy, dx, dinit, silu):
    """dpre = dy * silu'(pre) written in fp32 by the forward kernel, then the backward kernel reads it."""
    d, L, w = x.shape[1], x.shape[2], weight.shape[1]
    grid, n_parts = _bwd_grid(run, x)
    dw_part, db_part = _partials(x, d, w, n_parts, bias is not None)
    dpre = dy
    if silu:  # fp32 gradient at the pre-activation, laid out like x
        dpre = _empty_like_layout(x, torch.float32)
        _launch_fwd(x, weight, bias, initial_state, seq_idx, dy, dpre, silu)
    conv1d_bwd_kernel[grid](
        x, weight, initial_state, seq_idx, dpre,
        dx, dinit, dw_part, db_part,
        d, L, run.tiles_per_program,
        *x.stride(), *weight.stride(), *_strides(initial_state, 3), *_strides(seq_idx, 2), *dpre.stride(),
        *dx.stride(), *_strides(dinit if initial_state is not None else None, 3),
        W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, HAS_SEQ=seq_idx is not None,
        BLOCK_L=run.block_l, BLOCK_D=run.block_d, BLOCK_W=triton.next_power_of_2(w), num_warps=run.num_warps,
    )
    return dw_part, db_part


@_conv_bwd.register_fake
def _(x, weight, bias, initial_state, seq_idx, dy, dfinal, silu, dx_out, path):
    return (_empty_like_layout(x, x.dtype) if dx_out is None else x.new_empty((0,)), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty((0,)),
            torch.empty_like(initial_state) if initial_state is not None else x.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_state, seq_idx, silu, return_final_state, bwd_path = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, seq_idx)
    ctx.silu, ctx.return_final_state, ctx.bwd_path = silu, return_final_state, bwd_path
    ctx.x_slot = grad_slot(x)  # a gradient-arena slice to write dx into (split_with_grad_arena), or None


def _backward(ctx, dy, dfinal):
    x, weight, bias, initial_state, seq_idx = ctx.saved_tensors
    if not ctx.return_final_state:
        dfinal = None
    if dy is None:  # only the final state reached the loss (eager fast path: unused gradients are None)
        dy = torch.zeros_like(x)
    dx_out = ctx.x_slot.get() if ctx.x_slot is not None else None
    dx, dweight, dbias, dinit = eager(_conv_bwd)(x, weight, bias, initial_state, seq_idx, dy, dfinal, ctx.silu, dx_out,
                                                 ctx.bwd_path)
    if dx_out is not None:
        dx = dx_out
    return (dx, dweight, dbias if bias is not None else None, dinit if initial_state is not None else None,
            None, None, None, None)


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)
fastpath(_conv_fwd, _conv_fwd_impl, setup_context=_setup_context, backward=_backward)


# ------------------------------------------------------------------------------------------------------ update op

def _conv_update_impl(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor], state_indices: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
    """x (b, d), conv_state (B, d, w-1) shifted in place -> y (b, d) in x.dtype."""
    b, d = x.shape
    w = weight.shape[1]
    y = x.new_empty((b, d))
    if b * d == 0:
        return y
    block_d = min(256, triton.next_power_of_2(d))
    conv1d_update_kernel[(b, triton.cdiv(d, block_d))](
        x, conv_state, weight, bias, state_indices, y,
        d, *x.stride(), *conv_state.stride(), *weight.stride(), *y.stride(),
        W=w, HAS_BIAS=bias is not None, HAS_IDX=state_indices is not None, SILU=silu, BLOCK_D=block_d,
        num_warps=4,
    )
    return y


_conv_update = torch.library.custom_op("mamba_parallel::causal_conv1d_update",
                                       mutates_args=("conv_state",))(_conv_update_impl)
fastpath(_conv_update, _conv_update_impl)


@_conv_update.register_fake
def _(x, conv_state, weight, bias, state_indices, silu):
    return x.new_empty(x.shape)


# ------------------------------------------------------------------------------------------- public-named entries

def _fp64(*ts) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in ts)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, initial_state: Optional[torch.Tensor] = None,
                  seq_idx: Optional[torch.Tensor] = None, return_final_state: bool = False,
                  bwd_path: Optional[str] = None):
    """x (b, d, L) any strides, weight (d, w), bias (d,), initial_state (b, d, w-1), seq_idx (b, L)
    -> y (b, d, L) [, final_state (b, d, w-1)]. bwd_path (launch.BACKWARD_PATHS; tests and benchmarks): the
    backward to run instead of the default, where the width allows it."""
    if _fp64(x, weight, bias, initial_state):  # the kernels compute in fp32; fp64 (gradcheck) keeps the reference
        return naive.causal_conv1d(x, weight, bias, activation, initial_state, seq_idx, return_final_state)
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    path = backward_path(x, weight.shape[1], bwd_path)
    y, final = eager(_conv_fwd)(x, weight, bias, initial_state, seq_idx, activation == "silu", bool(return_final_state),
                                path)
    return (y, final) if return_final_state else y


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                         state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (b, d), conv_state (B, d, w-1) updated in place (rows state_indices (b,) or all) -> y (b, d)."""
    if _fp64(x, conv_state, weight, bias):
        return naive.causal_conv1d_update(x, conv_state, weight, bias, activation, state_indices)
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d_update: activation must be None or 'silu', got {activation!r}")
    return eager(_conv_update)(x, conv_state, weight, bias, state_indices, activation == "silu")


__all__ = ["causal_conv1d", "causal_conv1d_update"]
