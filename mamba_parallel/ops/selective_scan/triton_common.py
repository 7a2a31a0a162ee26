"""Pieces shared by the Mamba-1 scan kernels: the scan operator, exp2 / softplus, and the launch configuration.

Layout of the work: one program owns a block of BD channels of one sequence and walks L in chunks of T tokens;
inside a chunk it loops over the n states and scans one (BD, T) tile per state with ``tl.associative_scan``
along the tokens. Every load and store is a coalesced (channels, tokens) tile, and with the loads' layout each
thread holds a contiguous run of tokens, so most of the scan is sequential inside the thread.

The state carried between chunks goes through a small global buffer rather than a register tile: per state, the
chunk's last column is taken with a one-hot FMA chain and stored as a (BD,) vector; after a barrier the next
chunk loads it. With gradients the buffer keeps every chunk's entering state: these checkpoints ((b, nchunks, d,
n) fp32) are all the backward recomputes from. B and C arrive as fp32 (converted once by the host: they are small
and read n times per token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # Triton kernels may read constexpr globals only


@triton.jit
def linear_combine(a1, b1, a2, b2):
    """Compose two steps of h -> a h + b (first (a1, b1), then (a2, b2))."""
    return a1 * a2, a2 * b1 + b2


@triton.jit
def exp2(x, FAST: tl.constexpr):
    """2^x; FAST (GPU): one flush-to-zero MUFU instruction, no denormal fix-up (decays below 2^-126 are 0)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def softplus(x):
    # log(1 + e^x), exact enough in fp32; the linear branch avoids overflow (as torch's threshold=20).
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@dataclass(frozen=True)
class ScanConfig:
    """Tile sizes. ``chunk`` (T) fixes the checkpoint spacing: forward and backward agree on it."""

    chunk: int          # T, tokens per scan tile
    fwd_block_d: int    # BD of the forward
    fwd_warps: int
    bwd_block_d: int    # BD of the backward (d / BD programs per sequence write dB / dC partials)
    bwd_warps: int
    ckpt_every: int = 1  # v2-v5: keep the state entering every K-th chunk only (triton_v2_ckpt.py)


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap dividing x."""
    p = 1
    while p * 2 <= cap and x % (p * 2) == 0:
        p *= 2
    return p


def parse_config(text: str) -> tuple[int, ...]:
    """'T,BDf,Wf,BDb,Wb' -> five ints."""
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 5 or any(v <= 0 for v in vals):
        raise ValueError(f"MAMBA_PARALLEL_SCAN_CFG={text!r}: expected five positive ints 'T,BDf,Wf,BDb,Wb'")
    return vals


IMPLS = ("v1", "v2", "v3", "v4", "v5")


def scan_impl() -> str:
    """``MAMBA_PARALLEL_SCAN_IMPL=v1|v2|v3|v4|v5`` (default v1), read when a forward runs (its backward follows it).

    v1: (BD, T) tiles scanned with ``tl.associative_scan`` across threads (triton_fwd / triton_bwd).
    v2: one thread per channel, every token of a chunk in its registers (triton_v2_*).
    v3: v2 with, where the v2 register layout is certain (CUDA, token-major 16-byte-aligned u / delta / z,
        L % 16 == 0, no cu_seqlens, 32 | d / g, BD = 32 x warps: triton_impl._lanes), sequential token scans and
        dB / dC summed per warp by lane shuffles (triton_v3_lanes.py), several states per loop iteration;
        elsewhere it runs v2's code.
    v4: v3 with two rows (neighbouring lanes) per channel, each scanning half of the states (n even): twice the
        threads for the same work; BD = 16 x warps channels.
    v5: v3's forward with v4's backward (the row split costs the forward more than the backward).
    """
    impl = os.environ.get("MAMBA_PARALLEL_SCAN_IMPL", "v1").strip().lower() or "v1"
    if impl not in IMPLS:
        raise ValueError(f"MAMBA_PARALLEL_SCAN_IMPL={impl!r} is not one of {IMPLS}")
    return impl


def scan_config(d_per_group: int, seqlen: int, interpret: bool, impl: str = "v1") -> ScanConfig:
    """Tile sizes for channel blocks that never straddle a B/C group (BD divides d / g).

    ``MAMBA_PARALLEL_SCAN_CFG='T,BDf,Wf,BDb,Wb'`` overrides the choice (benchmark sweeps); block sizes are still
    capped to divisors of d / g. For v2-v5, T is the chunk S and BD should be 32 x warps (one thread per channel;
    16 x warps for v4's two rows per channel); ``MAMBA_PARALLEL_SCAN_CKPT_EVERY=K`` (default 1) checkpoints every
    K-th chunk only (4 n / (K S) bytes per (b, d, L) element), the backward recomputing the others.
    """
    # interpreter: tiny tiles (it is slow, and short chunks exercise the chunk carries)
    # GPU v1: the fastest of the tiles timed on an H200 (bf16, ANCHORS shapes; bench_selective_scan --sweep)
    # GPU v2: 16 tokens (two 16-byte bf16 vectors) per thread, 4 warps (sass_report: no spills)
    if impl in ("v2", "v3"):
        cfg = (8, 4, 1, 4, 1) if interpret else (16, 128, 4, 128, 4)
    elif impl == "v4":
        cfg = (8, 4, 1, 4, 1) if interpret else (16, 64, 4, 64, 4)
    elif impl == "v5":
        cfg = (8, 4, 1, 4, 1) if interpret else (16, 128, 4, 64, 4)
    else:
        cfg = (8, 4, 1, 4, 1) if interpret else (64, 8, 2, 16, 2)
    env = os.environ.get("MAMBA_PARALLEL_SCAN_CFG")
    if env:
        cfg = parse_config(env)
    t, bdf, wf, bdb, wb = cfg
    t = min(t, max(triton.next_power_of_2(seqlen), 2))
    kc = 1
    if impl != "v1":
        text = os.environ.get("MAMBA_PARALLEL_SCAN_CKPT_EVERY", "1").strip() or "1"
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"MAMBA_PARALLEL_SCAN_CKPT_EVERY={text!r}: expected a positive int (chunks per "
                             "checkpoint)")
        kc = int(text)
    return ScanConfig(t, _pow2_divisor(d_per_group, bdf), wf, _pow2_divisor(d_per_group, bdb), wb, kc)
