"""Triton path of the Mamba-3 scan (SISO): one autograd node around the kernels of triton_fwd / triton_bwd.

Forward: the state sweep (states entering every chunk, in x.dtype, and the final ones, fp32) then the chunk
outputs, all chunks at once. Backward: the sweep again (the states are not kept: they are larger than x), the
reverse state-gradient sweep, the per-chunk gradients, then a few torch ops for what is a per-token chain rule
(dt, A, trap from the decay's log and the trapezoid weights; the phase's suffix sums across chunks).
Outside the node, in plain differentiable torch: the initial state's trapezoid half step (the token before the
sequence) is folded into the initial state, and the final k / v (the last token's rotated B and x) are gathered.
MIMO (rank-R B / C) runs the reference (``supports`` says so).
"""

from __future__ import annotations

import math

import torch
import triton

from mamba_parallel.ops.mamba3 import naive
from mamba_parallel.ops.mamba3.naive import Mamba3State
from mamba_parallel.ops.mamba3.triton_bwd import chunk_bwd_kernel, dstates_kernel
from mamba_parallel.ops.mamba3.triton_common import block, dot_precision, tuned
from mamba_parallel.ops.mamba3.triton_fwd import chunk_fwd_kernel, states_kernel
from mamba_parallel.ops.mamba3.triton_layout import Layout, make_layout


def supports(x, dt, A, B, *args) -> bool:
    """The kernels cover SISO (B / C of rank 1); MIMO runs the reference."""
    return B.dim() == 4


def _strides(t, n=4):
    return tuple(t.stride()) if t is not None else (0,) * n


def _states(xs, dts, As, traps, Bs, B_bias, angs, init_angle, init_ssm, lay: Layout, T, halved, nstates,
            keep_final: bool):
    """The state sweep -> states entering every chunk (rows, h, nc, p, n) in x.dtype, phases (rows, h, nc, a),
    final state (nstates, h, p, n) and phase (nstates, h, a) fp32."""
    rows, Lk, H, P = xs.shape
    G, N, NA = Bs.shape[2], Bs.shape[3], angs.shape[3]
    dev = xs.device
    HS = torch.empty(rows, H, lay.nchunks, P, N, device=dev, dtype=xs.dtype)
    THS = torch.empty(rows, H, lay.nchunks, NA, device=dev, dtype=torch.float32)
    fin_ssm = torch.empty(nstates if keep_final else 0, H, P, N, device=dev, dtype=torch.float32)
    fin_ang = torch.empty(nstates if keep_final else 0, H, NA, device=dev, dtype=torch.float32)
    kernel = tuned(states_kernel, "states")
    grid = lambda meta: (rows * H, triton.cdiv(P, meta["BLOCK_P"]))  # noqa: E731
    kernel[grid](xs, dts, As, traps, Bs, B_bias, angs, init_ssm, init_angle, lay.init, lay.final if keep_final
                 else torch.full_like(lay.final, -2).masked_fill(lay.final != -2, -1), HS, THS, fin_ssm, fin_ang,
                 Lk, lay.nchunks, H, H // G, P, N // 2, NA,
                 *_strides(xs), *_strides(dts, 3), *_strides(Bs), *_strides(angs),
                 T=T, BH=block(N // 2), HALVED=halved, HAS_BIAS=B_bias is not None, HAS_INIT=init_ssm is not None,
                 PREC=dot_precision(xs.dtype))
    return HS, THS, fin_ssm, fin_ang


def _pack_all(lay: Layout, *ts):
    return tuple(lay.pack(t) for t in ts)


def _scalars(dt, A, trap):
    return tuple(t.float().contiguous() for t in (dt, A, trap))


def _forward(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, init_angle, init_ssm, lay, T, halved):
    dt, A, trap = _scalars(dt, A, trap)
    xs, dts, As, traps, Bs, Cs, angs, zs = _pack_all(lay, x, dt, A, trap, B, C, angles, z)
    rows, Lk, H, P = xs.shape
    G, N, NA = Bs.shape[2], Bs.shape[3], angs.shape[3]
    HS, THS, fin_ssm, fin_ang = _states(xs, dts, As, traps, Bs, B_bias, angs, init_angle, init_ssm, lay, T, halved,
                                        lay.nstates, True)
    y = torch.empty(rows, Lk, H, P, device=x.device, dtype=x.dtype)
    ypre = torch.empty_like(y) if z is not None else None
    kernel = tuned(chunk_fwd_kernel, "chunk_fwd")
    grid = lambda meta: (rows * H, lay.nchunks, triton.cdiv(P, meta["BLOCK_P"]))  # noqa: E731
    kernel[grid](xs, dts, As, traps, Bs, Cs, B_bias, C_bias, angs, D, zs, lay.final, HS, THS, y, ypre,
                 Lk, lay.nchunks, H, H // G, P, N // 2, NA,
                 *_strides(xs), *_strides(dts, 3), *_strides(Bs), *_strides(Cs), *_strides(angs), *_strides(zs),
                 *_strides(y), T=T, BH=block(N // 2), HALVED=halved, HAS_BIAS=B_bias is not None,
                 HAS_D=D is not None, HAS_Z=z is not None, PREC=dot_precision(x.dtype))
    if lay.empty is not None and lay.empty.numel():  # a sequence without tokens hands its initial state through
        fin_ssm[lay.empty] = init_ssm[lay.empty] if init_ssm is not None else 0.0
        fin_ang[lay.empty] = init_angle[lay.empty] if init_angle is not None else 0.0
    return lay.unpack(y, x), lay.unpack(ypre, x), fin_ang, fin_ssm


def _phase_carry(lay: Layout, tot, dfin_angle, T, Lk):
    """Per-chunk phase-gradient totals (rows, h, nc, a) -> what later chunks (and the final phase) add to every
    token of a chunk (rows, Lk, h, a), and the gradient of each initial phase (nseq_in_layout, h, a)."""
    rows, H, nc, NA = tot.shape
    flat = tot.permute(0, 2, 1, 3).reshape(rows * nc, H, NA)
    seq = lay.chunk_seq
    nseq = lay.seq_final.numel()
    dfin = flat.new_zeros(nseq, H, NA)
    if dfin_angle is not None:
        ok = lay.seq_final >= 0
        dfin[ok] = dfin_angle.float()[lay.seq_final[ok]]
    suffix = torch.cat([flat.flip(0).cumsum(0).flip(0), flat.new_zeros(1, H, NA)])  # inclusive, over all chunks
    last = torch.cumsum(torch.bincount(seq, minlength=nseq), 0) - 1
    first = torch.cat([last.new_zeros(1), last[:-1] + 1])
    after = suffix[last + 1]  # what the chunks after each sequence add
    carry = suffix[:-1] - flat - after[seq] + dfin[seq]
    carry = carry.view(rows, nc, 1, H, NA).expand(rows, nc, T, H, NA).reshape(rows, nc * T, H, NA)[:, :Lk]
    return carry, suffix[first] - after + dfin


def _backward(ctx, dy, dfin_angle, dfin_ssm):
    (x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, init_angle, init_ssm, ypre) = ctx.saved_tensors
    lay, T, halved = ctx.lay, ctx.T, ctx.halved
    dt, A, trap = _scalars(dt, A, trap)
    if dy is None:
        dy = torch.zeros(x.shape, device=x.device, dtype=x.dtype)
    assert ypre is None or ypre.is_contiguous()  # the kernels read dy and ypre with the same offsets
    xs, dts, As, traps, Bs, Cs, angs, zs, ypres, dys = _pack_all(lay, x, dt, A, trap, B, C, angles, z, ypre,
                                                                 dy.contiguous())
    rows, Lk, H, P = xs.shape
    G, N, NA = Bs.shape[2], Bs.shape[3], angs.shape[3]
    dev, f32 = x.device, torch.float32
    HS, THS, _, _ = _states(xs, dts, As, traps, Bs, B_bias, angs, init_angle, init_ssm, lay, T, halved,
                            lay.nstates, False)
    dHS = torch.empty_like(HS)
    need_dinit = init_ssm is not None and ctx.needs_input_grad[12]
    dinit = torch.zeros(lay.nstates, H, P, N, device=dev, dtype=f32) if need_dinit else None
    dfin = dfin_ssm.float().contiguous() if dfin_ssm is not None else None
    kernel = tuned(dstates_kernel, "dstates")
    grid = lambda meta: (rows * H, triton.cdiv(P, meta["BLOCK_P"]))  # noqa: E731
    kernel[grid](dys, zs, ypres, dts, As, traps, Cs, C_bias, angs, lay.init, lay.final, THS, dfin, dHS, dinit,
                 Lk, lay.nchunks, H, H // G, P, N // 2, NA,
                 *_strides(dts, 3), *_strides(Cs), *_strides(angs), *_strides(dys), *_strides(zs),
                 T=T, BH=block(N // 2), HALVED=halved, HAS_BIAS=C_bias is not None, HAS_Z=z is not None,
                 HAS_DFIN=dfin is not None, HAS_DINIT=dinit is not None, PREC=dot_precision(x.dtype))

    dx = torch.empty(rows, Lk, H, P, device=dev, dtype=x.dtype)
    dz = torch.empty_like(dx) if z is not None else None
    dBh = torch.zeros(rows, Lk, H, N, device=dev, dtype=f32)
    dCh = torch.zeros_like(dBh)
    dw, dg, da = (torch.zeros_like(dts) for _ in range(3))
    dphi = torch.zeros(rows, Lk, H, NA, device=dev, dtype=f32)
    dth_tot = torch.empty(rows, H, lay.nchunks, NA, device=dev, dtype=f32)
    dD = torch.empty(rows, H, lay.nchunks, device=dev, dtype=f32) if D is not None else None
    kernel = tuned(chunk_bwd_kernel, "chunk_bwd")
    kernel[(rows * H, lay.nchunks)](
        xs, dys, zs, ypres, dts, As, traps, Bs, Cs, B_bias, C_bias, angs, D, lay.final, HS, THS, dHS,
        dx, dz, dBh, dCh, dw, dg, da, dphi, dth_tot, dD,
        Lk, lay.nchunks, H, H // G, P, N // 2, NA,
        *_strides(xs), *_strides(dts, 3), *_strides(Bs), *_strides(Cs), *_strides(angs), *_strides(dys),
        *_strides(zs), *dBh.stride()[:3], *dphi.stride()[:3],
        T=T, BH=block(N // 2), BP=block(P), HALVED=halved, HAS_BIAS=B_bias is not None, HAS_D=D is not None,
        HAS_Z=z is not None, PREC=dot_precision(x.dtype))

    # the per-token chain rule: w_j = gamma_j + beta_{j+1}, gamma = trap dt, beta = (1 - trap) dt, log decay dt A
    dbeta = torch.zeros_like(dw)
    dbeta[:, 1:] = dw[:, :-1]
    dbeta = dbeta.masked_fill(lay.first_tokens(T)[..., None], 0.0)  # no token before a sequence's first here
    dgt = dw + dg
    carry, dinit_angle_seq = _phase_carry(lay, dth_tot, dfin_angle, T, Lk)
    dphi = dphi + carry
    ddt = da * As + traps * dgt + (1 - traps) * dbeta + (dphi * angs.float()).sum(-1)
    grads = dict(x=lay.unpack(dx, x), dt=lay.unpack(ddt, x), A=lay.unpack(da * dts, x),
                 trap=lay.unpack(dts * (dgt - dbeta), x), angles=lay.unpack(dphi * dts[..., None], x),
                 z=lay.unpack(dz, x))
    hpg = H // G
    grads["B"] = lay.unpack(dBh.view(rows, Lk, G, hpg, N).sum(3).to(B.dtype), x)
    grads["C"] = lay.unpack(dCh.view(rows, Lk, G, hpg, N).sum(3).to(C.dtype), x)
    dinit_angle = None
    if init_angle is not None and ctx.needs_input_grad[11]:
        dinit_angle = torch.zeros_like(init_angle, dtype=f32)
        ok = lay.seq_init >= 0
        dinit_angle[lay.seq_init[ok]] = dinit_angle_seq[ok]
    if lay.empty is not None and lay.empty.numel():
        if dinit_angle is not None and dfin_angle is not None:
            dinit_angle[lay.empty] += dfin_angle[lay.empty].float()
        if dinit is not None and dfin is not None:
            dinit[lay.empty] += dfin[lay.empty]
    return (grads["x"], grads["dt"], grads["A"], grads["B"], grads["C"], grads["trap"],
            grads["angles"].to(angles.dtype), dD.sum((0, 2)).to(D.dtype) if D is not None else None, grads["z"],
            dBh.sum((0, 1)).to(B_bias.dtype) if B_bias is not None else None,
            dCh.sum((0, 1)).to(C_bias.dtype) if C_bias is not None else None,
            dinit_angle, dinit, None, None, None)


class _Mamba3Scan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, init_angle, init_ssm, lay, T, halved):
        y, ypre, fin_angle, fin_ssm = _forward(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, init_angle,
                                               init_ssm, lay, T, halved)
        ctx.save_for_backward(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, init_angle, init_ssm, ypre)
        ctx.lay, ctx.T, ctx.halved = lay, T, halved
        return y, fin_angle, fin_ssm

    @staticmethod
    def backward(ctx, dy, dfin_angle, dfin_ssm):
        return _backward(ctx, dy, dfin_angle, dfin_ssm)


def _state_tokens(b, L, cu_seqlens, device):
    """(first, last) flat token index of every state's sequence (N,), and which sequences have tokens (None:
    all of them, known without looking at the device)."""
    if cu_seqlens is None:
        rows = torch.arange(b, device=device)
        return rows * L, rows * L + L - 1, None
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    return cu[:-1].clamp(max=L - 1), (cu[1:] - 1).clamp(min=0), cu[1:] > cu[:-1]


def _per_head(t, h):
    return t.repeat_interleave(h // t.shape[-2], dim=-2)


def mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, D=None, z=None, B_bias=None, C_bias=None,
                      mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved", initial_states=None, seq_idx=None,
                      cu_seqlens=None, return_final_states=False):
    """Triton path of ``mamba_parallel.ops.mamba3.mamba3_chunk_scan`` (SISO; arguments checked there).
    chunk_size must be a power of two >= 16."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"mamba3_chunk_scan (triton): chunk_size must be a power of two >= 16, got {chunk_size}")
    b, L, h, p = x.shape
    n = B.shape[-1]
    if L == 0:
        return naive.mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, D, z, B_bias, C_bias, rope=rope,
                                       initial_states=initial_states, cu_seqlens=cu_seqlens,
                                       return_final_states=return_final_states)
    lay = make_layout(b, L, chunk_size, seq_idx, cu_seqlens, x.device)
    first, last, nonempty = _state_tokens(b, L, cu_seqlens, x.device)
    flat = lambda t: t.reshape(b * L, *t.shape[2:])  # noqa: E731
    init_angle = init_ssm = None
    if initial_states is not None:
        # the trapezoid's half step of the token before each sequence joins its initial state
        beta0 = (1 - flat(trap)[first].float()) * flat(dt)[first].float()
        if nonempty is not None:
            beta0 = beta0 * nonempty[:, None]
        outer = initial_states.v.float()[..., :, None] * initial_states.k.float()[..., None, :]
        init_ssm = (initial_states.ssm.float() + beta0[..., None, None] * outer).contiguous()
        init_angle = initial_states.angle.float().contiguous()
    small = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    y, fin_angle, fin_ssm = _Mamba3Scan.apply(x, dt, A, B, C, trap, angles, small(D), z, small(B_bias),
                                              small(C_bias), init_angle, init_ssm, lay, chunk_size,
                                              rope == "halved")
    if not return_final_states:
        return y
    # the last token's rotated B and x, what the next token's trapezoid half step reads
    k0 = _per_head(flat(B)[last].float(), h)
    if B_bias is not None:
        k0 = k0 + B_bias.float()
    first_col, second_col = naive.rope_pairs(n, angles.shape[-1], rope, x.device)
    k_last = naive.rotate(k0, fin_angle, first_col, second_col)
    v_last = flat(x)[last]
    if nonempty is not None:  # a sequence without tokens hands its initial k / v through (or zeros)
        keep = nonempty[:, None, None]
        k_prev = initial_states.k.float() if initial_states is not None else torch.zeros_like(k_last)
        v_prev = initial_states.v.to(v_last.dtype) if initial_states is not None else torch.zeros_like(v_last)
        k_last, v_last = torch.where(keep, k_last, k_prev), torch.where(keep, v_last, v_prev)
    return y, Mamba3State(torch.remainder(fin_angle, 2 * math.pi), fin_ssm, k_last, v_last)


def supports_step(state, x, dt, A, B, *args) -> bool:
    """The decode kernel covers SISO; MIMO runs the reference."""
    return B.dim() == 3


def mamba3_state_update(state: Mamba3State, x, dt, A, B, C, trap, angles, D=None, z=None, B_bias=None,
                        C_bias=None, mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved"):
    """Triton path of ``mamba_parallel.ops.mamba3.mamba3_state_update`` (SISO; arguments checked there)."""
    from mamba_parallel.ops.mamba3.triton_step import step_kernel

    b, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    y = torch.empty_like(x)
    small = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    dt, A, trap = _scalars(dt, A, trap)
    # not autotuned: the kernel updates the cache in place, a tuning rerun would advance it twice
    step_kernel[(b * H,)](x, dt, A, trap, B, C, small(B_bias), small(C_bias), angles, small(D), z, *state, y,
                          H, H // G, P, N // 2, angles.shape[-1],
                          *_strides(x, 3), *_strides(dt, 2), *_strides(B, 3), *_strides(C, 3),
                          *_strides(angles, 3), *_strides(z, 3), *_strides(state.angle, 3), *_strides(state.ssm),
                          *_strides(state.k, 3), *_strides(state.v, 3), *_strides(y, 3),
                          BH=block(N // 2), BP=block(P), HALVED=rope == "halved", HAS_BIAS=B_bias is not None,
                          HAS_D=D is not None, HAS_Z=z is not None, num_warps=4)
    return y
