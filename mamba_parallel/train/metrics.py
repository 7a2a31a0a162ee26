"""Monitoring on rank 0: metrics.jsonl (always), TensorBoard (when installed), a rich progress bar on a terminal,
peak memory, and per-GPU utilisation / memory through NVML (nvidia-ml-py) on CUDA machines."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory of this process's GPU, or the process's peak RSS on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class GpuMonitor:
    """Utilisation (%) and used memory (GiB) of every GPU of this node, read through NVML; inert without it."""

    def __init__(self, enabled: bool):
        self.handles = []
        if not enabled:
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no driver / no nvidia-ml-py: monitoring is optional
            self.handles = []

    def read(self) -> dict:
        if not self.handles:
            return {}
        util, mem = [], []
        for h in self.handles:
            util.append(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            mem.append(round(self.nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30, 2))
        return {"gpu_util": util, "gpu_mem_gib": mem}


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


class MetricsLogger:
    """Appends one JSON object per call to ``<out>/metrics.jsonl``; mirrors scalars to TensorBoard on rank 0."""

    def __init__(self, out: str, is_main: bool, tensorboard: bool = True):
        self.is_main = is_main
        self.path = os.path.join(out, "metrics.jsonl")
        self.tb = None
        if is_main and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out, "tensorboard"))
            except Exception:  # tensorboard not installed
                self.tb = None

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        record = {k: _clean(v) for k, v in record.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A rich progress bar on rank 0 when stdout is a terminal; otherwise plain log lines."""

    def __init__(self, is_main: bool, total: int, start: int, enabled: bool = True):
        self.is_main, self.bar, self.task = is_main, None, None
        if is_main and enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn
            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                    TextColumn("{task.fields[info]}"))
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def print(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def update(self, step: int, info: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class Throughput:
    """Tokens/s over the steps since the last ``read`` (wall clock, device synchronised by the caller)."""

    def __init__(self):
        self.t0, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> tuple[float, float]:
        """(tokens/s, seconds) since the previous read; resets the window."""
        now = time.perf_counter()
        dt = max(now - self.t0, 1e-9)
        rate = self.tokens / dt
        self.t0, self.tokens = now, 0
        return rate, dt
