"""Every side-by-side benchmark in one process, then the report: what ``tools/side_by_side.sh`` runs on a GPU.

    mamba-parallel bench all [--only kernels,train,generate,long_context] [--out benchmarks/results]
        [--report docs/performance.md] [--plots DIR] [--budget-s 510] [--peer | --no-peer]

Sections (``--only`` picks some; ``kernels`` = ``ssd`` + ``selective_scan``): the SSD and selective-scan kernels on
their standard shapes, one training step of eight presets (seq 2048 x batch 8), generation of three models at
batch 1 and 64, and the longest mamba2-1.3b sequence one GPU trains; ``--only mamba3`` adds the Mamba-3 kernels
and layer (bench_mamba3.py). Each section writes its JSON as soon as it
ends (``<out>/<date>-<device>/<bench>.json``; mamba3 rewrites it after every row); a failing row keeps its error
and the run goes on. ``--budget-s``: presets / models / rows not started by then are listed as skipped (the run
then still writes the report). ``--precompile-workers N`` first compiles every kernel the run will time in N
parallel warm-up processes (precompile.py), their timings thrown away: on a fresh machine that takes the compile
time off the budget; the SSD and Mamba-3 warm-ups split their autotune candidates between processes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mamba_parallel.bench import candidates, peer as peer_mod
from mamba_parallel.bench.results import add_git_commit_flag, error_text, publish, say
from mamba_parallel.bench.timing import Deadline

SECTIONS = ("ssd", "selective_scan", "train", "generate", "long_context")
EXTRA = ("mamba3",)  # run when --only names them
GROUPS = {"kernels": ("ssd", "selective_scan")}


def parse_only(text: str | None) -> list[str]:
    if not text:
        return list(SECTIONS)
    picked = []
    for item in (x.strip() for x in text.split(",")):
        names = GROUPS.get(item, (item,))
        bad = [n for n in names if n not in SECTIONS + EXTRA]
        if bad:
            raise SystemExit(f"bench all: --only {item!r} is not one of "
                             f"{', '.join(list(GROUPS) + list(SECTIONS + EXTRA))}")
        picked += [n for n in names if n not in picked]
    return [s for s in SECTIONS + EXTRA if s in picked]


def _workers(text: str) -> int:
    """--precompile-workers: a count, or 'auto' (one per CPU core)."""
    if text == "auto":
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from mamba_parallel.bench import bench_generate, train_side_by_side

    ap = argparse.ArgumentParser(prog="mamba-parallel bench all", description=__doc__.splitlines()[0])
    peer_mod.add_peer_flags(ap)
    ap.add_argument("--only", default=None, metavar="LIST",
                    help="comma list of kernels, ssd, selective_scan, train, generate, long_context, mamba3 "
                         "(default: all)")
    ap.add_argument("--out", default="benchmarks/results", metavar="DIR",
                    help="results folder: <date>-<device>/<bench>.json go in it (default: benchmarks/results)")
    ap.add_argument("--report", default="docs/performance.md", metavar="FILE",
                    help="write the report here from --out's newest results ('' = no report; "
                         "default: docs/performance.md)")
    ap.add_argument("--plots", default=None, metavar="DIR", help="the report's PNG folder (default: beside --report)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="start no new preset / model after S seconds (default: no limit)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    ap.add_argument("--no-fla", action="store_true", help="leave fla out of the SSD table")
    ap.add_argument("--precompile-workers", type=_workers, default=0, metavar="N",
                    help="first compile every kernel the run times in N parallel warm-up processes (their timings "
                         "are thrown away): on a fresh machine compiling, not timing, is most of the run; 'auto': "
                         "one per CPU core, Triton compiles on the host (default 0: no warm-up)")
    ap.add_argument("--precompile-s", type=float, default=240.0, metavar="S",
                    help="stop the warm-up processes after S seconds (default 240)")
    ap.add_argument("--precompile-only", action="store_true",
                    help="warm up and stop: fills Triton's on-disk cache for a timed run that follows on the same "
                         "machine (with --precompile-workers)"),
    ap.add_argument("--warmup-candidates", type=candidates.parse, default=None, metavar="I/K",
                    help="internal, set on the warm-up processes of --precompile-workers: every autotuned kernel "
                         "tries only its candidates I, I+K, I+2K, ... (K processes compile disjoint binaries)")
    add_git_commit_flag(ap)
    g = ap.add_argument_group("sizes (defaults: the published set)")
    g.add_argument("--kernel-warmup", type=int, default=3, help="kernel calls before timing (default 3)")
    g.add_argument("--kernel-reps", type=int, default=10, help="timed kernel calls, median (default 10)")
    g.add_argument("--ssd-shape", type=int, nargs=6, action="append", metavar=("B", "L", "H", "P", "N", "G"))
    g.add_argument("--ssd-chunk", type=int, default=256)
    g.add_argument("--selective-scan-shape", type=int, nargs=4, action="append", metavar=("B", "D", "L", "N"),
                   help="a Mamba-1 selective-scan shape (repeatable; default: the published set)")
    g.add_argument("--train-presets", nargs="+", default=train_side_by_side.PRESETS)
    g.add_argument("--train-seq-len", type=int, default=2048)
    g.add_argument("--train-batch", type=int, default=8)
    g.add_argument("--train-warmup", type=int, default=2, help="untimed training steps per side (default 2)")
    g.add_argument("--train-steps", type=int, default=5, help="timed training steps per side (default 5)")
    g.add_argument("--train-cuda-graph", action="store_true",
                   help="our training step captured as one CUDA graph and replayed (train's --cuda-graph; the "
                        "peer's step eager, as it ships): a table of its own in the report")
    g.add_argument("--generate-models", nargs="+", default=bench_generate.MODELS)
    g.add_argument("--generate-batches", type=int, nargs="+", default=[1, 64])
    g.add_argument("--prompt-len", type=int, default=256)
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--generate-repeats", type=int, default=2)
    g.add_argument("--long-preset", default="mamba2-1.3b")
    g.add_argument("--long-start", type=int, default=16384)
    g.add_argument("--long-max", type=int, default=262144)
    g.add_argument("--n-layer", type=int, default=None, metavar="K",
                   help="cut every train / generate / long-context model to its first K layers (smoke runs; "
                        "the figures are then not the preset's)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from mamba_parallel.bench import (bench_generate, bench_mamba3, bench_selective_scan, bench_ssd,
                                      long_context_probe, train_side_by_side)

    a = build_parser().parse_args(argv)
    if a.warmup_candidates is not None:  # before any kernel runs: every autotuner of this process is sliced
        candidates.install(a.warmup_candidates)
    sections = parse_only(a.only)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    peer = peer_mod.resolve_peer(a.peer, a.peer_impl, log=say)
    fla_fn = None if a.no_fla or "ssd" not in sections else peer_mod.load_fla()
    if a.n_layer is not None and a.n_layer < 1:
        raise SystemExit(f"bench all: --n-layer must be >= 1, got {a.n_layer}")
    if a.train_cuda_graph and device.type != "cuda":
        raise SystemExit(f"bench all: --train-cuda-graph captures the step on a CUDA device, got --device {device}")
    ssd_shapes = [tuple(s) for s in a.ssd_shape] if a.ssd_shape else bench_ssd.SHAPES
    scan_shapes = [tuple(s) for s in a.selective_scan_shape] if a.selective_scan_shape else bench_selective_scan.SHAPES
    deadline = Deadline(a.budget_s)
    say(f"bench all: {', '.join(sections)} on {device} with peer {peer.name if peer else 'none'}"
        f"{' and fla' if fla_fn else ''}{f', budget {a.budget_s:.0f} s' if a.budget_s else ''}"
        f"{f', autotune candidates {a.warmup_candidates} only' if a.warmup_candidates else ''}")
    if a.precompile_workers:
        import tempfile

        from mamba_parallel.bench import precompile

        scratch = tempfile.mkdtemp(prefix="mamba-parallel-precompile-")
        jobs = precompile.jobs_for(a, sections, ssd_shapes, scan_shapes, out=f"{scratch}/results",
                                   fla=fla_fn is not None, workers=a.precompile_workers)
        precompile.run(jobs, a.precompile_workers, a.precompile_s, scratch, say)
    if a.precompile_only:
        if not a.precompile_workers:
            raise SystemExit("bench all: --precompile-only needs --precompile-workers N (N >= 1)")
        say("bench all: warm-up done (--precompile-only: nothing timed)")
        return 0
    # written row by row, as measured (each row can compile for minutes): a run cut short keeps what it timed
    files = {"mamba3": bench_mamba3.ResultFile(device, peer, a.out, git_commit=a.git_commit)}
    runs = {
        "ssd": lambda: bench_ssd.run(ssd_shapes, "bf16", device, peer, fla_fn, a.ssd_chunk, a.kernel_warmup,
                                     a.kernel_reps, deadline=deadline),
        "selective_scan": lambda: bench_selective_scan.run(scan_shapes, "bf16", device, peer, a.kernel_warmup,
                                                           a.kernel_reps, deadline=deadline),
        "train": lambda: train_side_by_side.run(a.train_presets, peer, device, a.train_seq_len, a.train_batch,
                                                a.train_warmup, a.train_steps, deadline=deadline, n_layer=a.n_layer,
                                                cuda_graph=a.train_cuda_graph),
        "generate": lambda: bench_generate.run(a.generate_models, peer, device, a.generate_batches, a.prompt_len,
                                               a.new_tokens, a.generate_repeats, deadline=deadline,
                                               n_layer=a.n_layer),
        "long_context": lambda: long_context_probe.run(a.long_preset, peer, device, a.long_start, a.long_max,
                                                       n_layer=a.n_layer),
        "mamba3": lambda: bench_mamba3.run(peer, device, "bf16", warmup=a.kernel_warmup, reps=a.kernel_reps,
                                           deadline=deadline, save=files["mamba3"]),
    }
    failed = []
    for name in sections:
        t0 = time.monotonic()
        if deadline.passed():
            say(f"== {name}: skipped (time budget spent)")
            failed.append(name)
            continue
        say(f"== {name} (at {time.monotonic() - deadline.start:.0f} s)")
        try:
            result = runs[name]()
        except Exception as e:  # a whole section failing must not take the others down
            say(f"== {name}: failed: {error_text(e)}")
            failed.append(name)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        publish(result, device, peer, fla_fn if name == "ssd" else None,
                files[name].final() if name in files else a.out, git_commit=a.git_commit)
        say(f"== {name}: {time.monotonic() - t0:.0f} s")
    if a.report:
        from mamba_parallel.bench import report

        report.main(["--results", a.out, "--out", a.report] + (["--plots", a.plots] if a.plots else []))
    say(f"bench all: done in {time.monotonic() - deadline.start:.0f} s"
        f"{'; not completed: ' + ', '.join(failed) if failed else ''}")
    if a.warmup_candidates is not None:
        say(candidates.summary(a.warmup_candidates))  # read back by the warm-up's summary line
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
