"""One timer for both sides of a side-by-side benchmark: CUDA events around each call, median after warm-up.

On a CPU (tests, or a CPU run) the same loop uses ``time.perf_counter``. Every side of a comparison is timed by
the same function with the same warm-up and repeat counts, so a ratio compares like with like.
"""

from __future__ import annotations

import statistics
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


class Clock:
    """Start / stop marks: CUDA events on a GPU (no host sync between marks), perf_counter on a CPU."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, start, stop) -> float:
        """Milliseconds between two marks (waits for the second one)."""
        if self.cuda:
            stop.synchronize()
            return start.elapsed_time(stop)
        return (stop - start) * 1e3


def time_calls(fn, device: torch.device | str, warmup: int = 3, reps: int = 10) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn()`` after ``warmup`` untimed calls (autotuning, caches)."""
    if warmup < 0 or reps < 1:
        raise ValueError(f"time_calls: need warmup >= 0 and reps >= 1, got {warmup}, {reps}")
    clock = Clock(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    marks = []
    for _ in range(reps):
        start = clock.mark()
        fn()
        marks.append((start, clock.mark()))
    synchronize(device)
    return [clock.ms(a, b) for a, b in marks]


def median_ms(fn, device: torch.device | str, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of one call of ``fn()`` (see ``time_calls``)."""
    return statistics.median(time_calls(fn, device, warmup, reps))


class Deadline:
    """A wall-clock budget: ``passed()`` once ``seconds`` have gone by since it was made (None: never)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.start = time.monotonic()

    def passed(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.start > self.seconds

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.start)
