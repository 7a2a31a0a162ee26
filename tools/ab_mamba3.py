"""Other revisions' Mamba-3 scan beside this checkout's, in one process: the same inputs, each side's fwd+bwd
timed in alternation, how far each side's outputs and gradients are from the first one's, and (--profile) each
side's kernels.

    python tools/ab_mamba3.py prepare REV [--dest build/ab_base]     where git is: REV's package, renamed
    python tools/ab_mamba3.py time [--base build/ab_base ...] [--shape B L H P N R ...] [--dtype bf16] [--reps 20]
                                   [--profile]                          on a GPU

``prepare`` writes git REV's package under --dest, renamed to ``mamba_parallel_<short sha>`` (its imports too), so
several revisions and this checkout import side by side; only what the scan imports is kept (the package's
``__init__``, ``config`` and ``ops/``: about 0.6 MB to carry). ``time`` runs the benchmark's scan inputs
(bench_mamba3.scan_inputs, one B / C group, n / 4 rotated pairs, D, biases and the gate) through every ``--base``
(repeatable) and this checkout. build/ is git-ignored: a run on another machine must carry the folders.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEPT = ("__init__.py", "config.py", "ops")  # what mamba_parallel.ops.mamba3 imports of the package


def prepare(rev: str, dest: str) -> str:
    """REV's package under dest as mamba_parallel_<short sha> -> that name (also written to dest/PACKAGE)."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    name = f"mamba_parallel_{sha[:10]}"
    with tempfile.TemporaryDirectory() as tmp:
        tar = os.path.join(tmp, "pkg.tar")
        subprocess.run(["git", "-C", ROOT, "archive", "-o", tar, rev, *(f"mamba_parallel/{k}" for k in KEPT)],
                       check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        subprocess.run(["rm", "-rf", dest], check=True)
        os.makedirs(dest)
        os.rename(os.path.join(tmp, "mamba_parallel"), os.path.join(dest, name))
    word = re.compile(r"\bmamba_parallel\b")
    for folder, _, files in os.walk(os.path.join(dest, name)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                text = open(path).read()
                open(path, "w").write(word.sub(name, text))
    open(os.path.join(dest, "REV"), "w").write(sha + "\n")
    open(os.path.join(dest, "PACKAGE"), "w").write(name + "\n")
    print(f"ab_mamba3: {rev} ({sha[:12]}) as {name} in {dest}")
    return name


def load_base(base: str):
    """A prepared folder -> (its revision's short sha, its mamba3_chunk_scan)."""
    import importlib

    name = open(os.path.join(base, "PACKAGE")).read().strip()
    sys.path.insert(0, os.path.abspath(base))
    impl = importlib.import_module(f"{name}.ops.mamba3.triton_impl")
    return open(os.path.join(base, "REV")).read().strip()[:12], impl.mamba3_chunk_scan


def _run(op, inputs, dy):
    """One fwd+bwd -> (y, {name: grad})."""
    import torch

    from mamba_parallel.bench.bench_mamba3 import grad_names
    from mamba_parallel.bench.peer_mamba3 import ours_scan

    leaves = {k: (v.detach().requires_grad_(True) if k in grad_names(inputs) else v) for k, v in inputs.items()}
    y = ours_scan(**leaves, op=op)
    y.backward(dy)
    return y.detach(), {k: leaves[k].grad for k in grad_names(inputs) if leaves[k].grad is not None}


def time_all(bases, shapes, dtype_name: str, reps: int, warmup: int, profile: bool) -> None:
    import torch

    sys.path.insert(0, ROOT)
    from mamba_parallel.bench.bench_mamba3 import case_name, scan_inputs
    from mamba_parallel.ops.mamba3 import triton_impl as new_impl

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    sides = dict(load_base(b) for b in bases)
    sides["this checkout"] = new_impl.mamba3_chunk_scan
    print(f"ab_mamba3: {torch.cuda.get_device_name()}, {dtype_name}, median of {reps} alternating fwd+bwd")
    for shape in shapes:
        inputs = scan_inputs(*shape, dtype, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        b, L, h, p = shape[:4]
        dy = torch.randn(b, L, h, p, device="cuda", dtype=dtype, generator=gen)
        results = {name: _run(op, inputs, dy) for name, op in sides.items()}
        for _ in range(warmup):
            for op in sides.values():
                _run(op, inputs, dy)
        times = {name: [] for name in sides}
        for _ in range(reps):
            for name, op in sides.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                _run(op, inputs, dy)
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
        print(f"\n{case_name(shape)}")
        for name, ts in times.items():
            print(f"  {name}: fwd+bwd {sorted(ts)[len(ts) // 2]:.3f} ms")
        first, (y0, g0) = next(iter(results.items()))
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()  # noqa: E731
        for name, (y1, g1) in list(results.items())[1:]:
            diffs = [f"y {rel(y1, y0):.1e}"] + [f"d{k} {rel(g1[k], g0[k]):.1e}" for k in g0 if k in g1]
            print(f"  relative difference ({name} against {first}): " + ", ".join(diffs))
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as prof

            for name, op in sides.items():
                with prof(activities=[ProfilerActivity.CUDA]) as pr:
                    for _ in range(5):
                        _run(op, inputs, dy)
                    torch.cuda.synchronize()
                print(f"  {name}, CUDA time per fwd+bwd by kernel (ms):")
                rows = sorted(pr.key_averages(), key=lambda e: -e.device_time_total)
                for e in rows[:14]:
                    print(f"    {e.device_time_total / 5e3:8.3f}  {e.key[:100]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write REV's package as mamba_parallel_<sha> under --dest (needs git)")
    p.add_argument("rev")
    p.add_argument("--dest", default=os.path.join(ROOT, "build", "ab_base"))
    t = sub.add_parser("time", help="time every side on a GPU")
    t.add_argument("--base", action="append", help="a prepared folder; repeatable (default: build/ab_base)")
    t.add_argument("--shape", nargs=6, type=int, action="append", metavar=("B", "L", "H", "P", "N", "R"),
                   help="repeatable; R = 1: SISO (default: 8 4096 32 64 128 1 and its MIMO rank 4)")
    t.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    t.add_argument("--reps", type=int, default=20)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--profile", action="store_true", help="also each side's CUDA time by kernel")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.rev, a.dest)
    else:
        shapes = a.shape or [[8, 4096, 32, 64, 128, 1], [8, 4096, 32, 64, 128, 4]]
        time_all(a.base or [os.path.join(ROOT, "build", "ab_base")], shapes, a.dtype, a.reps, a.warmup, a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
