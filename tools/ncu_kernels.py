"""Nsight Compute over one forward + backward of a scan (ours or mamba_ssm's), and a table of what each kernel reaches.

    ncu --profile-from-start off --clock-control none --target-processes all --csv --page raw \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python tools/ncu_kernels.py run ssd [--peer] [--shape 8 4096 64 64 128 1] > ncu.csv
    python tools/ncu_kernels.py table ncu.csv [--all]

``run`` builds the benchmark's inputs for the op (ssd: b L h p n g; selective_scan: b d L n; mamba3: b L h p n R),
runs three untimed fwd+bwd (compiles, autotuning) and then one inside cudaProfilerStart / Stop, so that ncu with
``--profile-from-start off`` sees that one only. ``table`` reads ncu's raw CSV (program output before it is skipped)
and prints one Markdown row per kernel launch: its time, the busiest SM unit's and DRAM's share of their peaks,
achieved occupancy, registers per thread, cycles between issued instructions, and the stall reasons that cost most
(cycles per issued instruction). ``--all`` keeps torch's own kernels (fills, casts, reductions).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SHAPES = {"ssd": (8, 4096, 64, 64, 128, 1), "selective_scan": (8, 4096, 4096, 16),
                  "mamba3": (8, 4096, 32, 64, 128, 1)}
COLUMNS = [("µs", "gpu__time_duration.sum", 1e-3), ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
           ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
           ("registers", "launch__registers_per_thread", 1),
           ("cycles / issue", "smsp__average_warp_latency_per_inst_issued.ratio", 1)]
_STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def _inputs_and_fn(op: str, shape, peer: bool):
    """-> (inputs dict, fn(**inputs) -> output tensor) for ``op`` at ``shape`` on the GPU, bf16."""
    import torch

    from mamba_parallel.bench import peer as peer_mod

    dtype = torch.bfloat16
    the_peer = peer_mod.load_peer("mamba_ssm") if peer else None
    if op == "ssd":
        from mamba_parallel.bench.bench_ssd import make_inputs, sides_for
        return make_inputs(*shape, dtype, "cuda"), sides_for(the_peer, None)["peer" if peer else "ours"]
    if op == "selective_scan":
        from mamba_parallel.bench.bench_selective_scan import make_inputs, sides_for
        return make_inputs(*shape, dtype, "cuda"), sides_for(the_peer)["peer" if peer else "ours"]
    from mamba_parallel.bench.bench_mamba3 import scan_inputs
    from mamba_parallel.bench.peer_mamba3 import mamba3_side, ours_scan
    return scan_inputs(*shape, dtype, "cuda"), (mamba3_side(the_peer).scan if peer else ours_scan)


def run(op: str, shape, peer: bool) -> None:
    import torch

    inputs, fn = _inputs_and_fn(op, shape, peer)
    leaves = {k: (v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in inputs.items()}
    wrt = [v for v in leaves.values() if isinstance(v, torch.Tensor) and v.requires_grad]

    def once():
        y = fn(**leaves)
        y = y[0] if isinstance(y, tuple) else y
        torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    once()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def table(text: str, keep_all: bool = False) -> str:
    """ncu's raw CSV page (possibly after the program's own output) -> a Markdown table, one row per launch."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit("ncu_kernels table: no ncu CSV header (a line starting with \"ID\") in the input: was ncu "
                         "run with --csv --page raw?")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]  # rows[1]: the units
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith(_STALL[0]) and h.endswith(_STALL[1])]
    out = ["| kernel | " + " | ".join(name for name, _, _ in COLUMNS) + " | costliest stalls (cycles per issue) |",
           "|---" * (len(COLUMNS) + 2) + "|"]
    for r in body:
        name = r[col["Kernel Name"]] if "Kernel Name" in col else "?"
        if not keep_all and name.startswith(("void at::", "at::")):
            continue
        cells = []
        for _, metric, scale in COLUMNS:
            v = _number(r[col[metric]]) if metric in col else None
            cells.append("" if v is None else f"{v * scale:.4g}")
        costs = sorted(((_number(r[col[h]]) or 0.0, h[len(_STALL[0]):-len(_STALL[1])]) for h in stalls), reverse=True)
        top = ", ".join(f"{n} {v:.1f}" for v, n in costs[:3] if v > 0)
        out.append(f"| `{name[:48]}` | " + " | ".join(cells) + f" | {top} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one profiled fwd+bwd (under ncu)")
    r.add_argument("op", choices=sorted(DEFAULT_SHAPES))
    r.add_argument("--peer", action="store_true", help="mamba_ssm's kernels instead of ours")
    r.add_argument("--shape", type=int, nargs="+", help="the op's shape (default: the first benchmark shape)")
    t = sub.add_parser("table", help="ncu's raw CSV -> Markdown")
    t.add_argument("csv")
    t.add_argument("--all", action="store_true", help="keep torch's own kernels")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        shape = tuple(a.shape) if a.shape else DEFAULT_SHAPES[a.op]
        if len(shape) != len(DEFAULT_SHAPES[a.op]):
            ap.error(f"--shape for {a.op} takes {len(DEFAULT_SHAPES[a.op])} numbers, got {len(shape)}")
        sys.path.insert(0, ROOT)
        run(a.op, shape, a.peer)
    else:
        with open(a.csv, encoding="utf-8", errors="replace") as fh:
            print(table(fh.read(), a.all))
    return 0


if __name__ == "__main__":
    sys.exit(main())
