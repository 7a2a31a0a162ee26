"""Pieces shared by the Mamba-1 scan kernels: exp2 / softplus / L2 prefetch, and the variant / tile choice.

The kernels (triton_fwd.py, triton_bwd.py) give one thread a channel (a row of the tile) and keep a chunk's S tokens
in its registers, so the token scans, the carries and the sums over tokens stay inside the thread (triton_tiles.py).
Variants (``MAMBA_PARALLEL_SCAN_IMPL``, VARIANTS.md) are launch choices of these two kernels: v2 (generic code for
any layout), v3 (register chains and lane-shuffle sums where the row-per-thread layout is certain), v4 (v3 with two
rows per channel); the default picks v3 or v4 by the work per SM.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # Triton kernels may read constexpr globals only


@triton.jit
def exp2(x, FAST: tl.constexpr):
    """2^x; FAST (GPU): one flush-to-zero MUFU instruction, no denormal fix-up (decays below 2^-126 are 0)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines holding ``ptrs`` (GPU only; no data comes back, the dummy result is unused)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def segment_flags(sid_row, t, mt, L, end, VARLEN: tl.constexpr):
    """seq_idx of one row at tokens t (mt = t < L) -> (s_cur, start, end): start marks tokens whose state restarts
    (a new sequence; with VARLEN also token 0); with VARLEN, end marks each packed sequence's last token, otherwise
    the given ``end`` passes through."""
    s_cur = tl.load(sid_row + t, mask=mt, other=0)
    s_prev = tl.load(sid_row + t - 1, mask=mt & (t > 0), other=0)
    start = mt & (s_cur != s_prev) & (t > 0)
    if VARLEN:
        start = start | (t == 0)
        s_next = tl.load(sid_row + t + 1, mask=(t + 1) < L, other=0)
        end = mt & (((t + 1) >= L) | (s_next != s_cur))
    return s_cur, start, end


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
    ckpt_every: int = 1  # keep the state entering every K-th chunk only (triton_sparse_ckpt.py)


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


IMPLS = ("v2", "v3", "v4")
DEFAULT_IMPL = "auto"  # v3 or v4 by the work per SM (pick_impl)
REMOVED_IMPLS = ("v1", "v5")  # dominated on the H200 (issue #5, VARIANTS.md)
# v4 (two rows per channel) when v3 would give each SM fewer warps than this. H200 (132 SMs), bf16, n = 16:
# v4 wins at b4 d5120 (4.8 warps per SM: forward 3.87 vs 5.25 ms) and in the mamba-130m / 370m training steps
# (b8 d1536 / d2048: 2.9 / 3.9 warps per SM, +13 % / +19 % tokens/s with CUDA graphs); v3 wins at b8 d4096 (7.8
# per SM: forward 2.67 vs 3.86 ms) and so for mamba-1.4b / 2.8b (d4096 / d5120 at batch 8).
V4_BELOW_WARPS_PER_SM = 6


# What the custom ops receive: a variant of IMPLS, or "v4+v3" = v4's forward with v3's backward (the default at few
# warps per SM: v3's pipelined backward beats v4's at every timed shape, b4 d5120 L8192 9.9 vs 11.3 ms, while v4's
# extra rows fill the SMs in the forward). Both keep chunks of 16 tokens, so the checkpoints are the same.
MIXED = {"v4+v3": ("v4", "v3")}


def fwd_variant(impl: str) -> str:
    """The variant whose forward kernel runs for ``impl``."""
    return MIXED[impl][0] if impl in MIXED else impl


def bwd_variant(impl: str) -> str:
    """The variant whose backward kernel runs for ``impl``."""
    return MIXED[impl][1] if impl in MIXED else impl


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_impl(batch: int, d: int, n: int, device: torch.device, interpreted: bool, varlen: bool = False) -> str:
    """The default variant for a scan of ``batch`` x ``d`` channels with ``n`` states: "v4+v3" (v4's forward, v3's
    backward) when v3's warps (one per 32 channels) would leave the GPU's SMs short of work and n is even, else v3
    (always v3 in the interpreter and with cu_seqlens, where both run v2's generic code)."""
    if interpreted or varlen or device.type != "cuda" or n % 2:
        return "v3"
    warps = -(-batch * d // 32)
    return "v4+v3" if warps < V4_BELOW_WARPS_PER_SM * _sm_count(device) else "v3"


def scan_impl(batch: int, d: int, n: int, device: torch.device, interpreted: bool, varlen: bool = False) -> str:
    """``MAMBA_PARALLEL_SCAN_IMPL=auto|v2|v3|v4|v4+v3`` (default auto: ``pick_impl``), read when a forward runs
    (its backward follows it; v4+v3: v4's forward, v3's backward).

    v2: one thread per channel, every token of a chunk in its registers (two-level ``tl.associative_scan`` over
        the tokens, dB / dC summed over the program's channels by ``tl.reduce``): any layout, cu_seqlens.
    v3: v2 with, where the row-per-thread layout is certain (CUDA, token-major 16-byte-aligned u / delta / z,
        L % 16 == 0, no cu_seqlens, 32 | d / g, BD = 32 x warps: triton_impl._lanes), sequential token scans and
        dB / dC summed per warp by lane shuffles (triton_lanes.py), several states per loop iteration;
        elsewhere it runs v2's code.
    v4: v3 with two rows (neighbouring lanes) per channel, each scanning half of the states (n even): twice the
        threads for the same work (BD = 16 x warps channels); faster when few channels x batch fill the GPU.
    """
    impl = os.environ.get("MAMBA_PARALLEL_SCAN_IMPL", DEFAULT_IMPL).strip().lower() or DEFAULT_IMPL
    if impl in REMOVED_IMPLS:
        raise ValueError(f"MAMBA_PARALLEL_SCAN_IMPL={impl!r} was removed (dominated, see "
                         f"ops/selective_scan/VARIANTS.md); use auto or one of {IMPLS} (default {DEFAULT_IMPL})")
    if impl == "auto":
        return pick_impl(batch, d, n, device, interpreted, varlen)
    if impl not in IMPLS and impl not in MIXED:
        raise ValueError(f"MAMBA_PARALLEL_SCAN_IMPL={impl!r} is not auto or one of {IMPLS + tuple(MIXED)}")
    return impl


# GPU tiles 'T,BDf,Wf,BDb,Wb' per variant, the fastest timed on an H200 (bf16, bench_selective_scan --sweep):
# v3 at one warp per program (32 channels) beats 4 warps in both passes at both ANCHORS shapes; v2 keeps the
# 4-warp tiles whose register use sass_report measured without spills; v4 has 16 channels (32 rows) per warp.
GPU_TILES = {"v2": (16, 128, 4, 128, 4), "v3": (16, 32, 1, 32, 1), "v4": (16, 64, 4, 64, 4)}
INTERPRETER_TILES = (8, 4, 1, 4, 1)  # the interpreter is slow, and short chunks exercise the chunk carries


def scan_config(d_per_group: int, seqlen: int, interpret: bool, impl: str = "v3") -> ScanConfig:
    """Tile sizes for channel blocks that never straddle a B/C group (BD divides d / g).

    ``MAMBA_PARALLEL_SCAN_CFG='T,BDf,Wf,BDb,Wb'`` overrides the choice (benchmark sweeps); block sizes are still
    capped to divisors of d / g. T is the chunk S (tokens per thread, the checkpoint spacing) and BD should be
    32 x warps (one thread per channel; 16 x warps for v4's two rows per channel).
    ``MAMBA_PARALLEL_SCAN_CKPT_EVERY=K`` (default 1) checkpoints every K-th chunk only (4 n / (K S) bytes per
    (b, d, L) element), the backward recomputing the others.
    """
    if impl not in GPU_TILES:
        raise ValueError(f"scan_config: impl {impl!r} is not one of {IMPLS}")
    cfg = INTERPRETER_TILES if interpret else GPU_TILES[impl]
    env = os.environ.get("MAMBA_PARALLEL_SCAN_CFG")
    if env:
        cfg = parse_config(env)
    t, bdf, wf, bdb, wb = cfg
    t = min(t, max(triton.next_power_of_2(seqlen), 2))
    text = os.environ.get("MAMBA_PARALLEL_SCAN_CKPT_EVERY", "1").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"MAMBA_PARALLEL_SCAN_CKPT_EVERY={text!r}: expected a positive int (chunks per checkpoint)")
    return ScanConfig(t, _pow2_divisor(d_per_group, bdf), wf, _pow2_divisor(d_per_group, bdb), wb, int(text))
