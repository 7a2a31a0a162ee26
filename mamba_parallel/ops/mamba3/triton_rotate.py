"""The rotary phase of every chunk and the rotated B / C, computed chunk-parallel before the sweeps.

``chunk_turn_kernel``: one program per (batch row, head, chunk) sums the chunk's phase steps angle_t * dt_t
(one (a,) vector per chunk); ``phase_prefix_kernel`` turns those sums into the phase entering every chunk (a
prefix over each sequence's chunks, in float64, reduced to [0, 2 pi)). ``rotate_kernel``: one program per (batch row, head, chunk)
adds the biases to B (and C) and turns them by each token's phase, written per head in the columns they came
from (k, q: (rows, L, [R,] h, n) in x.dtype). The sweeps then read k and q as plain tiles: no trigonometry and no
phase prefix inside their serial loop. ``unrotate_kernel`` goes the other way in the backward: the gradients of
the rotated k / q, turned back by the same phases and summed over each group's heads, are those of B and C.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.backend import gpu_compiled
from mamba_parallel.ops.mamba3.triton_common import (block, cos_sin, load_halves, per_token, rotate_pairs,
                                                      rows, store_halves)
from mamba_parallel.ops.mamba3.triton_layout import Layout, bc_strides


@triton.jit
def chunk_turn_kernel(ANG, DT, TURNS, L, NC, H, NA, sab, sat, sah, saa, sdb, sdt, sdh,
                      T: tl.constexpr, BA: tl.constexpr):
    """TURNS (rows, nc, h, a) fp32: sum over the chunk's tokens of angle * dt."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    t = c * T + tl.arange(0, T)
    offs_a = tl.arange(0, BA)
    am = offs_a < NA
    valid = t < L
    dt = tl.load(DT + b * sdb + h * sdh + t * sdt, mask=valid, other=0.0).to(tl.float32)
    om = tl.load(ANG + b * sab + h * sah + t[:, None] * sat + offs_a[None, :] * saa,
                 mask=valid[:, None] & am[None, :], other=0.0).to(tl.float32)
    tl.store(TURNS + ((b * NC + c) * H + h) * NA + offs_a, tl.sum(om * dt[:, None], 0), mask=am)


@triton.jit
def _reset_add(v1, f1, v2, f2):
    """The combine of a sum that restarts where the flag is set (a new sequence)."""
    return tl.where(f2 != 0, v2, v1 + v2), tl.maximum(f1, f2)


@triton.jit
def phase_prefix_kernel(TURNS, CINIT, CFINAL, INIT_ANG, THS, FIN, NC, H, NA,
                        BC: tl.constexpr, BA: tl.constexpr, HAS_INIT: tl.constexpr):
    """One program per (batch row, head) runs over its chunks, BC at a time: the phase entering chunk c is its
    sequence's initial phase at a sequence start (CINIT: -1 zero, >= 0 INIT_ANG's row), else the phase entering
    c - 1 plus that chunk's turn (TURNS (rows, nc, h, a), chunk_turn_kernel). The sum runs in float64: phases add
    up over a whole sequence, an fp32 sum over thousands of chunks would lose the digits that matter once reduced.
    THS (rows, h, nc, a) gets every chunk's entering phase, FIN (nstates, h, a) every returned final phase
    (CFINAL >= 0: the sequence ends in this chunk), both fp32 in [0, 2 pi)."""
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = pid % H
    offs_a = tl.arange(0, BA)
    am = offs_a < NA
    two_pi = 6.283185307179586
    carry = tl.zeros((BA,), dtype=tl.float64)  # the phase entering the chunk before this block
    for c0 in range(0, NC, BC):
        cs = c0 + tl.arange(0, BC)
        cm = cs < NC
        m = cm[:, None] & am[None, :]
        init = tl.load(CINIT + b * NC + cs, mask=cm, other=-2)
        start = init != -2
        base = tl.zeros((BC, BA), dtype=tl.float64)
        if HAS_INIT:
            base = tl.load(INIT_ANG + (tl.maximum(init, 0).to(tl.int64) * H + h)[:, None] * NA + offs_a[None, :],
                           mask=m & (init >= 0)[:, None], other=0.0).to(tl.float64)
        prev = tl.load(TURNS + ((b * NC + cs - 1) * H + h)[:, None] * NA + offs_a[None, :],
                       mask=m & (cs >= 1)[:, None], other=0.0).to(tl.float64)
        step = tl.where(start[:, None], base, prev)
        flag = tl.broadcast_to(start.to(tl.int32)[:, None], (BC, BA))
        enter, reset = tl.associative_scan((step, flag), 0, _reset_add)
        enter = tl.where(reset != 0, enter, enter + carry[None, :])
        ths = enter - two_pi * tl.floor(enter / two_pi)
        tl.store(THS + ((b * H + h) * NC + cs)[:, None] * NA + offs_a[None, :], ths.to(tl.float32), mask=m)
        final = tl.load(CFINAL + b * NC + cs, mask=cm, other=-2)
        own = tl.load(TURNS + ((b * NC + cs) * H + h)[:, None] * NA + offs_a[None, :], mask=m, other=0.0)
        end = enter + own.to(tl.float64)
        end = end - two_pi * tl.floor(end / two_pi)
        tl.store(FIN + (tl.maximum(final, 0).to(tl.int64) * H + h)[:, None] * NA + offs_a[None, :],
                 end.to(tl.float32), mask=m & (final >= 0)[:, None])
        carry = tl.sum(tl.where((cs == c0 + BC - 1)[:, None], enter, 0.0), 0)


@triton.jit
def _phase(ANG, DT, THS, b, h, c, t, lead, valid, j0, NC, H, NA, sab, sat, sah, saa, sdb, sdt, sdh,
           BJ: tl.constexpr, FAST: tl.constexpr):
    """cos / sin (rows, BJ) of every row's phase for pairs j0 .. j0 + BJ of head h: the phase entering chunk c plus
    the chunk's steps up to the row's token (one row per token steps it: every rank of a token turns by the same
    angle). Pairs j >= NA have no angle: they read cos 1, sin 0."""
    offs_j = j0 + tl.arange(0, BJ)
    am = offs_j < NA
    dt = tl.load(DT + b * sdb + h * sdh + t * sdt, mask=valid, other=0.0).to(tl.float32)
    th_c = tl.load(THS + ((b * H + h) * NC + c) * NA + offs_j, mask=am, other=0.0)
    om = tl.load(ANG + b * sab + h * sah + t[:, None] * sat + offs_j[None, :] * saa,
                 mask=valid[:, None] & am[None, :], other=0.0).to(tl.float32)
    th_t = th_c[None, :] + tl.cumsum(tl.where(lead[:, None], om * dt[:, None], 0.0), 0)
    return cos_sin(th_t, FAST)


@triton.jit
def rotate_kernel(Bm, Cm, BIAS_B, BIAS_C, ANG, DT, THS, KT, QT, L, NC, H, HPG, NH, NA,
                  sbb, sbt, sbr, sbg, sbn, scb, sct, scr, scg, scn, sab, sat, sah, saa, sdb, sdt, sdh,
                  skb, skt, skr, skh,
                  T: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BA: tl.constexpr, HALVED: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_K: tl.constexpr, HAS_Q: tl.constexpr, FAST: tl.constexpr):
    """KT / QT share one layout (strides sk*; the rank stride skr is 0 for SISO). THS (rows, h, nc, a): the phase
    entering every chunk. HAS_K / HAS_Q: write k / q (the forward needs both, the backward's state-gradient sweep
    q alone). Pairs BA .. BH (BA <= BH a power of two covering the NA turning pairs) never turn: they are copied
    with their bias, without trigonometry (at d_state 128 with a quarter of it rotary, half of the pairs)."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    b = (pid // H).to(tl.int64)
    h = pid % H
    t, rank, lead = rows(c, T, R)
    valid = t < L
    cos, sin = _phase(ANG, DT, THS, b, h, c, t, lead, valid, 0, NC, H, NA, sab, sat, sah, saa, sdb, sdt, sdh, BA,
                      FAST)
    g = h // HPG
    out = b * skb + t * skt + rank * skr + h * skh
    bias_row = (h * R + rank) * (2 * NH)  # the biases (h, [R,] n), contiguous
    if HAS_K:
        _rotate_rows(Bm + b * sbb + g * sbg, t * sbt + rank * sbr, BIAS_B, bias_row, KT, out, cos, sin, valid, NH, BH,
                     BA, HALVED, HAS_BIAS)
    if HAS_Q:
        _rotate_rows(Cm + b * scb + g * scg, t * sct + rank * scr, BIAS_C, bias_row, QT, out, cos, sin, valid, NH, BH,
                     BA, HALVED, HAS_BIAS)


@triton.jit
def _with_bias(SRC, src, BIAS, bias_row, valid, j0, NH, BJ: tl.constexpr, HALVED: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """Pairs j0 .. j0 + BJ of the rows at src, plus the bias row at bias_row (HAS_BIAS): fp32 halves, unturned."""
    v1, v2 = load_halves(SRC, src, valid, j0, NH, BJ, HALVED)
    if HAS_BIAS:
        e1, e2 = load_halves(BIAS, bias_row, valid, j0, NH, BJ, HALVED)
        v1, v2 = v1 + e1, v2 + e2
    return v1, v2


@triton.jit
def _rotate_rows(SRC, src, BIAS, bias_row, DST, dst, cos, sin, valid, NH, BH: tl.constexpr, BA: tl.constexpr,
                 HALVED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Rows (src + bias) turned by cos / sin (pairs 0 .. BA), the rest copied, written at dst."""
    v1, v2 = _with_bias(SRC, src, BIAS, bias_row, valid, 0, NH, BA, HALVED, HAS_BIAS)
    r1, r2 = rotate_pairs(v1, v2, cos, sin)
    store_halves(DST, dst, r1, r2, valid, 0, NH, BA, HALVED)
    for jb in tl.static_range(1, BH // BA):
        v1, v2 = _with_bias(SRC, src, BIAS, bias_row, valid, jb * BA, NH, BA, HALVED, HAS_BIAS)
        store_halves(DST, dst, v1, v2, valid, jb * BA, NH, BA, HALVED)


@triton.jit
def unrotate_kernel(DK, DQ, Bm, Cm, BIAS_B, BIAS_C, ANG, DT, THS, DB, DC, DBB, DCB, DPHI, L, NC, H, HPG, NH, NA,
                    sab, sat, sah, saa, sdb, sdt, sdh, sgb, sgt, sgr, sgh, sob, sot, sor, sog,
                    sbb, sbt, sbr, sbg, scb, sct, scr, scg, spb, spt, sph,
                    T: tl.constexpr, R: tl.constexpr, BJ: tl.constexpr, HALVED: tl.constexpr,
                    HAS_BB: tl.constexpr, HAS_CB: tl.constexpr, FAST: tl.constexpr):
    """One program per (batch row, group, chunk, block of BJ pairs). DK, DQ (rows, L, [R,] h, n) fp32 or bf16
    (strides sg*): the gradients of the rotated k and q. Each head's rows are turned back by its phases and summed
    over the group's heads into DB, DC (rows, L, [R,] g, n) fp32 (strides so*): the gradients of B and C. HAS_BB /
    HAS_CB: the biases (h, [R,] n) are there, and per head the chunk's share of their gradients (summed over its
    tokens, per rank) goes to DBB / DCB (rows, h, nc, R, n).
    DPHI (rows, L, h, a) fp32 (strides sp*): per head and token the gradient of the phase through that token's own
    B and C (token_bwd sums it from the end of the chunk, where no head loop waits on the sum). Turning a pair v
    (B or C plus bias) by theta and reading the gradient g of the turned pair, d theta = g . J R v = (R^T g) . J v:
    the turned-back gradient against the unturned pair, J a quarter turn."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    j0 = tl.program_id(2) * BJ
    G = H // HPG
    b = (pid // G).to(tl.int64)
    g = pid % G
    t, rank, lead = rows(c, T, R)
    valid = t < L
    turns = j0 < NA
    offs_j = j0 + tl.arange(0, BJ)
    tt = c * T + tl.arange(0, T)
    k1 = tl.zeros((T * R, BJ), dtype=tl.float32)
    k2 = tl.zeros((T * R, BJ), dtype=tl.float32)
    q1 = tl.zeros((T * R, BJ), dtype=tl.float32)
    q2 = tl.zeros((T * R, BJ), dtype=tl.float32)
    for i in range(HPG):
        h = g * HPG + i
        if turns:
            cos, sin = _phase(ANG, DT, THS, b, h, c, t, lead, valid, j0, NC, H, NA, sab, sat, sah, saa, sdb, sdt,
                              sdh, BJ, FAST)
        else:  # pairs that never turn: no trigonometry
            cos = tl.full((T * R, BJ), 1.0, tl.float32)
            sin = tl.zeros((T * R, BJ), dtype=tl.float32)
        off = b * sgb + h * sgh + t * sgt + rank * sgr
        part = ((b * H + h) * NC + c) * R * (2 * NH)
        bias_row = (h * R + rank) * (2 * NH)
        gk1, gk2 = _turn_back(DK, off, cos, sin, valid, j0, NH, BJ, HALVED)
        k1, k2 = k1 + gk1, k2 + gk2
        gq1, gq2 = _turn_back(DQ, off, cos, sin, valid, j0, NH, BJ, HALVED)
        q1, q2 = q1 + gq1, q2 + gq2
        if HAS_BB or HAS_CB:
            _bias_partials(DBB, DCB, part, gk1, gk2, gq1, gq2, j0, NH, T, R, BJ, HALVED, HAS_BB, HAS_CB)
        if turns:  # the group's B and C rows, unturned (read again per head: cached, and fewer live registers)
            v1, v2 = _with_bias(Bm + b * sbb + g * sbg, t * sbt + rank * sbr, BIAS_B, bias_row, valid, j0, NH, BJ,
                                HALVED, HAS_BB)
            dth = v1 * gk2 - v2 * gk1
            v1, v2 = _with_bias(Cm + b * scb + g * scg, t * sct + rank * scr, BIAS_C, bias_row, valid, j0, NH, BJ,
                                HALVED, HAS_CB)
            dth += v1 * gq2 - v2 * gq1
            tl.store(DPHI + b * spb + h * sph + tt[:, None] * spt + offs_j[None, :], per_token(dth, T, R, BJ),
                     mask=(tt < L)[:, None] & (offs_j < NA)[None, :])
    out = b * sob + g * sog + t * sot + rank * sor
    store_halves(DB, out, k1, k2, valid, j0, NH, BJ, HALVED)
    store_halves(DC, out, q1, q2, valid, j0, NH, BJ, HALVED)


@triton.jit
def _turn_back(ptr, off, cos, sin, valid, j0, NH, BJ: tl.constexpr, HALVED: tl.constexpr):
    """One head's gradient rows (of the turned pairs) turned back."""
    d1, d2 = load_halves(ptr, off, valid, j0, NH, BJ, HALVED)
    return rotate_pairs(d1, d2, cos, -sin)


@triton.jit
def _add4(a1, a2, a3, a4, b1, b2, b3, b4):
    return a1 + b1, a2 + b2, a3 + b3, a4 + b4


@triton.jit
def _bias_partials(DBB, DCB, part, gk1, gk2, gq1, gq2, j0, NH, T: tl.constexpr, R: tl.constexpr, BJ: tl.constexpr,
                   HALVED: tl.constexpr, HAS_BB: tl.constexpr, HAS_CB: tl.constexpr):
    """One head's turned-back gradients summed over the chunk's tokens per rank (the biases' gradients): the four
    sums as one reduction, so the program's warps exchange their partial sums once instead of four times."""
    sk1, sk2, sq1, sq2 = tl.reduce((tl.reshape(gk1, (T, R, BJ)), tl.reshape(gk2, (T, R, BJ)),
                                    tl.reshape(gq1, (T, R, BJ)), tl.reshape(gq2, (T, R, BJ))), 0, _add4)
    ranks = tl.arange(0, R)
    if HAS_BB:
        store_halves(DBB + part, ranks * (2 * NH), sk1, sk2, ranks >= 0, j0, NH, BJ, HALVED)
    if HAS_CB:
        store_halves(DCB + part, ranks * (2 * NH), sq1, sq2, ranks >= 0, j0, NH, BJ, HALVED)


# ptxas gives unrotate_kernel 168 - 216 registers a thread uncapped (d_state 128, SISO and MIMO, every dtype; sm_90,
# Triton 3.6) and none of them spills at 160; at 128 they spill 56 - 120 bytes
UNROTATE_REGS = 160


def chunk_phases(lay: Layout, angs, dts, init_angle, T: int):
    """-> the phase entering every chunk (rows, h, nc, a) and the final phase of every state (nstates, h, a), fp32
    in [0, 2 pi). Two launches: the chunks' own turns (chunk-parallel), then their prefix per sequence."""
    rows_, Lk, H, NA = angs.shape
    nc = lay.nchunks
    dev = angs.device
    turns = torch.empty(rows_, nc, H, NA, device=dev, dtype=torch.float32)
    chunk_turn_kernel[(rows_ * H, nc)](angs, dts, turns, Lk, nc, H, NA, *angs.stride(), *dts.stride(), T=T,
                                       BA=block(NA), num_warps=4)
    ths = torch.empty(rows_, H, nc, NA, device=dev, dtype=torch.float32)
    # a sequence without tokens writes no final phase (the caller hands its initial one through)
    fin = (torch.zeros if lay.empty is not None else torch.empty)(lay.nstates, H, NA, device=dev,
                                                                   dtype=torch.float32)
    phase_prefix_kernel[(rows_ * H,)](turns, lay.init, lay.final, init_angle, ths, fin, nc, H, NA,
                                      BC=min(128, block(nc)), BA=block(NA), HAS_INIT=init_angle is not None,
                                      num_warps=4)
    return ths, fin


def rotated_bc(Bs, Cs, B_bias, C_bias, angs, dts, ths, lay: Layout, T: int, H: int, halved: bool, want_k=True,
               want_q=True):
    """-> k, q (rows, Lk, [R,] h, n) in B's dtype (None where not wanted): B / C plus bias, turned by each
    token's phase."""
    Bs, Cs = (t if t.stride(-1) == 1 else t.contiguous() for t in (Bs, Cs))  # the kernel reads whole rows of n
    rows_, Lk = Bs.shape[:2]
    mimo = Bs.dim() == 5
    R, G, N = (Bs.shape[2] if mimo else 1), Bs.shape[-2], Bs.shape[-1]
    shape = (rows_, Lk, *((R,) if mimo else ()), H, N)
    kt = torch.empty(shape, device=Bs.device, dtype=Bs.dtype) if want_k else None
    qt = torch.empty(shape, device=Bs.device, dtype=Bs.dtype) if want_q else None
    like = kt if kt is not None else qt
    st = like.stride()
    kst = (st[0], st[1], st[2] if mimo else 0, st[-2])
    rotate_kernel[(rows_ * H, lay.nchunks)](
        Bs, Cs, B_bias, C_bias, angs, dts, ths, kt, qt, Lk, lay.nchunks, H, H // G, N // 2, angs.shape[3],
        *bc_strides(Bs), *bc_strides(Cs), *angs.stride(), *dts.stride(), *kst,
        T=T, R=R, BH=block(N // 2), BA=min(block(angs.shape[3]), block(N // 2)), HALVED=halved,
        HAS_BIAS=B_bias is not None, HAS_K=want_k, HAS_Q=want_q, FAST=gpu_compiled(Bs),
        num_warps=4)
    return kt, qt


def unrotate(dk, dq, Bs, Cs, B_bias, C_bias, angs, dts, ths, lay: Layout, T: int, halved: bool,
             dtype=torch.float32):
    """dk, dq (rows, Lk, [R,] h, n), the gradients of the rotated k / q -> those of B and C (shaped as Bs / Cs: rows,
    Lk, [R,] groups, n) in ``dtype`` (each head's turned back and summed over its group's heads in fp32), the
    phases' gradients (rows, Lk, h, a) fp32, each token's through its own B / C (token_bwd sums them from the end
    of the chunk), and those of the
    biases (shaped and typed as B_bias / C_bias; None without one): per-chunk partials (rows, h, nc, R, n) fp32
    summed here."""
    Bs, Cs = (t if t.stride(-1) == 1 else t.contiguous() for t in (Bs, Cs))  # whole rows of n
    rows_, Lk = dk.shape[:2]
    mimo = dk.dim() == 5
    R, H, N = (dk.shape[2] if mimo else 1), dk.shape[-2], dk.shape[-1]
    groups, NH, NA = Bs.shape[-2], N // 2, angs.shape[3]
    dB = torch.empty(Bs.shape, device=dk.device, dtype=dtype)
    dC = torch.empty_like(dB)
    dphi = torch.empty(rows_, Lk, H, NA, device=dk.device, dtype=torch.float32)
    bias_part = lambda t: (None if t is None else  # noqa: E731
                           torch.empty(rows_, H, lay.nchunks, R, N, device=dk.device, dtype=torch.float32))
    dbb, dcb = bias_part(B_bias), bias_part(C_bias)
    st, so = dk.stride(), dB.stride()
    # pair blocks of 16 (whole 128-byte rows of interleaved fp32 pairs) give the grid enough programs at one group
    BJ = min(16, block(NH))
    # a register cap (not in the interpreter): three 4-warp programs per SM instead of two, without spills
    cap = {"maxnreg": UNROTATE_REGS} if gpu_compiled(Bs) else {}
    unrotate_kernel[(rows_ * groups, lay.nchunks, triton.cdiv(NH, BJ))](
        dk, dq, Bs, Cs, B_bias, C_bias, angs, dts, ths, dB, dC, dbb, dcb, dphi, Lk, lay.nchunks, H, H // groups, NH,
        NA, *angs.stride(), *dts.stride(), st[0], st[1], st[2] if mimo else 0, st[-2],
        so[0], so[1], so[2] if mimo else 0, so[-2], *bc_strides(Bs)[:4], *bc_strides(Cs)[:4], *dphi.stride()[:3],
        T=T, R=R, BJ=BJ, HALVED=halved, HAS_BB=B_bias is not None, HAS_CB=C_bias is not None,
        FAST=gpu_compiled(Bs), num_warps=4, **cap)
    bias_grad = lambda part, bias: (None if bias is None else  # noqa: E731
                                    part.sum((0, 2)).reshape(bias.shape).to(bias.dtype))
    return dB, dC, dphi, bias_grad(dbb, B_bias), bias_grad(dcb, C_bias)
