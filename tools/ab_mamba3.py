"""Other revisions' Mamba-3 scan beside this checkout's, in one process: the same inputs, each side's fwd+bwd
timed in alternation, how far each side's outputs and gradients are from the first one's, and (--profile) each
side's kernels.

    python tools/ab_mamba3.py prepare REV [--dest build/ab_base]     where git is: REV's package, renamed
    python tools/ab_mamba3.py time [--base build/ab_base ...] [--shape B L H P N R ...] [--dtype bf16] [--reps 20]
                                   [--launch ENTRY:warps=W,stages=S,KEY=V ...] [--peer] [--profile]
                                   [--compile-jobs N]     on a GPU

``prepare`` writes git REV's package under --dest, renamed to ``mamba_parallel_<short sha>`` (its imports too), so
several revisions and this checkout import side by side; only what the scan imports is kept (the package's
``__init__``, ``config`` and ``ops/``: about 0.6 MB to carry). ``time`` runs the benchmark's scan inputs
(bench_mamba3.scan_inputs, one B / C group, n / 4 rotated pairs, D, biases and the gate) through every ``--base``
(repeatable, none needed) and this checkout. build/ is git-ignored: a run on another machine must carry the folders.
``--launch`` (repeatable) adds this checkout once more with one launch candidate in place of a tuner entry's list
(e.g. ``chunk_bwd_dqk:warps=4,stages=1,BJ=32``): a candidate is timed alone, without editing the table. ``--peer``
adds mamba_ssm's Mamba-3 scan (SISO shapes), called as its layer calls it, so the same run gives the ratio.
On a cold Triton cache the first fwd+bwd of each side compiles and tunes for tens of seconds (mamba_ssm's about 30
s a shape), one kernel after another; ``--compile-jobs N`` runs every side's first fwd+bwd in a process of its own,
N at a time, before the timed process starts on a warm cache.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

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
        shutil.rmtree(dest, ignore_errors=True)
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

    marker = os.path.join(base, "PACKAGE")
    if not os.path.isfile(marker):
        raise SystemExit(f"ab_mamba3: --base {base}: not a prepared folder (no PACKAGE file); "
                         f"write one with: python tools/ab_mamba3.py prepare REV --dest {base}")
    name = open(marker).read().strip()
    sys.path.insert(0, os.path.abspath(base))
    impl = importlib.import_module(f"{name}.ops.mamba3.triton_impl")
    return open(os.path.join(base, "REV")).read().strip()[:12], impl.mamba3_chunk_scan


def parse_launch(text: str):
    """'ENTRY:warps=W,stages=S,KEY=V,...' -> (entry, triton.Config); block values are integers."""
    from mamba_parallel.ops.mamba3.triton_common import tuned
    from mamba_parallel.ops.tuning import config

    entry, sep, spec = text.partition(":")
    if not sep or entry not in tuned.table:
        raise SystemExit(f"ab_mamba3: --launch {text!r}: the entry before ':' must be one of {sorted(tuned.table)}")
    fields = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not value.strip().lstrip("-").isdigit():
            raise SystemExit(f"ab_mamba3: --launch {text!r}: {item!r} is not KEY=INTEGER")
        fields[key.strip()] = int(value)
    if "warps" not in fields or "stages" not in fields:
        raise SystemExit(f"ab_mamba3: --launch {text!r}: give warps=W and stages=S")
    return entry, config(fields.pop("warps"), fields.pop("stages"), **fields)


class Side:
    """One timed side: ``op`` a mamba3_chunk_scan-like function (fed through the benchmark's preparation) or, with
    ``raw``, a function of the raw inputs (the peer); ``launch`` (entry, candidate) puts that candidate in place of
    the tuner entry's list while the side runs, forward and backward (the backward's launches happen after the
    forward returns)."""

    def __init__(self, op, raw: bool = False, launch=None):
        self.op, self.raw, self.launch = op, raw, launch
        if launch is not None:
            from mamba_parallel.ops.mamba3.triton_common import tuned

            entry, candidate = launch
            kept = tuned.table[entry]
            # one list object for the side's life: the tuner keys its wrappers on the list's identity
            only = [candidate]
            self._table, self._swapped = tuned.table, (only, candidate, kept[2]) + ((only,) if len(kept) > 3 else ())

    @contextlib.contextmanager
    def running(self):
        if self.launch is None:
            yield
            return
        entry = self.launch[0]
        kept, self._table[entry] = self._table[entry], self._swapped
        try:
            yield
        finally:
            self._table[entry] = kept


def peer_side() -> Side:
    """mamba_ssm's scan from the raw inputs (the benchmark's peer side); a clear error where it does not import."""
    from mamba_parallel.bench.peer import MambaSsmPeer, PeerUnavailable
    from mamba_parallel.bench.peer_mamba3 import mamba3_side

    try:
        return Side(mamba3_side(MambaSsmPeer()).scan, raw=True)
    except PeerUnavailable as e:
        raise SystemExit(f"ab_mamba3: --peer: {e}") from e


def _run(side, inputs, dy):
    """One fwd+bwd of a Side (or a plain mamba3_chunk_scan-like op) -> (y, {name: grad})."""
    from mamba_parallel.bench.bench_mamba3 import grad_names
    from mamba_parallel.bench.peer_mamba3 import ours_scan

    side = side if isinstance(side, Side) else Side(side)
    leaves = {k: (v.detach().requires_grad_(True) if k in grad_names(inputs) else v) for k, v in inputs.items()}
    with side.running():
        y = side.op(**leaves) if side.raw else ours_scan(**leaves, op=side.op)
        y.backward(dy)
    return y.detach(), {k: leaves[k].grad for k in grad_names(inputs) if leaves[k].grad is not None}


def sides_for(bases, launches=(), peer: bool = False) -> dict:
    """name -> side: every prepared base, this checkout, this checkout once per --launch, the peer."""
    sys.path.insert(0, ROOT)
    from mamba_parallel.ops.mamba3 import triton_impl as new_impl

    sides = dict(load_base(b) for b in bases)
    sides["this checkout"] = new_impl.mamba3_chunk_scan
    for text in launches:
        entry, candidate = parse_launch(text)
        sides[f"this checkout, {text}"] = Side(new_impl.mamba3_chunk_scan, launch=(entry, candidate))
    if peer:
        sides["mamba_ssm"] = peer_side()
    return sides


def _sides_at(all_sides: dict, shape) -> dict:
    """The sides that run at a shape: the peer's MIMO kernels need TileLang, so MIMO shapes run ours only."""
    return {n: s for n, s in all_sides.items() if shape[5] == 1 or not (isinstance(s, Side) and s.raw)}


def _inputs(shape, dtype_name: str, device: str):
    """The benchmark's scan inputs at a shape and a seeded output gradient dy -> (inputs, dy)."""
    import torch

    from mamba_parallel.bench.bench_mamba3 import scan_inputs
    from mamba_parallel.bench.timing import DTYPES

    gen = torch.Generator(device=device).manual_seed(1)
    dy = torch.randn(*shape[:4], device=device, dtype=DTYPES[dtype_name], generator=gen)
    return scan_inputs(*shape, DTYPES[dtype_name], device), dy


def _first_runs(sides: dict, shape, inputs, dy) -> dict:
    """Each side's first fwd+bwd (it compiles and tunes), timed and said as it ends -> name: (y, grads)."""
    from mamba_parallel.bench.bench_mamba3 import case_name

    results = {}
    for name, op in sides.items():
        start = time.perf_counter()
        results[name] = _run(op, inputs, dy)
        print(f"  {case_name(shape)}, {name}: first fwd+bwd {time.perf_counter() - start:.1f} s", flush=True)
    return results


def first_runs(all_sides: dict, shapes, dtype_name: str, device: str = "cuda") -> None:
    """Each side's first fwd+bwd at every shape: what compiles and tunes its kernels (Triton's cache keeps them)."""
    for shape in shapes:
        _first_runs(_sides_at(all_sides, shape), shape, *_inputs(shape, dtype_name, device))


def child_argv(a, name: str) -> list:
    """The command that runs only side ``name``'s first fwd+bwd, with the timed run's sides and shapes."""
    argv = [sys.executable, os.path.abspath(__file__), "time", "--dtype", a.dtype, "--only", name]
    for base in a.base:
        argv += ["--base", base]
    for shape in a.shape or []:
        argv += ["--shape", *map(str, shape)]
    for text in a.launch:
        argv += ["--launch", text]
    return argv + (["--peer"] if a.peer else [])


def compile_in_parallel(a, names, jobs: int) -> None:
    """One process per side, ``jobs`` at a time, runs its first fwd+bwd: compiles are CPU-bound and one after
    another inside a process, so on a many-core host this fills the shared Triton cache several times faster, and
    the timed process then loads the binaries. A side whose process fails is compiled by the timed process."""
    from concurrent.futures import ThreadPoolExecutor

    def compile_side(name):
        return subprocess.run(child_argv(a, name), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:  # threads only wait: each side compiles in its own process
        for name, proc in zip(names, pool.map(compile_side, names)):
            if proc.returncode:
                tail = "\n    ".join(proc.stdout.strip().splitlines()[-5:])
                print(f"  {name}: its compile process failed ({proc.returncode}):\n    {tail}", flush=True)
    print(f"ab_mamba3: {len(names)} sides compiled in parallel in {time.perf_counter() - start:.0f} s", flush=True)


def time_all(all_sides: dict, shapes, dtype_name: str, reps: int, warmup: int, profile: bool) -> None:
    import torch

    from mamba_parallel.bench.bench_mamba3 import case_name

    print(f"ab_mamba3: {torch.cuda.get_device_name()}, {dtype_name}, median of {reps} alternating fwd+bwd")
    for shape in shapes:
        sides = _sides_at(all_sides, shape)
        inputs, dy = _inputs(shape, dtype_name, "cuda")
        results = _first_runs(sides, shape, inputs, dy)  # said as each ends, so a slow compile shows
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
    t.add_argument("--base", action="append", default=[],
                   help="a prepared folder; repeatable (none: this checkout and its --launch / --peer sides)")
    t.add_argument("--shape", nargs=6, type=int, action="append", metavar=("B", "L", "H", "P", "N", "R"),
                   help="repeatable; R = 1: SISO (default: 8 4096 32 64 128 1 and its MIMO rank 4)")
    t.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    t.add_argument("--reps", type=int, default=20)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--launch", action="append", default=[], metavar="ENTRY:warps=W,stages=S,KEY=V",
                   help="repeatable: this checkout again with one launch candidate for a tuner entry")
    t.add_argument("--peer", action="store_true", help="also mamba_ssm's scan (SISO shapes; needs mamba_ssm)")
    t.add_argument("--profile", action="store_true", help="also each side's CUDA time by kernel")
    t.add_argument("--compile-jobs", type=int, default=0, metavar="N",
                   help="first compile every side in its own process, N at a time (a cold cache on a many-core "
                        "host), then time; 0: each side compiles in the timed process")
    t.add_argument("--only", metavar="SIDE", help=argparse.SUPPRESS)  # a --compile-jobs process: one side's first run
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.rev, a.dest)
        return 0
    shapes = a.shape or [[8, 4096, 32, 64, 128, 1], [8, 4096, 32, 64, 128, 4]]
    sides = sides_for(a.base, a.launch, a.peer)
    if a.only is not None:
        if a.only not in sides:
            raise SystemExit(f"ab_mamba3: --only {a.only!r}: no such side (these are: {', '.join(sides)})")
        first_runs({a.only: sides[a.only]}, shapes, a.dtype)
        return 0
    if a.compile_jobs < 0:
        raise SystemExit(f"ab_mamba3: --compile-jobs {a.compile_jobs}: must be 0 or more")
    if a.compile_jobs:
        compile_in_parallel(a, list(sides), a.compile_jobs)
    time_all(sides, shapes, a.dtype, a.reps, a.warmup, a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
