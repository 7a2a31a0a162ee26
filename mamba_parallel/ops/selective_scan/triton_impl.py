"""Triton selective scan (Mamba-1): forward and backward as ``torch.library`` custom ops with autograd.

Arguments are already validated by ``mamba_parallel.ops.selective_scan.selective_scan``. Varlen input is turned into
a per-token sequence id (b, L) int32 here: ``seq_idx`` as given, or derived from ``cu_seqlens`` (then
``varlen=True``: initial / last states are per packed sequence). The backward recomputes the states from
checkpoints taken every ``chunk`` tokens (or every ``ckpt_every`` chunks), so the (b, d, n, L) states are never
stored. Carries, checkpoints, A and dA are state-major ((., n, d)): a warp's accesses to one state are one
coalesced access. ``impl`` (v2 | v3 | v4, ``triton_common.scan_impl``) picks the launch: rows per channel, the
register-chain / lane-shuffle paths (``_lanes``) and states per loop iteration.

The backward kernel leaves partial sums (dB / dC per channel block or warp, dA / dD / d delta_bias per sequence);
``triton_finish.finish_bwd`` reduces them all in one launch (a small model's step is bound by host launch cost),
casting into the outputs. ``scan_bwd_impl`` can write dB / dC straight into a caller's buffer (e.g. slices of the
x_proj output's gradient) and return dA times a scale (A for d A_log); the custom op's body calls it with fresh
outputs.
"""

from __future__ import annotations

import os

import torch
import triton

from mamba_parallel.ops.backend import interpret_mode
from mamba_parallel.ops.eager_fastpath import eager, fastpath
from mamba_parallel.ops.selective_scan.triton_bwd import selective_scan_bwd_kernel
from mamba_parallel.ops.selective_scan.triton_common import bwd_variant, fwd_variant, scan_config, scan_impl
from mamba_parallel.ops.selective_scan.triton_finish import finish_bwd
from mamba_parallel.ops.selective_scan.triton_fwd import selective_scan_fwd_kernel


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """B / C (b, n, L) -> (b, 1, n, L) view; grouped (b, g, n, L) unchanged."""
    return t.unsqueeze(1) if t.dim() == 3 else t


def _bc32(t: torch.Tensor) -> torch.Tensor:
    """B / C as (b, g, n, L) fp32: they are small (no d axis) and read n times per token, so converting them once
    here saves the kernels a conversion per element and state. An fp32 (b, g, n, L) tensor (a caller that
    converted once for the forward and backward) comes back as is, without a copy."""
    return _as4d(t).float()


def _interpreted(u: torch.Tensor) -> bool:
    return not u.is_cuda or interpret_mode()


def _config(u: torch.Tensor, B: torch.Tensor, impl: str):
    return scan_config(u.shape[1] // _as4d(B).shape[1], u.shape[2], interpret=_interpreted(u), impl=impl)


def _rows_per_channel(impl: str, n: int) -> int:
    """v4 splits each channel's states over two rows (lanes); n must be even."""
    return 2 if impl == "v4" and n % 2 == 0 else 1


def _tile_meta(u: torch.Tensor, chunk: int, impl: str, n: int, bwd: bool) -> dict:
    """Tile constexprs of the (P, BD R, V) tiles: V = one 16-byte vector of u per thread (4 in the interpreter, so
    that tests cover both scan levels), P = chunk / V, R rows per channel, UNROLL states per loop iteration."""
    v = min(chunk, 16 // u.element_size(), 4 if _interpreted(u) else 16)
    r = _rows_per_channel(impl, n)
    return dict(P=chunk // v, V=v, R=r, UNROLL=_unroll(impl, n // r, bwd, r))


def _unroll(impl: str, states_per_row: int, bwd: bool, rows: int) -> int:
    """States per loop iteration (v3, v4): more independent work per iteration for the scheduler, as far as the
    registers allow (sass_report, bf16: forward 4 states -> 175 registers, 2 with two rows per channel -> 174;
    backward 2 -> 255 without spills, 1 with two rows per channel)."""
    if impl == "v2":
        return 1
    want = (2 if rows == 1 else 1) if bwd else (4 if rows == 1 else 2)
    while want > 1 and states_per_row % want:
        want //= 2
    return want


# Tests set this to run the lane paths in the interpreter with the shuffles emulated (kernels' EMU).
EMULATE_LANES_IN_INTERPRETER = False

# v4's forward with n / 2 <= this many states per row unrolls the state loop (the kernel's NS path: A and carries
# in registers, u / delta / z prefetched into L2 two chunks ahead), capped at 168 registers so that three 4-warp
# programs share an SM. H200, b4 d5120 L8192 bf16: 3.76 -> 2.83 ms (VARIANTS.md). Tests set 0 for the loop path;
# MAMBA_PARALLEL_SCAN_V4_UNROLLED=0 does the same (A/B timings).
V4_UNROLLED_STATES = 8
PREFETCH_CHUNKS = 2
V4_UNROLLED_MAXNREG = 168


def _unrolled_meta(impl: str, n: int, chunk: int, lanes: bool, varlen: bool, interpreted: bool) -> dict:
    """Forward constexprs / launch options of v4's unrolled-states path, or {} for the state loop (a row's states
    sit in the token slots of a chunk tile, so they must not outnumber the chunk's tokens)."""
    r = _rows_per_channel(impl, n)
    off = os.environ.get("MAMBA_PARALLEL_SCAN_V4_UNROLLED", "1").strip() == "0"
    if off or r != 2 or not lanes or varlen or n // r > min(V4_UNROLLED_STATES, chunk):
        return {}
    if interpreted:
        return dict(NS=n)
    return dict(NS=n, PREFETCH=PREFETCH_CHUNKS, maxnreg=V4_UNROLLED_MAXNREG)


def _lanes(u, delta, z, block_d: int, warps: int, chunk: int, d_per_group: int, impl: str, n: int,
           varlen: bool) -> bool:
    """Whether v3 / v4 may rely on the row-per-thread layout (row i of a program in lane i mod 32 of warp i / 32,
    all of a chunk's tokens in its registers): sequential token scans, lane-shuffle sums of dB / dC and of v4's
    row pairs. Triton picks it for token-major inputs with one row per thread whose rows are 16-byte aligned (it
    vectorises a row's tokens only when the JIT sees row strides divisible by 16 and aligned pointers; otherwise
    it spreads them over lanes), unless cu_seqlens' per-token gathers of initial / last states (3D pointer tiles)
    pull the tiles into another layout (sass_report: they do)."""
    r = _rows_per_channel(impl, n)
    token_major = all(t is None or t.stride(2) == 1 for t in (u, delta, z))
    aligned = u.shape[2] % 16 == 0 and all(
        t is None or (t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0 and t.data_ptr() % 16 == 0)
        for t in (u, delta, z))
    interp = _interpreted(u)
    return (impl in ("v3", "v4") and (not interp or EMULATE_LANES_IN_INTERPRETER) and not varlen
            and token_major and (aligned or interp)
            and block_d * r == 32 * warps and d_per_group % (32 // r) == 0 and chunk * r <= 32)


def _ckpt_slots(u: torch.Tensor, B: torch.Tensor, impl: str) -> int:
    """Checkpoints a forward with gradients keeps: one per chunk, or per ckpt_every chunks."""
    cfg = _config(u, B, impl)
    return triton.cdiv(triton.cdiv(u.shape[2], cfg.chunk), cfg.ckpt_every)


def _strides(u, delta, z, B4, C4, sid) -> tuple[int, ...]:
    return (*u.stride(), *delta.stride(), *z.stride(), *B4.stride(), *C4.stride(),
            sid.stride(0) if sid is not None else 0)


def _scan_fwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
              initial_state: torch.Tensor | None, sid: torch.Tensor | None, delta_softplus: bool,
              varlen: bool, nstates: int, save_ckpt: bool, impl: str) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor, torch.Tensor]:
    """u, delta, z (b, d, L); A (d, n); B, C (b, [g,] n, L); sid (b, L) int32 -> y (b, d, L),
    last_state (nstates, d, n) fp32, checkpoints (b, nckpt, n, d) fp32 (state-major; empty unless save_ckpt),
    ypre (b, d, L) = y before the z gate (empty unless save_ckpt and z is given). impl: 'v2' | 'v3' | 'v4'
    (triton_common.scan_impl; 'v4+v3' runs v4's forward)."""
    impl = fwd_variant(impl)
    b, d, L = u.shape
    n = A.shape[1]
    cfg = _config(u, B, impl)
    nchunks = triton.cdiv(L, cfg.chunk)
    B4, C4 = _bc32(B), _bc32(C)
    dev, f32 = u.device, torch.float32
    y = torch.empty((b, d, L), device=dev, dtype=u.dtype)
    if varlen:  # a sequence with no tokens keeps its initial state
        hlast = (initial_state.float().clone() if initial_state is not None
                 else torch.zeros((nstates, d, n), device=dev, dtype=f32))
    else:
        hlast = torch.empty((nstates, d, n), device=dev, dtype=f32)
    sparse = save_ckpt and cfg.ckpt_every > 1  # checkpoints in their own buffer, every K-th chunk
    nslots = nchunks if save_ckpt and not sparse else min(nchunks, 2)
    states = torch.empty((b, nslots, n, d), device=dev, dtype=f32)
    if initial_state is not None and not varlen:
        states[:, 0] = initial_state.transpose(1, 2)
    else:
        states[:, 0] = 0.0
    ncks = triton.cdiv(nchunks, cfg.ckpt_every)
    ck = torch.empty((b, ncks, n, d), device=dev, dtype=f32) if sparse else states
    if sparse:
        ck[:, 0] = states[:, 0]
    ypre = torch.empty((b, d, L) if save_ckpt and z is not None else (0,), device=dev, dtype=u.dtype)
    h0 = initial_state.contiguous() if initial_state is not None else None
    zz = z if z is not None else u
    opt = lambda t: t if t is not None else y  # noqa: E731  (pointer placeholder for an absent tensor)
    meta = _tile_meta(u, cfg.chunk, impl, n, bwd=False)
    lanes = _lanes(u, delta, z, cfg.fwd_block_d, cfg.fwd_warps, cfg.chunk, d // B4.shape[1], impl, n, varlen)
    if lanes:
        meta.update(LANES=True, EMU=_interpreted(u))
    else:
        meta["UNROLL"] = 1  # v2's code: its register use was only measured without unrolling
    meta["KC"] = cfg.ckpt_every if sparse else 1
    meta.update(_unrolled_meta(impl, n, cfg.chunk, lanes, varlen, _interpreted(u)), CKPT=save_ckpt)
    selective_scan_fwd_kernel[(d // cfg.fwd_block_d, b)](
        u, delta, zz, B4, C4, A.t().contiguous(), opt(D), opt(delta_bias), opt(h0), opt(sid), y, ypre, hlast,
        states, ck, L, d, n, d // B4.shape[1], nchunks, nslots, ncks, *_strides(u, delta, zz, B4, C4, sid),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_H0=h0 is not None, HAS_SID=sid is not None, VARLEN=varlen, SAVE_YPRE=save_ckpt and z is not None,
        FAST_EXP=not _interpreted(u), BD=cfg.fwd_block_d, num_warps=cfg.fwd_warps, **meta,
    )
    ckpt = ck if save_ckpt else states.new_empty((0,))
    return y, hlast, ckpt, ypre


selective_scan_fwd = torch.library.custom_op("mamba_parallel::selective_scan_fwd", mutates_args=())(_scan_fwd)


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus, varlen, nstates, save_ckpt, impl):
    b, d, L = u.shape
    n = A.shape[1]
    return (u.new_empty((b, d, L)), u.new_empty((nstates, d, n), dtype=torch.float32),
            u.new_empty((b, _ckpt_slots(u, B, fwd_variant(impl)), n, d) if save_ckpt else (0,),
                        dtype=torch.float32),
            u.new_empty((b, d, L) if save_ckpt and z is not None else (0,)))


def scan_bwd_impl(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                  initial_state: torch.Tensor | None, sid: torch.Tensor | None, ckpt: torch.Tensor,
                  ypre: torch.Tensor, dy: torch.Tensor, dlast: torch.Tensor | None, delta_softplus: bool,
                  varlen: bool, impl: str, dB_out: torch.Tensor | None = None, dC_out: torch.Tensor | None = None,
                  dA_scale: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Gradients [du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state] in the inputs' dtypes and
    shapes; an absent optional input gets an empty tensor. impl: the forward's 'v2' | 'v3' | 'v4' | 'v4+v3'
    (v3's backward). B / C: (b, [g,] n, L) of any dtype (e.g. the layer's bf16 views, or fp32 (b, g, n, L)
    tensors a caller converted once for the forward: no copy then).
    dB_out / dC_out (B-shaped (b, [g,] n, L), any strides and dtype, e.g. slices of the caller's x_proj output
    gradient): dB / dC are written there and the list holds empty placeholders for them. dA_scale (d, n): the
    returned dA is dA * dA_scale (A = -exp(A_log) with dA_scale = A gives d A_log)."""
    impl = bwd_variant(impl)
    b, d, L = u.shape
    n = A.shape[1]
    cfg = _config(u, B, impl)
    nchunks = triton.cdiv(L, cfg.chunk)
    ncks = _ckpt_slots(u, B, impl)
    if ckpt.shape != (b, ncks, n, d):
        raise RuntimeError(f"selective_scan_bwd: checkpoints {tuple(ckpt.shape)} do not match the tile config "
                           f"(chunk {cfg.chunk}, every {cfg.ckpt_every}); was MAMBA_PARALLEL_SCAN_CFG or "
                           f"MAMBA_PARALLEL_SCAN_CKPT_EVERY changed between forward and backward?")
    for name, out, like in (("dB_out", dB_out, B), ("dC_out", dC_out, C)):
        if out is not None and out.shape != like.shape:
            raise ValueError(f"selective_scan_bwd: {name} {tuple(out.shape)} must have B / C's shape "
                             f"{tuple(like.shape)}")
    B4, C4 = _bc32(B), _bc32(C)
    G = B4.shape[1]
    bd = cfg.bwd_block_d
    lane_sum = _lanes(u, delta, z, bd, cfg.bwd_warps, cfg.chunk, d // G, impl, n, varlen=varlen)
    rows = _rows_per_channel(impl, n)
    nblk = d * rows // 32 if lane_sum else d // bd  # dB / dC partials: per warp (v3, v4) or per program
    dev, f32 = u.device, torch.float32
    dy = dy.contiguous()
    du = torch.empty((b, d, L), device=dev, dtype=u.dtype)
    ddt = torch.empty((b, d, L), device=dev, dtype=delta.dtype)
    dz = torch.empty((b, d, L), device=dev, dtype=z.dtype) if z is not None else None
    dBp = torch.empty((b, nblk, n, L), device=dev, dtype=f32)
    dCp = torch.empty((b, nblk, n, L), device=dev, dtype=f32)
    dA = torch.zeros((b, n, d), device=dev, dtype=f32)
    dD = torch.empty((b, d), device=dev, dtype=f32) if D is not None else None
    ddtb = torch.empty((b, d), device=dev, dtype=f32) if delta_bias is not None else None
    adj = torch.zeros((b, 2, n, d), device=dev, dtype=f32)  # ping-pong adjoint carries
    h0 = initial_state.contiguous() if initial_state is not None else None
    dl = dlast.contiguous() if dlast is not None else None
    if dl is not None and not varlen:  # read per chunk and state: state-major
        dl = dl.transpose(1, 2).contiguous()
    if h0 is None:
        dh0 = None
    elif varlen:  # a sequence with no tokens passes d(last_state) straight to its initial state
        dh0 = dl.float().clone() if dl is not None else torch.zeros(h0.shape, device=dev, dtype=f32)
    else:
        dh0 = torch.empty(h0.shape, device=dev, dtype=f32)
    if z is not None and ypre.shape != u.shape:
        raise RuntimeError("selective_scan_bwd: needs y before the gate (ypre) from the forward")
    zz = z if z is not None else u
    opt = lambda t: t if t is not None else du  # noqa: E731  (pointer placeholder for an absent tensor)
    meta = _tile_meta(u, cfg.chunk, impl, n, bwd=True)
    if lane_sum:
        meta.update(LANE_SUM=True, LP=meta["P"].bit_length() - 1, LV=meta["V"].bit_length() - 1,
                    EMU=_interpreted(u))
    else:
        meta["UNROLL"] = 1  # v2's code: its register use was only measured without unrolling
    kc = cfg.ckpt_every
    scr = torch.empty((b, kc, n, d), device=dev, dtype=f32) if kc > 1 else adj  # recomputed chunk states
    selective_scan_bwd_kernel[(d // bd, b)](
        u, delta, zz, B4, C4, A.t().contiguous(), opt(D), opt(delta_bias), opt(h0), opt(sid), ckpt,
        ypre if z is not None else du, dy, opt(dl),
        du, ddt, opt(dz), dBp, dCp, dA, opt(dD), opt(ddtb), opt(dh0), adj, scr,
        L, d, n, d // G, nchunks, nblk, ncks, *_strides(u, delta, zz, B4, C4, sid),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_H0=h0 is not None, HAS_SID=sid is not None, VARLEN=varlen, HAS_DLAST=dl is not None,
        FAST_EXP=not _interpreted(u), BD=bd, KC=kc, num_warps=cfg.bwd_warps, **meta,
    )
    empty = lambda: u.new_empty((0,))  # noqa: E731  (distinct tensors: custom-op outputs may not alias)
    dB = torch.empty(B.shape, device=dev, dtype=B.dtype) if dB_out is None else dB_out
    dC = torch.empty(C.shape, device=dev, dtype=C.dtype) if dC_out is None else dC_out
    dA_out = torch.empty((d, n), device=dev, dtype=A.dtype)
    dD_out = torch.empty((d,), device=dev, dtype=D.dtype) if D is not None else None
    ddtb_out = torch.empty((d,), device=dev, dtype=delta_bias.dtype) if delta_bias is not None else None
    # one launch for the sums over channel blocks (blocks never straddle a group) and over sequences
    finish_bwd(dBp, dCp, dA, dD, ddtb, G, _as4d(dB), _as4d(dC), dA_out, dD_out, ddtb_out, dA_scale=dA_scale)
    return [du, ddt, dA_out, dB if dB_out is None else empty(), dC if dC_out is None else empty(),
            dD_out if dD_out is not None else empty(),
            dz if dz is not None else empty(),
            ddtb_out if ddtb_out is not None else empty(),
            dh0.to(initial_state.dtype) if dh0 is not None else empty()]


def _scan_bwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
              initial_state: torch.Tensor | None, sid: torch.Tensor | None, ckpt: torch.Tensor,
              ypre: torch.Tensor, dy: torch.Tensor, dlast: torch.Tensor | None, delta_softplus: bool,
              varlen: bool, impl: str) -> list[torch.Tensor]:
    """The custom op's body: ``scan_bwd_impl`` with fresh outputs for every gradient."""
    return scan_bwd_impl(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre, dy, dlast,
                         delta_softplus, varlen, impl)


selective_scan_bwd = torch.library.custom_op("mamba_parallel::selective_scan_bwd", mutates_args=())(_scan_bwd)
fastpath(selective_scan_bwd, _scan_bwd)


@selective_scan_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre, dy, dlast, delta_softplus, varlen,
      impl):
    like = lambda t: torch.empty_like(t) if t is not None else u.new_empty((0,))  # noqa: E731
    return [torch.empty_like(u), torch.empty_like(delta), torch.empty_like(A), torch.empty_like(B),
            torch.empty_like(C), like(D), like(z), like(delta_bias), like(initial_state)]


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus, varlen, nstates, save_ckpt, impl = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, output[2], output[3])
    ctx.delta_softplus, ctx.varlen, ctx.impl = delta_softplus, varlen, impl


def _backward(ctx, dy, dlast, _dckpt, _dypre):
    u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre = ctx.saved_tensors
    if ckpt.numel() == 0:
        raise RuntimeError("selective_scan: backward through a forward that ran without grad enabled")
    if dy is None:  # only last_state reached the loss
        dy = torch.zeros_like(u)
    grads = eager(selective_scan_bwd)(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre, dy,
                                      dlast, ctx.delta_softplus, ctx.varlen, ctx.impl)
    du, ddt, dA, dB, dC, dD, dz, ddtb, dh0 = grads
    none_if_absent = lambda g, t: g if t is not None else None  # noqa: E731
    return (du, ddt, dA, dB, dC, none_if_absent(dD, D), none_if_absent(dz, z), none_if_absent(ddtb, delta_bias),
            none_if_absent(dh0, initial_state), None, None, None, None, None, None)


selective_scan_fwd.register_autograd(_backward, setup_context=_setup_context)
fastpath(selective_scan_fwd, _scan_fwd, setup_context=_setup_context, backward=_backward)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
                   return_last_state=False, seq_idx=None, cu_seqlens=None):
    """Same contract as ``mamba_parallel.ops.selective_scan.selective_scan`` (u (b, d, L) -> y (b, d, L)
    [, last_state (b or nseq, d, n) fp32])."""
    b, d, L = u.shape
    if L == 0:  # nothing to scan: the reference handles the empty edge case
        from mamba_parallel.ops.selective_scan import naive
        return naive.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                                    return_last_state, seq_idx, cu_seqlens)
    if cu_seqlens is not None:
        positions = torch.arange(L, device=u.device, dtype=cu_seqlens.dtype)
        sid = torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).to(torch.int32)[None]
        varlen, nstates = True, cu_seqlens.numel() - 1
    else:
        sid = seq_idx.to(torch.int32) if seq_idx is not None else None
        varlen, nstates = False, b
    tensors = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    save_ckpt = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    y, last, _, _ = eager(selective_scan_fwd)(u, delta, A, B, C, D, z, delta_bias, initial_state, sid,
                                              delta_softplus, varlen, nstates, save_ckpt,
                                              scan_impl(b, d, A.shape[1], u.device, _interpreted(u), varlen))
    return (y, last) if return_last_state else y
