"""Triton causal depthwise conv1d (+ SiLU, initial state, seq_idx) and its decode update, as torch custom ops.

``causal_conv1d`` and ``causal_conv1d_update`` take the public functions' arguments (docs/API.md). The output
keeps the input's layout: a channels-last x (b, d, L) = (b, L, d).transpose(1, 2) gives a channels-last y, so the
Mamba-2 layer never copies to transpose.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from mamba_parallel.ops.conv1d import naive
from mamba_parallel.ops.conv1d.triton_conv1d_bwd import conv1d_bwd_kernel
from mamba_parallel.ops.conv1d.triton_conv1d_fwd import conv1d_fwd_kernel
from mamba_parallel.ops.conv1d.triton_conv1d_update import conv1d_update_kernel


def _channels_last(x: torch.Tensor) -> bool:
    return x.stride(1) == 1 and x.shape[2] > 1 and x.stride(2) != 1


def _empty_like_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(b, d, L) tensor laid out like x: channels-last when x is, else contiguous."""
    b, d, L = x.shape
    if _channels_last(x):
        return torch.empty((b, L, d), dtype=dtype, device=x.device).transpose(1, 2)
    return torch.empty((b, d, L), dtype=dtype, device=x.device)


# Tiles (BLOCK_L, BLOCK_D, num_warps) per pass and layout. Forward: measured on an H200 at b8 d5376 L2048 bf16
# (channels-last 16x128: 0.14 ms, 2.5 TB/s). Backward: small enough that the w-tap weight-gradient accumulators fit
# without spilling on sm_90 (72 registers; 126 with initial state and seq_idx). One backward program walks
# BWD_TILES_PER_PROGRAM tiles, so few weight-gradient partials remain to sum.
TILES = {
    ("fwd", "channels_last"): (16, 128, 4), ("fwd", "contiguous"): (128, 16, 4),
    ("bwd", "channels_last"): (8, 64, 4), ("bwd", "contiguous"): (64, 8, 4),
}
BWD_TILES_PER_PROGRAM = 16


def _tile_override(pass_: str) -> tuple[int, int, int] | None:
    """MAMBA_PARALLEL_CONV_TILES='BLf,BDf,NWf,BLb,BDb,NWb' overrides the tiles (benchmark sweeps)."""
    spec = os.environ.get("MAMBA_PARALLEL_CONV_TILES")
    if not spec:
        return None
    try:
        vals = [int(v) for v in spec.split(",")]
        assert len(vals) == 6 and all(v > 0 and v & (v - 1) == 0 for v in vals)
    except (ValueError, AssertionError):
        raise ValueError(f"MAMBA_PARALLEL_CONV_TILES={spec!r}: expected six powers of two "
                         "'BLOCK_L,BLOCK_D,num_warps' for the forward then the backward") from None
    return tuple(vals[:3]) if pass_ == "fwd" else tuple(vals[3:])


def _tiles(x: torch.Tensor, pass_: str) -> tuple[int, int, int]:
    """(BLOCK_L, BLOCK_D, num_warps): wide in the unit-stride axis so loads coalesce, clipped to the shape."""
    _, d, L = x.shape
    layout = "channels_last" if _channels_last(x) else "contiguous"
    block_l, block_d, warps = _tile_override(pass_) or TILES[(pass_, layout)]
    return min(block_l, triton.next_power_of_2(L)), min(block_d, triton.next_power_of_2(d)), warps


def _strides(t: Optional[torch.Tensor], n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def _final_state_mask(seq_idx: torch.Tensor, L: int, w: int) -> torch.Tensor:
    """(b, w-1) bool: final-state slot j (input L-(w-1)+j) belongs to the last token's sequence."""
    pos = torch.arange(L - (w - 1), L, device=seq_idx.device).clamp_min(0)
    return seq_idx[:, pos] == seq_idx[:, -1:]


def _final_state(x, initial_state, seq_idx, w: int) -> torch.Tensor:
    """The last w-1 inputs of [initial_state, x] (b, d, w-1) in x.dtype, zeroed outside the last sequence."""
    b, d, L = x.shape
    if L >= w - 1:
        tail = x[:, :, L - (w - 1):]
    else:
        pre = initial_state if initial_state is not None else x.new_zeros((b, d, w - 1))
        tail = torch.cat([pre[:, :, L:].to(x.dtype), x], dim=-1)
    if seq_idx is not None:
        tail = tail * _final_state_mask(seq_idx, L, w)[:, None, :].to(x.dtype)
    # a fresh tensor: a custom op's output may not alias its input
    return tail.to(x.dtype).clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------------- forward op

@torch.library.custom_op("mamba_parallel::causal_conv1d_fwd", mutates_args=())
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              initial_state: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], silu: bool,
              return_final_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (b, d, L), weight (d, w) -> y (b, d, L) in x's layout, final_state (b, d, w-1) (or (b, d, 0) unless asked)."""
    b, d, L = x.shape
    w = weight.shape[1]
    y = _empty_like_layout(x, x.dtype)
    final = (_final_state(x, initial_state, seq_idx, w) if return_final_state
             else x.new_empty((b, d, 0)))
    if b * d * L == 0:
        return y, final
    _launch_fwd(x, weight, bias, initial_state, seq_idx, None, y, silu)
    return y, final


def _launch_fwd(x, weight, bias, initial_state, seq_idx, dy, out, silu):
    """out = act(conv(x)); with dy given, out = dy * silu'(conv(x)) (the gradient at the pre-activation)."""
    b, d, L = x.shape
    block_l, block_d, warps = _tiles(x, "fwd")
    conv1d_fwd_kernel[(triton.cdiv(L, block_l), triton.cdiv(d, block_d), b)](
        x, weight, bias, initial_state, seq_idx, dy, out,
        d, L,
        *x.stride(), *weight.stride(), *_strides(initial_state, 3), *_strides(seq_idx, 2), *_strides(dy, 3),
        *out.stride(),
        W=weight.shape[1], HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None,
        HAS_SEQ=seq_idx is not None, SILU=silu, DPRE=dy is not None, BLOCK_L=block_l, BLOCK_D=block_d,
        num_warps=warps,
    )


@_conv_fwd.register_fake
def _(x, weight, bias, initial_state, seq_idx, silu, return_final_state):
    b, d, _ = x.shape
    w = weight.shape[1]
    return _empty_like_layout(x, x.dtype), x.new_empty((b, d, w - 1 if return_final_state else 0))


# --------------------------------------------------------------------------------------------------- backward op

@torch.library.custom_op("mamba_parallel::causal_conv1d_bwd", mutates_args=())
def _conv_bwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              initial_state: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], dy: torch.Tensor,
              dfinal: Optional[torch.Tensor], silu: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx (b, d, L) x's layout, dweight (d, w), dbias (d,) or empty, dinitial_state (b, d, w-1) or empty."""
    b, d, L = x.shape
    w = weight.shape[1]
    dx = _empty_like_layout(x, x.dtype)
    dinit = torch.empty_like(initial_state) if initial_state is not None else x.new_empty((0,))
    block_l, block_d, warps = _tiles(x, "bwd")
    n_tiles = triton.cdiv(L, block_l)
    tiles_per_program = min(n_tiles, BWD_TILES_PER_PROGRAM)
    n_lprog = triton.cdiv(n_tiles, tiles_per_program)
    dw_part = torch.empty((b * n_lprog, d, w), dtype=torch.float32, device=x.device)
    db_part = torch.empty((b * n_lprog, d) if bias is not None else (0,), dtype=torch.float32, device=x.device)
    if b * d * L > 0:
        dpre = dy
        if silu:  # fp32 gradient at the pre-activation, laid out like x
            dpre = _empty_like_layout(x, torch.float32)
            _launch_fwd(x, weight, bias, initial_state, seq_idx, dy, dpre, silu)
        conv1d_bwd_kernel[(n_lprog, triton.cdiv(d, block_d), b)](
            x, weight, initial_state, seq_idx, dpre,
            dx, dinit, dw_part, db_part,
            d, L, tiles_per_program,
            *x.stride(), *weight.stride(), *_strides(initial_state, 3), *_strides(seq_idx, 2), *dpre.stride(),
            *dx.stride(), *_strides(dinit if initial_state is not None else None, 3),
            W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, HAS_SEQ=seq_idx is not None,
            BLOCK_L=block_l, BLOCK_D=block_d, BLOCK_W=triton.next_power_of_2(w), num_warps=warps,
        )
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
    return dx, dweight, dbias, dinit


@_conv_bwd.register_fake
def _(x, weight, bias, initial_state, seq_idx, dy, dfinal, silu):
    return (_empty_like_layout(x, x.dtype), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty((0,)),
            torch.empty_like(initial_state) if initial_state is not None else x.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_state, seq_idx, silu, return_final_state = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, seq_idx)
    ctx.silu, ctx.return_final_state = silu, return_final_state


def _backward(ctx, dy, dfinal):
    x, weight, bias, initial_state, seq_idx = ctx.saved_tensors
    if not ctx.return_final_state:
        dfinal = None
    dx, dweight, dbias, dinit = _conv_bwd(x, weight, bias, initial_state, seq_idx, dy, dfinal, ctx.silu)
    return (dx, dweight, dbias if bias is not None else None, dinit if initial_state is not None else None,
            None, None, None)


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------------ update op

@torch.library.custom_op("mamba_parallel::causal_conv1d_update", mutates_args=("conv_state",))
def _conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 state_indices: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
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


@_conv_update.register_fake
def _(x, conv_state, weight, bias, state_indices, silu):
    return x.new_empty(x.shape)


# ------------------------------------------------------------------------------------------- public-named entries

def _fp64(*ts) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in ts)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, initial_state: Optional[torch.Tensor] = None,
                  seq_idx: Optional[torch.Tensor] = None, return_final_state: bool = False):
    """x (b, d, L) any strides, weight (d, w), bias (d,), initial_state (b, d, w-1), seq_idx (b, L)
    -> y (b, d, L) [, final_state (b, d, w-1)]."""
    if _fp64(x, weight, bias, initial_state):  # the kernels compute in fp32; fp64 (gradcheck) keeps the reference
        return naive.causal_conv1d(x, weight, bias, activation, initial_state, seq_idx, return_final_state)
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    y, final = _conv_fwd(x, weight, bias, initial_state, seq_idx, activation == "silu", bool(return_final_state))
    return (y, final) if return_final_state else y


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                         state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (b, d), conv_state (B, d, w-1) updated in place (rows state_indices (b,) or all) -> y (b, d)."""
    if _fp64(x, conv_state, weight, bias):
        return naive.causal_conv1d_update(x, conv_state, weight, bias, activation, state_indices)
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d_update: activation must be None or 'silu', got {activation!r}")
    return _conv_update(x, conv_state, weight, bias, state_indices, activation == "silu")


__all__ = ["causal_conv1d", "causal_conv1d_update"]
