"""How far bf16 selective-scan checkpoints move the gradients, beside how far bf16 activations already do.

    python tools/scan_checkpoint_precision.py [--length 512] [--channels 64]

In fp64 on the CPU. The backward that restarts each 16-token chunk from a bf16-rounded state computes the gradient
of the same recurrence with every chunk's entering state shifted by its rounding error, the adjoint untouched;
this builds exactly that (a straight-through shift at each chunk start) and prints relative-norm errors of the
gradients against the exact ones, next to the errors that rounding u, delta, B, C and the output gradient to bf16
causes (what a bf16 autocast step lives with anyway), and the error of y before the gate as the backward rebuilds
it from those checkpoints for dz (against a bf16 copy of y, what keeping it would cost). Inputs follow Mamba-1's
initialisation: A = -[1..n], delta = softplus(x + dt bias) with dt log-uniform in [1e-3, 0.1].
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

NAMES = ("u", "delta", "A", "B", "C")


def scan(u, delta, A, B, C, chunk: int | None = None):
    """u, delta (b, d, L); A (d, n); B, C (b, n, L) -> y (b, d, L). ``chunk``: the state entering every chunk-th
    token is seen by the backward as its bf16 rounding (the forward's values are unchanged)."""
    b, d, L = u.shape
    h = u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(L):
        if chunk and t and t % chunk == 0:
            h = h + (h.to(torch.bfloat16).double() - h).detach()
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(ys, -1)


def gradients(inputs, bias, dy, chunk=None, bf16_activations=False):
    leaves = [t.detach().clone() for t in inputs]
    if bf16_activations:  # all but A (an fp32 parameter)
        leaves = [t if name == "A" else t.to(torch.bfloat16).double() for name, t in zip(NAMES, leaves)]
        dy = dy.to(torch.bfloat16).double()
    for t in leaves:
        t.requires_grad_(True)
    u, x, A, B, C = leaves
    y = scan(u, F.softplus(x + bias[:, None]), A, B, C, chunk)
    return torch.autograd.grad(y, leaves, dy)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--states", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16, help="tokens per checkpoint (the GPU kernels' chunk)")
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    b, d, n, L = 2, args.channels, args.states, args.length
    f64 = dict(dtype=torch.float64)
    dt = torch.exp(torch.rand(d, generator=gen, **f64) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    bias = dt + torch.log(-torch.expm1(-dt))  # softplus(bias) = dt
    print(f"relative error of each gradient (norm), b{b} d{d} n{n} L{L}, checkpoints every {args.chunk} tokens")
    print(f"{'u scale':>8} {'source':>34} " + " ".join(f"{'d' + k:>9}" for k in NAMES))
    for scale in (1.0, 10.0):
        inputs = (torch.randn(b, d, L, generator=gen, **f64) * scale, torch.randn(b, d, L, generator=gen, **f64) * 0.5,
                  -torch.arange(1, n + 1, **f64).repeat(d, 1), torch.randn(b, n, L, generator=gen, **f64),
                  torch.randn(b, n, L, generator=gen, **f64))
        dy = torch.randn(b, d, L, generator=gen, **f64)
        exact = gradients(inputs, bias, dy)
        for label, kw in (("bf16 checkpoints", dict(chunk=args.chunk)),
                          ("bf16 activations and output grad", dict(bf16_activations=True))):
            got = gradients(inputs, bias, dy, **kw)
            errs = [((g - e).norm() / e.norm()).item() for g, e in zip(got, exact)]
            print(f"{scale:>8g} {label:>34} " + " ".join(f"{e:9.1e}" for e in errs))
        # dz's factor: y before the gate, rebuilt by the backward from the rounded checkpoints (nothing of it is
        # kept), against the copy rounded to bf16 that a forward would keep
        u, delta, A, B, C = inputs[0], F.softplus(inputs[1] + bias[:, None]), *inputs[2:]
        y, rebuilt = scan(u, delta, A, B, C), scan(u, delta, A, B, C, chunk=args.chunk)
        err = lambda t: ((t - y).norm() / y.norm()).item()  # noqa: E731
        print(f"{scale:>8g} {'y rebuilt from the checkpoints':>34} {err(rebuilt):9.1e} "
              f"(y kept as bf16: {err(y.to(torch.bfloat16).double()):.1e})")


if __name__ == "__main__":
    main()
