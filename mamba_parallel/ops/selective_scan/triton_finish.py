"""One launch for the finishing reductions of the Mamba-1 selective-scan backward.

The backward kernel (triton_bwd.py) leaves partial sums: dB / dC per channel block (b, nblk, n, L), dA per sequence
and sequence segment (parts, n, d), dD and d delta_bias likewise (parts, d). Summing them with torch takes ~8
small launches, and a small model's training step on an H200 is bound by their host cost (~10-20 us each). Here
one 1-D grid does all of it, its program ids split into ranges by job:

    [0, nbc)              dB: a program sums the nblk / G partial rows of one (b, g, n) row over BT tokens
    [nbc, 2 nbc)          dC: the same
    [2 nbc, 2 nbc + na)   dA: BA elements of the (n, d) partials summed over parts (times dA_scale), stored as (d, n)
    [2 nbc + na, end)     dD and d delta_bias: BA channels summed over parts

Sums are fp32 in a fixed order (no atomics), so the results are deterministic. Outputs take any strides and dtype
(cast on store): the caller may pass slices of a bigger buffer, e.g. its x_proj output's gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.backend import interpret_mode

# Elements per program: (KR partial rows, BT tokens) tiles for dB / dC, BA elements for the small jobs. The
# interpreter's are tiny so that tests with tiny shapes cross several tiles.
GPU_TILE, GPU_BA, GPU_KR = 2048, 1024, 4
INTERP_TILE, INTERP_BA, INTERP_KR = 64, 16, 4


@triton.jit
def _group_sum(src_ptr, dst_ptr, tile, K, nblk, G, dstate, L, ntok_tiles, s_b, s_g, s_n, s_l,
               KR: tl.constexpr, BT: tl.constexpr):
    """dst[i, g, s, t] = sum_{k < K} src[i, g K + k, s, t] for BT tokens t of one (i, g, s) row.
    src (b, nblk, n, L) fp32 contiguous; dst (b, G, n, L) with strides s_*."""
    row = tile // ntok_tiles  # (i, g, s) flattened
    t = (tile % ntok_tiles) * BT + tl.arange(0, BT)
    s = row % dstate
    g = (row // dstate) % G
    i = (row // dstate // G).to(tl.int64)
    mt = (t < L)[None, :]
    k = tl.arange(0, KR)[:, None]  # KR partial rows per load: independent loads in flight
    nl = dstate * L
    ptrs = src_ptr + ((i * nblk + g * K) * dstate + s) * L + k * nl + t[None, :]
    acc = tl.zeros([KR, BT], dtype=tl.float32)
    for k0 in range(0, K, KR):
        acc += tl.load(ptrs, mask=((k0 + k) < K) & mt, other=0.0)
        ptrs += KR * nl
    out = dst_ptr + i * s_b + g * s_g + s * s_n + t * s_l
    tl.store(out, tl.sum(acc, axis=0).to(dst_ptr.dtype.element_ty), mask=t < L)


@triton.jit
def _dA_sum(part_ptr, scale_ptr, dst_ptr, tile, nb, dim, dstate, sc_d, sc_n, s_d, s_n,
            HAS_SCALE: tl.constexpr, BA: tl.constexpr):
    """dst[c, s] = sum_i part[i, s, c] (* scale[c, s]) for BA elements of the flattened (n, d) partials.
    part (nb, n, d) fp32 contiguous; scale, dst (d, n) with strides sc_*, s_*."""
    offs = tile * BA + tl.arange(0, BA)
    m = offs < dim * dstate
    acc = tl.zeros([BA], dtype=tl.float32)
    ptrs = part_ptr + offs
    for i in range(nb):
        acc += tl.load(ptrs, mask=m, other=0.0)
        ptrs += dim * dstate
    s = offs // dim
    c = offs % dim
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + c * sc_d + s * sc_n, mask=m, other=0.0).to(tl.float32)
    tl.store(dst_ptr + c * s_d + s * s_n, acc.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _channel_sum(part_ptr, dst_ptr, tile, nb, dim, s_d, BA: tl.constexpr):
    """dst[c] = sum_i part[i, c] for BA channels; part (nb, d) fp32 contiguous, dst (d,) with stride s_d."""
    offs = tile * BA + tl.arange(0, BA)
    m = offs < dim
    acc = tl.zeros([BA], dtype=tl.float32)
    ptrs = part_ptr + offs
    for i in range(nb):
        acc += tl.load(ptrs, mask=m, other=0.0)
        ptrs += dim
    tl.store(dst_ptr + offs * s_d, acc.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def finish_bwd_kernel(
    dBp_ptr, dCp_ptr, dB_ptr, dC_ptr, dAp_ptr, scale_ptr, dA_ptr, dDp_ptr, dD_ptr, ddtbp_ptr, ddtb_ptr,
    nb, nblk, K, G, dstate, L, dim, ntok_tiles, nbc, na,
    sB_b, sB_g, sB_n, sB_l, sC_b, sC_g, sC_n, sC_l, ssc_d, ssc_n, sA_d, sA_n, sD, sdtb,
    HAS_SCALE: tl.constexpr, HAS_D: tl.constexpr, HAS_DTB: tl.constexpr,
    KR: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr,
):
    """One program of one job, picked by its program id (ranges in the module docstring)."""
    pid = tl.program_id(0)
    if pid < nbc:
        _group_sum(dBp_ptr, dB_ptr, pid, K, nblk, G, dstate, L, ntok_tiles, sB_b, sB_g, sB_n, sB_l, KR, BT)
    elif pid < 2 * nbc:
        _group_sum(dCp_ptr, dC_ptr, pid - nbc, K, nblk, G, dstate, L, ntok_tiles, sC_b, sC_g, sC_n, sC_l, KR, BT)
    elif pid < 2 * nbc + na:
        _dA_sum(dAp_ptr, scale_ptr, dA_ptr, pid - 2 * nbc, nb, dim, dstate, ssc_d, ssc_n, sA_d, sA_n, HAS_SCALE, BA)
    else:
        tile = pid - 2 * nbc - na
        if HAS_D:
            _channel_sum(dDp_ptr, dD_ptr, tile, nb, dim, sD, BA)
        if HAS_DTB:
            _channel_sum(ddtbp_ptr, ddtb_ptr, tile, nb, dim, sdtb, BA)


def _check_part(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"finish_bwd: {name} must be a contiguous fp32 tensor of shape {shape}, got "
                         f"{tuple(t.shape)} {t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}")


def _check_out(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"finish_bwd: {name} must have shape {shape}, got {tuple(t.shape)}")


def _pair(name: str, part: torch.Tensor | None, out: torch.Tensor | None, b: int, d: int) -> None:
    """An optional (parts, d) partial and its (d,) output: both given or both None."""
    if (part is None) != (out is None):
        raise ValueError(f"finish_bwd: {name}_part and {name}_out must both be given or both be None")
    if part is not None:
        _check_part(f"{name}_part", part, (b, d))
        _check_out(f"{name}_out", out, (d,))


def finish_bwd(dBp: torch.Tensor, dCp: torch.Tensor, dA_part: torch.Tensor, dD_part: torch.Tensor | None,
               ddtb_part: torch.Tensor | None, groups: int, dB_out: torch.Tensor, dC_out: torch.Tensor,
               dA_out: torch.Tensor, dD_out: torch.Tensor | None, ddtb_out: torch.Tensor | None,
               dA_scale: torch.Tensor | None = None) -> None:
    """Writes, in one kernel launch:
    dB_out (b, G, n, L) = dBp (b, nblk, n, L) summed over each group's nblk / G consecutive partial rows (dC too);
    dA_out (d, n) = dA_part (parts, n, d) summed over parts, transposed, times dA_scale (d, n) when given;
    dD_out, ddtb_out (d,) = dD_part, ddtb_part (parts, d) summed over parts (skipped where None).
    parts: any count, e.g. b sequences times the backward's segments of each. Partials are contiguous fp32;
    outputs any strides and dtype (cast on store); G = groups."""
    if dBp.dim() != 4:
        raise ValueError(f"finish_bwd: dBp must be (b, nblk, n, L), got shape {tuple(dBp.shape)}")
    b, nblk, n, L = dBp.shape
    d = dA_part.shape[2] if dA_part.dim() == 3 else -1
    parts = dA_part.shape[0] if dA_part.dim() == 3 else -1
    if groups < 1 or nblk % groups:
        raise ValueError(f"finish_bwd: groups={groups} must divide the {nblk} partial rows of dBp")
    _check_part("dBp", dBp, (b, nblk, n, L))
    _check_part("dCp", dCp, (b, nblk, n, L))
    _check_part("dA_part", dA_part, (parts, n, d))
    for name, t in (("dB_out", dB_out), ("dC_out", dC_out)):
        _check_out(name, t, (b, groups, n, L))
    _check_out("dA_out", dA_out, (d, n))
    if dA_scale is not None:
        _check_out("dA_scale", dA_scale, (d, n))
    _pair("dD", dD_part, dD_out, parts, d)
    _pair("ddtb", ddtb_part, ddtb_out, parts, d)

    interp = not dBp.is_cuda or interpret_mode()
    tile, ba, kr = (INTERP_TILE, INTERP_BA, INTERP_KR) if interp else (GPU_TILE, GPU_BA, GPU_KR)
    K = nblk // groups
    kr = min(kr, triton.next_power_of_2(K))
    bt = min(tile // kr, max(16, triton.next_power_of_2(L)))
    ntok_tiles = triton.cdiv(L, bt)
    nbc = b * groups * n * ntok_tiles
    na = triton.cdiv(d * n, ba)
    nv = triton.cdiv(d, ba) if dD_part is not None or ddtb_part is not None else 0
    grid = 2 * nbc + na + nv
    if grid == 0:
        return
    opt = lambda t: t if t is not None else dA_out  # noqa: E731  (pointer placeholder for an absent tensor)
    st = lambda t, i: t.stride(i) if t is not None else 0  # noqa: E731
    finish_bwd_kernel[(grid,)](
        dBp, dCp, dB_out, dC_out, dA_part, opt(dA_scale), dA_out, opt(dD_part), opt(dD_out), opt(ddtb_part),
        opt(ddtb_out),
        parts, nblk, K, groups, n, L, d, ntok_tiles, nbc, na,
        *dB_out.stride(), *dC_out.stride(), st(dA_scale, 0), st(dA_scale, 1), *dA_out.stride(),
        st(dD_out, 0), st(ddtb_out, 0),
        HAS_SCALE=dA_scale is not None, HAS_D=dD_part is not None, HAS_DTB=ddtb_part is not None,
        KR=kr, BT=bt, BA=ba, num_warps=4,
    )
