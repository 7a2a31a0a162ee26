"""Triton launches of the fused Mamba-2 decode step's stages (arguments validated by ops.decode_step)."""

from __future__ import annotations

import functools

import torch
import triton

from mamba_parallel.ops.decode_step.triton_kernels import (gated_out_proj_residual_kernel,
                                                           mamba1_state_update_gate_kernel,
                                                           norm_in_proj_conv_kernel, state_update_gate_kernel,
                                                           x_proj_partials_kernel)

# GEMV tiles (output columns per program, K step, warps). in_proj (many columns, short K): 32 x 256, a 16 KB bf16
# weight tile per step; out_proj (few columns, long K): 8 x 512, twice the programs of 16 columns. Measured on an
# H100 (mamba2-2.7b, graph replay, PDL), one changed at a time from (16, 512, 4) for both (2.71 ms a step): 2.51
# and 2.62 ms; together 2.43.
IN_PROJ_TILES = (32, 256, 4)
OUT_PROJ_TILES = (8, 512, 4)


@functools.lru_cache(maxsize=None)
def _has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _pdl(t: torch.Tensor) -> dict:
    """The launch options of a decode kernel on ``t``'s device: programmatic dependent launch where the GPU has it
    (compute capability 9.0+: each kernel's programs start while the previous kernel finishes, and stream their
    first weight tile before waiting for its output), off elsewhere (CPU interpreter, older GPUs). Measured on an
    H100 (mamba2-2.7b, graph replay, batch 1): 2.95 -> 2.71 ms a step at equal tiles."""
    if _has_pdl(t.device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def norm_in_proj_conv(residual, norm_weight, eps, weight, bias, conv_weight, conv_bias, conv_state, conv_start):
    b, K = residual.shape
    N = weight.shape[0]
    out = torch.empty((b, N), device=residual.device, dtype=weight.dtype)
    dc = conv_weight.shape[1]
    bn, bk, warps = IN_PROJ_TILES
    norm_in_proj_conv_kernel[(triton.cdiv(N, bn), b)](
        residual, norm_weight, weight, bias if bias is not None else out, conv_weight,
        conv_bias if conv_bias is not None else out, conv_state, out,
        K, N, float(eps), conv_start, conv_state.shape[1],
        residual.stride(0), weight.stride(0), *conv_weight.stride(), *conv_state.stride(), out.stride(0),
        HAS_BIAS=bias is not None, HAS_CB=conv_bias is not None, DC=dc, DCP=triton.next_power_of_2(dc),
        BN=bn, BK=min(bk, triton.next_power_of_2(K)), num_warps=warps, **_pdl(out))
    return out


def state_update_gate(state, x, dt, A, B, C, D, z, dt_bias, dt_limit, norm_weight, ngroups):
    b, h, p = x.shape
    n = state.shape[3]
    ns = triton.next_power_of_2(n)
    bp = max(1, min(triton.next_power_of_2(p), max(1, 2048 // ns)))
    nblk = triton.cdiv(p, bp)
    gw = torch.empty((b, h * p), device=x.device, dtype=torch.float32)
    ss = torch.empty((b, h * nblk), device=x.device, dtype=torch.float32)
    D2 = None if D is None else (D if D.dim() == 2 else D[:, None].expand(h, p))
    lo, hi = dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    state_update_gate_kernel[(nblk, h, b)](
        state, x, dt, A, B, C, D2 if D2 is not None else gw, z, dt_bias if dt_bias is not None else gw,
        norm_weight, gw, ss,
        p, n, h // B.shape[1], float(lo), float(hi) if clamp else 0.0, nblk,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *z.stride(),
        *(D2.stride() if D2 is not None else (0, 0)), gw.stride(0), ss.stride(0),
        HAS_D=D is not None, HAS_DTB=dt_bias is not None, CLAMP=clamp, BP=bp, NS=ns, **_pdl(gw))
    return gw, ss.view(b, ngroups, -1)


def gated_out_proj_residual(gw, sumsq, eps, weight, bias, residual):
    b, K = gw.shape
    N = weight.shape[0]
    groups, slots = (sumsq.shape[1], sumsq.shape[2]) if sumsq is not None else (1, 1)
    gs = K // groups
    bn, bk, warps = OUT_PROJ_TILES
    gated_out_proj_residual_kernel[(triton.cdiv(N, bn), b)](
        gw, sumsq if sumsq is not None else residual, weight, bias if bias is not None else residual, residual,
        K, N, float(eps), gs, slots, gw.stride(0), sumsq.stride(0) if sumsq is not None else 0, weight.stride(0),
        residual.stride(0), HAS_BIAS=bias is not None, NORM=sumsq is not None, SP=triton.next_power_of_2(slots),
        BN=bn, BK=min(bk, gs & -gs) if sumsq is not None else bk,  # a normed K step stays in one norm group
        num_warps=warps, **_pdl(residual))
    return residual


# Mamba-1's x_proj: 16 output columns per program, K in slices of 512 (mamba-2.8b: 12 x 10 programs)
X_PROJ_TILES = (16, 512, 4)


def mamba1_x_proj_state_update(state, x, z, x_proj_weight, dt_proj_weight, dt_bias, A, D, bcdt_eps=None):
    b, d = x.shape
    n = state.shape[2]
    N, r = x_proj_weight.shape[0], dt_proj_weight.shape[1]
    bn, ks, warps = X_PROJ_TILES
    slices = triton.cdiv(d, ks)
    part = torch.empty((b, slices, N), device=x.device, dtype=torch.float32)
    x_proj_partials_kernel[(triton.cdiv(N, bn), slices, b)](
        x, x_proj_weight, part, d, N, ks, x.stride(0), x_proj_weight.stride(0), part.stride(0), part.stride(1),
        BN=bn, BK=ks, num_warps=warps, **_pdl(part))
    y = torch.empty((b, d), device=x.device, dtype=x.dtype)
    bd = 32
    mamba1_state_update_gate_kernel[(triton.cdiv(d, bd), b)](
        state, x, z, part, dt_proj_weight, dt_bias if dt_bias is not None else y, A, D if D is not None else y, y,
        d, n, r, slices, float(bcdt_eps or 0.0), *state.stride(), x.stride(0), z.stride(0), part.stride(0),
        part.stride(1), dt_proj_weight.stride(0), *A.stride(), y.stride(0),
        HAS_D=D is not None, HAS_DTB=dt_bias is not None, BCDT=bcdt_eps is not None,
        SP=triton.next_power_of_2(slices),
        RP=triton.next_power_of_2(r), NS=triton.next_power_of_2(n), BD=bd, num_warps=4, **_pdl(y))
    return y
