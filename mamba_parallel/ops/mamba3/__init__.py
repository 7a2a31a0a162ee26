"""The Mamba-3 scan (trapezoidal discretisation, data-dependent rotary phase, SISO or MIMO), chunk by chunk."""

from __future__ import annotations

import torch

from mamba_parallel.ops._common import (check_cu_seqlens, check_divides, check_int, check_int32_span, check_ndim,
                                        check_shape, kernel_module)
from mamba_parallel.ops.backend import use_triton
from mamba_parallel.ops.mamba3 import naive
from mamba_parallel.ops.mamba3.naive import ROPE_LAYOUTS, Mamba3Discretization, Mamba3State, discretize


def _kernel():
    return kernel_module(__name__)


def check_mamba3_args(op, x, dt, A, B, C, trap, angles, chunk_size, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o,
                      rope, initial_states, seq_idx, cu_seqlens) -> None:
    """Validate ``mamba3_chunk_scan`` arguments; raises ValueError naming the culprit."""
    check_ndim(op, "x", x, (4,), "(b, L, h, p)")
    b, L, h, p = x.shape
    for name, t in (("dt", dt), ("A", A), ("trap", trap)):
        check_shape(op, name, t, ("b", b), ("L", L), ("h", h))
    check_ndim(op, "B", B, (4, 5), "(b, L, g, n) (SISO) or (b, L, R, g, n) (MIMO)")
    mimo = B.dim() == 5
    R = B.shape[2] if mimo else 1
    g, n = B.shape[-2], B.shape[-1]
    lead = (("b", b), ("L", L)) + ((("R", R),) if mimo else ())
    check_shape(op, "B", B, *lead, ("g", g), ("n", n))
    check_shape(op, "C", C, *lead, ("g", g), ("n", n))
    check_divides(op, "B/C groups g", g, "heads h", h)
    if n % 2:
        raise ValueError(f"{op}: the state size n = {n} must be even (its coordinates rotate in pairs)")
    check_ndim(op, "angles", angles, (4,), "(b, L, h, a)")
    a = angles.shape[-1]
    check_shape(op, "angles", angles, ("b", b), ("L", L), ("h", h), ("a", a))
    if not 1 <= a <= n // 2:
        raise ValueError(f"{op}: angles has a = {a} rotated pairs; need 1 <= a <= n / 2 = {n // 2}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    check_shape(op, "D", D, ("h", h))
    check_shape(op, "z", z, ("b", b), ("L", L), ("h", h), ("p", p))
    bias_dims = (("h", h),) + ((("R", R),) if mimo else ()) + (("n", n),)
    check_shape(op, "B_bias", B_bias, *bias_dims)
    check_shape(op, "C_bias", C_bias, *bias_dims)
    for name, t in (("mimo_x", mimo_x), ("mimo_z", mimo_z), ("mimo_o", mimo_o)):
        if t is not None and not mimo:
            raise ValueError(f"{op}: {name} is a MIMO projection; it needs B / C of rank R (b, L, R, g, n)")
        check_shape(op, name, t, ("h", h), ("R", R), ("p", p))
    if mimo_z is not None and z is None:
        raise ValueError(f"{op}: mimo_z projects the gate z, which is missing")
    if rope not in ROPE_LAYOUTS:
        raise ValueError(f"{op}: rope must be one of {ROPE_LAYOUTS}, got {rope!r}")
    check_shape(op, "seq_idx", seq_idx, ("b", b), ("L", L))
    check_int(op, "seq_idx", seq_idx)
    nseq = check_cu_seqlens(op, cu_seqlens, b)
    if nseq is not None and seq_idx is not None:
        raise ValueError(f"{op}: pass seq_idx or cu_seqlens, not both")
    if initial_states is not None:
        if len(initial_states) != 4:
            raise ValueError(f"{op}: initial_states must be a Mamba3State (angle, ssm, k, v), got "
                             f"{len(initial_states)} tensors")
        N = ("nseq", nseq) if nseq else ("b", b)
        angle, ssm, k, v = initial_states
        check_shape(op, "initial_states.angle", angle, N, ("h", h), ("a", a))
        check_shape(op, "initial_states.ssm", ssm, N, ("h", h), ("p", p), ("n", n))
        check_shape(op, "initial_states.k", k, N, *((("R", R),) if mimo else ()), ("h", h), ("n", n))
        check_shape(op, "initial_states.v", v, N, ("h", h), ("p", p))


def mamba3_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      trap: torch.Tensor, angles: torch.Tensor, chunk_size: int = 64, D: torch.Tensor | None = None,
                      z: torch.Tensor | None = None, B_bias: torch.Tensor | None = None,
                      C_bias: torch.Tensor | None = None, mimo_x: torch.Tensor | None = None,
                      mimo_z: torch.Tensor | None = None, mimo_o: torch.Tensor | None = None,
                      rope: str = "interleaved", initial_states: Mamba3State | None = None,
                      seq_idx: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                      return_final_states: bool = False):
    """The Mamba-3 state space model over whole sequences (recurrence: ``ops/mamba3/naive.py``).

    x (b, L, h, p); dt (b, L, h) > 0 (the step, already softplus'd); A (b, L, h) < 0 (the per-token decay rate);
    B, C (b, L, g, n) SISO or (b, L, R, g, n) MIMO of rank R, g dividing h (head block i of h / g heads reads group
    i); trap (b, L, h) in [0, 1] (the trapezoid's weight on the current token); angles (b, L, h, a): rotation speed
    of the first a <= n / 2 coordinate pairs, the phase growing by dt * angles per token (an expanded (b, L, 1, a)
    view is fine); D (h,); z (b, L, h, p): output gate silu(z); B_bias, C_bias (h, n) or (h, R, n).
    MIMO only: mimo_x (h, R, p) lifts x to R inputs, mimo_z (h, R, p) scales z per rank, mimo_o (h, R, p) folds the
    R outputs back (None: the output keeps the rank axis). rope: "interleaved" pairs (2i, 2i+1), "halved" pairs
    (i, i + n/2). initial_states: a ``Mamba3State`` (angle (N, h, a), ssm (N, h, p, n), k (N, [R,] h, n),
    v (N, h, p)) with N = b, or nseq with cu_seqlens. seq_idx (b, L) int32 / cu_seqlens (nseq + 1,) int32 (b == 1):
    packed sequences, nothing crosses a boundary.
    Returns y (b, L, h, p) (MIMO without mimo_o: (b, L, R, h, p)) in x.dtype [, final ``Mamba3State``: angle and
    ssm fp32 (angle reduced to [0, 2 pi)), k fp32, v in x.dtype]. L need not be a multiple of chunk_size.
    """
    check_mamba3_args("mamba3_chunk_scan", x, dt, A, B, C, trap, angles, chunk_size, D, z, B_bias, C_bias, mimo_x,
                      mimo_z, mimo_o, rope, initial_states, seq_idx, cu_seqlens)
    if initial_states is not None:
        initial_states = Mamba3State(*initial_states)
    args = (x, dt, A, B, C, trap, angles, chunk_size, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, rope,
            initial_states, seq_idx, cu_seqlens, return_final_states)
    kernel = _kernel()
    if use_triton(x, op="mamba3_chunk_scan", has_kernel=kernel is not None and kernel.supports(*args)):
        check_int32_span("mamba3_chunk_scan", x=x, B=B, C=C, z=z, angles=angles)
        return kernel.mamba3_chunk_scan(*args)
    return naive.mamba3_chunk_scan(*args)


def mamba3_state_update(state: Mamba3State, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                        C: torch.Tensor, trap: torch.Tensor, angles: torch.Tensor, D: torch.Tensor | None = None,
                        z: torch.Tensor | None = None, B_bias: torch.Tensor | None = None,
                        C_bias: torch.Tensor | None = None, mimo_x: torch.Tensor | None = None,
                        mimo_z: torch.Tensor | None = None, mimo_o: torch.Tensor | None = None,
                        rope: str = "interleaved", discretize: Mamba3Discretization | None = None) -> torch.Tensor:
    """One decode token of ``mamba3_chunk_scan``; ``state`` (a ``Mamba3State`` of batch b, the cache) is advanced
    IN PLACE: the phase, the SSM state, and this token's rotated B and x for the next token's trapezoid half-step.

    x (b, h, p); dt, A, trap (b, h); B, C (b, g, n) or (b, R, g, n); angles (b, h, a); the rest as in
    ``mamba3_chunk_scan``. discretize (a ``Mamba3Discretization``: dt_bias (h,), A_floor > 0): dt, A, trap and
    angles are a layer's raw projections, turned into the scan's inputs here (``naive.discretize``; inside the
    kernel on a GPU). Returns y (b, h, p) (MIMO without mimo_o: (b, R, h, p)) in x.dtype.
    """
    op = "mamba3_state_update"
    check_ndim(op, "x", x, (3,), "(b, h, p)")
    if len(state) != 4:
        raise ValueError(f"{op}: state must be a Mamba3State (angle, ssm, k, v)")
    lift = lambda t: t.unsqueeze(1) if isinstance(t, torch.Tensor) else t  # noqa: E731  one-token sequences
    check_mamba3_args(op, lift(x), lift(dt), lift(A), lift(B), lift(C), lift(trap), lift(angles), 1, D, lift(z),
                      B_bias, C_bias, mimo_x, mimo_z, mimo_o, rope, state, None, None)
    if discretize is not None:
        if len(discretize) != 2:
            raise ValueError(f"{op}: discretize must be a Mamba3Discretization (dt_bias, A_floor)")
        if not isinstance(discretize.dt_bias, torch.Tensor):
            raise ValueError(f"{op}: discretize.dt_bias must be a tensor (h,), got {type(discretize.dt_bias).__name__}")
        check_shape(op, "discretize.dt_bias", discretize.dt_bias, ("h", x.shape[1]))
        if not float(discretize.A_floor) > 0:
            raise ValueError(f"{op}: discretize.A_floor must be > 0, got {discretize.A_floor!r}")
        discretize = Mamba3Discretization(*discretize)
    state = Mamba3State(*state)
    args = (state, x, dt, A, B, C, trap, angles, D, z, B_bias, C_bias, mimo_x, mimo_z, mimo_o, rope)
    kernel = _kernel()
    if use_triton(x, op=op, has_kernel=kernel is not None and kernel.supports_step(*args)):
        return kernel.mamba3_state_update(*args, discretize=discretize)
    if discretize is not None:
        dt, A, trap, angles = naive.discretize(dt, A, trap, angles, discretize)
        args = (state, x, dt, A, B, C, trap, angles, *args[8:])
    return naive.mamba3_state_update(*args)


__all__ = ["mamba3_chunk_scan", "mamba3_state_update", "Mamba3State", "Mamba3Discretization", "discretize"]
