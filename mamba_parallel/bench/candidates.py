"""Autotune candidates split between warm-up processes (``bench all --warmup-candidates i/k``, set by precompile.py).

Triton compiles an autotuner's candidates one after another in one process: mamba_ssm's Mamba-3 kernels try 27 to
81 launch configurations each, so one process warming them up compiles for minutes. In a process given the slice
i/k, every Triton autotuner (ours, the peer's, fla's) tries only the candidates i, i + k, i + 2k, ... of its full
list, so k warm-ups started together compile disjoint sets of binaries into the shared on-disk cache, and the
timed run then finds every candidate compiled and only times them.

The patch is on Triton's ``Autotuner`` class (``prune_configs`` and ``run``, present in every Triton this package
supports), so the autotuners built at import, before it was installed, are sliced too. The slice is taken from
the full list before any pruning (our pruners compile a candidate to measure its shared memory). A kernel still
runs when its slice has nothing for it, so that the kernels after it in the same call get compiled as well: an
empty slice (fewer candidates than slices) keeps the first candidate, and a slice whose candidates are all pruned
away or fail to compile falls back to the other candidates one at a time, in order.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

PREFIX = "warm-up candidates"  # starts the line a sliced process prints at its end (precompile.py reads it)


@dataclass(frozen=True)
class Slice:
    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def take(self, configs: list) -> list:
        """The candidates of this slice (the first one when the slice is empty)."""
        return list(configs[self.index::self.count]) or list(configs[:1])


def parse(text: str) -> Slice:
    """'i/k' -> Slice(i, k), 0 <= i < k (an argparse type)."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/K (slice I of K, 0 <= I < K), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected I/K with 0 <= I < K, got {text!r}")
    return Slice(index, count)


class NoCandidate(Exception):
    """Pruning left an autotuner of this slice nothing to run (older Tritons return the empty list)."""


def _failures() -> tuple:
    """The errors that mean "this candidate cannot run here" (what Triton's autotuner itself skips, and an
    autotuner left with no candidate); some are missing from older Tritons."""
    from triton.runtime import errors

    out = [errors.OutOfResources, NoCandidate]
    out += [getattr(errors, name) for name in ("PTXASError", "AutotunerError") if hasattr(errors, name)]
    try:
        from triton.compiler.errors import CompileTimeAssertionFailure
        out.append(CompileTimeAssertionFailure)
    except ImportError:
        pass
    return tuple(out)


_original: dict = {}  # Triton's own methods while a slice is installed
_stats = {"sweeps": 0, "candidates": 0, "kept": 0, "fallbacks": 0}


def stats() -> dict:
    """Since install: autotune sweeps sliced, their candidates, the ones kept here, kernels that fell back."""
    return dict(_stats)


def summary(part: Slice) -> str:
    s = _stats
    return (f"{PREFIX} {part}: {s['sweeps']} autotune sweeps, {s['kept']} of their {s['candidates']} candidates "
            f"tried here, {s['fallbacks']} kernels fell back to a candidate of another slice")


def install(part: Slice) -> None:
    """From now on, every autotuner in this process tries only ``part`` of its candidates (module docstring)."""
    from triton.runtime.autotuner import Autotuner

    uninstall()
    _original.update(prune_configs=Autotuner.prune_configs, run=Autotuner.run)
    _stats.update(sweeps=0, candidates=0, kept=0, fallbacks=0)
    prune, run = _original["prune_configs"], _original["run"]
    failures = _failures()

    def prune_configs(self, *args, **kwargs):
        full = self.configs
        fallback = getattr(self, "_warmup_fallback", None)
        if fallback is None:
            picked = part.take(full)
            _stats["sweeps"] += 1
            _stats["candidates"] += len(full)
            _stats["kept"] += len(picked)
        else:
            picked = [fallback]
        self.configs = picked  # Triton's pruning reads self.configs: it then prunes the slice only
        try:
            kept = prune(self, *args, **kwargs)
        finally:
            self.configs = full
        if not kept:
            raise NoCandidate(f"no candidate of slice {part} is left after pruning")
        return kept

    def sliced_run(self, *args, **kwargs):
        known = set(self.cache)
        try:
            return run(self, *args, **kwargs)
        except failures as e:
            if len(self.configs) <= 1:
                raise
            error = e
        mine = {id(c) for c in part.take(self.configs)}
        for c in [c for c in self.configs if id(c) not in mine]:
            for key in set(self.cache) - known:  # the failed choice is not kept for later calls
                del self.cache[key]
            self._warmup_fallback = c
            try:
                out = run(self, *args, **kwargs)
            except failures:
                continue
            finally:
                self._warmup_fallback = None
            _stats["fallbacks"] += 1
            return out
        raise error

    Autotuner.prune_configs = prune_configs
    Autotuner.run = sliced_run


def uninstall() -> None:
    """Triton's autotuner as it was (every candidate tried again)."""
    if not _original:
        return
    from triton.runtime.autotuner import Autotuner

    Autotuner.prune_configs = _original.pop("prune_configs")
    Autotuner.run = _original.pop("run")
