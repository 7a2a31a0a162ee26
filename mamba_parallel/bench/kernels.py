"""What the kernel benchmarks share: time one op of every side in three modes and turn the times into rows.

Modes: ``fwd`` (forward with gradients enabled, as training runs it: each side saves what its backward needs),
``fwd+bwd`` (forward, then the gradients of every floating input through ``torch.autograd.grad``), and
``inference`` (forward under ``torch.no_grad``). Every side gets the same input tensors, the same argument set,
the same timer and the same warm-up; one side failing (out of memory, a kernel that does not compile) leaves its
error in the row and the others still run. Each side's timing ends with a device synchronisation, so an error a
side's kernels raise asynchronously (an illegal memory access) lands in that side's row. Such an error leaves the
process's CUDA context unusable: every later CUDA call fails, so what was not run yet is listed with that error
instead (``context_lost``) and the result is still written.
"""

from __future__ import annotations

import statistics

import torch

from mamba_parallel.bench.results import add_git_commit_flag, error_text, make_row
from mamba_parallel.bench.timing import time_calls

MODES = ("fwd", "fwd+bwd", "inference")
MODE_LABELS = {"fwd": "fwd, grad enabled", "fwd+bwd": "fwd+bwd", "inference": "inference (no grad)"}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def mode_fn(fn, inputs: dict, grad_names: tuple[str, ...], mode: str, dy: torch.Tensor | None = None):
    """A no-argument callable running ``fn(**inputs)`` in ``mode`` (leaves for ``grad_names`` made here)."""
    if mode == "inference":
        def run():
            with torch.no_grad():
                fn(**inputs)
        return run
    leaves = {k: (v.detach().requires_grad_(k in grad_names) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}
    if mode == "fwd":
        return lambda: fn(**leaves)
    if mode != "fwd+bwd":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    params = [leaves[k] for k in grad_names]

    def run_bwd():
        y = _first(fn(**leaves))
        torch.autograd.grad(y, params, dy if dy is not None else torch.ones_like(y))
    return run_bwd


_lost: list[str] = []  # why this process's CUDA context cannot run kernels any more (empty while it can)


def context_lost() -> str | None:
    """None while CUDA works here; after a side broke the CUDA context, the text every later row carries."""
    return _lost[0] if _lost else None


def after_failure(side: str, device) -> None:
    """A side failed: free what it cached. If CUDA itself fails now, the context is lost (an illegal memory access
    poisons every later call): remember it, so that nothing more is launched in this process."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available() or _lost:
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as e:
        _lost.append(f"not run: the CUDA context was lost after the {side} side failed ({error_text(e)})")


def time_in_turns(calls: dict, device, warmup: int = 3, reps: int = 10, rounds: int = 2) -> dict:
    """``calls``: {side: {mode: no-argument callable}} -> {mode: ({side: ms or None}, {side: error or None},
    {side: spread or None})}. The sides take turns ``rounds`` times (ours, peer, ..., ours, peer, ...), so a slow
    moment of the GPU or host does not fall on one side only; ms is the median of all timed calls, spread the
    slowest round's median over the fastest's (1.0: the rounds agree; a ratio nearer 1 than the spread is noise)."""
    modes = list(dict.fromkeys(m for per_mode in calls.values() for m in per_mode))
    out = {}
    for mode in modes:
        sides = [side for side in calls if mode in calls[side]]
        timed = {side: [] for side in sides}
        medians = {side: [] for side in sides}
        errors = {side: None for side in sides}
        for r in range(rounds):
            for side in sides:
                if errors[side] is not None:
                    continue
                if context_lost():  # nothing more runs here; a side with a round timed keeps it
                    if not timed[side]:
                        errors[side] = context_lost()
                    continue
                try:
                    ms = time_calls(calls[side][mode], device, warmup if r == 0 else 1, reps)
                except Exception as e:  # recorded in the row; the table goes on
                    errors[side] = error_text(e)
                    after_failure(side, device)
                    continue
                timed[side] += ms
                medians[side].append(statistics.median(ms))
        times = {side: statistics.median(timed[side]) if errors[side] is None else None for side in sides}
        spread = {side: max(m) / min(m) if errors[side] is None and min(m) > 0 else None
                  for side, m in medians.items()}
        out[mode] = (times, errors, spread)
    return out


def time_sides(sides: dict, inputs: dict, grad_names: tuple[str, ...], device, dy=None, modes=MODES,
               warmup: int = 3, reps: int = 10, rounds: int = 2) -> dict:
    """``time_in_turns`` of every side's op on the same inputs, in each of ``modes`` (see ``mode_fn``)."""
    calls = {side: {mode: mode_fn(fn, inputs, grad_names, mode, dy) for mode in modes} for side, fn in sides.items()}
    return time_in_turns(calls, device, warmup, reps, rounds)


def rows_for_case(case: str, timed: dict, **extra) -> list[dict]:
    """``timed``: {mode: (times, errors, spread)} as time_in_turns gives it."""
    rows = []
    for mode, (times, errors, spread) in timed.items():
        spread = {k: v for k, v in spread.items() if v is not None}
        rows.append(make_row(case, MODE_LABELS[mode], "ms", "lower", times, errors, mode=mode,
                             **({"spread": spread} if spread else {}), **extra))
    return rows


SKIPPED = "skipped: time budget spent"


def skipped_rows(case: str, sides, modes=MODES, why: str = SKIPPED, **extra) -> list[dict]:
    """The rows of a case not started (the run's time budget spent, or ``why``): the table says so."""
    return [make_row(case, MODE_LABELS[m], "ms", "lower", {s: None for s in sides}, {s: why for s in sides},
                     mode=m, **extra) for m in modes]


def not_startable(deadline) -> str | None:
    """Why a new case cannot start (the time budget spent, the CUDA context lost), or None."""
    if context_lost():
        return context_lost()
    if deadline is not None and deadline.passed():
        return SKIPPED
    return None


def time_shapes(bench: str, shapes, make_inputs, case, sides: dict, grad_names, device, warmup: int, reps: int,
                log, out_like: str = "x", extra=lambda shape: {}, deadline=None) -> list[dict]:
    """Every shape x mode x side -> rows. ``make_inputs(shape)`` builds one case's inputs and ``case(shape)`` names
    it; ``grad_names``: the inputs differentiated (or a function of the inputs giving them); the backward's output
    gradient is shaped like ``inputs[out_like]``; ``extra(shape)``: more fields for the case's rows; shapes not
    started before ``deadline`` (timing.Deadline) passed get skipped rows."""
    rows = []
    for shape in shapes:
        why = not_startable(deadline)
        if why:
            rows += skipped_rows(case(shape), sides, why=why, **extra(shape))
            log(f"{bench} {case(shape)}: {why}")
            continue
        inputs = make_inputs(shape)
        dy = torch.randn_like(inputs[out_like])
        names = grad_names(inputs) if callable(grad_names) else grad_names
        timed = time_sides(sides, inputs, names, device, dy, warmup=warmup, reps=reps)
        new = rows_for_case(case(shape), timed, **extra(shape))
        for r in new:
            log(f"{bench} {r['case']} {r['metric']}: " + ", ".join(f"{s} {r.get(s)}" for s in sides))
        rows += new
        del inputs, dy
        if torch.device(device).type == "cuda" and not context_lost():
            torch.cuda.empty_cache()
    return rows


def parse_run_args(ap, argv):
    """A kernel benchmark's command line -> (arguments, device, peer or None, deadline), flags from
    ``add_device_flags`` and ``peer.add_peer_flags``."""
    from mamba_parallel.bench import peer as peer_mod
    from mamba_parallel.bench.timing import Deadline

    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return a, device, peer_mod.resolve_peer(a.peer, a.peer_impl), Deadline(a.budget_s)


def add_device_flags(ap) -> None:
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="input dtype (default bf16)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per side and mode first (default 3)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per side and mode, median (default 10)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="start no new shape after S seconds; the rest are listed as skipped and the result is "
                         "still written (default: no limit)")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="write the result: a .json file, or a folder (then <date>-<device>/<bench>.json in it)")
    add_git_commit_flag(ap)
