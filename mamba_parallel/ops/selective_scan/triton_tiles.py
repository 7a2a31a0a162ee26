"""Tiles, loads and token scans of the Mamba-1 scan kernels, kept inside each thread.

A tile is (P, R BD, V): row R c + h of the program (channel c; R = 2 rows per channel or 1), token p V + v of the
chunk (S = P V tokens). ``load_tile`` reads it through a (P R BD, V) pointer tile, so that with token-major inputs
Triton gives each thread V contiguous tokens (one 16-byte vector) of one row, the rows spread over lanes and warps
and P repeating in registers, under both Triton 3.6's and 3.9's tie-breaking between equally contiguous axes:
each thread owns every token of its row (the "row-per-thread layout"), so the scans and every extraction along the
tokens run in registers, without shuffles or shared memory. (Other strides still give correct results, through
whatever layout Triton picks.)

Where the layout is certain (the row-per-thread paths, launch.py) the scans are sequential chains over the
S tokens, one FMA each, written with ``_at`` (one token as a sum of ``where(i == k, x, -0.0)``, the -0.0 made
from its bits: ``_neg_zero``) and ``_put`` (``where(i == k, val, acc)``): with thread-local tokens the masks are
constants per register, so both fold to register moves (x + -0.0 is x). In any other layout (the generic paths,
where the unrolled chain is slow) they run as two-level ``tl.associative_scan``s: along V inside a vector, then an
exclusive scan of the per-vector maps along P. ``pick`` extracts one position of an axis like ``_at``; a "take
the last" reduction would rely on the reduction order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_common import softplus
from mamba_parallel.ops.selective_scan.triton_lanes import butterfly


@triton.jit
def linear_combine(a1, b1, a2, b2):
    """Compose two steps of h -> a h + b (first (a1, b1), then (a2, b2))."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _neg_zero(x):
    """-0.0 in x's shape and dtype, the filler of a one-hot sum: x + -0.0 is x, so the sum folds to a register read.
    Any way of writing -0.0 as a Triton constant gives +0.0 (a scalar equal to 0 becomes the type's null value),
    and x + 0.0 is an add per element (-0.0 + 0.0 is +0.0): the sign bit set on an integer is kept."""
    return tl.full(x.shape, -2147483648, tl.int32).to(tl.float32, bitcast=True).to(x.dtype)


@triton.jit
def pick(x, idx, k, axis: tl.constexpr):
    """x at position k of ``axis`` (idx: that axis' arange, broadcastable to x); the axis is dropped."""
    return tl.sum(tl.where(idx == k, x, _neg_zero(x)), axis=axis)


@triton.jit
def _at(x, p: tl.constexpr, v: tl.constexpr, P: tl.constexpr, V: tl.constexpr):
    """(P, BD, V) -> (BD,) at token p V + v: a register read when the tokens are thread-local."""
    sel = (tl.arange(0, P)[:, None, None] == p) & (tl.arange(0, V)[None, None, :] == v)
    return tl.sum(tl.sum(tl.where(sel, x, _neg_zero(x)), axis=2), axis=0)


@triton.jit
def _put(acc, val, p: tl.constexpr, v: tl.constexpr, P: tl.constexpr, V: tl.constexpr):
    """acc (P, BD, V) with token p V + v replaced by val (BD,): a register write when the tokens are thread-local
    (the mask is a constant per register, so the select folds away)."""
    sel = (tl.arange(0, P)[:, None, None] == p) & (tl.arange(0, V)[None, None, :] == v)
    return tl.where(sel, val[None, :, None], acc)


@triton.jit
def scan_forward_seq(a, b, h_in, P: tl.constexpr, V: tl.constexpr):
    """h_t = a_t h_{t-1} + b_t over the tokens of (P, BD, V) tiles a, b from h_in (BD,) entering the chunk
    -> h (P, BD, V). A sequential chain, one FMA per token: each thread owns its tokens, and ``_at`` / ``_put``
    compile to register moves (``tl.associative_scan`` would add a fix-up pass per vector)."""
    h = h_in
    out = b  # every token is overwritten: no zero fill
    for k in tl.static_range(P * V):
        h = _at(a, k // V, k % V, P, V) * h + _at(b, k // V, k % V, P, V)
        out = _put(out, h, k // V, k % V, P, V)
    return out


@triton.jit
def scan_adjoint_seq(am, cx, g, P: tl.constexpr, V: tl.constexpr):
    """dh_t = cx_t + am_{t+1} dh_{t+1} over (P, BD, V) tiles, reverse in time; g (BD,) = am dh at the first token
    of the next chunk (0 past the end) -> dh (P, BD, V). A sequential chain from the last token, reading
    am_{t+1} from the registers: no shift, no second exp2, and no ``associative_scan(reverse=True)`` (which
    Triton lowers with lane shuffles even on a thread-local axis: 1 per value in 3.9, 5 in 3.6)."""
    out = cx  # every token is overwritten: no zero fill
    d = _at(cx, P - 1, V - 1, P, V) + g
    out = _put(out, d, P - 1, V - 1, P, V)
    for k in tl.static_range(2, P * V + 1):  # token t = P V - k, its successor t + 1
        d = (_at(cx, (P * V - k) // V, (P * V - k) % V, P, V)
             + _at(am, (P * V - k + 1) // V, (P * V - k + 1) % V, P, V) * d)
        out = _put(out, d, (P * V - k) // V, (P * V - k) % V, P, V)
    return out


@triton.jit
def exclusive_combine(xa1, xb1, la1, lb1, xa2, xb2, la2, lb2):
    """Scan of affine maps h -> a h + b that yields, at each element, the composition of the elements before it.

    A segment is (X = its elements but the last, composed; L = its last element); in scan order
    (X1, L1) . (X2, L2) = (X1 then L1 then X2, L2). Elements start as (identity, map)."""
    ta = xa1 * la1
    tb = la1 * xb1 + lb1
    return ta * xa2, xa2 * tb + xb2, la2, lb2


@triton.jit
def adjoint_combine(p1, f1, e1, p2, f2, e2):
    """Reverse scan of dh_t = cx_t + a_{t+1} dh_{t+1} without shifting a: a token run [i..j] is summarised by
    (P = a_{i+1} ... a_j, F = a_i, E = dh_i when w_{j+1} = a_{j+1} dh_{j+1} is 0), dh_i = E + P w_{j+1}.
    (p1, f1, e1) is the later run, (p2, f2, e2) the earlier one (reverse-scan order)."""
    pf = p2 * f1
    return pf * p1, f2, e2 + pf * e1


@triton.jit
def scan_forward_assoc(a, b, h_in, v_idx, p_idx, P: tl.constexpr, V: tl.constexpr):
    """``scan_forward`` for any layout: ``tl.associative_scan`` along V, then an exclusive scan of the per-vector
    maps along P whose result enters each vector."""
    acum, hv = tl.associative_scan((a, b), axis=2, combine_fn=linear_combine)
    if P == 1:
        return hv + acum * h_in[None, :, None]
    else:
        av = pick(acum, v_idx, V - 1, 2)  # (P, BD): each vector as one affine map
        hvv = pick(hv, v_idx, V - 1, 2)
        one = tl.zeros_like(av) + 1.0
        xa, xb, _, _ = tl.associative_scan((one, one - 1.0, av, hvv), axis=0, combine_fn=exclusive_combine)
        enter = xa * h_in[None, :] + xb  # state entering each vector
        return hv + acum * enter[:, :, None]


@triton.jit
def scan_adjoint_assoc(am, cx, g, v_idx, p_idx, P: tl.constexpr, V: tl.constexpr):
    """``scan_adjoint`` for any layout: reverse ``tl.associative_scan`` along V with ``adjoint_combine`` (no shift
    of am), then an exclusive reverse scan of the per-vector maps along P."""
    one = tl.zeros_like(am) + 1.0
    pr, _, vr = tl.associative_scan((one, am, cx), axis=2, combine_fn=adjoint_combine, reverse=True)
    if P == 1:
        return vr + pr * g[None, :, None]
    else:
        # vector q maps w entering it from the right to w at its first token: w -> F (V + P w)
        fv = pick(am, v_idx, 0, 2)
        alpha = fv * pick(pr, v_idx, 0, 2)
        beta = fv * pick(vr, v_idx, 0, 2)
        one2 = tl.zeros_like(alpha) + 1.0
        xa, xb, _, _ = tl.associative_scan((one2, one2 - 1.0, alpha, beta), axis=0, combine_fn=exclusive_combine,
                                           reverse=True)
        w = xa * g[None, :] + xb  # w entering each vector from its right
        return vr + pr * w[:, :, None]


@triton.jit
def scan_forward(a, b, h_in, v_idx, p_idx, P: tl.constexpr, V: tl.constexpr, SEQ: tl.constexpr):
    """h_t = a_t h_{t-1} + b_t over the tokens of (P, BD, V) tiles a, b from h_in (BD,) entering the chunk
    -> h (P, BD, V). SEQ: the tokens are known to be thread-local (the row-per-thread layout on a GPU)."""
    if SEQ:
        return scan_forward_seq(a, b, h_in, P, V)
    else:
        return scan_forward_assoc(a, b, h_in, v_idx, p_idx, P, V)


@triton.jit
def scan_adjoint(am, cx, g, v_idx, p_idx, P: tl.constexpr, V: tl.constexpr, SEQ: tl.constexpr):
    """dh_t = cx_t + am_{t+1} dh_{t+1} over (P, BD, V) tiles, reverse in time; g (BD,) = am dh at the first token
    of the next chunk (0 past the end) -> dh (P, BD, V). SEQ as in ``scan_forward``."""
    if SEQ:
        return scan_adjoint_seq(am, cx, g, P, V)
    else:
        return scan_adjoint_assoc(am, cx, g, v_idx, p_idx, P, V)


@triton.jit
def first_token(x, v_idx, p_idx):
    """(P, BD, V) -> (BD,) at the chunk's first token."""
    return pick(pick(x, v_idx, 0, 2), p_idx, 0, 0)


@triton.jit
def last_token(x, v_idx, p_idx, P: tl.constexpr, V: tl.constexpr):
    """(P, BD, V) -> (BD,) at the chunk's last token."""
    return pick(pick(x, v_idx, V - 1, 2), p_idx, P - 1, 0)


@triton.jit
def rows_sum(x, R: tl.constexpr, LANES: tl.constexpr, EMU: tl.constexpr = False):
    """(P, BD * R, V) with R rows per channel (row R c + h) -> every row holding its channel's sum over its rows.
    LANES (R = 2, row-per-thread layout): the partner row is the neighbouring lane, one shuffle (EMU: emulated,
    tests)."""
    if R == 1:
        return x
    elif LANES:
        return x + butterfly(x, 1, 1, EMU)
    else:
        s = tl.sum(tl.reshape(x, (x.shape[0], x.shape[1] // R, R, x.shape[2])), axis=2)
        return tl.reshape(tl.broadcast_to(s[:, :, None, :], (x.shape[0], x.shape[1] // R, R, x.shape[2])), x.shape)


@triton.jit
def _tile_2d(c0, s_d, s_l, t0, L, P: tl.constexpr, ROWS: tl.constexpr, V: tl.constexpr, R: tl.constexpr):
    """Offsets and mask of a (P ROWS, V) tile, row p ROWS + r = token vector p of channel c0 + r / R."""
    i = tl.arange(0, P * ROWS)
    tp = t0 + (i // ROWS) * V
    tv = tp[:, None] + tl.arange(0, V)[None, :]
    offs = ((c0 + (i % ROWS) // R) * s_d + tp * s_l)[:, None] + (tl.arange(0, V) * s_l)[None, :]
    return offs, tv < L


@triton.jit
def load_tile(ptr, c0, s_d, s_l, t0, L, P: tl.constexpr, ROWS: tl.constexpr, V: tl.constexpr, R: tl.constexpr):
    """ptr[(c0 + r / R) s_d + (t0 + p V + v) s_l] as a (P, ROWS, V) fp32 tile (0 past L).

    Loaded as a (P ROWS, V) tile, p-major, then reshaped: Triton gives it one row per thread with the P vectors in
    registers whatever order it breaks ties between equally contiguous axes in (Triton 3.6 and 3.9 differ), where
    a (P, ROWS, V) pointer tile can put P across lanes."""
    offs, m = _tile_2d(c0, s_d, s_l, t0, L, P, ROWS, V, R)
    return tl.reshape(tl.load(ptr + offs, mask=m, other=0.0).to(tl.float32), (P, ROWS, V))


@triton.jit
def store_tile(ptr, x, c0, s_d, s_l, t0, L, P: tl.constexpr, ROWS: tl.constexpr, V: tl.constexpr,
               R: tl.constexpr):
    """Store (P, ROWS, V) tile x as ``load_tile`` reads it; with R rows per channel only the first one stores."""
    offs, m = _tile_2d(c0, s_d, s_l, t0, L, P, ROWS, V, R)
    if R > 1:
        m = m & ((tl.arange(0, P * ROWS) % R) == 0)[:, None]
    tl.store(ptr + offs, tl.reshape(x, (P * ROWS, V)), mask=m)


@triton.jit
def state_row(base, n, s_n, s_l, t2, mt2):
    """B or C of state n at the chunk's tokens t2 as a (P, 1, V) tile (the same for every row)."""
    return tl.load(base + n * s_n + t2 * s_l, mask=mt2, other=0.0)[:, None, :]


@triton.jit
def paired_state_row(base, n, nh, s_n, s_l, t2, mt2, first_row, R: tl.constexpr):
    """``state_row`` for R rows per channel: with R == 2 the second row of each channel takes state n + nh (each
    row scans half of the states)."""
    v = state_row(base, n, s_n, s_l, t2, mt2)
    if R == 2:
        v = tl.where(first_row, v, state_row(base, n + nh, s_n, s_l, t2, mt2))
    return v


@triton.jit
def state_rows(base, n, nh, s_n, s_l, t0, L, P: tl.constexpr, ROWS: tl.constexpr, V: tl.constexpr, R: tl.constexpr):
    """B or C of state n (row R c + h: state n + h nh) at the chunk's tokens as a (P, ROWS, V) tile: each row
    loads its own state's tokens, through load_tile's pointer-tile shape so that the layout is the tiles'. Not for
    the pipelined state loop, whose asynchronous copies would stage one tile per row."""
    i = tl.arange(0, P * ROWS)
    tp = t0 + (i // ROWS) * V
    offs = ((n + (i % ROWS) % R * nh) * s_n + tp * s_l)[:, None] + (tl.arange(0, V) * s_l)[None, :]
    m = (tp[:, None] + tl.arange(0, V)[None, :]) < L
    return tl.reshape(tl.load(base + offs, mask=m, other=0.0), (P, ROWS, V))


@triton.jit
def delta_tile(dt_base, c0, s_d, s_l, t0, L, mt, bias, P: tl.constexpr, ROWS: tl.constexpr, V: tl.constexpr,
               R: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr):
    """The chunk's delta as load_tile gives it -> (raw = delta + bias, the scans' delta = softplus(raw) or raw,
    0 past L so no state decays there). The backward's softplus derivative reads raw."""
    raw = load_tile(dt_base, c0, s_d, s_l, t0, L, P, ROWS, V, R)
    if HAS_DTB:
        raw += bias
    dt = raw
    if SOFTPLUS:
        dt = softplus(raw)
    return raw, tl.where(mt, dt, 0.0)
