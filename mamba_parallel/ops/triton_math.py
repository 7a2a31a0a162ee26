"""Elementwise math for Triton kernels that the language lacks, written once (fp32 in, fp32 out)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(v):
    """log(1 + e^v) without losing digits for very negative v (Goldberg's log1p); identity above 20, as torch's
    threshold."""
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))
    return tl.where(v > 20.0, v, lp)


@triton.jit
def tanh(v):
    """tanh from one exp; the series below |v| = 0.01, where 1 - e^(-2|v|) would cancel."""
    e = tl.exp(-2.0 * tl.abs(v))
    t = (1.0 - e) / (1.0 + e)
    v2 = v * v
    return tl.where(tl.abs(v) < 0.01, v * (1.0 - v2 * (1.0 / 3.0 - v2 * (2.0 / 15.0))), tl.where(v < 0, -t, t))
