"""Sequence split of the Mamba-1 scan (``MAMBA_PARALLEL_SCAN_SPLIT=k``): k times the programs.

The default kernels give one thread a channel for the whole sequence: b d / 32 warps in all, too few to hide
latency at few channels x batch (b4 d5120: ~5 warps per H200 SM). With a split, the sequence is cut into k
segments of Ls tokens (a multiple of the chunk S times the checkpoint spacing K, so checkpoint slots line up),
each a row of its own, so k times as many programs. Forward:

1. ``split_local_kernel`` scans segments 0 .. k-2 from a zero state and writes each one's final local state
   (rows, n, d) and its sum of dt per channel; the segment's decay product per (channel, state) is then
   exp(A sum(dt)): no exp2 per element beyond the scan's own.
2. ``combine_segments`` (torch, k tiny steps on (b, n, d)): entering state of segment s + 1 = decay_s h_s + local_s,
   where a seq_idx change inside segment s cuts its decay product to 0, and one at segment s + 1's first token
   zeroes its entering state.
3. the regular forward (``launch``) runs on the segment rows from their true entering states and writes y, the
   checkpoints (then exactly the unsplit layout (b, L / (K S), n, d)) and the last state.

Backward, the same for the adjoint: ``split_adjoint_kernel`` runs segments 1 .. k-1 in reverse from a zero
adjoint (no states needed) to their local adjoint of the entering state, a reverse combine gives each segment the
adjoint entering from the next one, and the regular backward runs on the segment rows with it as d(last state),
recomputing the states from the checkpoints.

Segment rows are strided views of u / delta / z when the layout allows: token-major (b, d, L) inputs without
seq_idx fold the batch into the channels (one sequence of b d channels, b g groups of B / C), channels-last
(b, L, d) storage splits when k divides L; otherwise padded copies, the padding neutral (u = 0, dt = 0: delta_bias
folded into an fp32 delta, padded with 0, or -inf under softplus). The kernels' contiguous (b, d, L) outputs
(y, ypre, du, ddelta, dz) and dy / ypre come back or go in through one copy each. cu_seqlens (packed sequences)
keeps the unsplit kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mamba_parallel.ops.selective_scan.triton_common import LOG2E, exp2, segment_flags
from mamba_parallel.ops.selective_scan.triton_tiles import (delta_tile, first_token, last_token, load_tile,
                                                            scan_adjoint, scan_forward, state_row)

ENV = "MAMBA_PARALLEL_SCAN_SPLIT"
AUTO_WARPS_PER_SM = 8  # "auto": split until b d / 32 x k warps reach this per SM (untimed guess)
AUTO_MIN_SEGMENT = 512  # "auto": never below this many tokens per segment (untimed guess)


@triton.jit
def split_local_kernel(
    u_ptr, dt_ptr, B_ptr, A_ptr, dtb_ptr, sid_ptr, carry_ptr, hloc_ptr, dsum_ptr,
    Lseg, dim, dstate, d_per_group, nchunks, kseg,
    su_b, su_d, su_l, sdt_b, sdt_d, sdt_l, sB_b, sB_g, sB_n, sB_l, ssid_b,
    HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SID: tl.constexpr, FAST_EXP: tl.constexpr,
    BD: tl.constexpr, P: tl.constexpr, V: tl.constexpr, LANES: tl.constexpr = False, UNROLL: tl.constexpr = 1,
):
    """One program: channels [pid_d BD, +BD) of segment row (pid // (kseg - 1)) kseg + pid % (kseg - 1) (the
    last segment of each sequence feeds no later one), from a zero state. Writes hloc (b (kseg-1), n, d) fp32, the
    segment's final local state (state-major), and dsum (b (kseg-1), d) fp32, its sum of dt. carry
    (b (kseg-1), 2, n, d) fp32 zero-filled: ping-pong chunk carries."""
    pid_d = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    row = (pid // (kseg - 1)) * kseg + pid % (kseg - 1)
    rows = tl.arange(0, BD)
    offs_d = pid_d * BD + rows
    p_idx = tl.arange(0, P)[:, None]
    v_idx = tl.arange(0, V)[None, None, :]
    tok = tl.arange(0, P)[:, None, None] * V + v_idx
    tok2 = tl.arange(0, P)[:, None] * V + tl.arange(0, V)[None, :]
    g = (pid_d * BD) // d_per_group
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)[None, :, None]
    else:
        bias = 0.0
    B_base = B_ptr + row * sB_b + g * sB_g
    dn = dim * dstate
    dsum = tl.zeros([BD], dtype=tl.float32)
    for c in range(nchunks):
        t0 = c * (P * V)
        t = t0 + tok
        mt = t < Lseg
        t2 = t0 + tok2
        mt2 = t2 < Lseg
        u = load_tile(u_ptr + row * su_b, pid_d * BD, su_d, su_l, t0, Lseg, P, BD, V, 1)
        _, dt = delta_tile(dt_ptr + row * sdt_b, pid_d * BD, sdt_d, sdt_l, t0, Lseg, mt, bias, P, BD, V, 1, HAS_DTB,
                           SOFTPLUS)
        dsum += tl.sum(tl.sum(dt, axis=2), axis=0)
        dtu = dt * u
        if HAS_SID:
            _s, start, _e = segment_flags(sid_ptr + row * ssid_b, t, mt, Lseg, mt, False)
        c_in = carry_ptr + (pid * 2 + c % 2) * dn + offs_d
        if c + 1 < nchunks:
            c_out = carry_ptr + (pid * 2 + (c + 1) % 2) * dn + offs_d
        else:
            c_out = hloc_ptr + pid * dn + offs_d
        for n0 in range(0, dstate, UNROLL):
            for k in tl.static_range(UNROLL):
                n = n0 + k
                A_n = (tl.load(A_ptr + n * dim + offs_d).to(tl.float32) * LOG2E)[None, :, None]
                B_n = state_row(B_base, n, dstate, sB_n, sB_l, t2, mt2, None, 1)
                a = exp2(dt * A_n, FAST_EXP)
                if HAS_SID:
                    a = tl.where(start, 0.0, a)
                hs = scan_forward(a, dtu * B_n, tl.load(c_in + n * dim), v_idx, p_idx, P, V, LANES)
                tl.store(c_out + n * dim, last_token(hs, v_idx, p_idx, P, V))
        if not LANES:  # other layouts: the next chunk's carries may come from other threads
            tl.debug_barrier()
    tl.store(dsum_ptr + pid * dim + offs_d, dsum)


@triton.jit
def split_adjoint_kernel(
    dt_ptr, z_ptr, dy_ptr, C_ptr, A_ptr, dtb_ptr, sid_ptr, carry_ptr, gloc_ptr, dsum_ptr,
    Lseg, dim, dstate, d_per_group, nchunks, kseg,
    sdt_b, sdt_d, sdt_l, sz_b, sz_d, sz_l, sdy_b, sdy_d, sdy_l, sC_b, sC_g, sC_n, sC_l, ssid_b,
    HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_SID: tl.constexpr,
    FAST_EXP: tl.constexpr, BD: tl.constexpr, P: tl.constexpr, V: tl.constexpr, LANES: tl.constexpr = False,
    UNROLL: tl.constexpr = 1,
):
    """The backward's pass 1: one program, channels [pid_d BD, +BD) of segment row (pid // (kseg - 1)) kseg +
    pid % (kseg - 1) + 1 (the first segment of each sequence feeds no earlier one), walked in reverse from a zero
    adjoint: dh_t = dy_t C_t + a_{t+1} dh_{t+1} (dy before the z gate). Writes gloc (b (kseg-1), n, d) fp32 =
    a_0 dh_0, the segment's local adjoint of its entering state, and dsum (b (kseg-1), d) fp32, its sum of dt.
    carry (b (kseg-1), 2, n, d) fp32 zero-filled: ping-pong chunk carries."""
    pid_d = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    row = (pid // (kseg - 1)) * kseg + pid % (kseg - 1) + 1
    offs_d = pid_d * BD + tl.arange(0, BD)
    p_idx = tl.arange(0, P)[:, None]
    v_idx = tl.arange(0, V)[None, None, :]
    tok = tl.arange(0, P)[:, None, None] * V + v_idx
    tok2 = tl.arange(0, P)[:, None] * V + tl.arange(0, V)[None, :]
    g = (pid_d * BD) // d_per_group
    if HAS_DTB:
        bias = tl.load(dtb_ptr + offs_d).to(tl.float32)[None, :, None]
    else:
        bias = 0.0
    C_base = C_ptr + row * sC_b + g * sC_g
    dn = dim * dstate
    dsum = tl.zeros([BD], dtype=tl.float32)
    for ci in range(nchunks):
        c = nchunks - 1 - ci
        t0 = c * (P * V)
        t = t0 + tok
        mt = t < Lseg
        t2 = t0 + tok2
        mt2 = t2 < Lseg
        _, dt = delta_tile(dt_ptr + row * sdt_b, pid_d * BD, sdt_d, sdt_l, t0, Lseg, mt, bias, P, BD, V, 1, HAS_DTB,
                           SOFTPLUS)
        dsum += tl.sum(tl.sum(dt, axis=2), axis=0)
        dy = load_tile(dy_ptr + row * sdy_b, pid_d * BD, sdy_d, sdy_l, t0, Lseg, P, BD, V, 1)
        if HAS_Z:
            zv = load_tile(z_ptr + row * sz_b, pid_d * BD, sz_d, sz_l, t0, Lseg, P, BD, V, 1)
            dy = dy * zv * tl.sigmoid(zv)
        if HAS_SID:
            _s, start, _e = segment_flags(sid_ptr + row * ssid_b, t, mt, Lseg, mt, False)
        g_in = carry_ptr + (pid * 2 + (c + 1) % 2) * dn + offs_d
        if c > 0:
            g_out = carry_ptr + (pid * 2 + c % 2) * dn + offs_d
        else:
            g_out = gloc_ptr + pid * dn + offs_d
        for n0 in range(0, dstate, UNROLL):
            for k in tl.static_range(UNROLL):
                n = n0 + k
                A_n = (tl.load(A_ptr + n * dim + offs_d).to(tl.float32) * LOG2E)[None, :, None]
                C_n = state_row(C_base, n, dstate, sC_n, sC_l, t2, mt2, None, 1)
                am = exp2(dt * A_n, FAST_EXP)
                if HAS_SID:
                    am = tl.where(start, 0.0, am)
                dh = scan_adjoint(am, dy * C_n, tl.load(g_in + n * dim), v_idx, p_idx, P, V, LANES)
                tl.store(g_out + n * dim, first_token(dh, v_idx, p_idx) * first_token(am, v_idx, p_idx))
        if not LANES:  # other layouts: the next chunk's carries may come from other threads
            tl.debug_barrier()
    tl.store(dsum_ptr + pid * dim + offs_d, dsum)


def split_request() -> str:
    """``MAMBA_PARALLEL_SCAN_SPLIT``: '1' (default: no split), a power of two k, or 'auto'."""
    text = os.environ.get(ENV, "1").strip().lower() or "1"
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1 or int(text) & (int(text) - 1):
        raise ValueError(f"{ENV}={text!r}: expected a power of two (segments of the sequence) or 'auto'")
    return text


def split_count(b: int, d: int, L: int, device: torch.device, interpreted: bool) -> int:
    """Segments asked for (b, d, L: the scan's shape). 'auto' (untimed): double k while the b d / 32 k warps stay
    below AUTO_WARPS_PER_SM per SM and segments keep >= AUTO_MIN_SEGMENT tokens; 1 in the interpreter."""
    text = split_request()
    if text != "auto":
        return int(text)
    if interpreted or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    k = 1
    while b * d // 32 * k < AUTO_WARPS_PER_SM * sms and L // (2 * k) >= AUTO_MIN_SEGMENT:
        k *= 2
    return k


def segment_length(L: int, k: int, chunk: int, ckpt_every: int) -> tuple[int, int]:
    """-> (Ls, segments): Ls a multiple of chunk x ckpt_every (checkpoint slots line up), no empty segment."""
    unit = chunk * ckpt_every
    ls = triton.cdiv(triton.cdiv(L, k), unit) * unit
    return ls, triton.cdiv(L, ls)


def _rows(x: torch.Tensor, k: int, ls: int, pad: float) -> torch.Tensor:
    """(b, d, L) -> segment rows (b k, d, Ls): a strided view where the layout allows, else a copy padded with
    ``pad`` past L."""
    b, d, L = x.shape
    if L == k * ls and (b == 1 or x.stride(0) == k * ls * x.stride(2)):
        return x.as_strided((b * k, d, ls), (ls * x.stride(2), x.stride(1), x.stride(2)))
    out = x.new_full((b, k, d, ls), pad)
    src = x if L == k * ls else torch.cat([x, x.new_full((b, d, k * ls - L), pad)], dim=2)
    out.copy_(src.reshape(b, d, k, ls).transpose(1, 2))
    return out.view(b * k, d, ls)


def _bc_rows(t: torch.Tensor, k: int, ls: int) -> torch.Tensor:
    """B / C (b, g, n, L) fp32 -> (b k, g, n, Ls) contiguous, zero-padded (small: no d axis)."""
    b, g, n, L = t.shape
    out = t.new_zeros((b, k, g, n, ls))
    src = t if L == k * ls else torch.cat([t, t.new_zeros((b, g, n, k * ls - L))], dim=3)
    out.copy_(src.view(b, g, n, k, ls).permute(0, 3, 1, 2, 4))
    return out.view(b * k, g, n, ls)


def _unrows(x: torch.Tensor, b: int, k: int, L: int) -> torch.Tensor:
    """Segment rows (b k, d, Ls) -> (b, d, L) contiguous."""
    _, d, ls = x.shape
    return x.view(b, k, d, ls).transpose(1, 2).reshape(b, d, k * ls)[:, :, :L].contiguous()


def seq_cuts(sid: torch.Tensor | None, b: int, k: int, ls: int, L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_idx (b, L) -> (cut (b, k): a sequence starts inside segment s, after its first token, so its decay
    product is 0; first (b, k): one starts at segment s's first token (s > 0), so its entering state is 0)."""
    change = torch.zeros((b, k * ls), dtype=torch.bool, device=device)
    if sid is not None:
        change[:, 1:L] = sid[:, 1:] != sid[:, :-1]
    change = change.view(b, k, ls)
    return change[:, :, 1:].any(-1), change[:, :, 0]


def combine_segments(hloc: torch.Tensor, dsum: torch.Tensor, A: torch.Tensor, h0: torch.Tensor | None,
                     cut: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """hloc (b, k-1, n, d) local final states, dsum (b, k-1, d) sums of dt, A (d, n), h0 (b, d, n) or None,
    cut / first (b, k) bool (``seq_cuts``) -> entering states (b, k, n, d) fp32 (state-major)."""
    b, km1, n, d = hloc.shape
    decay = torch.exp(A.float().t()[None, None] * dsum[:, :, None, :])
    decay = decay.masked_fill(cut[:, :km1, None, None], 0.0)
    h = h0.float().transpose(1, 2) if h0 is not None else hloc.new_zeros((b, n, d))
    enters = [h]
    for s in range(1, km1 + 1):
        h = (decay[:, s - 1] * h + hloc[:, s - 1]).masked_fill(first[:, s, None, None], 0.0)
        enters.append(h)
    return torch.stack(enters, 1)


def split_forward(launch, cfg, lane_check, tile_meta, interpreted: bool, k: int, u, delta, A, B4, C4, D, z,
                  delta_bias, initial_state, sid, delta_softplus: bool, save_ckpt: bool, impl: str):
    """The split forward. u, delta, z (b, d, L); B4 / C4 (b, g, n, L) fp32; sid (b, L) int32 or None ->
    (y (b, d, L), last state (b, d, n) fp32, checkpoints (b, ncks, n, d) fp32 or empty, ypre (b, d, L) or empty),
    as ``launch`` (the unsplit forward, same arguments and results) gives them. cfg: the unsplit tile config;
    lane_check / tile_meta: triton_impl's ``_lanes`` / ``_tile_meta``. k >= 2 segments."""
    b, d, L = u.shape
    n = A.shape[1]
    ls, k = segment_length(L, k, cfg.chunk, cfg.ckpt_every)
    if k < 2:
        return launch(u, delta, A, B4, C4, D, z, delta_bias, initial_state, sid, delta_softplus, False, b,
                      save_ckpt, impl)
    acts = [t for t in (u, delta, z) if t is not None]
    views = L == k * ls and all(t.stride(0) == k * ls * t.stride(2) for t in acts)
    if b > 1 and sid is None and not views and all(t.stride(0) == d * t.stride(1) for t in acts):
        return _fold_batch(launch, cfg, lane_check, tile_meta, interpreted, k, u, delta, A, B4, C4, D, z,
                           delta_bias, initial_state, delta_softplus, save_ckpt, impl)
    padded = L != k * ls
    dtb = delta_bias
    if padded:  # dt = 0 on the padding: fold the bias in (fp32, as the kernels add it), pad with softplus' zero
        delta = delta.float() + (delta_bias.float()[None, :, None] if delta_bias is not None else 0.0)
        dtb = None
    u_s = _rows(u, k, ls, 0.0)
    dt_s = _rows(delta, k, ls, float("-inf") if delta_softplus and padded else 0.0)
    z_s = _rows(z, k, ls, 0.0) if z is not None else None
    B_s, C_s = _bc_rows(B4, k, ls), _bc_rows(C4, k, ls)
    sid_s = _sid_rows(sid, b, k, ls, L)
    # pass 1: segments 0 .. k-2 from zero states
    dev, f32 = u.device, torch.float32
    rows1 = b * (k - 1)
    hloc = torch.empty((rows1, n, d), device=dev, dtype=f32)
    dsum = torch.empty((rows1, d), device=dev, dtype=f32)
    carry = torch.zeros((rows1, 2, n, d), device=dev, dtype=f32)
    G = B_s.shape[1]
    bd, warps, meta = _pass1_meta(cfg, lane_check, tile_meta, interpreted, u_s, dt_s, d, n, G)
    opt = lambda t: t if t is not None else hloc  # noqa: E731  (pointer placeholder for an absent tensor)
    split_local_kernel[(d // bd, rows1)](
        u_s, dt_s, B_s, A.t().contiguous(), opt(dtb), opt(sid_s), carry, hloc, dsum,
        ls, d, n, d // G, triton.cdiv(ls, cfg.chunk), k, *u_s.stride(), *dt_s.stride(), *B_s.stride(),
        sid_s.stride(0) if sid_s is not None else 0,
        HAS_DTB=dtb is not None, SOFTPLUS=delta_softplus, HAS_SID=sid_s is not None, FAST_EXP=not interpreted,
        BD=bd, num_warps=warps, **meta,
    )
    # pass 2: entering states
    cut, first = seq_cuts(sid, b, k, ls, L, dev)
    enters = combine_segments(hloc.view(b, k - 1, n, d), dsum.view(b, k - 1, d), A, initial_state, cut, first)
    h_in = enters.transpose(2, 3).reshape(b * k, d, n)
    # pass 3: the regular forward on the segment rows
    y_s, hl_s, ck_s, ypre_s = launch(u_s, dt_s, A, B_s, C_s, D, z_s, dtb, h_in, sid_s, delta_softplus, False,
                                     b * k, save_ckpt, impl)
    y = _unrows(y_s, b, k, L)
    hlast = hl_s.view(b, k, d, n)[:, -1].contiguous()
    ypre = _unrows(ypre_s, b, k, L) if ypre_s.numel() else ypre_s
    ckpt = ck_s
    if ck_s.numel():
        ncks = triton.cdiv(triton.cdiv(L, cfg.chunk), cfg.ckpt_every)
        ckpt = ck_s.view(b, -1, n, d)[:, :ncks].contiguous()
    return y, hlast, ckpt, ypre


def _fold_batch(launch, cfg, lane_check, tile_meta, interpreted, k, u, delta, A, B4, C4, D, z, delta_bias,
                initial_state, delta_softplus, save_ckpt, impl):
    """``split_forward`` for (b, d, L) inputs whose b and d axes merge (contiguous (b, d, L): the Mamba-1 layer's
    layout) and no seq_idx: the batch becomes channels, one sequence of b d channels in b g groups of B / C, so
    its segments are strided views (no copy of u / delta / z). Checkpoints come back through one copy."""
    b, d, L = u.shape
    n = A.shape[1]
    fold = lambda t: t.reshape(1, b * d, L) if t is not None else None  # noqa: E731  (views: b, d merge)
    rep = lambda t: t.repeat(b, *([1] * (t.dim() - 1))) if t is not None else None  # noqa: E731  (per channel)
    g = B4.shape[1]
    y, hlast, ck, ypre = split_forward(
        launch, cfg, lane_check, tile_meta, interpreted, k, fold(u), fold(delta), rep(A),
        B4.reshape(1, b * g, n, L), C4.reshape(1, b * g, n, L), rep(D), fold(z), rep(delta_bias),
        initial_state.reshape(1, b * d, n) if initial_state is not None else None, None, delta_softplus,
        save_ckpt, impl)
    if ck.numel():
        ck = ck.view(-1, n, b, d).permute(2, 0, 1, 3).contiguous()
    return (y.view(b, d, L), hlast.view(b, d, n), ck,
            ypre.view(b, d, L) if ypre.numel() else ypre)


def _sid_rows(sid: torch.Tensor | None, b: int, k: int, ls: int, L: int) -> torch.Tensor | None:
    """seq_idx (b, L) -> (b k, Ls), padded with its last id (no reset on the padding)."""
    if sid is None:
        return None
    out = sid[:, -1:].expand(b, k * ls).clone()
    out[:, :L] = sid
    return out.view(b * k, ls)


def _pass1_meta(cfg, lane_check, tile_meta, interpreted, u_s, dt_s, d, n, G):
    """Block, warps and tile constexprs of the pass-1 kernels: v3's one-warp programs (32 channels)."""
    bd, warps = 32, 1
    while bd > 1 and (d // G) % bd:
        bd //= 2
    if interpreted:
        bd, warps = min(bd, cfg.fwd_block_d), cfg.fwd_warps
    meta = tile_meta(u_s, cfg.chunk, "v3", n, bwd=False)
    meta.pop("R")
    lanes = lane_check(u_s, dt_s, None, bd, warps, cfg.chunk, d // G, "v3", n, False)
    if not lanes:
        meta["UNROLL"] = 1
    return bd, warps, dict(meta, LANES=lanes)


def split_backward(launch, cfg, lane_check, tile_meta, interpreted: bool, k: int, u, delta, A, B, C, D, z,
                   delta_bias, initial_state, sid, ckpt, ypre, dy, dlast, delta_softplus: bool, impl: str):
    """The split backward: ``launch`` (the unsplit backward, same arguments and results: [du, ddelta, dA, dB, dC,
    dD, dz, ddelta_bias, dinitial_state]) on k segment rows, whose adjoints entering from the later segment come
    from pass 1 (``split_adjoint_kernel``, local adjoints of the entering states) and a reverse combine.
    u, delta, z, ypre, dy (b, d, L); ckpt (b, ncks, n, d) (any forward's: the states are the true ones);
    dlast (b, d, n) or None. cfg, lane_check, tile_meta as in ``split_forward``."""
    b, d, L = u.shape
    n = A.shape[1]
    ls, k = segment_length(L, k, cfg.chunk, cfg.ckpt_every)
    if k < 2:
        return launch(u, delta, A, B, C, D, z, delta_bias, initial_state, sid, ckpt, ypre, dy, dlast,
                      delta_softplus, False, impl)
    B4, C4 = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
    acts = [t for t in (u, delta, z) if t is not None]
    views = L == k * ls and all(t.stride(0) == k * ls * t.stride(2) for t in acts)
    if b > 1 and sid is None and not views and all(t.stride(0) == d * t.stride(1) for t in acts):
        return _fold_batch_bwd(launch, cfg, lane_check, tile_meta, interpreted, k, u, delta, A, B, C, D, z,
                               delta_bias, initial_state, ckpt, ypre, dy, dlast, delta_softplus, impl)
    padded = L != k * ls
    dtb = delta_bias
    delta_in = delta
    if padded:  # dt = 0 on the padding, as in split_forward
        delta = delta.float() + (delta_bias.float()[None, :, None] if delta_bias is not None else 0.0)
        dtb = None
    u_s = _rows(u, k, ls, 0.0)
    dt_s = _rows(delta, k, ls, float("-inf") if delta_softplus and padded else 0.0)
    z_s = _rows(z, k, ls, 0.0) if z is not None else None
    dy_s = _rows(dy, k, ls, 0.0)
    ypre_s = _rows(ypre, k, ls, 0.0).contiguous() if z is not None else ypre
    B_s, C_s = _bc_rows(B4.float(), k, ls), _bc_rows(C4.float(), k, ls)
    sid_s = _sid_rows(sid, b, k, ls, L)
    nseg = ls // (cfg.chunk * cfg.ckpt_every)
    if ckpt.shape[1] == k * nseg:
        ck_s = ckpt.view(b * k, nseg, n, d)
    else:  # zeros past L: the padding's recomputed states must stay finite
        ck_s = ckpt.new_zeros((b, k * nseg, n, d))
        ck_s[:, :ckpt.shape[1]] = ckpt
        ck_s = ck_s.view(b * k, nseg, n, d)
    # pass 1: local adjoints entering segments 1 .. k-1
    dev, f32 = u.device, torch.float32
    rows1 = b * (k - 1)
    gloc = torch.empty((rows1, n, d), device=dev, dtype=f32)
    dsum = torch.empty((rows1, d), device=dev, dtype=f32)
    carry = torch.zeros((rows1, 2, n, d), device=dev, dtype=f32)
    G = C_s.shape[1]
    bd, warps, meta = _pass1_meta(cfg, lane_check, tile_meta, interpreted, u_s, dt_s, d, n, G)
    opt = lambda t: t if t is not None else gloc  # noqa: E731  (pointer placeholder for an absent tensor)
    zz = z_s if z_s is not None else dy_s
    split_adjoint_kernel[(d // bd, rows1)](
        dt_s, zz, dy_s, C_s, A.t().contiguous(), opt(dtb), opt(sid_s), carry, gloc, dsum,
        ls, d, n, d // G, triton.cdiv(ls, cfg.chunk), k, *dt_s.stride(), *zz.stride(), *dy_s.stride(),
        *C_s.stride(), sid_s.stride(0) if sid_s is not None else 0,
        HAS_Z=z is not None, HAS_DTB=dtb is not None, SOFTPLUS=delta_softplus, HAS_SID=sid_s is not None,
        FAST_EXP=not interpreted, BD=bd, num_warps=warps, **meta,
    )
    # pass 2: adjoints entering each segment from the next one (reverse combine)
    cut, first = seq_cuts(sid, b, k, ls, L, dev)
    decay = torch.exp(A.float().t()[None, None] * dsum.view(b, k - 1, 1, d)).masked_fill(
        cut[:, 1:, None, None], 0.0)
    gl = gloc.view(b, k - 1, n, d)
    g = dlast.float().transpose(1, 2) if dlast is not None else gl.new_zeros((b, n, d))
    outs = [g]
    for s in range(k - 2, -1, -1):
        g = (gl[:, s] + decay[:, s] * g).masked_fill(first[:, s + 1, None, None], 0.0)
        outs.append(g)
    g_rows = torch.stack(outs[::-1], 1).transpose(2, 3).reshape(b * k, d, n)
    # pass 3: the regular backward on the segment rows
    h0_s = torch.zeros((b * k, d, n), device=dev, dtype=f32) if initial_state is not None else None
    du, ddt, dA, dB, dC, dD, dz, ddtb, dh0 = launch(u_s, dt_s, A, B_s, C_s, D, z_s, dtb, h0_s, sid_s, ck_s,
                                                    ypre_s, dy_s, g_rows, delta_softplus, False, impl)
    ddt_full = _unrows(ddt, b, k, L)
    if padded and delta_bias is not None:  # the bias was folded into delta: its gradient sums d delta
        ddtb = ddt_full.float().sum((0, 2)).to(delta_bias.dtype)
    bc = lambda t, ref: _bc_unrows(t, b, k, L).to(ref.dtype).view(ref.shape)  # noqa: E731
    return [_unrows(du, b, k, L), ddt_full.to(delta_in.dtype), dA, bc(dB, B), bc(dC, C), dD,
            _unrows(dz, b, k, L) if z is not None else dz, ddtb,
            dh0.view(b, k, d, n)[:, 0].to(initial_state.dtype) if initial_state is not None else dh0]


def _bc_unrows(t: torch.Tensor, b: int, k: int, L: int) -> torch.Tensor:
    """(b k, g, n, Ls) -> (b, g, n, L)."""
    _, g, n, ls = t.shape
    return t.view(b, k, g, n, ls).permute(0, 2, 3, 1, 4).reshape(b, g, n, k * ls)[..., :L].contiguous()


def _fold_batch_bwd(launch, cfg, lane_check, tile_meta, interpreted, k, u, delta, A, B, C, D, z, delta_bias,
                    initial_state, ckpt, ypre, dy, dlast, delta_softplus, impl):
    """``split_backward`` with the batch folded into channels (as ``_fold_batch``); the checkpoints and the
    gradients of B / C and of the per-channel parameters come back through small copies / sums."""
    b, d, L = u.shape
    n = A.shape[1]
    fold = lambda t: t.reshape(1, b * d, L) if t is not None else None  # noqa: E731
    rep = lambda t: t.repeat(b, *([1] * (t.dim() - 1))) if t is not None else None  # noqa: E731
    B4, C4 = (t.unsqueeze(1) if t.dim() == 3 else t for t in (B, C))
    g = B4.shape[1]
    ck = ckpt.permute(1, 2, 0, 3).reshape(1, ckpt.shape[1], n, b * d)
    du, ddt, dA, dB, dC, dD, dz, ddtb, dh0 = split_backward(
        launch, cfg, lane_check, tile_meta, interpreted, k, fold(u), fold(delta), rep(A),
        B4.reshape(1, b * g, n, L), C4.reshape(1, b * g, n, L), rep(D), fold(z), rep(delta_bias),
        initial_state.reshape(1, b * d, n) if initial_state is not None else None, None, ck,
        fold(ypre) if z is not None else ypre, fold(dy.contiguous()),
        dlast.reshape(1, b * d, n) if dlast is not None else None, delta_softplus, impl)
    per_channel = lambda t: t.view(b, d, *t.shape[1:]).sum(0) if t.numel() else t  # noqa: E731
    return [du.view(b, d, L), ddt.view(b, d, L), per_channel(dA), dB.view(B.shape), dC.view(C.shape),
            per_channel(dD), dz.view(b, d, L) if z is not None else dz, per_channel(ddtb),
            dh0.view(b, d, n) if initial_state is not None else dh0]
