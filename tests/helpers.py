"""Shared test helpers: per-dtype tolerances, written once, and a relative error measure."""

from __future__ import annotations

import torch

# Relative-RMS error bounds per dtype (kernel vs reference computed in fp32 / fp64).
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Looser bounds for gradients, which sum over long reductions.
GRAD_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny), in float64 (a relative RMS error)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, dtype=torch.float32, grad=False, name="tensor", factor=1.0):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    tol = (GRAD_RTOL if grad else RTOL)[dtype] * factor
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} ({dtype})"
