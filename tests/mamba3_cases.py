"""Inputs for the Mamba-3 scan tests (reference, kernels, context parallel): realistic value ranges."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_parallel.ops.mamba3 import Mamba3State

# Every differentiable argument of mamba3_chunk_scan (initial_states expand to its four tensors).
TENSOR_ARGS = ("x", "dt", "A", "B", "C", "trap", "angles", "D", "z", "B_bias", "C_bias", "mimo_x", "mimo_z",
               "mimo_o")
STATE_NAMES = ("angle", "ssm", "k", "v")


def make_inputs(b, L, h, p, n, g=1, a=None, R=None, dtype=torch.float32, device="cpu", init=True, nstates=None,
                z=True, D=True, bias=True, mimo_o=True, seed=0, A_scale=1.0, expand_angles=False):
    """Keyword arguments of mamba3_chunk_scan. R: MIMO rank (None: SISO); a: rotated pairs (default n / 4)."""
    gen = torch.Generator().manual_seed(seed)
    a = a or max(1, n // 4)
    mimo = R is not None

    def r(*shape, scale=1.0, shift=0.0, dt_=dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift).to(device=device, dtype=dt_)

    rank = (R,) if mimo else ()
    pdt = torch.float64 if dtype == torch.float64 else torch.float32  # parameters and states: fp32 (fp64 tests)
    B = F.normalize(r(b, L, *rank, g, n, dt_=torch.float64), dim=-1) * n ** 0.5  # RMS-normed, as the layer feeds it
    C = F.normalize(r(b, L, *rank, g, n, dt_=torch.float64), dim=-1) * n ** 0.5
    angles = torch.pi * torch.tanh(r(b, L, 1 if expand_angles else h, a, dt_=torch.float64))
    args = dict(
        x=r(b, L, h, p), dt=F.softplus(r(b, L, h, scale=0.5, shift=-1.5, dt_=torch.float64)).to(dtype),
        A=(-F.softplus(r(b, L, h, dt_=torch.float64)) * A_scale).clamp(max=-1e-4).to(dtype),
        B=B.to(dtype), C=C.to(dtype), trap=torch.sigmoid(r(b, L, h, dt_=torch.float64)).to(dtype),
        angles=(angles.expand(b, L, h, a) if expand_angles else angles).to(dtype),
        D=r(h, dt_=pdt) if D else None, z=r(b, L, h, p) if z else None,
        B_bias=(1 + 0.1 * r(h, *rank, n, dt_=pdt)) if bias else None,
        C_bias=(1 + 0.1 * r(h, *rank, n, dt_=pdt)) if bias else None,
    )
    if mimo:
        args.update(mimo_x=r(h, R, p, scale=0.5, dt_=pdt),
                    mimo_z=r(h, R, p, scale=0.5, shift=1.0, dt_=pdt) if z else None,
                    mimo_o=r(h, R, p, scale=0.5, dt_=pdt) if mimo_o else None)
    if init:
        N = nstates or b
        args["initial_states"] = Mamba3State(r(N, h, a, dt_=pdt), r(N, h, p, n, scale=0.3,
                                                                               dt_=pdt),
                                             r(N, *rank, h, n, dt_=pdt), r(N, h, p))
    return args


def leaves(args: dict, dtype=None) -> dict:
    """Detached copies requiring grad (optionally cast), initial_states as a Mamba3State of leaves."""
    def leaf(t):
        if t is None or not t.is_floating_point():
            return t
        t = t.detach() if dtype is None else t.detach().to(dtype)
        return t.requires_grad_(True)

    out = {k: leaf(v) for k, v in args.items() if k != "initial_states"}
    if args.get("initial_states") is not None:
        out["initial_states"] = Mamba3State(*(leaf(s) for s in args["initial_states"]))
    return out


def grads(lv: dict) -> dict:
    """{name: grad} of every leaf that requires grad (initial states as init.<part>)."""
    out = {k: v.grad for k, v in lv.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    if lv.get("initial_states") is not None:
        out.update({f"init.{n}": s.grad for n, s in zip(STATE_NAMES, lv["initial_states"])})
    return out


def random_loss(y, final, seed=123):
    """A random linear function of the output and the final states (every gradient path gets a signal)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda t: torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device)  # noqa: E731
    loss = (y.double() * r(y)).sum()
    if final is not None:
        loss = loss + sum((s.double() * r(s)).sum() for s in final)
    return loss
