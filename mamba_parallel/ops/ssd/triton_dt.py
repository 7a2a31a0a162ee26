"""SSD stage 1: dt processing (bias, softplus, clamp) and the within-chunk cumulative decay, forward and backward.

Layout of the per-chunk tensors shared by every SSD kernel: ``dt_proc`` and ``dA_cs`` are fp32
(b, h, nchunks, chunk); ``dA_cs[..., t] = sum_{s <= t} dt_proc[s] * A`` within the chunk. Positions past the
end of the sequence (or padding slots of a packed layout) have dt_proc = 0, so they neither decay nor feed
the state and every later stage can treat every chunk as full.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.triton_math import softplus


@triton.jit
def _raw_dt_tile(dt_ptr, bias_ptr, valid_ptr, pid_b, pid_c, L, H, s_b, s_l, s_h,
                 CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, pid_h, HAS_BIAS: tl.constexpr,
                 HAS_VALID: tl.constexpr):
    offs_t = tl.arange(0, CHUNK)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    t = pid_c * CHUNK + offs_t
    keep = t < L
    mh = offs_h < H
    v = tl.load(dt_ptr + pid_b * s_b + t[:, None] * s_l + offs_h[None, :] * s_h,
                mask=keep[:, None] & mh[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)[None, :]
    if HAS_VALID:
        keep &= tl.load(valid_ptr + pid_b * L + t, mask=keep, other=0) != 0
    return v, keep, offs_t, offs_h, mh


@triton.jit
def _dt_fwd_kernel(dt_ptr, bias_ptr, A_ptr, valid_ptr, dtp_ptr, dacs_ptr,
                   L, H, NC, s_b, s_l, s_h, lo, hi,
                   CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, HAS_VALID: tl.constexpr):
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    v, keep, offs_t, offs_h, mh = _raw_dt_tile(dt_ptr, bias_ptr, valid_ptr, pid_b, pid_c, L, H, s_b, s_l, s_h,
                                               CHUNK, BLOCK_H, pid_h, HAS_BIAS, HAS_VALID)
    if SOFTPLUS:
        v = softplus(v)
    if HAS_LIMIT:
        v = tl.minimum(tl.maximum(v, lo), hi)
    v = tl.where(keep[:, None], v, 0.0)
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    acs = tl.cumsum(v * A[None, :], axis=0)
    out = (pid_b * H + offs_h[None, :]) * NC * CHUNK + pid_c * CHUNK + offs_t[:, None]
    tl.store(dtp_ptr + out, v, mask=mh[None, :])
    tl.store(dacs_ptr + out, acs, mask=mh[None, :])


@triton.jit
def _dt_bwd_kernel(dt_ptr, bias_ptr, A_ptr, valid_ptr, dtp_ptr, dac_ptr, ddir_ptr, dlast_ptr,
                   ddt_ptr, dA_part_ptr, dbias_part_ptr,
                   L, H, NC, s_b, s_l, s_h, sd_b, sd_l, sd_h, lo, hi,
                   CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, HAS_VALID: tl.constexpr):
    """dA_cs gradient -> dt gradient. ``dac`` holds the dA_cs gradient but for the last slot's
    ``dlast`` = <dH_out, H_out>; ``ddir`` = x_t . G_t is the direct gradient of dt_t (from the dx kernel)."""
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    v, keep, offs_t, offs_h, mh = _raw_dt_tile(dt_ptr, bias_ptr, valid_ptr, pid_b, pid_c, L, H, s_b, s_l, s_h,
                                               CHUNK, BLOCK_H, pid_h, HAS_BIAS, HAS_VALID)
    gain = tl.full(v.shape, 1.0, tl.float32)
    if SOFTPLUS:
        gain = tl.where(v > 20.0, 1.0, tl.sigmoid(v))
        v = softplus(v)
    if HAS_LIMIT:
        # torch.clamp passes the gradient where lo <= v <= hi and blocks it where the value was clamped
        gain = tl.where((v >= lo) & (v <= hi), gain, 0.0)
    base = (pid_b * H + offs_h[None, :]) * NC * CHUNK + pid_c * CHUNK + offs_t[:, None]
    mask = mh[None, :]
    dtp = tl.load(dtp_ptr + base, mask=mask, other=0.0)
    ddir = tl.load(ddir_ptr + base, mask=mask, other=0.0)
    da = tl.load(dac_ptr + base, mask=mask, other=0.0)
    dlast = tl.load(dlast_ptr + (pid_b * H + offs_h) * NC + pid_c, mask=mh, other=0.0)
    da += tl.where(offs_t[:, None] == CHUNK - 1, dlast[None, :], 0.0)
    # reverse cumulative sum: gradient of dt_s * A is the sum of dA_cs gradients at t >= s
    rc = tl.sum(da, axis=0)[None, :] - tl.cumsum(da, axis=0) + da
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    ddtp = ddir + A[None, :] * rc
    dA = tl.sum(dtp * rc, axis=0)
    ddt = tl.where(keep[:, None], ddtp * gain, 0.0)
    t = pid_c * CHUNK + offs_t
    tl.store(ddt_ptr + pid_b * sd_b + t[:, None] * sd_l + offs_h[None, :] * sd_h,
             ddt.to(ddt_ptr.dtype.element_ty), mask=(t < L)[:, None] & mask)
    part = (pid_b * NC + pid_c) * H + offs_h
    tl.store(dA_part_ptr + part, dA, mask=mh)
    tl.store(dbias_part_ptr + part, tl.sum(ddt, axis=0), mask=mh)


def _limit_flags(dt_min: float, dt_max: float) -> bool:
    return not (dt_min == 0.0 and dt_max == math.inf)


def dt_forward(dt, A, dt_bias, softplus, dt_min, dt_max, valid, chunk):
    """dt (b, L, h) raw; A (h,); dt_bias (h,) or None; valid (b, L) int8 or None -> (dt_proc, dA_cs), each
    (b, h, nchunks, chunk) fp32."""
    b, L, H = dt.shape
    nc = triton.cdiv(L, chunk)
    dtp = torch.empty(b, H, nc, chunk, device=dt.device, dtype=torch.float32)
    dacs = torch.empty_like(dtp)
    bh = min(8, triton.next_power_of_2(H))
    _dt_fwd_kernel[(b, nc, triton.cdiv(H, bh))](
        dt, dt_bias if dt_bias is not None else dt, A, valid if valid is not None else dt, dtp, dacs,
        L, H, nc, dt.stride(0), dt.stride(1), dt.stride(2), float(dt_min), float(dt_max),
        CHUNK=chunk, BLOCK_H=bh, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
        HAS_LIMIT=_limit_flags(dt_min, dt_max), HAS_VALID=valid is not None, num_warps=4)
    return dtp, dacs


def dt_backward(dt, A, dt_bias, softplus, dt_min, dt_max, valid, dtp, dac, ddir, dlast, ddt=None):
    """Gradients of dt (b, L, h) raw (dt.dtype), A (h,) fp32 and dt_bias (h,) fp32 (or None).

    dac, ddir: (b, h, nchunks, chunk) fp32; dlast: (b, h, nchunks) fp32 (see ``_dt_bwd_kernel``).
    ddt: where to write dt's gradient (any strides, dt's shape and dtype), else a fresh tensor."""
    b, L, H = dt.shape
    nc, chunk = dtp.shape[2], dtp.shape[3]
    if ddt is None:
        ddt = torch.empty(b, L, H, device=dt.device, dtype=dt.dtype)
    dA_part = torch.empty(b, nc, H, device=dt.device, dtype=torch.float32)
    dbias_part = torch.empty_like(dA_part)
    bh = min(8, triton.next_power_of_2(H))
    _dt_bwd_kernel[(b, nc, triton.cdiv(H, bh))](
        dt, dt_bias if dt_bias is not None else dt, A, valid if valid is not None else dt, dtp, dac, ddir, dlast,
        ddt, dA_part, dbias_part, L, H, nc, dt.stride(0), dt.stride(1), dt.stride(2),
        ddt.stride(0), ddt.stride(1), ddt.stride(2), float(dt_min), float(dt_max),
        CHUNK=chunk, BLOCK_H=bh, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
        HAS_LIMIT=_limit_flags(dt_min, dt_max), HAS_VALID=valid is not None, num_warps=4)
    dbias = dbias_part.sum((0, 1)) if dt_bias is not None else None
    return ddt, dA_part.sum((0, 1)), dbias
