"""The Mamba-3 scan in plain PyTorch: the specification (fp32 math, or fp64 for fp64 inputs; autograd for every
gradient).

Per head, with the state h (p, n), rank-R inputs (R = 1: SISO) and the token's rotary phase theta_t:

    theta_t = theta_{t-1} + dt_t * angles_t                          (per head and rotated pair)
    k_{t,r} = rot(B_{t,r} + B_bias_r, theta_t),  q_{t,r} = rot(C_{t,r} + C_bias_r, theta_t)
    u_{t,r} = x_t * mimo_x_r                                         (SISO: u_t = x_t)
    alpha_t = exp(dt_t A_t),  beta_t = (1 - trap_t) dt_t,  gamma_t = trap_t dt_t
    h_t = alpha_t h_{t-1} + alpha_t beta_t sum_r u_{t-1,r} k_{t-1,r}^T + gamma_t sum_r u_{t,r} k_{t,r}^T
    y_{t,r} = h_t q_{t,r} + D u_{t,r};   y_{t,r} *= silu(z_t * mimo_z_r);   y_t = sum_r mimo_o_r * y_{t,r}

The second term is the trapezoid: each token's input also enters at the next step. ``rot`` turns pairs of state
coordinates by the phase: pairs (2i, 2i+1) ("interleaved", SISO) or (i, i + n/2) ("halved", MIMO), for the first
``a`` pairs; the rest pass unrotated. A rotation of both B and C by theta_t is the complex-valued state of the
paper written in real coordinates.

``mamba3_chunk_scan`` is the chunked form: inside a chunk of T tokens, token j reaches token i > j with weight
(gamma_j + beta_{j+1}) exp(sum_{s=j+1..i} dt_s A_s) and itself with gamma_i; chunks pass the state on. No loop over
tokens. ``mamba3_sequential`` is the token-by-token recurrence above, an independent formulation for tests.

Packed sequences (seq_idx or cu_seqlens) restart everything at a boundary: state, phase and the previous token.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mamba_parallel.ops._common import compute_dtype, fp32_math

ROPE_LAYOUTS = ("interleaved", "halved")


class Mamba3State(NamedTuple):
    """The recurrent state of a Mamba-3 layer between two tokens (N = batch rows or packed sequences).

    angle (N, h, a) fp32: the rotary phase theta; ssm (N, h, p, n) fp32: h; k (N, h, n) (SISO) or (N, R, h, n)
    (MIMO): the last token's rotated, biased B (what the trapezoid feeds in at the next step); v (N, h, p): the
    last token's x.
    """

    angle: Tensor
    ssm: Tensor
    k: Tensor
    v: Tensor


class Mamba3Discretization(NamedTuple):
    """What turns a Mamba-3 layer's raw projections into the scan's inputs (``discretize``): dt_bias (h,) and the
    decay rate's floor A_floor > 0."""

    dt_bias: Tensor
    A_floor: float


def discretize(dt: Tensor, A: Tensor, trap: Tensor, angles: Tensor, d: Mamba3Discretization):
    """Raw projections -> the scan's inputs, fp32: dt = softplus(dt + dt_bias) > 0, A = -max(softplus(A), A_floor),
    trap = sigmoid(trap), angles = pi tanh(angles) (rad per unit of dt). Any leading shape, heads last for dt, A,
    trap; angles (..., a) or (..., h, a)."""
    dt = F.softplus(dt.float() + d.dt_bias.float())
    A = -F.softplus(A.float()).clamp(min=d.A_floor)
    return dt, A, torch.sigmoid(trap.float()), math.pi * torch.tanh(angles.float())


# ---- sequences --------------------------------------------------------------------------------------------------
def segments(b: int, L: int, seq_idx: Tensor | None, cu_seqlens: Tensor | None):
    """[(row, start, end, initial-state index or None)] for every sequence; the initial state of a packed
    sequence is its own (cu_seqlens) or, with seq_idx, row r's for the row's first sequence and zero after."""
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        return [(0, s, e, k) for k, (s, e) in enumerate(zip(cu[:-1], cu[1:]))]
    if seq_idx is None:
        return [(r, 0, L, r) for r in range(b)]
    out = []
    for r in range(b):
        row = seq_idx[r].tolist()
        cuts = [0] + [t for t in range(1, L) if row[t] != row[t - 1]] + [L]
        out += [(r, s, e, r if k == 0 else None) for k, (s, e) in enumerate(zip(cuts[:-1], cuts[1:]))]
    return out


def final_owner(segs, nfinal: int, packed: bool) -> list[int]:
    """Index of the segment whose end state is final state i (per row: its last sequence; packed: each one)."""
    if packed:
        return list(range(len(segs)))
    last = [0] * nfinal
    for i, (r, _, _, _) in enumerate(segs):
        last[r] = i
    return last


# ---- pieces shared with the sequential form ----------------------------------------------------------------------
def rope_pairs(n: int, a: int, layout: str, device) -> tuple[Tensor, Tensor]:
    """Indices (a,), (a,) of the two coordinates of each rotated pair."""
    i = torch.arange(a, device=device)
    return (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + n // 2)


def rotate(v: Tensor, theta: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """v (..., n) turned by theta (..., a) (broadcast) on the pairs (first[i], second[i])."""
    c, s = torch.cos(theta), torch.sin(theta)
    u, w = v[..., first], v[..., second]
    out = v.index_copy(-1, first, u * c - w * s)
    return out.index_copy(-1, second, u * s + w * c)


def _per_head(t: Tensor, h: int) -> Tensor:
    """B or C (..., R, g, n) -> (..., R, h, n), head i reading group i // (h / g)."""
    return t.repeat_interleave(h // t.shape[-2], dim=-2)


def _rank_view(t: Tensor, mimo: bool) -> Tensor:
    """SISO tensors get a rank axis of size 1 before the head axis (..., h, n) -> (..., 1, h, n)."""
    return t if mimo else t.unsqueeze(-3)


def _finish(y: Tensor, u: Tensor, D, z, mimo_z, mimo_o, mimo: bool, ct) -> Tensor:
    """y, u (..., R, h, p) -> + D u, gated, reduced over ranks -> (..., h, p) or (..., R, h, p) (MIMO, no mimo_o)."""
    if D is not None:
        y = y + D.to(ct)[:, None] * u
    if z is not None:
        zr = z.to(ct).unsqueeze(-3)
        if mimo_z is not None:
            zr = zr * mimo_z.to(ct).transpose(0, 1)
        y = y * F.silu(zr)
    if not mimo:
        return y.squeeze(-3)
    if mimo_o is not None:
        return (y * mimo_o.to(ct).transpose(0, 1)).sum(-3)
    return y


# ---- chunked form ------------------------------------------------------------------------------------------------
def _chunked(x, dt, A, q0, k0, trap, angles, u, angle0, ssm0, k_prev, u_prev, T: int, first, second):
    """One sequence per row, zero-padded at the end (padding: dt = 0, so no decay, no input, phase held).

    x (S, L, h, p); dt, A, trap (S, L, h); q0, k0 (S, L, R, h, n) biased, unrotated; angles (S, L, h, a);
    u (S, L, R, h, p); initial phase angle0 (S, h, a), state ssm0 (S, h, p, n), previous token's k_prev
    (S, R, h, n) and u_prev (S, R, h, p) -> (y before D / gate (S, L, R, h, p), theta (S, L, h, a),
    k rotated (S, L, R, h, n), final ssm state (S, h, p, n)).
    """
    S, L, h, p = x.shape
    R, n = q0.shape[2], q0.shape[-1]
    if L == 0:
        return u.new_zeros(S, 0, R, h, p), angles, k0, ssm0
    theta = angle0[:, None] + torch.cumsum(angles * dt[..., None], dim=1)
    q = rotate(q0, theta[:, :, None], first, second)
    k = rotate(k0, theta[:, :, None], first, second)
    gamma, beta = trap * dt, (1 - trap) * dt
    w = gamma + F.pad(beta[:, 1:], (0, 0, 0, 1))  # token j's weight toward every later token: gamma_j + beta_{j+1}

    pad = (-L) % T
    pad_seq = lambda t: F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))  # noqa: E731
    c = (L + pad) // T
    chunks = lambda t: pad_seq(t).unflatten(1, (c, T))  # noqa: E731
    qc, kc, uc = chunks(q), chunks(k), chunks(u)
    cs = torch.cumsum(chunks(A * dt), dim=2)  # (S, c, T, h): log decay from the chunk start through token i
    wc, gc = chunks(w), chunks(gamma)

    # within a chunk: y_i = sum_{j<i} (q_i . k_j) exp(cs_i - cs_j) w_j u_j + gamma_i (q_i . k_i) u_i
    diff = cs.transpose(2, 3)[..., :, None] - cs.transpose(2, 3)[..., None, :]  # (S, c, h, T, T)
    ii = torch.arange(T, device=x.device)
    strict = ii[:, None] > ii[None, :]
    weight = torch.exp(diff.masked_fill(~strict, -math.inf)) * wc.transpose(2, 3)[..., None, :]
    weight = weight + torch.diag_embed(gc.transpose(2, 3))
    scores = torch.einsum("sciahn,scjbhn->schiajb", qc, kc)
    y = torch.einsum("schiajb,schij,scjbhp->sciahp", scores, weight, uc)

    # chunk states, seen at each chunk's last token, then passed across chunks
    to_end = torch.exp(cs[:, :, -1:] - cs) * wc  # (S, c, T, h)
    local = torch.einsum("scjh,scjbhp,scjbhn->schpn", to_end, uc, kc)
    # the trapezoid's half-step of the token before the sequence
    state = ssm0 + beta[:, 0, :, None, None] * torch.einsum("sbhp,sbhn->shpn", u_prev, k_prev)
    entering = []
    for ci in range(c):
        entering.append(state)
        state = torch.exp(cs[:, ci, -1])[..., None, None] * state + local[:, ci]
    H = torch.stack(entering, dim=1)  # (S, c, h, p, n)
    y = y + torch.einsum("sciahn,schpn->sciahp", qc, H) * torch.exp(cs)[:, :, :, None, :, None]
    return y.flatten(1, 2)[:, :L], theta, k, state


def _gather(t: Tensor | None, rows: Tensor, cols: Tensor, valid: Tensor) -> Tensor | None:
    """t (b, L, ...) -> (S, Lmax, ...) with t[rows[s], cols[s, j]] where valid, zero elsewhere."""
    if t is None:
        return None
    g = t[rows[:, None], cols]
    return g * valid.view(*valid.shape, *([1] * (g.dim() - 2))).to(g.dtype)


def _inputs(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, ct):
    """Common preprocessing -> per-head, biased q0 / k0 (b, L, R, h, n), u (b, L, R, h, p), all in ct."""
    mimo = B.dim() == 5
    h = x.shape[2]
    k0 = _per_head(_rank_view(B.to(ct), mimo), h)
    q0 = _per_head(_rank_view(C.to(ct), mimo), h)
    ranked = lambda bias: bias.to(ct).transpose(0, 1) if mimo else bias.to(ct).unsqueeze(0)  # noqa: E731
    if B_bias is not None:
        k0 = k0 + ranked(B_bias)  # (R, h, n)
    if C_bias is not None:
        q0 = q0 + ranked(C_bias)
    u = x.to(ct).unsqueeze(2)
    if mimo_x is not None:
        u = u * mimo_x.to(ct).transpose(0, 1)
    return mimo, q0, k0, u


def _zero_state(N, h, p, n, a, R, mimo, like, ct) -> Mamba3State:
    z = lambda *s: like.new_zeros(*s, dtype=ct)  # noqa: E731
    return Mamba3State(z(N, h, a), z(N, h, p, n), z(N, R, h, n) if mimo else z(N, h, n), z(N, h, p))


def _setup(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, rope, initial_states,
           seq_idx, cu_seqlens):
    """What both full-sequence forms start from: the compute dtype, the scan inputs (``_inputs``), the rotary pairs,
    the sequences (``segments``), their count N and their initial states (zeros when none are given)."""
    ct = compute_dtype(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o,
                       *(initial_states or ()))
    b, L, h, p = x.shape
    n, a = B.shape[-1], angles.shape[-1]
    mimo, q0, k0, u = _inputs(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, ct)
    first, second = rope_pairs(n, a, rope, x.device)
    packed = cu_seqlens is not None
    segs = segments(b, L, seq_idx, cu_seqlens)
    N = len(segs) if packed else b
    init = initial_states if initial_states is not None else _zero_state(N, h, p, n, a, q0.shape[2], mimo, x, ct)
    return ct, mimo, q0, k0, u, first, second, segs, N, packed, Mamba3State(*(s.to(ct) for s in init))


@fp32_math
def mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, D=None, z=None, B_bias=None, C_bias=None,
                      mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved", initial_states=None, seq_idx=None,
                      cu_seqlens=None, return_final_states=False):
    """See ``mamba_parallel.ops.mamba3.mamba3_chunk_scan`` (same contract)."""
    ct, mimo, q0, k0, u, first, second, segs, N, packed, init = _setup(
        x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, rope, initial_states, seq_idx,
        cu_seqlens)
    b, L, h, p = x.shape
    n, a, R = B.shape[-1], angles.shape[-1], q0.shape[2]
    zero = _zero_state(1, h, p, n, a, R, mimo, x, ct)

    # gather every sequence into its own zero-padded row
    lens = [e - s for _, s, e, _ in segs]
    Lmax = max(lens) if segs else 0
    dev = x.device
    rows = torch.tensor([r for r, _, _, _ in segs], device=dev, dtype=torch.long)
    starts = torch.tensor([s for _, s, _, _ in segs], device=dev, dtype=torch.long)
    pos = torch.arange(Lmax, device=dev)
    valid = pos[None] < torch.tensor(lens, device=dev)[:, None]
    cols = torch.where(valid, starts[:, None] + pos[None], torch.zeros_like(pos)[None])
    g = lambda t: _gather(t, rows, cols, valid)  # noqa: E731
    kv = lambda i: (Mamba3State(*(s[i:i + 1] for s in init)) if i is not None else zero)  # noqa: E731
    seg_init = Mamba3State(*(torch.cat(parts) for parts in zip(*(kv(i) for _, _, _, i in segs))))
    k_prev = _rank_view(seg_init.k, mimo)
    u_prev = seg_init.v.unsqueeze(1) * (mimo_x.to(ct).transpose(0, 1) if mimo_x is not None else 1)
    y_pre, theta, k, ssm = _chunked(g(x.to(ct)), g(dt.to(ct)), g(A.to(ct)), g(q0), g(k0), g(trap.to(ct)),
                                    g(angles.to(ct)), g(u), seg_init.angle, seg_init.ssm, k_prev, u_prev,
                                    chunk_size, first, second)
    # scatter back to the packed layout
    yb = y_pre.new_zeros(b, L, *y_pre.shape[2:])
    yb = yb.index_put((rows[:, None].expand_as(cols)[valid], cols[valid]), y_pre[valid])
    y = _finish(yb, u, D, z, mimo_z, mimo_o, mimo, ct).to(x.dtype)
    if not return_final_states:
        return y

    last = (torch.tensor(lens, device=dev) - 1).clamp(min=0)
    sidx = torch.arange(len(segs), device=dev)
    nonempty = (torch.tensor(lens, device=dev) > 0)
    k_last = torch.where(nonempty.view(-1, 1, 1, 1), k[sidx, last], _rank_view(seg_init.k, mimo))
    v_last = torch.where(nonempty.view(-1, 1, 1), g(x.to(ct))[sidx, last], seg_init.v)
    fin = Mamba3State(torch.remainder(theta[:, -1] if Lmax else seg_init.angle, 2 * math.pi), ssm,
                      k_last if mimo else k_last.squeeze(1), v_last)
    owner = torch.tensor(final_owner(segs, N, packed), device=dev, dtype=torch.long)
    return y, Mamba3State(*(s[owner] for s in fin))


# ---- token-by-token form -----------------------------------------------------------------------------------------
@fp32_math
def mamba3_sequential(x, dt, A, B, C, trap, angles, chunk_size=None, D=None, z=None, B_bias=None, C_bias=None,
                      mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved", initial_states=None, seq_idx=None,
                      cu_seqlens=None, return_final_states=False):
    """Same contract as ``mamba3_chunk_scan`` (chunk_size ignored); the recurrence token by token. For tests."""
    ct, mimo, q0, k0, u, first, second, segs, N, packed, init = _setup(
        x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, rope, initial_states, seq_idx,
        cu_seqlens)
    b, L, h, p = x.shape
    n, a, R = B.shape[-1], angles.shape[-1], q0.shape[2]
    dtf, Af, lam, om = dt.to(ct), A.to(ct), trap.to(ct), angles.to(ct)
    mx = mimo_x.to(ct).transpose(0, 1) if mimo_x is not None else None
    rows = [[None] * L for _ in range(b)]
    finals = []
    for r, s0, e0, i in segs:
        if i is None:
            theta, hs = x.new_zeros(h, a, dtype=ct), x.new_zeros(h, p, n, dtype=ct)
            k_prev, v_prev = x.new_zeros(R, h, n, dtype=ct), x.new_zeros(h, p, dtype=ct)
        else:
            theta, hs = init.angle[i], init.ssm[i]
            k_prev, v_prev = _rank_view(init.k[i], mimo), init.v[i]
        for t in range(s0, e0):
            d = dtf[r, t]  # (h,)
            theta = theta + om[r, t] * d[:, None]
            q = rotate(q0[r, t], theta, first, second)  # (R, h, n)
            k = rotate(k0[r, t], theta, first, second)
            alpha, beta, gamma = torch.exp(Af[r, t] * d), (1 - lam[r, t]) * d, lam[r, t] * d
            u_prev = v_prev.unsqueeze(0) * (mx if mx is not None else 1)
            hs = (alpha[:, None, None] * hs
                  + (alpha * beta)[:, None, None] * torch.einsum("bhp,bhn->hpn", u_prev, k_prev)
                  + gamma[:, None, None] * torch.einsum("bhp,bhn->hpn", u[r, t], k))
            rows[r][t] = torch.einsum("hpn,bhn->bhp", hs, q)
            k_prev, v_prev = k, x[r, t].to(ct)
        finals.append(Mamba3State(torch.remainder(theta, 2 * math.pi), hs, k_prev if mimo else k_prev[0], v_prev))
    y = torch.stack([torch.stack(row) for row in rows]) if L else u.new_zeros(b, 0, R, h, p)
    y = _finish(y, u, D, z, mimo_z, mimo_o, mimo, ct).to(x.dtype)
    if not return_final_states:
        return y
    owner = final_owner(segs, N, packed)
    return y, Mamba3State(*(torch.stack([finals[o][j] for o in owner]) for j in range(4)))


# ---- one decode token ---------------------------------------------------------------------------------------------
@fp32_math
def mamba3_state_update(state: Mamba3State, x, dt, A, B, C, trap, angles, D=None, z=None, B_bias=None, C_bias=None,
                        mimo_x=None, mimo_z=None, mimo_o=None, rope="interleaved"):
    """One token for every row: x (b, h, p); dt, A, trap (b, h); B, C (b, [R,] g, n); angles (b, h, a) -> y
    (b, h, p) (MIMO without mimo_o: (b, R, h, p)) in x.dtype; ``state`` (batch b) advanced in place."""
    ct = compute_dtype(x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o)
    lift = lambda t: t.unsqueeze(1) if t is not None else None  # noqa: E731  (b, ...) -> (b, 1, ...)
    mimo, q0, k0, u = _inputs(x.unsqueeze(1), dt, A, lift(B), lift(C), trap, angles, D, None, B_bias, C_bias,
                              mimo_x, ct)
    q0, k0, u = q0[:, 0], k0[:, 0], u[:, 0]  # (b, R, h, n), (b, R, h, p)
    n, a = B.shape[-1], angles.shape[-1]
    first, second = rope_pairs(n, a, rope, x.device)
    d = dt.to(ct)
    theta = state.angle.to(ct) + angles.to(ct) * d[..., None]
    q = rotate(q0, theta[:, None], first, second)
    k = rotate(k0, theta[:, None], first, second)
    lam = trap.to(ct)
    alpha, beta, gamma = torch.exp(A.to(ct) * d), (1 - lam) * d, lam * d
    mx = mimo_x.to(ct).transpose(0, 1) if mimo_x is not None else 1
    u_prev = state.v.to(ct).unsqueeze(1) * mx
    k_prev = _rank_view(state.k.to(ct), mimo)
    hs = (alpha[..., None, None] * state.ssm.to(ct)
          + (alpha * beta)[..., None, None] * torch.einsum("brhp,brhn->bhpn", u_prev, k_prev)
          + gamma[..., None, None] * torch.einsum("brhp,brhn->bhpn", u, k))
    y = torch.einsum("bhpn,brhn->brhp", hs, q)
    y = _finish(y, u, D, z, mimo_z, mimo_o, mimo, ct).to(x.dtype)
    state.angle.copy_(torch.remainder(theta, 2 * math.pi))
    state.ssm.copy_(hs)
    state.k.copy_(k if mimo else k[:, 0])
    state.v.copy_(x)
    return y
