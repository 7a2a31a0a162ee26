"""Triton path of the Mamba-3 scan (SISO and MIMO): one autograd node around the kernels of triton_fwd / triton_bwd.

Forward: the phase entering every chunk and the rotated B / C (chunk-parallel, triton_rotate), then one sweep per
(batch row, head) over the chunks, the state in registers: the outputs and the final states (fp32); when a
backward will follow, also the states entering every chunk (x.dtype). Backward: the reverse state-gradient sweep,
the per-chunk gradients, the rotation turned back (dB / dC summed per group), then the per-token chain rule
(triton_token_bwd: dt, A, trap from the decay's log and the trapezoid weights; the phases' carry across chunks)
and torch sums over chunks (dD, the biases, the MIMO scales). The launches are few on purpose: at training sizes
the host's time per launch, not the GPU, set the pace of the torch version of these steps.
Outside the node, in plain differentiable torch: the initial state's trapezoid half step (the token before the
sequence) is folded into the initial state, and the final k / v (the last token's rotated B and x) are gathered.
MIMO needs a power-of-two rank R (the kernels hold chunk x R rows); otherwise the reference runs.
"""

from __future__ import annotations

import math

import torch
import triton

from mamba_parallel.ops._common import fp32_math
from mamba_parallel.ops.mamba3 import naive
from mamba_parallel.ops.mamba3.naive import Mamba3State
from mamba_parallel.ops.mamba3.triton_bwd import chunk_bwd_kernel, dstates_kernel
from mamba_parallel.ops.mamba3.triton_common import block, dot_precision, tuned
from mamba_parallel.ops.mamba3.triton_fwd import scan_fwd_kernel
from mamba_parallel.ops.mamba3.triton_layout import Layout, bc_strides, make_layout, row_strides, strides
from mamba_parallel.ops.mamba3.triton_rotate import chunk_phases, rotated_bc, unrotate
from mamba_parallel.ops.mamba3.triton_token_bwd import token_bwd_kernel


MAX_ROWS = 64  # rows (tokens x rank) of one chunk's tiles: 64 x 64 fp32 score tiles stay in registers


def _rank(B) -> int:
    return B.shape[2] if B.dim() == 5 else 1


def supports(x, dt, A, B, *args) -> bool:
    """SISO, or MIMO of a power-of-two rank; anything else runs the reference."""
    R = _rank(B)
    return R & (R - 1) == 0


def _kt_strides(kt):
    """Rotated k / q (rows, L, [R,] h, n) -> (sb, st, sr, sh) (sr = 0 for SISO; n is contiguous)."""
    st = kt.stride()
    return st[0], st[1], st[2] if kt.dim() == 5 else 0, st[-2]


def _pack_all(lay: Layout, *ts):
    return tuple(lay.pack(t) for t in ts)


def _scalars(dt, A, trap):
    return tuple(t.float().contiguous() for t in (dt, A, trap))


def _forward(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, init_angle, init_ssm, lay,
             T, halved, for_backward):
    """-> y, y before the gate and the fold (for the backward, with a gate or a fold), final phase and state
    (fp32), and for the backward (None without for_backward) the states (x.dtype) and phases entering every
    chunk and the rotated k, q."""
    dt, A, trap = _scalars(dt, A, trap)
    xs, dts, As, traps, Bs, Cs, angs, zs = _pack_all(lay, x, dt, A, trap, B, C, angles, z)
    rows, Lk, H, P = xs.shape
    R, N = _rank(B), B.shape[-1]
    dev = x.device
    ths, fin_ang = chunk_phases(lay, angs, dts, init_angle, T)
    kt, qt = rotated_bc(Bs, Cs, B_bias, C_bias, angs, dts, ths, lay, T, H, halved)
    rank_axis = (R,) if R > 1 else ()
    fold = mimo_o is not None
    y = torch.empty(rows, Lk, *(() if fold else rank_axis), H, P, device=dev, dtype=x.dtype)
    hs = torch.empty(rows, H, lay.nchunks, P, N, device=dev, dtype=x.dtype) if for_backward else None
    keep_ypre = for_backward and (z is not None or fold)  # the backward of the gate / the fold reads y before them
    ypre = torch.empty(rows, Lk, *rank_axis, H, P, device=dev, dtype=x.dtype) if keep_ypre else None
    row_t = ypre if ypre is not None else (y if not fold else None)  # the per-row layout (None: none written)
    fin_ssm = torch.empty(lay.nstates, H, P, N, device=dev, dtype=torch.float32)
    kernel = tuned(scan_fwd_kernel, "scan_fwd", x.dtype)
    grid = lambda meta: (rows * H, triton.cdiv(P, meta["BLOCK_P"]))  # noqa: E731
    kernel[grid](xs, dts, As, traps, kt, qt, D, zs, mimo_x, mimo_z, mimo_o, init_ssm, lay.init, lay.final, y, ypre,
                 fin_ssm, hs, Lk, lay.nchunks, H, P, N,
                 *strides(xs), *strides(dts, 3), *_kt_strides(kt), *strides(zs),
                 *row_strides(row_t), *(strides(y) if fold else (0,) * 4),
                 T=T, R=R, BN=block(N), HAS_D=D is not None, HAS_Z=z is not None, HAS_MX=mimo_x is not None,
                 HAS_MZ=mimo_z is not None, HAS_MO=fold, HAS_INIT=init_ssm is not None, KEEP_YPRE=ypre is not None,
                 KEEP_STATES=hs is not None, PREC=dot_precision(x.dtype))
    if lay.empty is not None and lay.empty.numel():  # a sequence without tokens hands its initial state through
        fin_ssm[lay.empty] = init_ssm[lay.empty] if init_ssm is not None else 0.0
        fin_ang[lay.empty] = init_angle[lay.empty] if init_angle is not None else 0.0
    kept = (hs, ths, kt, qt) if for_backward else (None,) * 4
    return (lay.unpack(y, x), lay.unpack(ypre, x), fin_ang, fin_ssm) + kept


def _turn(d, s, col1, col2):
    """<d, J s> per rotated pair, summed over headdim: how a state's rotation by a small angle moves the loss
    (J turns each pair (s1, s2) to (-s2, s1)). d, s (.., p, n) -> (.., a)."""
    return (d[..., col2] * s[..., col1] - d[..., col1] * s[..., col2]).sum(-2)


def _end_terms(lay: Layout, dfin_angle, dfin_ssm, fin_ssm, col1, col2, H, NA, like):
    """Per sequence of the layout (nseq, h, a): what turning its final phase moves the loss by (d fin_angle) and
    what turning its final state does (<d fin_ssm, J fin_ssm>); zeros where the final state is not returned.
    fin_ssm is None when no phase gradient is asked for (the result is not used then)."""
    fin = lay.seq_final
    ok = (fin >= 0)[:, None, None]
    f = fin.clamp(min=0)
    ang = like.new_zeros(fin.numel(), H, NA)
    turned = like.new_zeros(fin.numel(), H, NA)
    if dfin_angle is not None:
        ang = torch.where(ok, dfin_angle.float()[f], 0.0)
    if dfin_ssm is not None and fin_ssm is not None:
        turned = torch.where(ok, _turn(dfin_ssm.float()[f], fin_ssm[f], col1, col2), 0.0)
    return ang, turned


def _init_angle_grad(lay: Layout, ends, dfin_angle, dinit, init_ssm, col1, col2):
    """The gradient of every initial phase (nstates, h, a), from the states alone.

    Turning a sequence's initial phase by delta turns every q and k of the sequence by delta: the scores q . k and
    what q reads of the state k u^T built inside the sequence do not change, so the loss moves only through the
    final phase (+ delta), the final state (turned by delta) and the initial state (read as if turned by -delta):
    d init_angle = d fin_angle + <d fin_ssm, J fin_ssm> - <d init_ssm, J init_ssm>. Summing the per-token phase
    gradients over the sequence gives the same in exact arithmetic, but those terms cancel to this small total
    (every pair q_i . k_j adds +x at token i and -x at token j), and their rounding (half-precision dot operands,
    states stored in x.dtype) does not cancel: over a thousand tokens that left a few percent of error in bf16.
    """
    dang = -_turn(dinit, init_ssm, col1, col2)
    ang, turned = ends
    ok = (lay.seq_init >= 0) & (lay.seq_final >= 0)
    dang[lay.seq_init[ok]] += (ang + turned)[ok]
    if lay.empty is not None and lay.empty.numel() and dfin_angle is not None:
        # no tokens: the final phase is the initial one and the state passes through unturned (dinit is still
        # zero there: the caller adds the pass-through after this)
        dang[lay.empty] += dfin_angle[lay.empty].float()
    return dang


def _column_blocks(meta, BH: int) -> int:
    """Programs per chunk of chunk_bwd's dq / dk part: one per column block when it splits n (SPLIT), else one."""
    return triton.cdiv(BH, meta["BJ"]) if meta.get("SPLIT") else 1


def _backward(ctx, dy, dfin_angle, dfin_ssm):
    (x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, init_angle, init_ssm,
     ypre, fin_ssm, HS, THS, KT, QT) = ctx.saved_tensors
    lay, T, halved = ctx.lay, ctx.T, ctx.halved
    fold = mimo_o is not None
    R = _rank(B)
    dt, A, trap = _scalars(dt, A, trap)
    if dy is None:
        dy = torch.zeros(ctx.y_shape, device=x.device, dtype=x.dtype)
    xs, dts, As, traps, Bs, Cs, angs, zs, ypres, dys = _pack_all(lay, x, dt, A, trap, B, C, angles, z, ypre,
                                                                 dy.contiguous())
    rows, Lk, H, P = xs.shape
    N, NA = B.shape[-1], angs.shape[3]
    dev, f32 = x.device, torch.float32
    dHS = torch.empty_like(HS)
    need_dangle = init_angle is not None and ctx.needs_input_grad[14]
    need_dinit = init_ssm is not None and (ctx.needs_input_grad[15] or need_dangle)  # the angle's reads it
    dinit = torch.zeros(lay.nstates, H, P, N, device=dev, dtype=f32) if need_dinit else None
    dfin = dfin_ssm.float().contiguous() if dfin_ssm is not None else None
    row_t = ypres if ypres is not None else dys  # per-row layout: ypre (kept with a gate or a fold), else dy
    dx = torch.empty(rows, Lk, H, P, device=dev, dtype=x.dtype)  # per token, contiguous: dy's layout when folded
    tok_strides = strides(dx)
    npb = max(triton.cdiv(P, c.kwargs["BLOCK_P"]) for c in tuned.launches("dstates", x.dtype))  # a slot per block
    turn = torch.empty(rows, H, lay.nchunks, npb, NA, device=dev, dtype=f32)  # <dH, J H> at every chunk's end
    dz = torch.empty_like(dx) if z is not None else None
    # SISO with a gate: the reverse sweep takes the gate's backward once and leaves dy after it (and dz) per token,
    # so the two per-chunk launches read one tensor where each read dy, z and y before the gate
    dyg = torch.empty_like(dx) if z is not None and R == 1 and not fold else None
    kernel = tuned(dstates_kernel, "dstates", x.dtype)
    BH = block(N // 2)
    grid = lambda meta: (rows * H, triton.cdiv(P, meta["BLOCK_P"]))  # noqa: E731
    kst = _kt_strides(KT)
    kernel[grid](dys, zs, ypres, mimo_z, mimo_o, dts, As, traps, QT, lay.init, lay.final, dfin,
                 dHS, dinit, HS, turn, dyg, dz, Lk, lay.nchunks, H, P, N // 2, NA, npb,
                 *strides(dts, 3), *kst, *row_strides(row_t), *tok_strides,
                 *strides(zs), T=T, R=R, BH=BH, HALVED=halved, HAS_Z=z is not None,
                 HAS_MZ=mimo_z is not None, HAS_MO=fold, HAS_DFIN=dfin is not None, HAS_DINIT=dinit is not None,
                 HAS_TURN=True, STORE_DYG=dyg is not None, PREC=dot_precision(x.dtype))

    rank_axis = (R,) if R > 1 else ()
    # every element of these is written by chunk_bwd (no zero fill)
    # the per-head gradients of the rotated k / q, read once more to be turned back and summed over the heads: in
    # bf16 with bf16 inputs (half the traffic of the two largest tensors of the backward; each head's share is
    # rounded once, as a bf16 result would be), fp32 otherwise (fp16's range is too short for per-head sums)
    dBh = torch.empty(rows, Lk, *rank_axis, H, N, device=dev, dtype=x.dtype if x.dtype == torch.bfloat16 else f32)
    dCh = torch.empty_like(dBh)
    dw, dg = (torch.empty_like(dts) for _ in range(2))
    dD = torch.empty(rows, H, lay.nchunks, device=dev, dtype=f32) if D is not None else None
    part = lambda t: torch.empty(rows, H, lay.nchunks, R, P, device=dev, dtype=f32) if t is not None else None  # noqa
    dmx, dmz, dmo = part(mimo_x), part(mimo_z), part(mimo_o)
    # two launches, each with about half the tiles of one: du's part, then dq / dk's (in one program per chunk or
    # one per column block); each leaves its share of the decay's gradient in slots of da that token_bwd sums
    parts = ((1, "chunk_bwd_dx"), (2, "chunk_bwd_dqk")) if R == 1 else ((1, "chunk_bwd_mimo_dx"),
                                                                         (2, "chunk_bwd_mimo_dqk"))
    nda = 1 + max(_column_blocks(c.kwargs, BH) for c in tuned.launches(parts[1][1], x.dtype))
    da = torch.empty(nda, *dts.shape, device=dev, dtype=f32)
    grid = lambda meta: (rows * H, lay.nchunks, _column_blocks(meta, BH) if meta["PART"] == 2 else 1)  # noqa: E731
    for part, name in parts:
        tuned(chunk_bwd_kernel, name, x.dtype)[grid](
            xs, dys, zs, ypres, dyg, dts, As, traps, KT, QT, D, mimo_x, mimo_z, mimo_o, lay.final, HS,
            dHS, dx, dz, dBh, dCh, dw, dg, da, dD, dmx, dmz, dmo,
            Lk, lay.nchunks, H, P, N // 2, NA, nda, da.stride(0),
            *strides(xs), *strides(dts, 3), *kst, *row_strides(row_t),
            *strides(dx), *strides(zs), *bc_strides(dBh)[:4],
            T=T, R=R, BH=BH, BP=block(P), HAS_D=D is not None,
            HAS_Z=z is not None, HAS_MX=mimo_x is not None, HAS_MZ=mimo_z is not None, HAS_MO=fold,
            HAS_DYG=dyg is not None, PREC=dot_precision(x.dtype), PART=part)
    # dk, dq -> dB, dC (+ bias), and the phases' gradients within each chunk
    dB, dC, dphi, dB_bias, dC_bias = unrotate(dBh, dCh, Bs, Cs, B_bias, C_bias, angs, dts, THS, lay, T, halved,
                                              B.dtype)

    # the final phase's and state's share of the phase gradients (when the final states are used)
    has_ends = dfin_angle is not None or (dfin is not None and fin_ssm is not None)
    if has_ends or need_dangle:
        col1, col2 = naive.rope_pairs(N, NA, "halved" if halved else "interleaved", dev)
        ends = _end_terms(lay, dfin_angle, dfin, fin_ssm, col1, col2, H, NA, turn)
    ddt, dA, dtrap = (torch.empty_like(dts) for _ in range(3))
    dang = torch.empty(rows, Lk, H, NA, device=dev, dtype=angles.dtype)
    end_ang, end_turn = ends if has_ends else (None, None)
    token_bwd_kernel[(rows * H, lay.nchunks)](
        dw, dg, da, dphi, dts, As, traps, angs, turn, lay.init, lay.final, lay.chunk_seq, end_ang, end_turn,
        ddt, dA, dtrap, dang, Lk, lay.nchunks, H, NA, npb, nda, da.stride(0), *strides(dts, 3), *angs.stride(),
        *dphi.stride()[:3],
        T=T, BA=block(NA), HAS_ENDS=has_ends, num_warps=4)
    unpack = lambda t: lay.unpack(t, x)  # noqa: E731
    dinit_angle = _init_angle_grad(lay, ends, dfin_angle, dinit, init_ssm, col1, col2) if need_dangle else None
    if lay.empty is not None and lay.empty.numel() and dinit is not None and dfin is not None:
        dinit[lay.empty] += dfin[lay.empty]  # a sequence without tokens hands its state through
    if not ctx.needs_input_grad[15]:
        dinit = None
    rank_sum = lambda t, like: t.sum((0, 2)).to(like.dtype) if like is not None else None  # noqa: E731
    return (unpack(dx), unpack(ddt), unpack(dA), unpack(dB), unpack(dC), unpack(dtrap), unpack(dang),
            dD.sum((0, 2)).to(D.dtype) if D is not None else None, unpack(dz),
            dB_bias, dC_bias,
            rank_sum(dmx, mimo_x), rank_sum(dmz, mimo_z), rank_sum(dmo, mimo_o), dinit_angle, dinit,
            None, None, None, None, None)


class _Mamba3Scan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, init_angle,
                init_ssm, lay, T, halved, for_backward, final_used):
        y, ypre, fin_angle, fin_ssm, *kept = _forward(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x,
                                                        mimo_z, mimo_o, init_angle, init_ssm, lay, T, halved,
                                                        for_backward)
        # the phases' gradients read the final state (_end_terms) when the caller uses it: a copy, the caller may
        # update the state in place
        keep_fin = final_used and any(ctx.needs_input_grad[i] for i in (1, 6, 14))  # dt, angles, initial phase
        ctx.save_for_backward(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o,
                              init_angle, init_ssm, ypre, fin_ssm.clone() if keep_fin else None, *kept)
        ctx.set_materialize_grads(False)  # the final states' gradients arrive as None when they are not used
        ctx.lay, ctx.T, ctx.halved, ctx.y_shape = lay, T, halved, y.shape
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


@fp32_math  # the few torch ops around the kernels (initial / final k, v) stay fp32 inside a caller's autocast
def mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, D=None, z=None, B_bias=None, C_bias=None,
                      mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved", initial_states=None, seq_idx=None,
                      cu_seqlens=None, return_final_states=False):
    """Triton path of ``mamba_parallel.ops.mamba3.mamba3_chunk_scan`` (arguments checked there). chunk_size must be
    a power of two with chunk_size x R >= 16 (R = 1 for SISO). The kernels hold a chunk's T x R rows as one tile
    pair: they use chunks of at most MAX_ROWS rows (a larger chunk_size is split; the result does not depend on
    the chunk size)."""
    R = _rank(B)
    if chunk_size & (chunk_size - 1) or chunk_size * R < 16:
        raise ValueError(f"mamba3_chunk_scan (triton): chunk_size must be a power of two with chunk_size x rank >= 16,"
                         f" got {chunk_size} (rank {R})")
    chunk_size = min(chunk_size, max(1, MAX_ROWS // R))
    b, L, h, p = x.shape
    n = B.shape[-1]
    mimo = B.dim() == 5
    if L == 0:
        return naive.mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, D, z, B_bias, C_bias, mimo_x, mimo_z,
                                       mimo_o, rope=rope, initial_states=initial_states, cu_seqlens=cu_seqlens,
                                       return_final_states=return_final_states)
    lay = make_layout(b, L, chunk_size, seq_idx, cu_seqlens, x.device)
    if initial_states is not None or return_final_states:
        first, last, nonempty = _state_tokens(b, L, cu_seqlens, x.device)
    flat = lambda t: t.reshape(b * L, *t.shape[2:])  # noqa: E731
    mx = mimo_x.float().transpose(0, 1) if mimo_x is not None else 1.0  # (R, h, p)
    init_angle = init_ssm = None
    if initial_states is not None:
        # the trapezoid's half step of the token before each sequence joins its initial state
        beta0 = (1 - flat(trap)[first].float()) * flat(dt)[first].float()
        if nonempty is not None:
            beta0 = beta0 * nonempty[:, None]
        k_prev = initial_states.k.float() if mimo else initial_states.k.float().unsqueeze(1)
        u_prev = initial_states.v.float().unsqueeze(1) * mx
        outer = torch.einsum("nrhp,nrhq->nhpq", u_prev, k_prev)
        init_ssm = (initial_states.ssm.float() + beta0[..., None, None] * outer).contiguous()
        init_angle = initial_states.angle.float().contiguous()
    small = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    leaves = (x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, init_angle, init_ssm)
    for_backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)
    y, fin_angle, fin_ssm = _Mamba3Scan.apply(x, dt, A, B, C, trap, angles, small(D), z, small(B_bias),
                                              small(C_bias), small(mimo_x), small(mimo_z), small(mimo_o),
                                              init_angle, init_ssm, lay, chunk_size, rope == "halved", for_backward,
                                              return_final_states)
    if not return_final_states:
        return y
    # the last token's rotated B and x, what the next token's trapezoid half step reads
    k0 = _per_head(flat(B)[last].float(), h)  # (N, [R,] h, n)
    if B_bias is not None:
        k0 = k0 + (B_bias.float().transpose(0, 1) if mimo else B_bias.float())
    first_col, second_col = naive.rope_pairs(n, angles.shape[-1], rope, x.device)
    k_last = naive.rotate(k0, fin_angle[:, None] if mimo else fin_angle, first_col, second_col)
    v_last = flat(x)[last]
    if nonempty is not None:  # a sequence without tokens hands its initial k / v through (or zeros)
        k_prev = initial_states.k.float() if initial_states is not None else torch.zeros_like(k_last)
        v_prev = initial_states.v.to(v_last.dtype) if initial_states is not None else torch.zeros_like(v_last)
        k_last = torch.where(nonempty.view(-1, *([1] * (k_last.dim() - 1))), k_last, k_prev)
        v_last = torch.where(nonempty[:, None, None], v_last, v_prev)
    return y, Mamba3State(torch.remainder(fin_angle, 2 * math.pi), fin_ssm, k_last, v_last)


def supports_step(state, x, dt, A, B, *args) -> bool:
    """SISO, or MIMO of a power-of-two rank (the kernel's rank axis)."""
    R = B.shape[1] if B.dim() == 4 else 1
    return R & (R - 1) == 0


def _ranked3(t):
    """(b, [R,] c, n) -> strides (sb, sr, sc, sn) with sr = 0 without a rank axis."""
    if t.dim() == 4:
        return tuple(t.stride())
    sb, sc, sn = t.stride()
    return sb, 0, sc, sn


def step_launch(b: int, H: int, P: int) -> tuple[int, int]:
    """(headdim rows per program, warps) of the decode step. Few rows per program: on an H200 (b64 h64 p64 n128,
    bf16) a step took 583 us with a whole head per program, 245 with 16 rows, 135 with 8 (one warp) and 122 with 4
    (docs/kernels/mamba3.md#decode-step)."""
    return min(block(P, least=1), 4), 1


def mamba3_state_update(state: Mamba3State, x, dt, A, B, C, trap, angles, D=None, z=None, B_bias=None,
                        C_bias=None, mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved", discretize=None):
    """Triton path of ``mamba_parallel.ops.mamba3.mamba3_state_update`` (arguments checked there)."""
    from mamba_parallel.ops.mamba3.triton_step import step_kernel, step_shared_kernel

    b, H, P = x.shape
    R = B.shape[1] if B.dim() == 4 else 1
    G, N = B.shape[-2], B.shape[-1]
    fold = mimo_o is not None or R == 1
    y = torch.empty(b, H, P, device=x.device, dtype=x.dtype) if fold else \
        torch.empty(b, R, H, P, device=x.device, dtype=x.dtype)
    small = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    raw = discretize is not None
    dt_bias = small(discretize.dt_bias) if raw else None
    A_floor = float(discretize.A_floor) if raw else 0.0
    if not raw:
        dt, A, trap = _scalars(dt, A, trap)
    elif not dt.stride() == A.stride() == trap.stride():  # raw projections: their own dtype, one set of strides
        dt, A, trap = dt.contiguous(), A.contiguous(), trap.contiguous()
    B_bias, C_bias = small(B_bias), small(C_bias)
    BP, warps = step_launch(b, H, P)
    blocks = triton.cdiv(P, BP)
    halved, NA = rope == "halved", angles.shape[-1]
    # not autotuned: the kernels update the cache in place, a tuning rerun would advance it twice
    step_kernel[(b * H, blocks)](
        x, dt, A, trap, B, C, B_bias, C_bias, angles, small(D), z, small(mimo_x), small(mimo_z), small(mimo_o),
        *state, y, dt_bias, A_floor, H, H // G, P, N // 2, NA,
        *strides(x, 3), *strides(dt, 2), *_ranked3(B), *_ranked3(C), *strides(angles, 3),
        *strides(z, 3), *strides(state.angle, 3), *strides(state.ssm), *_ranked3(state.k),
        *strides(state.v, 3), *((y.stride(0), 0, *y.stride()[1:]) if fold else y.stride()),
        R=R, BH=block(N // 2), BP=BP, HALVED=halved, HAS_BIAS=B_bias is not None,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_MX=mimo_x is not None,
        HAS_MZ=mimo_z is not None, HAS_MO=mimo_o is not None, WRITE_SHARED=blocks == 1, RAW=raw, num_warps=warps)
    if blocks > 1:
        step_shared_kernel[(b * H,)](
            dt, dt_bias, angles, B, B_bias, state.angle, state.k, H, H // G, N // 2, NA,
            *strides(dt, 2), *_ranked3(B), *strides(angles, 3), *strides(state.angle, 3), *_ranked3(state.k),
            R=R, BH=block(N // 2), HALVED=halved, HAS_BIAS=B_bias is not None, RAW=raw, num_warps=1)
    return y
