"""Do two training runs give the same losses? Step by step, from their metrics.jsonl files (one of them the reference).

    python -m mamba_parallel.bench.loss_match REF/metrics.jsonl RUN.jsonl [RUN2.jsonl ...] [--rtol 0.01]

For runs of one model with the same seed, data and global batch on different layouts (one GPU with CPU offload,
FSDP2, tensor or pipeline parallel): the same initial weights and the same batches, so the losses differ only by
rounding (summation order, bf16, stochastic rounding of bf16 weights), which grows slowly over the steps. Prints each
step's losses, the largest relative difference per run, each run's tokens/s and peak GPU memory; exits 1 when a run's
largest difference exceeds ``--rtol`` or the runs share no step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

DEFAULT_RTOL = 1e-2  # bf16 autocast + bf16 weights: per-step losses of equal runs stay well inside 1 %


def read_metrics(path: str | Path) -> dict[int, dict]:
    """{step: record} of a metrics.jsonl (training records, those with a loss; a later record of a step wins)."""
    out = {}
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise SystemExit(f"loss_match: {path} line {n} is not JSON") from None
            if "loss" in rec and "step" in rec:
                out[int(rec["step"])] = rec
    return out


def compare(ref: dict[int, dict], run: dict[int, dict]) -> dict:
    """Steps both runs logged, their losses and relative differences; the run's median tokens/s and peak memory."""
    steps = sorted(set(ref) & set(run))
    rel = {s: abs(run[s]["loss"] - ref[s]["loss"]) / max(abs(ref[s]["loss"]), 1e-12) for s in steps}
    later = [run[s]["tokens_per_s"] for s in sorted(run) if s > 1 and run[s].get("tokens_per_s")]
    mem = [run[s]["mem_gib"] for s in run if run[s].get("mem_gib") is not None]
    return {"steps": steps, "rel": rel, "max_rel": max(rel.values()) if rel else None,
            "worst_step": max(rel, key=rel.get) if rel else None,
            "tokens_per_s": statistics.median(later) if later else None, "peak_gib": max(mem) if mem else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mamba_parallel.bench.loss_match", description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="metrics.jsonl of the reference run (e.g. the one-GPU offload run)")
    ap.add_argument("runs", nargs="+", help="metrics.jsonl of the runs to compare with it")
    ap.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                    help=f"largest relative loss difference allowed at any step (default {DEFAULT_RTOL})")
    a = ap.parse_args(argv)
    ref = read_metrics(a.reference)
    runs = {p: read_metrics(p) for p in a.runs}
    results = {p: compare(ref, r) for p, r in runs.items()}
    names = [Path(p).stem if Path(p).stem != "metrics" else Path(p).parent.name for p in a.runs]
    print("| step | reference | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for s in sorted(ref):
        cells = [f"{runs[p][s]['loss']:.4f} ({results[p]['rel'][s]:.1e})" if s in runs[p] else "–" for p in a.runs]
        print(f"| {s} | {ref[s]['loss']:.4f} | " + " | ".join(cells) + " |")
    ok = True
    for name, p in zip(names, a.runs):
        r = results[p]
        if r["max_rel"] is None:
            print(f"{name}: no step in common with the reference")
            ok = False
            continue
        good = r["max_rel"] <= a.rtol
        ok &= good
        tps = f"{r['tokens_per_s']:,.0f} tokens/s" if r["tokens_per_s"] else "tokens/s not logged"
        mem = f"peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "peak memory not logged"
        print(f"{name}: {len(r['steps'])} steps, largest relative loss difference {r['max_rel']:.2e} at step "
              f"{r['worst_step']} ({'equal' if good else 'DIFFERENT'} at rtol {a.rtol:g}); {tps}, {mem}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
