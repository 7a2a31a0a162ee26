"""Triton selective scan (Mamba-1): forward and backward as ``torch.library`` custom ops with autograd.

Arguments are already validated by ``mamba_parallel.ops.selective_scan.selective_scan``. Varlen input is turned into
a per-token sequence id (b, L) int32 here: ``seq_idx`` as given, or derived from ``cu_seqlens`` (then
``varlen=True``: initial / last states are per packed sequence). The backward recomputes the states from
checkpoints taken every ``chunk`` tokens, so the (b, d, n, L) states are never stored.
"""

from __future__ import annotations

import torch
import triton

from mamba_parallel.ops.backend import interpret_mode
from mamba_parallel.ops.selective_scan.triton_bwd import selective_scan_bwd_kernel
from mamba_parallel.ops.selective_scan.triton_common import scan_config
from mamba_parallel.ops.selective_scan.triton_fwd import selective_scan_fwd_kernel


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """B / C (b, n, L) -> (b, 1, n, L) view; grouped (b, g, n, L) unchanged."""
    return t.unsqueeze(1) if t.dim() == 3 else t


def _bc32(t: torch.Tensor) -> torch.Tensor:
    """B / C as (b, g, n, L) fp32: they are small (no d axis) and read n times per token, so converting them once
    here saves the kernels a conversion per element and state."""
    return _as4d(t).float()


def _interpreted(u: torch.Tensor) -> bool:
    return not u.is_cuda or interpret_mode()


def _config(u: torch.Tensor, B: torch.Tensor):
    return scan_config(u.shape[1] // _as4d(B).shape[1], u.shape[2], interpret=_interpreted(u))


def _strides(u, delta, z, B4, C4, sid) -> tuple[int, ...]:
    return (*u.stride(), *delta.stride(), *z.stride(), *B4.stride(), *C4.stride(),
            sid.stride(0) if sid is not None else 0)


@torch.library.custom_op("mamba_parallel::selective_scan_fwd", mutates_args=())
def selective_scan_fwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                       initial_state: torch.Tensor | None, sid: torch.Tensor | None, delta_softplus: bool,
                       varlen: bool, nstates: int, save_ckpt: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor, torch.Tensor]:
    """u, delta, z (b, d, L); A (d, n); B, C (b, [g,] n, L); sid (b, L) int32 -> y (b, d, L),
    last_state (nstates, d, n) fp32, checkpoints (b, nchunks, d, n) fp32 (empty unless save_ckpt),
    ypre (b, d, L) = y before the z gate (empty unless save_ckpt and z is given)."""
    b, d, L = u.shape
    n = A.shape[1]
    cfg = _config(u, B)
    nchunks = triton.cdiv(L, cfg.chunk)
    B4, C4 = _bc32(B), _bc32(C)
    dev, f32 = u.device, torch.float32
    y = torch.empty((b, d, L), device=dev, dtype=u.dtype)
    if varlen:  # a sequence with no tokens keeps its initial state
        hlast = (initial_state.float().clone() if initial_state is not None
                 else torch.zeros((nstates, d, n), device=dev, dtype=f32))
    else:
        hlast = torch.empty((nstates, d, n), device=dev, dtype=f32)
    nslots = nchunks if save_ckpt else min(nchunks, 2)
    states = torch.empty((b, nslots, d, n), device=dev, dtype=f32)
    if initial_state is not None and not varlen:
        states[:, 0] = initial_state
    else:
        states[:, 0] = 0.0
    ypre = torch.empty((b, d, L) if save_ckpt and z is not None else (0,), device=dev, dtype=u.dtype)
    h0 = initial_state.contiguous() if initial_state is not None else None
    zz = z if z is not None else u
    opt = lambda t: t if t is not None else y  # noqa: E731  (pointer placeholder for an absent tensor)
    selective_scan_fwd_kernel[(d // cfg.fwd_block_d, b)](
        u, delta, zz, B4, C4, A.contiguous(), opt(D), opt(delta_bias), opt(h0), opt(sid), y, ypre, hlast, states,
        L, d, n, d // B4.shape[1], nchunks, nslots, *_strides(u, delta, zz, B4, C4, sid),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_H0=h0 is not None, HAS_SID=sid is not None, VARLEN=varlen, SAVE_YPRE=save_ckpt and z is not None,
        FAST_EXP=not _interpreted(u), BD=cfg.fwd_block_d, T=cfg.chunk, num_warps=cfg.fwd_warps,
    )
    ckpt = states if save_ckpt else states.new_empty((0,))
    return y, hlast, ckpt, ypre


@selective_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus, varlen, nstates, save_ckpt):
    b, d, L = u.shape
    n = A.shape[1]
    nchunks = triton.cdiv(L, _config(u, B).chunk)
    return (u.new_empty((b, d, L)), u.new_empty((nstates, d, n), dtype=torch.float32),
            u.new_empty((b, nchunks, d, n) if save_ckpt else (0,), dtype=torch.float32),
            u.new_empty((b, d, L) if save_ckpt and z is not None else (0,)))


@torch.library.custom_op("mamba_parallel::selective_scan_bwd", mutates_args=())
def selective_scan_bwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
                       initial_state: torch.Tensor | None, sid: torch.Tensor | None, ckpt: torch.Tensor,
                       ypre: torch.Tensor, dy: torch.Tensor, dlast: torch.Tensor | None, delta_softplus: bool,
                       varlen: bool) -> list[torch.Tensor]:
    """Gradients [du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state] in the inputs' dtypes and
    shapes; an absent optional input gets an empty tensor."""
    b, d, L = u.shape
    n = A.shape[1]
    cfg = _config(u, B)
    nchunks = triton.cdiv(L, cfg.chunk)
    if ckpt.shape != (b, nchunks, d, n):
        raise RuntimeError(f"selective_scan_bwd: checkpoints {tuple(ckpt.shape)} do not match the tile config "
                           f"(chunk {cfg.chunk}); was MAMBA_PARALLEL_SCAN_CFG changed between forward and backward?")
    B4, C4 = _bc32(B), _bc32(C)
    G = B4.shape[1]
    bd = cfg.bwd_block_d
    nblk = d // bd
    dev, f32 = u.device, torch.float32
    dy = dy.contiguous()
    du = torch.empty((b, d, L), device=dev, dtype=u.dtype)
    ddt = torch.empty((b, d, L), device=dev, dtype=delta.dtype)
    dz = torch.empty((b, d, L), device=dev, dtype=z.dtype) if z is not None else None
    dBp = torch.empty((b, nblk, n, L), device=dev, dtype=f32)
    dCp = torch.empty((b, nblk, n, L), device=dev, dtype=f32)
    dA = torch.zeros((b, d, n), device=dev, dtype=f32)
    dD = torch.empty((b, d), device=dev, dtype=f32) if D is not None else None
    ddtb = torch.empty((b, d), device=dev, dtype=f32) if delta_bias is not None else None
    adj = torch.zeros((b, 2, d, n), device=dev, dtype=f32)  # ping-pong adjoint carries between chunks
    h0 = initial_state.contiguous() if initial_state is not None else None
    dl = dlast.contiguous() if dlast is not None else None
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
    selective_scan_bwd_kernel[(nblk, b)](
        u, delta, zz, B4, C4, A.contiguous(), opt(D), opt(delta_bias), opt(h0), opt(sid), ckpt,
        ypre if z is not None else du, dy, opt(dl),
        du, ddt, opt(dz), dBp, dCp, dA, opt(dD), opt(ddtb), opt(dh0), adj,
        L, d, n, d // G, nchunks, nblk, *_strides(u, delta, zz, B4, C4, sid),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_H0=h0 is not None, HAS_SID=sid is not None, VARLEN=varlen, HAS_DLAST=dl is not None,
        FAST_EXP=not _interpreted(u), BD=bd, T=cfg.chunk, num_warps=cfg.bwd_warps,
    )
    # channel blocks never straddle a group: sum the per-block partials of each group
    dB = dBp.view(b, G, nblk // G, n, L).sum(2).to(B.dtype).view(B.shape)
    dC = dCp.view(b, G, nblk // G, n, L).sum(2).to(C.dtype).view(C.shape)
    empty = lambda: u.new_empty((0,))  # noqa: E731  (distinct tensors: custom-op outputs may not alias)
    return [du, ddt, dA.sum(0).to(A.dtype), dB, dC,
            dD.sum(0).to(D.dtype) if dD is not None else empty(),
            dz if dz is not None else empty(),
            ddtb.sum(0).to(delta_bias.dtype) if ddtb is not None else empty(),
            dh0.to(initial_state.dtype) if dh0 is not None else empty()]


@selective_scan_bwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre, dy, dlast, delta_softplus, varlen):
    like = lambda t: torch.empty_like(t) if t is not None else u.new_empty((0,))  # noqa: E731
    return [torch.empty_like(u), torch.empty_like(delta), torch.empty_like(A), torch.empty_like(B),
            torch.empty_like(C), like(D), like(z), like(delta_bias), like(initial_state)]


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus, varlen, nstates, save_ckpt = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, output[2], output[3])
    ctx.delta_softplus, ctx.varlen = delta_softplus, varlen


def _backward(ctx, dy, dlast, _dckpt, _dypre):
    u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre = ctx.saved_tensors
    if ckpt.numel() == 0:
        raise RuntimeError("selective_scan: backward through a forward that ran without grad enabled")
    if dy is None:  # only last_state reached the loss
        dy = torch.zeros_like(u)
    grads = selective_scan_bwd(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre, dy, dlast,
                               ctx.delta_softplus, ctx.varlen)
    du, ddt, dA, dB, dC, dD, dz, ddtb, dh0 = grads
    none_if_absent = lambda g, t: g if t is not None else None  # noqa: E731
    return (du, ddt, dA, dB, dC, none_if_absent(dD, D), none_if_absent(dz, z), none_if_absent(ddtb, delta_bias),
            none_if_absent(dh0, initial_state), None, None, None, None, None)


selective_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    y, last, _, _ = selective_scan_fwd(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, delta_softplus,
                                    varlen, nstates, save_ckpt)
    return (y, last) if return_last_state else y
