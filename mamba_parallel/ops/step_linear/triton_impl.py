"""Launches of the decode step's linear kernel (triton_kernel.py) for the public functions and for the gated norm +
out_proj of a few rows (``ops.gated_rms_norm_linear`` without autograd)."""

from __future__ import annotations

import torch
import triton

from mamba_parallel.ops.backend import interpret_mode
from mamba_parallel.ops.step_linear.rows import STEP_ROWS
from mamba_parallel.ops.step_linear.triton_kernel import step_linear_kernel

def supports_rows(m: int) -> bool:
    """Whether the kernel serves ``m`` rows: a decode batch of at most ``STEP_ROWS`` (every column block reads all
    of its rows' inputs, a few KB each; a larger batch is a GEMM for cuBLAS)."""
    return 1 <= m <= STEP_ROWS


def _launch_shape(m: int, n: int, k: int, split: bool) -> dict:
    """Tiles and warps by shape, from a sweep at the decode shapes on an H200 (one row, CUDA-graph replays over
    rotated weights): 32-column blocks with 256-wide K steps where that still makes ~100+ programs (in_proj, the LM
    head: at cuBLAS's speed, ~82% of the copy bandwidth), else 16 columns x 512 (out_proj: 12% faster than cuBLAS's
    split-K); split-K slices in 128 steps. The interpreter takes small tiles (the loops run on tiny test shapes)."""
    if interpret_mode():
        return dict(BM=16, BN=16, BK=32, num_warps=1)
    if split:
        return dict(BM=16, BN=16, BK=128, num_warps=4)
    wide = triton.cdiv(n, 32) >= 100
    return dict(BM=16, BN=32 if wide else 16, BK=256 if wide else 512, num_warps=4)


def _launch(x, weight, bias, out, *, norm=0, residual=None, z=None, norm_weight=None, new_residual=None, eps=0.0,
            group_size=None, norm_before_gate=False, conv=None, k_per_split=None):
    m, k = x.shape
    n = weight.shape[0]
    shape = _launch_shape(m, n, k, k_per_split is not None)
    bm, bn = shape["BM"], shape["BN"]
    split = 1 if k_per_split is None else triton.cdiv(k, k_per_split)
    dummy = out
    cs = conv.state if conv is not None else dummy
    scs = cs.stride() if conv is not None else (0, 0, 0)
    cw = conv.weight if conv is not None else dummy
    scw = cw.stride() if conv is not None else (0, 0)
    rout = new_residual if new_residual is not None else x  # only its dtype is read when norm != 1
    grid = (triton.cdiv(n, bn), split, triton.cdiv(m, bm))
    step_linear_kernel[grid](
        x, residual if residual is not None else x, z if z is not None else x,
        norm_weight if norm_weight is not None else dummy, weight, bias if bias is not None else dummy, out, rout,
        cs, cw, conv.bias if conv is not None and conv.bias is not None else dummy,
        m, n, k, float(eps), group_size or k, k_per_split or k,
        conv.start if conv is not None else 0, cs.shape[1] if conv is not None else 0,
        x.stride(0), residual.stride(0) if residual is not None else 0, z.stride(0) if z is not None else 0,
        weight.stride(0), out.stride(-2), rout.stride(0), out.stride(0) if split > 1 else 0, *scs, *scw,
        NORM=norm, HAS_RES=residual is not None, HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, HAS_BIAS=bias is not None,
        CONV=conv is not None, CONV_BIAS=conv is not None and conv.bias is not None,
        W=cw.shape[1] if conv is not None else 1, SPLIT_K=split, **shape,
    )
    return out


def _contiguous_rows(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def add_rms_norm_linear(x, residual, norm_weight, weight, bias, eps, residual_in_fp32, conv):
    x, residual, weight = _contiguous_rows(x), _contiguous_rows(residual), _contiguous_rows(weight)
    m, k = x.shape
    res_dtype = torch.float32 if residual_in_fp32 else x.dtype
    if x.dtype == torch.float64:
        res_dtype = torch.float64
    new_residual = torch.empty((m, k), device=x.device, dtype=res_dtype)
    out = torch.empty((m, weight.shape[0]), device=x.device, dtype=x.dtype)
    return _launch(x, weight, bias, out, norm=1, residual=residual, norm_weight=norm_weight,
                   new_residual=new_residual, eps=eps, conv=conv), new_residual


def linear_partials(x, weight, k_per_split):
    x, weight = _contiguous_rows(x), _contiguous_rows(weight)
    m, k = x.shape
    parts = torch.empty((triton.cdiv(k, k_per_split), m, weight.shape[0]), device=x.device, dtype=torch.float32)
    return _launch(x, weight, None, parts, k_per_split=k_per_split)


def gated_rms_norm_linear(x, z, weight, out_weight, out_bias, eps, group_size, norm_before_gate):
    """x / z (m, d) with m <= STEP_ROWS, out_weight (e, d) in x.dtype -> (m, e) in x.dtype: one launch."""
    x, z, out_weight = _contiguous_rows(x), _contiguous_rows(z), _contiguous_rows(out_weight)
    out = torch.empty((x.shape[0], out_weight.shape[0]), device=x.device, dtype=x.dtype)
    return _launch(x, out_weight, out_bias, out, norm=2, z=z, norm_weight=weight, eps=eps,
                   group_size=group_size or x.shape[1], norm_before_gate=norm_before_gate)
