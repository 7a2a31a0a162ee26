"""What the Mamba-3 kernels share: the per-chunk token scalars (decay, trapezoid weights), the rotary phase and
rotation of B / C, and the launch configurations.

A state of n coordinates is handled as two halves of n / 2 columns, the two coordinates of every rotated pair
(interleaved: columns 2j and 2j + 1; halved: j and j + n / 2); a rotation is then elementwise on the halves and
every product over n is the sum of two half-size dots. Pairs j >= a have zero angle speed: they never turn.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba_parallel.ops.tuning import Tuner, dot_precision  # noqa: F401  (the kernels' imports)
from mamba_parallel.ops.tuning import block_pow2 as block  # noqa: F401
from mamba_parallel.ops.tuning import config as _c

TWO_PI = tl.constexpr(6.283185307179586)  # Triton kernels may read constexpr globals only
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def wrap_angle(th):
    """th reduced to [0, 2 pi): rotary angles accumulate over the whole sequence, their fp32 sum would lose digits."""
    return th - TWO_PI * tl.floor(th * INV_TWO_PI)


@triton.jit
def cos_sin(th, FAST: tl.constexpr):
    """cos and sin of th. FAST (GPU): th reduced to [-pi, pi) in fp32, then one MUFU instruction each (absolute
    error about 1e-6 there, against libdevice's tens of instructions per call); the interpreter takes tl.cos /
    tl.sin."""
    if FAST:
        r = th - TWO_PI * tl.floor(th * INV_TWO_PI + 0.5)
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
        return c, s
    else:
        return tl.cos(th), tl.sin(th)


@triton.jit
def pair_columns(offs_j, n, HALVED: tl.constexpr):
    """Columns (in units of the n axis) of the two coordinates of pairs offs_j."""
    if HALVED:
        return offs_j, offs_j + n // 2
    return 2 * offs_j, 2 * offs_j + 1


@triton.jit
def rows(c, T: tl.constexpr, R: tl.constexpr):
    """The T * R rows of chunk c (token-major: row = token * R + rank) -> (token index t, rank, first-rank mask)."""
    offs = tl.arange(0, T * R)
    rank = offs % R
    return c * T + offs // R, rank, rank == 0


@triton.jit
def token_scalars(dt_ptr, a_ptr, trap_ptr, s_t, t, valid, next_ok):
    """dt, log decay dt*A, the diagonal weight gamma = trap dt and the weight w = gamma + beta_next of each token
    toward later ones (beta_next = (1 - trap) dt of the next token, zero where ``next_ok`` is false)."""
    dt = tl.load(dt_ptr + t * s_t, mask=valid, other=0.0).to(tl.float32)
    la = tl.load(a_ptr + t * s_t, mask=valid, other=0.0).to(tl.float32) * dt
    lam = tl.load(trap_ptr + t * s_t, mask=valid, other=0.0).to(tl.float32)
    dt_next = tl.load(dt_ptr + (t + 1) * s_t, mask=next_ok, other=0.0).to(tl.float32)
    lam_next = tl.load(trap_ptr + (t + 1) * s_t, mask=next_ok, other=0.0).to(tl.float32)
    gamma = lam * dt
    return dt, la, gamma, gamma + (1.0 - lam_next) * dt_next


@triton.jit
def load_halves(ptr, off, valid, j0, NH, BJ: tl.constexpr, HALVED: tl.constexpr):
    """Both halves (rows, BJ), fp32, of pairs j0 .. j0 + BJ in the rows at ``off`` (rows,) of a tensor whose n axis
    is contiguous. Whole rows are read at once: interleaved pairs are split after the load (a load per half would
    read every other element, one at a time)."""
    return load_pairs_below(ptr, off, valid, j0, NH, NH, BJ, HALVED)


@triton.jit
def load_pairs_below(ptr, off, valid, j0, NH, NJ, BJ: tl.constexpr, HALVED: tl.constexpr):
    """load_halves reading only the pairs below NJ (<= NH; the others zero): e.g. the turning ones."""
    offs = j0 + tl.arange(0, BJ)
    if HALVED:
        m = valid[:, None] & (offs < NJ)[None, :]
        v1 = tl.load(ptr + off[:, None] + offs[None, :], mask=m, other=0.0)
        v2 = tl.load(ptr + off[:, None] + NH + offs[None, :], mask=m, other=0.0)
        return v1.to(tl.float32), v2.to(tl.float32)
    cols = 2 * j0 + tl.arange(0, 2 * BJ)
    v = tl.load(ptr + off[:, None] + cols[None, :], mask=valid[:, None] & (cols < 2 * NJ)[None, :], other=0.0)
    v1, v2 = tl.split(tl.reshape(v.to(tl.float32), (v.shape[0], BJ, 2)))
    return v1, v2


@triton.jit
def store_halves(ptr, off, v1, v2, valid, j0, NH, BJ: tl.constexpr, HALVED: tl.constexpr):
    """load_halves' inverse: v1, v2 (rows, BJ) written (in ptr's dtype) as whole rows."""
    offs = j0 + tl.arange(0, BJ)
    dtype = ptr.dtype.element_ty
    if HALVED:
        m = valid[:, None] & (offs < NH)[None, :]
        tl.store(ptr + off[:, None] + offs[None, :], v1.to(dtype), mask=m)
        tl.store(ptr + off[:, None] + NH + offs[None, :], v2.to(dtype), mask=m)
    else:
        cols = 2 * j0 + tl.arange(0, 2 * BJ)
        v = tl.reshape(tl.join(v1.to(dtype), v2.to(dtype)), (v1.shape[0], 2 * BJ))
        tl.store(ptr + off[:, None] + cols[None, :], v, mask=valid[:, None] & (cols < 2 * NH)[None, :])


@triton.jit
def load_rank_rows(ptr, rank, cols, ncols, R: tl.constexpr, cmask):
    """A per-head (R, ncols) parameter (MIMO scales, biases) read for every row's rank -> (rows, len(cols)) fp32."""
    return tl.load(ptr + rank[:, None] * ncols + cols[None, :], mask=cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def rotate_pairs(v1, v2, cos, sin):
    return v1 * cos - v2 * sin, v1 * sin + v2 * cos


@triton.jit
def per_token(v, T: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """(T * R, C) per row -> summed over each token's R rows: (T, C)."""
    if R == 1:
        return v
    return tl.sum(tl.reshape(v, (T, R, C)), axis=1)


@triton.jit
def per_token_vec(v, T: tl.constexpr, R: tl.constexpr):
    """(T * R,) per row -> summed over each token's R rows: (T,)."""
    if R == 1:
        return v
    return tl.sum(tl.reshape(v, (T, R)), axis=1)


@triton.jit
def per_rank(v, T: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """(T * R, C) per row -> summed over the tokens, per rank: (R, C)."""
    return tl.sum(tl.reshape(v, (T, R, C)), axis=0)


# name -> (GPU candidates, interpreter config, autotune key[, GPU candidates for fp32 operands]). BLOCK_P:
# headdim columns per program (the sweeps and the forward outputs are independent per headdim column). Every
# candidate fits an H100 / H200's shared memory at d_state 128, headdim 64 and 64-row chunks (tools/compile_check.py
# checks it; docs/kernels/mamba3.md has the figures); ops/tuning.py drops those a smaller GPU cannot hold. The fp32
# lists put first what ptxas compiles without large spills: an untuned launch runs the first.
_CONFIGS = {
    # the forward sweep holds the state (BLOCK_P, n) in registers beside a chunk's q, k, u tiles; BLOCK_P = 32
    # doubles the programs (for small batch x heads) at the price of reading q and k twice. Two stages prefetch
    # the next chunk's q, k, x into shared memory
    "scan_fwd": ([_c(8, 2, BLOCK_P=64), _c(4, 2, BLOCK_P=64), _c(8, 2, BLOCK_P=32), _c(4, 2, BLOCK_P=32)],
                 _c(1, 1, BLOCK_P=16), ["P", "BN", "T", "R", "HAS_Z", "HAS_MO", "KEEP_YPRE", "KEEP_STATES"],
                 [_c(8, 1, BLOCK_P=32), _c(4, 1, BLOCK_P=32), _c(8, 1, BLOCK_P=64), _c(4, 1, BLOCK_P=64)]),
    # the reverse sweep: all 64 headdim columns at 4 warps won on an H100 (bf16 fwd+bwd, one process: 4.93 ms at
    # b8 L4096 h32, 9.24 at b4 L8192 h64), against 8 warps 5.23 / 9.77 and 32 columns 5.38 / 10.04. Splitting
    # d_state's pairs over programs lost at every shape (blocks of 32 pairs 5.16 / 9.64: each block redoes the
    # gate's backward and reads dy again); 2 warps spill 256 bytes
    "dstates": ([_c(4, 2, BLOCK_P=64), _c(4, 2, BLOCK_P=32), _c(8, 2, BLOCK_P=64)],
                _c(1, 1, BLOCK_P=16), ["P", "BH", "T", "R", "HAS_Z"],
                [_c(8, 2, BLOCK_P=64), _c(4, 2, BLOCK_P=32), _c(4, 2, BLOCK_P=64)]),
    # the per-chunk backward holds ~20 chunk-sized tiles; n taken 2 BJ columns at a time (BJ pairs' worth, at most all)
    # keeps one block's tiles live instead of all of them. It runs in two launches (du's part, then dq / dk's), each
    # with about half the tiles. What won on an H100 (bf16 fwd+bwd, same inputs, one process): du's part at 4 warps
    # (two programs per SM) 5.76 ms at b8 L4096 h32, against 6.93 at 8 warps and 6.63 at 8 warps with BJ = 64; dq /
    # dk's split over column blocks (one program per block of 32 pairs, 4 warps, 192 registers: two per SM) 5.22 ms
    # against 5.36 for one program walking all pairs at 8 warps, and 9.52 against 9.79 at b4 L8192 h64 (8 warps
    # split 6.11 / 11.26, blocks of 16 pairs 5.60 / 10.31). Before the column blocks (pair halves), dq / dk's part at
    # 4 warps computed wrong dB under Triton 3.6, and a 128-register cap spilled (12.1 ms against 6.9): a candidate
    # enters once it passes test_gpu_every_candidate_alone and is timed
    "chunk_bwd_dx": ([_c(4, 1, BJ=32)], _c(1, 1, BJ=16), ["P", "BH", "T", "R", "HAS_Z"], [_c(16, 1, BJ=32)]),
    "chunk_bwd_dqk": ([_c(4, 1, BJ=32, SPLIT=True), _c(8, 1, BJ=64)], _c(1, 1, BJ=16, SPLIT=True),
                      ["P", "BH", "T", "R", "HAS_Z"], [_c(16, 1, BJ=32)]),
    # MIMO (R rows per token), in the same two parts: with 16-bit operands, 64-row tiles and two blocks of 32 pairs,
    # Triton 3.6 on an H200 miscompiled the one-launch form (compute-sanitizer: an out-of-bounds shared-memory read
    # in a dot of pass 2; with 4 warps, wrong gradients and no fault); all pairs in one block at d_state 128
    # (BJ = 64) computes right. On an H100 (b8 L4096 h32 rank 4 bf16 fwd+bwd, one process): du's part at 4 warps
    # 28.1 ms, at 8 warps 30.7, the one-launch form 33.0
    "chunk_bwd_mimo_dx": ([_c(4, 1, BJ=64)], _c(1, 1, BJ=16), ["P", "BH", "T", "R", "HAS_Z"], [_c(16, 1, BJ=32)]),
    "chunk_bwd_mimo_dqk": ([_c(8, 1, BJ=64)], _c(1, 1, BJ=16), ["P", "BH", "T", "R", "HAS_Z"], [_c(16, 1, BJ=32)]),
}
tuned = Tuner(_CONFIGS)
