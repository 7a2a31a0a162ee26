"""Time variants of the batch-1 decode step in one process: the ops one by one, the fused step without and with
programmatic dependent launch, and GEMV tiles of the fused step (CUDA graph replay, random weights, bf16), each
with the recurrent states in every dtype asked for.

    python tools/decode_variants.py --presets mamba2-2.7b mamba-2.8b --json out.json [--sweep] [--state-dtypes fp32 bf16]

Each variant captures its own graph and times 200 replays with CUDA events (median of 5); the first three
variants run again in reverse order at the end, to show drift between the first and the last measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import mamba_parallel.ops.decode_step.triton_impl as kernels
from mamba_parallel.config import get_preset
from mamba_parallel.inference.cuda_graph import make_graphed_decoder, release_graphs
from mamba_parallel.models.lm import MambaLMHeadModel

IN_SWEEP = [(16, 512, 4), (64, 128, 4), (32, 128, 4), (16, 256, 2), (8, 512, 4), (32, 256, 8)]
OUT_SWEEP = [(16, 512, 4), (4, 512, 4), (8, 256, 4), (4, 1024, 4), (8, 512, 2)]


def time_replays(model, prompt, state_dtype=None, steps: int = 200, reps: int = 5) -> float:
    release_graphs(model)
    dec = make_graphed_decoder(model, prompt.shape[0], prompt.shape[1] + 8, state_dtype=state_dtype)
    cache = dec.new_cache()
    with torch.inference_mode():
        dec(prompt, inference_params=cache, num_last_tokens=1)
        cache.seqlen_offset = prompt.shape[1]
        for _ in range(10):
            dec(prompt[:, -1:], inference_params=cache)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                dec.graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["mamba2-2.7b"])
    p.add_argument("--sweep", action="store_true", help="also time the GEMV tiles of IN_SWEEP / OUT_SWEEP")
    p.add_argument("--state-dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32"],
                   help="recurrent state dtypes, each variant timed with each (default: fp32)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with_pdl, tiles = kernels._pdl, (kernels.IN_PROJ_TILES, kernels.OUT_PROJ_TILES)
    variants = [("ops one by one", dict(fused=False)), ("fused, no PDL", dict(pdl=False)), ("fused + PDL", {})]
    if a.sweep:
        variants += [(f"in_proj {t}", dict(inp=t)) for t in IN_SWEEP]
        variants += [(f"out_proj {t}", dict(outp=t)) for t in OUT_SWEEP]
    rows = []
    for name in a.presets:
        torch.manual_seed(0)
        model = MambaLMHeadModel(get_preset(name), device="cuda", dtype=torch.bfloat16).eval()
        prompt = torch.randint(0, 50000, (1, 64), device="cuda")
        for rnd, todo in enumerate((variants, variants[:3][::-1])):
            for (label, v), sd in ((t, sd) for t in todo for sd in a.state_dtypes):
                model.backbone.fused_decode = v.get("fused", True)
                kernels._pdl = with_pdl if v.get("pdl", True) else (lambda t: {"PDL": False})
                kernels.IN_PROJ_TILES = v.get("inp", tiles[0])
                kernels.OUT_PROJ_TILES = v.get("outp", tiles[1])
                state_dtype = torch.bfloat16 if sd == "bf16" else None
                row = dict(preset=name, variant=label, states=sd, round=rnd,
                           ms=round(time_replays(model, prompt, state_dtype), 4))
                print(json.dumps(row), flush=True)
                rows.append(row)
        release_graphs(model)
        del model
        torch.cuda.empty_cache()
    kernels._pdl, (kernels.IN_PROJ_TILES, kernels.OUT_PROJ_TILES) = with_pdl, tiles
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
