"""Tiles and backward path of the causal conv1d kernels, chosen from the layout and shape (pure Python).

Tiles are wide in the unit-stride axis so loads coalesce: channels-last x (b, d, L) = (b, L, d).transpose(1, 2)
(the layers' layout) gets tiles of many channels, a contiguous x tiles of many positions. H200, bf16: the
channels-last forward at b8 d5376 L2048 runs 16 x 128 tiles in 0.14 ms (2.5 TB/s).

Backward paths:

    one_pass  each thread walks positions with sliding windows of x and dpre = dy silu'(pre) in registers
              (triton_conv1d_bwd_scan.py), filter width w <= 4. Reads one row of channels per step: coalesced on
              the channels-last layout, where it runs by default: H200 b8 d4352 L2048 w4, 0.153 ms.
    two_pass  the forward kernel writes dpre in fp32, then triton_conv1d_bwd.py (any width; the contiguous
              layout): 0.659 ms at that shape.

A program walks ``tiles_per_program`` tiles of ``block_l`` positions along L (one_pass: rows per unrolled step),
so few weight-gradient partials remain to sum. In the interpreter (tests) the backward takes tiny tiles, so that
test shapes cross tiles, programs and channel blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ONE_PASS = "one_pass"
TWO_PASS = "two_pass"
BACKWARD_PATHS = (ONE_PASS, TWO_PASS)
ONE_PASS_MAX_WIDTH = 4  # its taps are written out; wider filters take the two-pass backward


@dataclass(frozen=True)
class Tiles:
    block_l: int
    block_d: int
    num_warps: int


@dataclass(frozen=True)
class BackwardLaunch:
    path: str
    block_l: int            # positions per tile (one_pass: rows per step, at most 8)
    block_d: int            # channels per program
    num_warps: int
    tiles_per_program: int  # tiles a program walks along L
    fast_sigmoid: bool      # one_pass on a GPU: sigmoid by flush-to-zero ex2 / rcp (inline PTX, ~2 ulp)


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def forward_tiles(channels_last: bool, d: int, L: int) -> Tiles:
    """(BLOCK_L, BLOCK_D, num_warps) of the forward kernel (also the two-pass backward's dpre step), clipped to the
    shape."""
    block_l, block_d = (16, 128) if channels_last else (128, 16)
    return Tiles(min(block_l, _next_pow2(L)), min(block_d, _next_pow2(d)), 4)


def backward_path(channels_last: bool, w: int, path: str | None = None) -> str:
    """``path`` (None: one_pass for channels-last x, two_pass for the contiguous layout); filters wider than
    ONE_PASS_MAX_WIDTH always take two_pass."""
    if path is None:
        path = ONE_PASS if channels_last else TWO_PASS
    elif path not in BACKWARD_PATHS:
        raise ValueError(f"causal_conv1d: backward path {path!r} is not one of {BACKWARD_PATHS}")
    return TWO_PASS if w > ONE_PASS_MAX_WIDTH else path


@functools.lru_cache(maxsize=1024)
def backward_launch(channels_last: bool, d: int, L: int, path: str, on_gpu: bool) -> BackwardLaunch:
    """Tiles of backward ``path`` (from ``backward_path``). H200 (bf16, b8 d4352 L2048 w4 silu, channels-last):
    one_pass 4 rows x 256 channels, 2 warps, 32 steps per program, the next step's rows loaded before the current
    one is computed, 0.153 ms (0.155 at 8 x 128 / 1 warp / 16 steps); two_pass tiles keep its w-tap
    accumulators unspilled on sm_90."""
    if not on_gpu:  # up to 16 channels (the interpreter's time grows with the programs), two blocks where d allows
        block_l, block_d, warps, per_prog = (2 if path == ONE_PASS else 4), min(16, max(4, _next_pow2(d) // 2)), 1, 3
    elif path == ONE_PASS:
        block_l, block_d, warps, per_prog = 4, 256, 2, 32
    else:
        block_l, block_d, warps, per_prog = (8, 64, 4, 16) if channels_last else (64, 8, 4, 16)
    block_l = min(block_l, _next_pow2(L))
    return BackwardLaunch(path=path, block_l=block_l, block_d=min(block_d, _next_pow2(d)), num_warps=warps,
                          tiles_per_program=min(-(-L // block_l), per_prog),
                          fast_sigmoid=on_gpu and path == ONE_PASS)
