"""Triton RMSNorm family, registered as torch custom ops so torch.compile keeps them as single graph nodes.

``rms_norm``, ``add_rms_norm``, ``gated_rms_norm`` and ``gated_rms_norm_linear`` (triton_norm_linear.py) take the
public functions' arguments (docs/API.md) and all run the same kernels (triton_norm_fwd.py / triton_norm_bwd.py):
fp32 statistics, rstd saved for the backward, one backward pass that writes dx (dz, dresidual) and per-program
weight-gradient partials, summed here.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from mamba_parallel.ops.eager_fastpath import eager, fastpath
from mamba_parallel.ops.grad_arena import grad_slot, tag_view
from mamba_parallel.ops.norm import naive
from mamba_parallel.ops.norm.triton_norm_bwd import norm_bwd_kernel
from mamba_parallel.ops.norm.triton_norm_fwd import norm_fwd_kernel

# One group of channels lives in registers: 64 KiB of fp32 per row is the most a program holds.
_MAX_GROUP = 16384


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_shape(group_size: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps): a row group over enough threads for ~16 elements each (no spills on sm_90)."""
    if group_size > _MAX_GROUP:
        raise ValueError(f"triton rms norm: group of {group_size} channels exceeds {_MAX_GROUP}; "
                         "use a smaller group_size or MAMBA_PARALLEL_BACKEND=naive")
    block = triton.next_power_of_2(group_size)
    return block, max(4, min(16, block // (32 * 16)))


# Backward grid: one wave of resident programs, so every SM keeps as many rows in flight as its register file
# holds. Registers per thread of norm_bwd_kernel by kind and BLOCK_N, as ptxas reports them for sm_90 (Triton
# 3.9, the largest over fp32 / fp16 / bf16, with and without the rebuilt output (STORE_Y), channel counts and
# strides divisible by 16; plain = rms_norm and add_rms_norm; ``tools/compile_check.py --ops norm``).
# Wider groups run one program per SM; a kernel that needs more registers than listed (odd channel counts: scalar
# loads) only gets a second, partial wave.
_BWD_REGS = {"plain": {512: 40, 1024: 64, 2048: 100, 4096: 128},
             "gate_in_norm": {512: 62, 1024: 93, 2048: 165, 4096: 176},
             "gate_after_norm": {512: 56, 1024: 72, 2048: 128, 4096: 168}}
_SM_REGS, _SM_WARPS, _CPU_BWD_PROGRAMS = 65536, 64, 4


def _bwd_launch_shape(group_size: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the backward: 16 values per thread like the forward, up to 32 warps (ptxas: no
    spills up to 8192 channels but 12-44 bytes for gate_in_norm at 8192, 16-44 with the rebuilt output; 64-600
    bytes at 16384)."""
    block, _ = _launch_shape(group_size)
    return block, max(4, min(32, block // (32 * 16)))


def _bwd_programs_per_sm(block: int, warps: int, has_z: bool, norm_before_gate: bool) -> int:
    """Resident programs of the backward per SM, from its register use (at least one)."""
    if block > 4096:
        return 1
    kind = "plain" if not has_z else ("gate_after_norm" if norm_before_gate else "gate_in_norm")
    regs = -(-_BWD_REGS[kind][max(block, 512)] // 8) * 8  # registers are allocated in units of 8 per thread
    return max(1, min(_SM_WARPS // warps, _SM_REGS // (regs * 32 * warps)))


def _bwd_row_split(x: torch.Tensor, rows: int, groups: int, per_sm: int) -> tuple[int, int]:
    """(row programs, rows per program) of the backward: ~``per_sm`` programs per SM over all groups, none empty
    (the CPU interpreter gets a handful)."""
    target = per_sm * _sm_count(x.device.index or 0) if x.is_cuda else _CPU_BWD_PROGRAMS
    rows_per_program = max(1, triton.cdiv(rows, max(1, min(rows, triton.cdiv(target, groups)))))
    return max(1, triton.cdiv(rows, rows_per_program)), rows_per_program


def _rows(t: Optional[torch.Tensor], d: int) -> Optional[torch.Tensor]:
    """(..., d) -> (M, d) with unit channel stride (copies only when it must)."""
    if t is None:
        return None
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, d)


def _tagged_rows(t: Optional[torch.Tensor], d: int) -> Optional[torch.Tensor]:
    """``_rows`` that keeps t's gradient-arena slot: its gradient buffer is viewed as rows the same way (a slice
    of a wider last dimension stays a view; where the reshape must copy, the split copies the gradient back)."""
    rows = _rows(t, d)
    return tag_view(rows, t, lambda g: _rows(g, d)) if rows is not None else None


# ---------------------------------------------------------------------------------------------------- forward op

def _norm_fwd_impl(x: torch.Tensor, z: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                   weight: torch.Tensor, eps: float, group_size: int, norm_before_gate: bool, store_residual: bool,
                   residual_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x/z/residual (M, d) -> y (M, d) x.dtype, residual_out (M, d) residual_dtype (or empty), rstd (G, M) fp32."""
    m, d = x.shape
    groups = d // group_size
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, d) if store_residual else (0, d), dtype=residual_dtype, device=x.device)
    rstd = torch.empty((groups, m), dtype=torch.float32, device=x.device)
    if m == 0:
        return y, res_out, rstd
    block, warps = _launch_shape(group_size)
    norm_fwd_kernel[(m, groups)](
        x, z, residual, weight, y, res_out, rstd,
        m, group_size,
        x.stride(0), z.stride(0) if z is not None else 0, residual.stride(0) if residual is not None else 0,
        y.stride(0), res_out.stride(0),
        eps,
        HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, HAS_RES=residual is not None,
        STORE_RES=store_residual, BLOCK_N=block, num_warps=warps,
    )
    return y, res_out, rstd


_norm_fwd = torch.library.custom_op("mamba_parallel::rms_norm_fwd", mutates_args=())(_norm_fwd_impl)


@_norm_fwd.register_fake
def _(x, z, residual, weight, eps, group_size, norm_before_gate, store_residual, residual_dtype):
    m, d = x.shape
    return (x.new_empty((m, d)), x.new_empty((m, d) if store_residual else (0, d), dtype=residual_dtype),
            x.new_empty((d // group_size, m), dtype=torch.float32))


# --------------------------------------------------------------------------------------------------- backward op

def _launch_bwd(dy: torch.Tensor, dres_out: Optional[torch.Tensor], xin: torch.Tensor, z: Optional[torch.Tensor],
                weight: torch.Tensor, rstd: torch.Tensor, group_size: int, norm_before_gate: bool,
                dx: torch.Tensor, dres: torch.Tensor, dz: torch.Tensor,
                y_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Runs the backward kernel into dx / dres / dz (M, d), any row stride, unit channel stride -> dweight (d,).
    ``y_out`` (M, d), unit channel stride: also receives the forward's output, rebuilt (the norm + linear node)."""
    m, d = xin.shape
    if m == 0:
        return torch.zeros_like(weight)
    groups = d // group_size
    block, warps = _bwd_launch_shape(group_size)
    per_sm = _bwd_programs_per_sm(block, warps, z is not None, norm_before_gate)
    n_programs, rows_per_program = _bwd_row_split(xin, m, groups, per_sm)
    dw_part = torch.empty((n_programs, d), dtype=torch.float32, device=xin.device)
    norm_bwd_kernel[(n_programs, groups)](
        xin, z, weight, dy, dres_out, rstd,
        dx, dres, dz, dw_part, y_out,
        m, group_size, rows_per_program,
        xin.stride(0), z.stride(0) if z is not None else 0, dy.stride(0),
        dres_out.stride(0) if dres_out is not None else 0, dx.stride(0), dres.stride(0), dz.stride(0),
        dw_part.stride(0), y_out.stride(0) if y_out is not None else 0,
        HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, HAS_DRES_OUT=dres_out is not None,
        STORE_DX2=dres.shape[0] != 0, STORE_Y=y_out is not None, BLOCK_N=block, num_warps=warps, num_stages=1,
    )
    return dw_part.sum(0).to(weight.dtype)


def _norm_bwd_impl(dy: torch.Tensor, dres_out: Optional[torch.Tensor], xin: torch.Tensor,
                   z: Optional[torch.Tensor], weight: torch.Tensor, rstd: torch.Tensor, group_size: int,
                   norm_before_gate: bool, dx_dtype: torch.dtype, dres_dtype: Optional[torch.dtype]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dx (M, d) dx_dtype, dresidual (M, d) dres_dtype (or empty), dz (M, d) (or empty), dweight (d,)."""
    m, d = xin.shape
    dx = torch.empty((m, d), dtype=dx_dtype, device=xin.device)
    dres = torch.empty((m, d) if dres_dtype is not None else (0, d), dtype=dres_dtype or dx_dtype,
                       device=xin.device)
    dz = torch.empty((m, d) if z is not None else (0, d), dtype=z.dtype if z is not None else dx_dtype,
                     device=xin.device)
    dw = _launch_bwd(dy, dres_out, xin, z, weight, rstd, group_size, norm_before_gate, dx, dres, dz)
    return dx, dres, dz, dw


_norm_bwd = torch.library.custom_op("mamba_parallel::rms_norm_bwd", mutates_args=())(_norm_bwd_impl)
fastpath(_norm_bwd, _norm_bwd_impl)


@_norm_bwd.register_fake
def _(dy, dres_out, xin, z, weight, rstd, group_size, norm_before_gate, dx_dtype, dres_dtype):
    m, d = xin.shape
    return (xin.new_empty((m, d), dtype=dx_dtype),
            xin.new_empty((m, d) if dres_dtype is not None else (0, d), dtype=dres_dtype or dx_dtype),
            xin.new_empty((m, d) if z is not None else (0, d), dtype=z.dtype if z is not None else dx_dtype),
            torch.empty_like(weight))


def _setup_context(ctx, inputs, output):
    x, z, residual, weight, eps, group_size, norm_before_gate, store_residual, residual_dtype = inputs
    _, res_out, rstd = output
    # For add_rms_norm the normalised input is the new residual; keep it rather than x.
    ctx.save_for_backward(res_out if store_residual else x, z, weight, rstd)
    ctx.group_size, ctx.norm_before_gate = group_size, norm_before_gate
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype if residual is not None else None
    ctx.store_residual = store_residual
    # Gradient-arena slots (ops/grad_arena.py): dx / dz written straight into a split's gradient buffer
    ctx.x_slot = grad_slot(x) if not store_residual else None
    ctx.z_slot = grad_slot(z) if z is not None else None


def _backward(ctx, dy, dres_out, _drstd):
    xin, z, weight, rstd = ctx.saved_tensors
    if not ctx.store_residual:
        dres_out = None
    if dy is None:  # only the residual output reached the loss (eager fast path: unused gradients are None)
        dy = torch.zeros(xin.shape, dtype=ctx.x_dtype, device=xin.device)
    if ctx.x_slot is not None or ctx.z_slot is not None:
        return _backward_into_slots(ctx, dy, xin, z, weight, rstd)  # never with a residual: no slot then
    dres_out = None if dres_out is None else dres_out.contiguous()
    dx, dres, dz, dw = eager(_norm_bwd)(dy.contiguous(), dres_out, xin, z, weight, rstd, ctx.group_size,
                                        ctx.norm_before_gate, ctx.x_dtype, ctx.res_dtype)
    return (dx, dz if z is not None else None, dres if ctx.res_dtype is not None else None, dw,
            None, None, None, None, None)


def _backward_into_slots(ctx, dy, xin, z, weight, rstd):
    """Eager only (slots are never made while compiling): the kernel writes dx / dz where the slots say (rows of
    unit channel stride: ``_tagged_rows`` maps the slot through ``_rows``)."""
    m, d = xin.shape
    dx = ctx.x_slot.get() if ctx.x_slot is not None else torch.empty((m, d), dtype=ctx.x_dtype, device=xin.device)
    dz = None
    if z is not None:
        dz = ctx.z_slot.get() if ctx.z_slot is not None else torch.empty((m, d), dtype=z.dtype, device=z.device)
    dres = dx.new_empty((0, d))
    dw = _launch_bwd(dy.contiguous(), None, xin, z, weight, rstd, ctx.group_size, ctx.norm_before_gate, dx, dres,
                     dz if dz is not None else dx.new_empty((0, d)))
    return dx, dz, None, dw, None, None, None, None, None


_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
fastpath(_norm_fwd, _norm_fwd_impl, setup_context=_setup_context, backward=_backward)


# ------------------------------------------------------------------------------------------- public-named entries

def _fp64(*ts) -> bool:
    return any(t is not None and t.dtype == torch.float64 for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x (..., d), weight (d,) -> (..., d) in x.dtype."""
    if _fp64(x, weight):  # the kernels compute in fp32; fp64 (gradcheck) keeps the exact reference
        return naive.rms_norm(x, weight, eps)
    d = x.shape[-1]
    y, _, _ = eager(_norm_fwd)(_rows(x, d), None, None, weight, float(eps), d, False, False, x.dtype)
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-5,
                 residual_in_fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., d), residual (..., d) or None -> (normed (..., d) x.dtype, new_residual (..., d))."""
    if _fp64(x, residual, weight):
        return naive.add_rms_norm(x, residual, weight, eps, residual_in_fp32)
    d = x.shape[-1]
    res_dtype = torch.float32 if residual_in_fp32 else x.dtype
    y, res_out, _ = eager(_norm_fwd)(_rows(x, d), None, _rows(residual, d), weight, float(eps), d, False, True,
                                     res_dtype)
    return y.view(x.shape), res_out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, z: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-5,
                   group_size: Optional[int] = None, norm_before_gate: bool = False) -> torch.Tensor:
    """x/z (..., d), weight (d,) -> (..., d) in x.dtype, RMS over groups of ``group_size`` channels."""
    if _fp64(x, z, weight):
        return naive.gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate)
    d = x.shape[-1]
    gs = d if group_size is None else int(group_size)
    y, _, _ = eager(_norm_fwd)(_tagged_rows(x, d), _tagged_rows(z, d), None, weight, float(eps), gs,
                               bool(norm_before_gate), False, x.dtype)
    return y.view(x.shape)


# The norm + linear nodes (their own files; they build on the launchers above, so they are imported after them).
from mamba_parallel.ops.norm.triton_add_norm_linear import add_rms_norm_linear  # noqa: E402
from mamba_parallel.ops.norm.triton_norm_linear import gated_rms_norm_linear  # noqa: E402

__all__ = ["rms_norm", "add_rms_norm", "add_rms_norm_linear", "gated_rms_norm", "gated_rms_norm_linear"]
