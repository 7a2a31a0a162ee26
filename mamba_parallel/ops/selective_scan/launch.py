"""Which kernel path and tiles the Mamba-1 selective scan launches, chosen from the shapes in ``plan``.

Pure Python over the shapes, the inputs' layout and the GPU's SM count (``sm_count``; None: Triton's CPU
interpreter), so the choice is testable anywhere. The reasons and timings are in docs/kernels/selective_scan.md.

Both kernels give each channel one row of a tile (``rows`` = 2: two rows, each scanning half of the states) and
keep a chunk of S tokens in each row's registers. Where the inputs are token-major with 16-byte-aligned rows
(L % 16 == 0, no cu_seqlens), Triton gives every row its own thread (the row-per-thread layout) and the kernels
rely on it: token scans as register chains, sums over channels by lane shuffles. Elsewhere they run generic code
(associative scans, ``tl.reduce``) that is correct for any layout.

Forward paths (the backward always runs one row per channel: "row_per_thread" where the layout allows, else
"generic"):

    row_per_thread        one row per channel, state loop (4 states per iteration, 2 pipeline stages)
    two_rows_per_channel  two rows per channel, the row's n / 2 <= 8 states unrolled in registers, u / delta / z
                          prefetched into L2 two chunks ahead, 168 registers (three 4-warp programs per SM)
    two_rows_state_loop   two rows per channel, state loop (more than 8 states per row)
    generic               one row per channel, any layout
    generic_two_rows      two rows per channel, any layout

The default takes two rows per channel where one row per channel would give each SM fewer than
``TWO_ROWS_BELOW_WARPS_PER_SM`` warps (and n is even), else one row.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

ROW_PER_THREAD = "row_per_thread"
TWO_ROWS_PER_CHANNEL = "two_rows_per_channel"
TWO_ROWS_STATE_LOOP = "two_rows_state_loop"
GENERIC = "generic"
GENERIC_TWO_ROWS = "generic_two_rows"
FORWARD_PATHS = (ROW_PER_THREAD, TWO_ROWS_PER_CHANNEL, TWO_ROWS_STATE_LOOP, GENERIC, GENERIC_TWO_ROWS)
ROW_LAYOUT_PATHS = frozenset({ROW_PER_THREAD, TWO_ROWS_PER_CHANNEL, TWO_ROWS_STATE_LOOP})

# Two rows per channel where one row per channel (one warp per 32 channels) gives each SM fewer warps than this.
# H200 (132 SMs), bf16, n 16: two rows win at b4 d5120 (4.8 warps per SM) and in the mamba-130m / 370m training
# steps (2.9 / 3.9), one row at b8 d4096 (7.8) and so for mamba-1.4b / 2.8b.
TWO_ROWS_BELOW_WARPS_PER_SM = 6
UNROLLED_STATES_MAX = 8  # states per row that the unrolled forward holds in registers (token slots of a tile)
PREFETCH_CHUNKS = 2
UNROLLED_MAXNREG = 168

# Forward paths on which the Mamba-1 layer's training forward lets the scan gate y * silu(z) itself, writing
# out_proj's channels-last input (``gated_forward``); on the others the scan stores y token-major and the layout
# op's gate kernel follows. Two rows per channel run at 3-6 warps per SM, where the gate's per-token z loads and
# output stores at each chunk's end wait on the chain. H100, bf16 (training-step profiles of one commit against
# the one before): forward with the gate inside / without it + the gate kernel, mamba-130m 715 / 554 + 54 µs,
# mamba-370m 735 / 584 + 71 µs (two rows per channel); mamba-1.4b 1160 / 1089 + 137 µs (one row per channel).
GATED_FORWARD_PATHS = frozenset({ROW_PER_THREAD, GENERIC})
# States per program of the backward's segment-carry pass (triton_bwd_carry.py, in the backward's tiles): 8 keep
# it at 128 registers on sm_90 (Triton 3.6); 16 take 255 with 708 B of spills (their C rows are loaded ahead).
CARRY_STATES = 8


class ScanShape(NamedTuple):
    """What the choice depends on (a tuple: built on every call, cheap to hash)."""

    batch: int
    d: int             # channels
    n: int             # states per channel
    groups: int        # B / C groups: d / groups channels share one
    seqlen: int
    elem_size: int     # bytes per element of u
    row_layout: bool   # u / delta / z token-major (on a GPU also 16-byte-aligned rows and L % 16 == 0)
    varlen: bool       # cu_seqlens: per-token gathers of initial / last states (other layouts)


@dataclass(frozen=True)
class Launch:
    """One kernel's path, tiles and launch options."""

    path: str
    rows: int             # R: rows per channel, each scanning n / R states
    row_layout: bool      # relies on the row-per-thread layout
    block_d: int          # BD: channels per program
    num_warps: int
    chunk: int            # S: tokens per chunk (the spacing of the forward's checkpoints)
    vec: int              # V: tokens per 16-byte vector; a row holds P = S / V vectors
    unroll: int           # states per state-loop iteration
    stages: int           # software-pipeline stages of the state loop (1: none)
    unrolled_states: int  # NS: n when the states are unrolled (no state loop), else 0
    prefetch: int         # chunks ahead whose u / delta / z rows are prefetched into L2 (0: none)
    maxnreg: int | None   # register cap per thread
    emulate: bool         # interpreter only: the lane shuffles of the row-per-thread paths emulated (tests)

    @property
    def vectors(self) -> int:
        return self.chunk // self.vec


@dataclass(frozen=True)
class ScanPlan:
    fwd: Launch
    bwd: Launch


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap dividing x."""
    p = 1
    while p * 2 <= cap and x % (p * 2) == 0:
        p *= 2
    return p


def _interp_block(d: int) -> int:
    """Channels per program of the interpreter's generic code: up to 16 (its time grows with the programs, not
    their width), at most half the channels where they allow, so that tests still cross channel blocks."""
    return _pow2_divisor(d, max(4, min(16, d // 2)))


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def chunk_tokens(seqlen: int, interp: bool) -> int:
    """S: 16 tokens (8 in the interpreter: short chunks exercise the carries), at most the sequence's."""
    return min(8 if interp else 16, max(_next_pow2(seqlen), 2))


def checkpoint_group(every: int, nchunks: int) -> int:
    """K: the chunks per kept checkpoint that the kernels run with for ``checkpoint_every`` = ``every`` (a power
    of two) over ``nchunks`` chunks. One group covers the whole sequence once ``every`` reaches it, so K stops at
    the next power of two >= nchunks (a scratch of K slots, not more); 1 is one checkpoint per chunk."""
    return min(every, _next_pow2(nchunks))


def _chunk_and_vec(s: ScanShape, interp: bool) -> tuple[int, int]:
    """The chunk, and one 16-byte vector of u per thread and vector (4 tokens in the interpreter, so that tests
    cover both levels of the generic token scans)."""
    chunk = chunk_tokens(s.seqlen, interp)
    return chunk, min(chunk, 16 // s.elem_size, 4 if interp else 16)


def _row_layout_ok(s: ScanShape, rows: int, block_d: int, warps: int, chunk: int) -> bool:
    """The row-per-thread layout holds: row i of a program in lane i mod 32 of warp i / 32, a chunk's tokens in
    its registers (Triton vectorises a row's tokens only for token-major, aligned rows; cu_seqlens' per-token
    gathers of states pull the tiles into another layout)."""
    return (s.row_layout and not s.varlen and block_d * rows == 32 * warps
            and (s.d // s.groups) % (32 // rows) == 0 and chunk * rows <= 32)


def _halved_to_divide(want: int, n: int) -> int:
    while want > 1 and n % want:
        want //= 2
    return want


def _forward(s: ScanShape, interp: bool, rows: int, row_layout: bool, unroll_states: bool) -> Launch:
    chunk, vec = _chunk_and_vec(s, interp)
    dpg = s.d // s.groups
    if interp:  # one warp; the row-per-thread paths need its 32 rows, generic code small ones
        block_d, warps = _pow2_divisor(dpg, 32 // rows), 1
        lanes = row_layout and _row_layout_ok(s, rows, block_d, warps, chunk)
        block_d = block_d if lanes else _interp_block(dpg)
    else:
        block_d, warps = (_pow2_divisor(dpg, 64), 4) if rows == 2 else (_pow2_divisor(dpg, 32), 1)
        lanes = row_layout and _row_layout_ok(s, rows, block_d, warps, chunk)
    # states per iteration: independent work for the scheduler, as far as the registers allow (4 / 2 states with
    # one / two rows per channel: ~175 registers, no spills); the generic code was only measured at 1
    unroll = _halved_to_divide(4 if rows == 1 else 2, s.n // rows) if lanes else 1
    unrolled = lanes and rows == 2 and unroll_states and s.n // 2 <= min(UNROLLED_STATES_MAX, chunk)
    if unrolled:
        path = TWO_ROWS_PER_CHANNEL
    elif rows == 2:
        path = TWO_ROWS_STATE_LOOP if lanes else GENERIC_TWO_ROWS
    else:
        path = ROW_PER_THREAD if lanes else GENERIC
    return Launch(path=path, rows=rows, row_layout=lanes, block_d=block_d, num_warps=warps, chunk=chunk, vec=vec,
                  unroll=unroll, stages=2 if lanes and not unrolled else 1, unrolled_states=s.n if unrolled else 0,
                  prefetch=PREFETCH_CHUNKS if unrolled and not interp else 0,
                  maxnreg=UNROLLED_MAXNREG if unrolled and not interp else None, emulate=interp and lanes)


def _backward(s: ScanShape, interp: bool, row_layout: bool) -> Launch:
    chunk, vec = _chunk_and_vec(s, interp)
    block_d = _pow2_divisor(s.d // s.groups, 32)
    lanes = row_layout and _row_layout_ok(s, 1, block_d, 1, chunk)
    if interp and not lanes:
        block_d = _interp_block(s.d // s.groups)
    return Launch(path=ROW_PER_THREAD if lanes else GENERIC, rows=1, row_layout=lanes, block_d=block_d, num_warps=1,
                  chunk=chunk, vec=vec, unroll=_halved_to_divide(2, s.n) if lanes else 1, stages=3 if lanes else 1,
                  unrolled_states=0, prefetch=0, maxnreg=None, emulate=interp and lanes)


# The backward's walk in sequence segments (triton_bwd.py, triton_bwd_carry.py), one program per 32 channels and
# segment. Its programs are latency-bound and run in waves of BWD_WARPS_PER_SM resident warps (255 registers a
# thread), so s segments take ~ceil(waves(s)) / s of the one-piece walk's wave time, plus the carry pass over
# (s - 1) / s of the tokens, which costs BWD_CARRY_COST of a full wave's walk, and BWD_SEGMENT_COST per segment
# (each program's setup, the later segments' carries summed). Fit on an H100, bf16, n 16 (scan_backward alone,
# B / C as strided bf16 views; docs/kernels/selective_scan.md has the table): b8 d1536 L2048 4.13 -> 2.38 ms (8
# segments), b8 d2048 4.22 -> 2.99 (2), b8 d5120 9.89 -> 7.42 (4), b4 d5120 L8192 19.3 -> 15.4 (3); b8 d4096
# (0.97 waves) stays one piece (two: +6 %).
BWD_WARPS_PER_SM = 8
BWD_CARRY_COST = 0.12
BWD_SEGMENT_COST = 0.005
BWD_MAX_SEGMENTS = 16
BWD_MIN_SEGMENT_CHUNKS = 8


def _segments_for(batch: int, d: int, nchunks: int, sm_count: int) -> int:
    waves = -(-batch * d // 32) / (BWD_WARPS_PER_SM * sm_count)  # of the one-piece walk
    cost = lambda s: math.ceil(waves * s - 1e-9) / s + BWD_CARRY_COST * (s - 1) / s + BWD_SEGMENT_COST * s  # noqa: E731
    return min(range(1, max(1, min(BWD_MAX_SEGMENTS, nchunks // BWD_MIN_SEGMENT_CHUNKS)) + 1), key=cost)


def backward_segment_chunks(batch: int, d: int, nchunks: int, ck: int, sm_count: int | None,
                            segments: int | None = None) -> int:
    """Chunks per segment of the backward's walk, ``nchunks`` or more: a single segment. ``segments``: the count
    wanted (tests, benchmarks); None: the least wave time by the model above (two in the interpreter, so that
    tests cross a segment). A segment holds whole checkpoint groups (``ck`` chunks: it rebuilds only its own);
    on a GPU whole units of BWD_MIN_SEGMENT_CHUNKS too, which is the ``states`` recompute's group, so that
    recompute moves no segment boundary and its gradients stay bit for bit those without it."""
    unit = ck if sm_count is None else max(ck, BWD_MIN_SEGMENT_CHUNKS)
    units = -(-nchunks // unit)
    if segments is None:
        segments = 2 if sm_count is None else _segments_for(batch, d, nchunks, sm_count)
    elif segments < 1:
        raise ValueError(f"selective_scan: segments={segments} must be at least 1")
    return unit * -(-units // max(1, min(segments, units)))


def default_request(batch: int, d: int, n: int, varlen: bool, sm_count: int | None) -> str:
    """Two rows per channel where one row (a warp per 32 channels) would leave the SMs short of warps (n even, no
    cu_seqlens), else one row; the interpreter always runs one row of generic code. Shapes only: the layout then
    decides, inside each op (``plan``)."""
    if sm_count is None:
        return GENERIC
    warps = -(-batch * d // 32)
    if not varlen and n % 2 == 0 and warps < TWO_ROWS_BELOW_WARPS_PER_SM * sm_count:
        return TWO_ROWS_PER_CHANNEL
    return ROW_PER_THREAD


def gates_in_forward(path: str) -> bool:
    """Whether a fused layer's training forward on forward path ``path`` gates inside the scan
    (GATED_FORWARD_PATHS)."""
    return path in GATED_FORWARD_PATHS


@functools.lru_cache(maxsize=4096)
def plan(s: ScanShape, sm_count: int | None, path: str | None = None) -> ScanPlan:
    """The forward and backward launches of a scan of shape ``s`` on a GPU with ``sm_count`` SMs (None: the
    interpreter). ``path`` (one of FORWARD_PATHS; None: ``default_request``) is what to run; where the shape or
    layout cannot take it, the nearest path that can runs instead (``plan(s, sm, p).fwd.path`` says which), in
    this order: two_rows_per_channel -> two_rows_state_loop (more than 8 states per row) -> generic_two_rows
    (no row-per-thread layout); row_per_thread -> generic; two rows -> one row for odd n or cu_seqlens. The
    interpreter runs the row-per-thread paths only when asked by name (with emulated shuffles: tests).

    The backward is determined by the forward's path: pass the forward's ``fwd.path`` to get the same plan.
    Cached: a training step asks for the same few shapes every layer."""
    interp = sm_count is None
    if path is None:
        path = default_request(s.batch, s.d, s.n, s.varlen, sm_count)
    elif path not in FORWARD_PATHS:
        raise ValueError(f"selective_scan: path {path!r} is not one of {FORWARD_PATHS}")
    row_layout = path in ROW_LAYOUT_PATHS  # asked for (the interpreter's default is generic)
    rows = 2 if path not in (ROW_PER_THREAD, GENERIC) and s.n % 2 == 0 and not s.varlen else 1
    fwd = _forward(s, interp, rows, row_layout, unroll_states=path == TWO_ROWS_PER_CHANNEL)
    # the interpreter emulates the backward's lane sums only behind a forward that was asked to emulate its own
    bwd = _backward(s, interp, row_layout=not interp or fwd.path in ROW_LAYOUT_PATHS)
    return ScanPlan(fwd, bwd)
