"""The Mamba-1 selective scan beside mamba_ssm's CUDA kernel, same inputs, same process.

    mamba-parallel bench selective_scan [--peer | --no-peer] [--shape B D L N ...] [--json PATH]

Arguments of both sides: u, delta, z (b, d, L), A (d, n) fp32, B / C (b, n, L), D (d,), delta_bias (d,),
delta_softplus (what a Mamba-1 layer passes). ours: ``mamba_parallel.ops.selective_scan``; mamba_ssm:
``selective_scan_fn``. Rows: forward with gradients enabled, forward + backward, inference (no grad). Median of
--reps CUDA-event timed calls after --warmup calls, per side.
"""

from __future__ import annotations

import argparse

import torch

from mamba_parallel.bench import kernels, peer as peer_mod
from mamba_parallel.bench.results import publish, say
from mamba_parallel.bench.timing import DTYPES

SHAPES = [(8, 4096, 4096, 16), (4, 5120, 8192, 16)]  # (b, d, L, n): mamba-1.4b-like and mamba-2.8b-like widths
GRADS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def case_name(shape) -> str:
    return "b{} d{} L{} n{}".format(*shape)


def make_inputs(b, d, L, n, dtype, device, seed=0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s, scale=1.0, dt=dtype):
        return (torch.randn(*s, generator=gen, device=device) * scale).to(dt)

    return dict(u=r(b, d, L), delta=r(b, d, L, scale=0.5),
                A=-(torch.rand(d, n, generator=gen, device=device) + 0.5),
                B=r(b, n, L), C=r(b, n, L), D=r(d, dt=torch.float32), z=r(b, d, L),
                delta_bias=r(d, scale=0.3, dt=torch.float32), delta_softplus=True)


def sides_for(peer) -> dict:
    from mamba_parallel import ops

    def ours(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
        return ops.selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)

    return {"ours": ours, **({"peer": peer.selective_scan} if peer is not None else {})}


def run(shapes, dtype: str, device, peer, warmup: int = 3, reps: int = 10, log=say, deadline=None) -> dict:
    sides = sides_for(peer)
    rows = kernels.time_shapes("selective_scan", shapes, lambda shape: make_inputs(*shape, DTYPES[dtype], device),
                               case_name, sides, GRADS, device, warmup, reps, log, out_like="u",
                               extra=lambda shape: {"shape": dict(zip("b d L n".split(), shape))},
                               deadline=deadline)
    return {"bench": "selective_scan", "title": "Mamba-1 selective scan",
            "settings": {"dtype": dtype, "warmup": warmup, "reps": reps,
                         "arguments": "u, delta, A, B, C, D, z, delta_bias, delta_softplus=True", "sides": list(sides)},
            "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench selective_scan", description=__doc__.splitlines()[0])
    peer_mod.add_peer_flags(ap)
    ap.add_argument("--shape", type=int, nargs=4, action="append", metavar=("B", "D", "L", "N"),
                    help="a shape to time (repeatable; default: the two standard shapes)")
    kernels.add_device_flags(ap)
    return ap


def main(argv=None) -> int:
    a, device, peer, deadline = kernels.parse_run_args(build_parser(), argv)
    result = run([tuple(s) for s in a.shape] if a.shape else SHAPES, a.dtype, device, peer, a.warmup, a.reps,
                 deadline=deadline)
    publish(result, device, peer, None, a.json, git_commit=a.git_commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
