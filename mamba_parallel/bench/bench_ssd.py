"""The Mamba-2 SSD chunked scan beside mamba_ssm's (and fla's simple GLA), same inputs, same process.

    mamba-parallel bench ssd [--peer | --no-peer] [--no-fla] [--shape B L H P N G ...] [--json PATH]

Arguments of every side: x (b, L, h, p), dt (b, L, h) raw, A (h,), B / C (b, L, g, n), chunk 256, D (h,), dt_bias (h,),
dt_softplus; no z, no initial states. ours: ``mamba_parallel.ops.ssd_chunk_scan``; mamba_ssm:
``mamba_chunk_scan_combined``; fla: ``chunk_simple_gla`` with g = dt * A, k = dt * B, q = C (B / C expanded to
every head), v = x, scale 1, its softplus / bias / expansion / + D x counted. Rows: forward with gradients enabled,
forward + backward, inference (no grad). Median of --reps CUDA-event timed calls after --warmup calls, per side.
"""

from __future__ import annotations

import argparse
import math

import torch

from mamba_parallel.bench import kernels, peer as peer_mod
from mamba_parallel.bench.results import publish, say
from mamba_parallel.bench.timing import DTYPES

# (b, L, h, p, n, g): Mamba-2 2.7b-like heads at two lengths, and a half-width model with a smaller state.
SHAPES = [(8, 4096, 64, 64, 128, 1), (4, 16384, 64, 64, 128, 1), (8, 4096, 32, 64, 64, 1)]
CHUNK = 256
GRADS = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def case_name(shape) -> str:
    return "b{} L{} h{} p{} n{} g{}".format(*shape)


def make_inputs(b, L, h, p, n, g, dtype, device, chunk=CHUNK, seed=0) -> dict:
    """Random inputs like a Mamba-2 layer's: dt raw (before dt_bias + softplus), A < 0, fp32 A / D / dt_bias."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s, scale=1.0, shift=0.0, dt=dtype):
        return (torch.randn(*s, generator=gen, device=device) * scale + shift).to(dt)

    return dict(x=r(b, L, h, p), dt=r(b, L, h, scale=0.5, shift=-1.0),
                A=-torch.exp(torch.rand(h, generator=gen, device=device) * math.log(16)),
                B=r(b, L, g, n), C=r(b, L, g, n), D=r(h, dt=torch.float32), dt_bias=r(h, scale=0.3, dt=torch.float32),
                chunk_size=chunk, dt_softplus=True)


def sides_for(peer, fla_fn) -> dict:
    from mamba_parallel import ops

    def ours(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False):
        return ops.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)

    sides = {"ours": ours}
    if peer is not None:
        sides["peer"] = peer.ssd
    if fla_fn is not None:
        sides["fla"] = peer_mod.fla_ssd(fla_fn)
    return sides


def run(shapes, dtype: str, device, peer, fla_fn, chunk: int = CHUNK, warmup: int = 3, reps: int = 10,
        log=say, deadline=None) -> dict:
    """Every shape x mode x side -> the result's settings and rows (see results.py)."""
    sides = sides_for(peer, fla_fn)
    rows = kernels.time_shapes("ssd", shapes, lambda shape: make_inputs(*shape, DTYPES[dtype], device, chunk),
                               case_name, sides, GRADS, device, warmup, reps, log,
                               extra=lambda shape: {"shape": dict(zip("b L h p n g".split(), shape))},
                               deadline=deadline)
    return {"bench": "ssd", "title": "Mamba-2 SSD chunked scan",
            "settings": {"dtype": dtype, "chunk_size": chunk, "warmup": warmup, "reps": reps,
                         "arguments": "x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus=True (no z)",
                         "fla": "chunk_simple_gla(q=C, k=dt*B, v=x, g=dt*A, scale=1) + D*x, preparation counted",
                         "sides": list(sides)},
            "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench ssd", description=__doc__.splitlines()[0])
    peer_mod.add_peer_flags(ap)
    ap.add_argument("--no-fla", action="store_true", help="leave out fla's chunk_simple_gla")
    ap.add_argument("--shape", type=int, nargs=6, action="append", metavar=("B", "L", "H", "P", "N", "G"),
                    help="a shape to time (repeatable; default: the three standard shapes)")
    ap.add_argument("--chunk", type=int, default=CHUNK, help=f"chunk size (default {CHUNK})")
    kernels.add_device_flags(ap)
    return ap


def main(argv=None) -> int:
    a, device, peer, deadline = kernels.parse_run_args(build_parser(), argv)
    fla_fn = None if a.no_fla else peer_mod.load_fla()
    result = run([tuple(s) for s in a.shape] if a.shape else SHAPES, a.dtype, device, peer, fla_fn, a.chunk,
                 a.warmup, a.reps, deadline=deadline)
    publish(result, device, peer, fla_fn, a.json, git_commit=a.git_commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
