"""Mamba-2 SSD scan (scalar decay per head), computed chunk by chunk as in the Mamba-2 paper."""

from __future__ import annotations

import math

import torch

from mamba_parallel.ops._common import (check_cu_seqlens, check_divides, check_int, check_int32_span, check_ndim,
                                        check_shape, kernel_module)
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.ssd import naive


def _kernel():
    return kernel_module(__name__)


def check_ssd_args(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_limit, initial_states, seq_idx, cu_seqlens):
    """Validate ``ssd_chunk_scan`` arguments (shared with ``ssd_sequential``); raises ValueError naming the culprit."""
    check_ndim(op, "x", x, (4,), "(b, L, h, p)")
    b, L, h, p = x.shape
    check_shape(op, "dt", dt, ("b", b), ("L", L), ("h", h))
    check_shape(op, "A", A, ("h", h))
    check_ndim(op, "B", B, (4,), "(b, L, g, n)")
    g, n = B.shape[2], B.shape[3]
    check_shape(op, "B", B, ("b", b), ("L", L), ("g", g), ("n", n))
    check_shape(op, "C", C, ("b", b), ("L", L), ("g", g), ("n", n))
    check_divides(op, "B/C groups g", g, "heads h", h)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    if D is not None:
        if D.dim() == 2:
            check_shape(op, "D", D, ("h", h), ("p", p))
        else:
            check_shape(op, "D", D, ("h", h))
    check_shape(op, "z", z, ("b", b), ("L", L), ("h", h), ("p", p))
    check_shape(op, "dt_bias", dt_bias, ("h", h))
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"{op}: dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
    check_shape(op, "seq_idx", seq_idx, ("b", b), ("L", L))
    check_int(op, "seq_idx", seq_idx)
    nseq = check_cu_seqlens(op, cu_seqlens, b)
    if nseq is not None and seq_idx is not None:
        raise ValueError(f"{op}: pass seq_idx or cu_seqlens, not both")
    check_shape(op, "initial_states", initial_states, ("nseq" if nseq else "b", nseq or b), ("h", h), ("p", p),
                ("n", n))


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The first and last byte addresses of t's elements (t not empty)."""
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * t.element_size()
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + t.element_size() - 1


def check_final_states_out(op, out, x, B, initial_states, cu_seqlens):
    """``final_states_out``: a contiguous floating-point (b or nseq, h, p, n) tensor on x's device that is
    ``initial_states`` itself (e.g. the inference cache a prompt continues from) or does not overlap it."""
    name = "final_states_out"
    check_ndim(op, name, out, (4,), "(b | nseq, h, p, n)")
    rows = ("nseq", cu_seqlens.numel() - 1) if cu_seqlens is not None else ("b", x.shape[0])
    check_shape(op, name, out, rows, ("h", x.shape[2]), ("p", x.shape[3]), ("n", B.shape[3]))
    if not out.is_floating_point():
        raise ValueError(f"{op}: {name} must be floating point (fp32, or e.g. a bf16 state cache), got {out.dtype}")
    if out.device != x.device:
        raise ValueError(f"{op}: {name} must be on x's device ({x.device}), got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (e.g. cache[:b] of a contiguous cache), got strides "
                         f"{tuple(out.stride())} for shape {tuple(out.shape)}")
    same_view = initial_states is not None and out.dtype == initial_states.dtype and out.is_set_to(initial_states)
    if (initial_states is not None and out.numel() and initial_states.numel() and not same_view
            and initial_states.device == out.device):
        (lo, hi), (ilo, ihi) = _byte_span(out), _byte_span(initial_states)
        if lo <= ihi and ilo <= hi:
            raise ValueError(f"{op}: {name} overlaps initial_states without being the same tensor: pass the same "
                             f"view for both (a cache read and written in place) or separate tensors")


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   chunk_size: int, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                   dt_limit: tuple[float, float] = (0.0, math.inf), initial_states: torch.Tensor | None = None,
                   seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                   return_final_states: bool = False, recompute_states: bool = False,
                   final_states_out: torch.Tensor | None = None):
    """The Mamba-2 state space model over a whole sequence.

    x (b, L, h, p); dt (b, L, h); A (h,) (negative); B, C (b, L, g, n), g dividing h (head block i of h/g heads
    uses group i); D (h,) or (h, p); z (b, L, h, p); dt_bias (h,); initial_states (b, h, p, n).
    dt <- clamp(softplus(dt + dt_bias), *dt_limit) (softplus only if dt_softplus; no clamp for (0, inf)).
    Per head: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T (p, n);  y_t = h_t C_t + D x_t;  y_t *= silu(z_t).
    seq_idx (b, L) int32 (non-decreasing): the state restarts from zero where it changes. cu_seqlens (nseq+1,)
    int32 with b == 1: packed sequences, each from its own initial_states (nseq, h, p, n).
    Returns y (b, L, h, p) in x.dtype [, final_states (b, h, p, n) or (nseq, h, p, n), fp32].
    L need not be a multiple of chunk_size. ``recompute_states`` (Triton path): the backward recomputes the
    per-chunk dt / decay and chunk states instead of keeping them (less memory, one more state pass).
    ``final_states_out`` (b or nseq, h, p, n), contiguous, fp32 or narrower (e.g. a bf16 state cache): the final
    states are written into it in place (rounded to its dtype, as by ``copy_``) and, with return_final_states, it
    is the final_states returned. It may be ``initial_states`` itself (a cache read and written in place), but
    must not otherwise overlap it. Without autograd the Triton path's kernels write it directly: no fp32 buffer
    and no copy.
    """
    op = "ssd_chunk_scan"
    check_ssd_args(op, x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_limit, initial_states, seq_idx, cu_seqlens)
    if final_states_out is not None:
        check_final_states_out(op, final_states_out, x, B, initial_states, cu_seqlens)
    if use_triton(x, op=op, has_kernel=_kernel() is not None):
        check_int32_span(op, x=x, dt=dt, B=B, C=C, z=z)
        return _kernel().ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit,
                                        initial_states, seq_idx, cu_seqlens, return_final_states,
                                        recompute_states, final_states_out)
    return naive.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                                seq_idx, cu_seqlens, return_final_states, final_states_out)


__all__ = ["ssd_chunk_scan"]
