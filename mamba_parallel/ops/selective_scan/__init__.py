"""Mamba-1 selective scan: h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t, y_t = C_t h_t + D u_t (gated by z)."""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import (check_cu_seqlens, check_divides, check_int, check_int32_span, check_ndim,
                                        check_shape, kernel_module)
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.selective_scan import naive


def _kernel():
    return kernel_module(__name__)


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                   initial_state: torch.Tensor | None = None, return_last_state: bool = False,
                   seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                   checkpoint_every: int = 1, checkpoint_dtype: torch.dtype | None = None):
    """The selective SSM of Mamba-1 over a whole sequence.

    u, delta, z (b, d, L); A (d, n) real (negative); B, C (b, n, L) or grouped (b, g, n, L) with g dividing d
    (channel block i of d/g channels uses group i); D (d,); delta_bias (d,); initial_state (b, d, n).
    delta <- softplus(delta + delta_bias) if delta_softplus else delta + delta_bias. Per channel c and state i:
    h_t = exp(delta_t A[c, i]) h_{t-1} + delta_t B_t[i] u_t;  y_t = sum_i C_t[i] h_t + D u_t;  y_t *= silu(z_t).
    seq_idx (b, L) int32 (non-decreasing): the state restarts from zero where it changes. cu_seqlens (nseq+1,)
    int32 with b == 1: packed sequences, each starting from its own initial_state (nseq, d, n).
    Returns y (b, d, L) in u.dtype [, last_state (b, d, n) or (nseq, d, n) with cu_seqlens, in fp32].
    checkpoint_every K (a power of two; Triton path with gradients): the forward keeps the state entering
    every K-th chunk of the kernels' S-token chunks (S = 16 on a GPU, less for L < 16; 8 in the interpreter), i.e.
    (b, cdiv(L, S K), n, d), and the backward rebuilds the states entering the other chunks (one more forward scan
    in the backward). 1: one per chunk (the fastest). The results do not depend on it (the reference ignores it).
    checkpoint_dtype (Triton path with gradients): torch.float32, or torch.bfloat16 with checkpoint_every 1 (half
    the memory; the forward still carries its state in fp32, only the backward restarts each chunk from the
    rounded state: ddelta, dA and dC move by less than bf16 inputs' own rounding moves them, du and dB not at
    all). None: bf16 for bf16 u with checkpoint_every 1, else fp32.
    """
    op = "selective_scan"
    check_ndim(op, "u", u, (3,), "(b, d, L)")
    b, d, L = u.shape
    check_shape(op, "delta", delta, ("b", b), ("d", d), ("L", L))
    check_ndim(op, "A", A, (2,), "(d, n)")
    if A.is_complex():
        raise ValueError(f"{op}: A must be real, got {A.dtype}")
    n = A.shape[1]
    check_shape(op, "A", A, ("d", d), ("n", n))
    check_ndim(op, "B", B, (3, 4), "(b, n, L) or (b, g, n, L)")
    if B.dim() == 3:
        check_shape(op, "B", B, ("b", b), ("n", n), ("L", L))
        check_shape(op, "C", C, ("b", b), ("n", n), ("L", L))
    else:
        g = B.shape[1]
        check_shape(op, "B", B, ("b", b), ("g", g), ("n", n), ("L", L))
        check_shape(op, "C", C, ("b", b), ("g", g), ("n", n), ("L", L))
        check_divides(op, "B/C groups g", g, "d", d)
    check_shape(op, "D", D, ("d", d))
    check_shape(op, "z", z, ("b", b), ("d", d), ("L", L))
    check_shape(op, "delta_bias", delta_bias, ("d", d))
    check_shape(op, "seq_idx", seq_idx, ("b", b), ("L", L))
    check_int(op, "seq_idx", seq_idx)
    nseq = check_cu_seqlens(op, cu_seqlens, b)
    if nseq is not None and seq_idx is not None:
        raise ValueError(f"{op}: pass seq_idx or cu_seqlens, not both")
    check_shape(op, "initial_state", initial_state, ("nseq" if nseq else "b", nseq or b), ("d", d), ("n", n))
    if (not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool) or checkpoint_every < 1
            or checkpoint_every & (checkpoint_every - 1)):
        raise ValueError(f"{op}: checkpoint_every must be a power of two >= 1 (chunks per kept state), got "
                         f"{checkpoint_every!r}")
    if checkpoint_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"{op}: checkpoint_dtype must be torch.float32, torch.bfloat16 or None, got "
                         f"{checkpoint_dtype!r}")
    if checkpoint_dtype == torch.bfloat16 and checkpoint_every != 1:
        raise ValueError(f"{op}: bf16 checkpoints need one per chunk (checkpoint_every 1), got checkpoint_every "
                         f"{checkpoint_every}")
    if use_triton(u, op=op, has_kernel=_kernel() is not None):
        check_int32_span(op, per_row=True, u=u, delta=delta, z=z, B=B, C=C)  # the kernels offset rows in int64
        return _kernel().selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                                        return_last_state, seq_idx, cu_seqlens, checkpoint_every=checkpoint_every,
                                        checkpoint_dtype=checkpoint_dtype)
    return naive.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                                return_last_state, seq_idx, cu_seqlens)


__all__ = ["selective_scan"]
