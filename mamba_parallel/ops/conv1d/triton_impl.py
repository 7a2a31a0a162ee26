"""Triton causal depthwise conv1d (+ SiLU, initial state, seq_idx) and its decode update, as torch custom ops.

``causal_conv1d`` and ``causal_conv1d_update`` take the public functions' arguments (docs/API.md). The output
keeps the input's layout: a channels-last x (b, d, L) = (b, L, d).transpose(1, 2) gives a channels-last y, so the
Mamba-2 layer never copies to transpose.

Backward variants (MAMBA_PARALLEL_CONV_BWD forces one; default: fused_scan for channels-last x, twopass for the
contiguous layout; widths w > 4 always take twopass):
  fused_scan    one pass, each thread walks positions with sliding windows of x and dpre (triton_conv1d_bwd_scan.py)
  twopass       dpre = dy * silu'(pre) written in fp32 by the forward kernel, then triton_conv1d_bwd.py
Backward tiles: MAMBA_PARALLEL_CONV_BWD_TILES='BLOCK_L,BLOCK_D,num_warps,tiles_per_program[,flags[,maxnreg]]'
(see BWD_TILES); MAMBA_PARALLEL_CONV_TILES='BLf,BDf,NWf,BLb,BDb,NWb' still sets forward and backward tiles.
When the input x carries a gradient-arena slot (ops/grad_arena.py), the backward writes dx into it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from mamba_parallel.ops.conv1d import naive
from mamba_parallel.ops.conv1d.triton_conv1d_bwd import conv1d_bwd_kernel
from mamba_parallel.ops.conv1d.triton_conv1d_bwd_scan import MAX_WIDTH, conv1d_bwd_scan_kernel
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


# Forward tiles (BLOCK_L, BLOCK_D, num_warps) per layout, measured on an H200 at b8 d5376 L2048 bf16 (channels-last
# 16x128: 0.14 ms, 2.5 TB/s). The two-pass backward's DPRE step uses them too.
TILES = {"channels_last": (16, 128, 4), "contiguous": (128, 16, 4)}
# Backward tiles (BLOCK_L, BLOCK_D, num_warps, tiles_per_program, flags, maxnreg) per variant and layout. A program
# walks tiles_per_program tiles of BLOCK_L positions (fused_scan: rows per unrolled step) along L, so few
# weight-gradient partials remain to sum. Flags (fused_scan only): "p" loads the next step's x and dy rows before
# computing the current ones, "f" takes the sigmoid from approximate flush-to-zero ex2 / rcp (inline PTX, ~2 ulp;
# ignored off CUDA, e.g. in the interpreter); maxnreg (0: none) caps registers per thread. H200 kernel times (bf16,
# b8 d4352 L2048 w4 silu, channels-last; docs/results/conv_bwd_variants.json): fused_scan 0.153 ms at the tiles
# below, 0.155 at (8,128,1,16,"f"), 0.157 at (8,512,4,16,"f"), 0.212 at the old (8,256,2,16,"f"); twopass 0.659 ms
# (three other one-pass variants, 0.46-3.3 ms, were removed); fused_scan vs twopass: max relative error 1.3e-3.
# twopass's tiles keep its w-tap accumulators unspilled on sm_90; the contiguous rows are untimed.
BWD_TILES = {
    ("twopass", "channels_last"): (8, 64, 4, 16, "", 0), ("twopass", "contiguous"): (64, 8, 4, 16, "", 0),
    ("fused_scan", "channels_last"): (4, 256, 2, 32, "pf", 0),
    ("fused_scan", "contiguous"): (8, 64, 2, 16, "f", 0),
}
BWD_FLAGS = "pf"
BWD_VARIANTS = ("twopass", "fused_scan")
# fused_scan reads one row of channels per step: coalesced only channels-last; the contiguous layout keeps twopass
# (fused_scan was never timed there)
DEFAULT_BWD = {"channels_last": "fused_scan", "contiguous": "twopass"}


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _int_list(name: str, spec: str, n: int, expected: str) -> list[int]:
    try:
        vals = [int(v) for v in spec.split(",")]
    except ValueError:
        vals = []
    if len(vals) != n:
        raise ValueError(f"{name}={spec!r}: expected {expected}")
    return vals


def _tile_override(pass_: str) -> tuple[int, int, int] | None:
    """MAMBA_PARALLEL_CONV_TILES='BLf,BDf,NWf,BLb,BDb,NWb' overrides the tiles (benchmark sweeps)."""
    name = "MAMBA_PARALLEL_CONV_TILES"
    spec = os.environ.get(name)
    if not spec:
        return None
    expected = "six powers of two 'BLOCK_L,BLOCK_D,num_warps' for the forward then the backward"
    vals = _int_list(name, spec, 6, expected)
    if not all(_pow2(v) for v in vals):
        raise ValueError(f"{name}={spec!r}: expected {expected}")
    return tuple(vals[:3]) if pass_ == "fwd" else tuple(vals[3:])


def _bwd_tile_override() -> tuple[int, int, int, int, str, int] | None:
    """MAMBA_PARALLEL_CONV_BWD_TILES='BL,BD,NW,TILES_PER_PROGRAM[,FLAGS[,MAXNREG]]' overrides the backward's
    tiles (any variant; flags and maxnreg only affect fused_scan)."""
    name = "MAMBA_PARALLEL_CONV_BWD_TILES"
    spec = os.environ.get(name)
    if not spec:
        return None
    expected = ("'BLOCK_L,BLOCK_D,num_warps,tiles_per_program[,flags[,maxnreg]]': three powers of two, a positive "
                f"integer, optionally flags from {BWD_FLAGS!r} (p: prefetch, f: fast sigmoid) and a register cap "
                "per thread (0: none, else 24..255)")
    fields = spec.split(",")
    flags, maxnreg = "", "0"
    if len(fields) == 6:
        maxnreg = fields.pop()
    if len(fields) == 5:
        flags = fields.pop().strip()
    vals = _int_list(name, ",".join(fields + [maxnreg]), 5, expected)
    ok = (all(_pow2(v) for v in vals[:3]) and vals[3] > 0 and (vals[4] == 0 or 24 <= vals[4] <= 255)
          and set(flags) <= set(BWD_FLAGS) and len(set(flags)) == len(flags))
    if not ok:
        raise ValueError(f"{name}={spec!r}: expected {expected}")
    return (*vals[:4], flags, vals[4])


def _layout(x: torch.Tensor) -> str:
    return "channels_last" if _channels_last(x) else "contiguous"


def bwd_variant(x: torch.Tensor, w: int) -> str:
    """The backward for x (b, d, L) and filter width w: MAMBA_PARALLEL_CONV_BWD (one of BWD_VARIANTS) if set, else
    DEFAULT_BWD of x's layout. fused_scan writes the taps out for w <= 4; wider filters always take twopass."""
    name = "MAMBA_PARALLEL_CONV_BWD"
    variant = os.environ.get(name) or DEFAULT_BWD[_layout(x)]
    if variant not in BWD_VARIANTS:
        raise ValueError(f"{name}={variant!r}: expected one of {', '.join(BWD_VARIANTS)}")
    return "twopass" if w > MAX_WIDTH else variant


def _tiles(x: torch.Tensor) -> tuple[int, int, int]:
    """Forward (BLOCK_L, BLOCK_D, num_warps): wide in the unit-stride axis so loads coalesce, clipped to the shape."""
    _, d, L = x.shape
    block_l, block_d, warps = _tile_override("fwd") or TILES[_layout(x)]
    return min(block_l, triton.next_power_of_2(L)), min(block_d, triton.next_power_of_2(d)), warps


def _bwd_tiles(x: torch.Tensor, variant: str) -> tuple[int, int, int, int, str, int]:
    """Backward (BLOCK_L, BLOCK_D, num_warps, tiles_per_program, flags, maxnreg) of ``variant``, clipped to the
    shape."""
    _, d, L = x.shape
    block_l, block_d, warps, per_prog, flags, maxnreg = BWD_TILES[(variant, _layout(x))]
    override = _tile_override("bwd")
    if override:
        block_l, block_d, warps = override
    block_l, block_d, warps, per_prog, flags, maxnreg = (_bwd_tile_override()
                                                         or (block_l, block_d, warps, per_prog, flags, maxnreg))
    if variant == "fused_scan" and block_l > 8:
        raise ValueError(f"fused_scan backward: BLOCK_L (rows per step) must be at most 8, got {block_l} "
                         "(MAMBA_PARALLEL_CONV_BWD_TILES / MAMBA_PARALLEL_CONV_TILES)")
    return (min(block_l, triton.next_power_of_2(L)), min(block_d, triton.next_power_of_2(d)), warps, per_prog, flags,
            maxnreg)


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

def _conv_fwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
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


_conv_fwd = torch.library.custom_op("mamba_parallel::causal_conv1d_fwd", mutates_args=())(_conv_fwd_impl)


def _launch_fwd(x, weight, bias, initial_state, seq_idx, dy, out, silu):
    """out = act(conv(x)); with dy given, out = dy * silu'(conv(x)) (the gradient at the pre-activation)."""
    b, d, L = x.shape
    block_l, block_d, warps = _tiles(x)
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

def _conv_bwd_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   initial_state: Optional[torch.Tensor], seq_idx: Optional[torch.Tensor], dy: torch.Tensor,
                   dfinal: Optional[torch.Tensor], silu: bool, dx_out: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx (b, d, L) x's layout, dweight (d, w), dbias (d,) or empty, dinitial_state (b, d, w-1) or empty.

    With dx_out (b, d, L) given (a gradient-arena slice, any strides), dx is written there and the returned dx is
    an empty placeholder (a custom op may not return an alias of its input).
    """
    b, d, L = x.shape
    w = weight.shape[1]
    if dx_out is not None and (dx_out.shape != x.shape or dx_out.dtype != x.dtype):
        raise ValueError(f"causal_conv1d backward: dx_out {tuple(dx_out.shape)} {dx_out.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    dx = dx_out if dx_out is not None else _empty_like_layout(x, x.dtype)
    dinit = torch.empty_like(initial_state) if initial_state is not None else x.new_empty((0,))
    if b * d * L > 0:
        launch = _launch_bwd_scan if bwd_variant(x, w) == "fused_scan" else _launch_bwd_twopass
        dw_part, db_part = launch(x, weight, bias, initial_state, seq_idx, dy, dx, dinit, silu)
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


def _bwd_grid(x, variant: str):
    """-> (grid, tiles (BLOCK_L, BLOCK_D, num_warps), tiles_per_program, (flags, maxnreg), number of partial
    rows)."""
    b, d, L = x.shape
    block_l, block_d, warps, per_prog, flags, maxnreg = _bwd_tiles(x, variant)
    n_tiles = triton.cdiv(L, block_l)
    per_prog = min(n_tiles, per_prog)
    n_lprog = triton.cdiv(n_tiles, per_prog)
    return (n_lprog, triton.cdiv(d, block_d), b), (block_l, block_d, warps), per_prog, (flags, maxnreg), b * n_lprog


def _partials(x, d: int, w: int, n_parts: int, has_bias: bool):
    dw_part = torch.empty((n_parts, d, w), dtype=torch.float32, device=x.device)
    db_part = torch.empty((n_parts, d) if has_bias else (0,), dtype=torch.float32, device=x.device)
    return dw_part, db_part


def _launch_bwd_scan(x, weight, bias, initial_state, seq_idx, dy, dx, dinit, silu):
    """One pass, dpre recomputed in registers (triton_conv1d_bwd_scan.py). -> (dweight, dbias) partials."""
    d, L, w = x.shape[1], x.shape[2], weight.shape[1]
    grid, (block_l, block_d, warps), per_prog, (flags, maxnreg), n_parts = _bwd_grid(x, "fused_scan")
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    dw_part, db_part = _partials(x, d, w, n_parts, bias is not None)
    conv1d_bwd_scan_kernel[grid](
        x, weight, bias, initial_state, seq_idx, dy,
        dx, dinit, dw_part, db_part,
        d, L, per_prog,
        *x.stride(), *weight.stride(), *_strides(initial_state, 3), *_strides(seq_idx, 2), *dy.stride(),
        *dx.stride(), *_strides(dinit if initial_state is not None else None, 3),
        W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, HAS_SEQ=seq_idx is not None,
        SILU=silu, FAST_SIGMOID="f" in flags and x.is_cuda, PREFETCH="p" in flags, BLOCK_L=block_l,
        BLOCK_D=block_d, num_warps=warps, **extra,
    )
    return dw_part, db_part


def _launch_bwd_twopass(x, weight, bias, initial_state, seq_idx, dy, dx, dinit, silu):
    """dpre = dy * silu'(pre) written in fp32 by the forward kernel, then the backward kernel reads it."""
    d, L, w = x.shape[1], x.shape[2], weight.shape[1]
    grid, (block_l, block_d, warps), per_prog, _, n_parts = _bwd_grid(x, "twopass")
    dw_part, db_part = _partials(x, d, w, n_parts, bias is not None)
    dpre = dy
    if silu:  # fp32 gradient at the pre-activation, laid out like x
        dpre = _empty_like_layout(x, torch.float32)
        _launch_fwd(x, weight, bias, initial_state, seq_idx, dy, dpre, silu)
    conv1d_bwd_kernel[grid](
        x, weight, initial_state, seq_idx, dpre,
        dx, dinit, dw_part, db_part,
        d, L, per_prog,
        *x.stride(), *weight.stride(), *_strides(initial_state, 3), *_strides(seq_idx, 2), *dpre.stride(),
        *dx.stride(), *_strides(dinit if initial_state is not None else None, 3),
        W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, HAS_SEQ=seq_idx is not None,
        BLOCK_L=block_l, BLOCK_D=block_d, BLOCK_W=triton.next_power_of_2(w), num_warps=warps,
    )
    return dw_part, db_part


@_conv_bwd.register_fake
def _(x, weight, bias, initial_state, seq_idx, dy, dfinal, silu, dx_out):
    return (_empty_like_layout(x, x.dtype) if dx_out is None else x.new_empty((0,)), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else x.new_empty((0,)),
            torch.empty_like(initial_state) if initial_state is not None else x.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_state, seq_idx, silu, return_final_state = inputs
    ctx.save_for_backward(x, weight, bias, initial_state, seq_idx)
    ctx.silu, ctx.return_final_state = silu, return_final_state
    ctx.x_slot = grad_slot(x)  # a gradient-arena slice to write dx into (split_with_grad_arena), or None


def _backward(ctx, dy, dfinal):
    x, weight, bias, initial_state, seq_idx = ctx.saved_tensors
    if not ctx.return_final_state:
        dfinal = None
    if dy is None:  # only the final state reached the loss (eager fast path: unused gradients are None)
        dy = torch.zeros_like(x)
    dx_out = ctx.x_slot.get() if ctx.x_slot is not None else None
    dx, dweight, dbias, dinit = eager(_conv_bwd)(x, weight, bias, initial_state, seq_idx, dy, dfinal, ctx.silu, dx_out)
    if dx_out is not None:
        dx = dx_out
    return (dx, dweight, dbias if bias is not None else None, dinit if initial_state is not None else None,
            None, None, None)


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
                  seq_idx: Optional[torch.Tensor] = None, return_final_state: bool = False):
    """x (b, d, L) any strides, weight (d, w), bias (d,), initial_state (b, d, w-1), seq_idx (b, L)
    -> y (b, d, L) [, final_state (b, d, w-1)]."""
    if _fp64(x, weight, bias, initial_state):  # the kernels compute in fp32; fp64 (gradcheck) keeps the reference
        return naive.causal_conv1d(x, weight, bias, activation, initial_state, seq_idx, return_final_state)
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: activation must be None or 'silu', got {activation!r}")
    y, final = eager(_conv_fwd)(x, weight, bias, initial_state, seq_idx, activation == "silu", bool(return_final_state))
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
