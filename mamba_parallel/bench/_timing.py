"""What the kernel benchmarks share: dtype flag values, the H200 copy rate, CUDA-event timing, the JSON file."""

from __future__ import annotations

import json

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COPY_TBPS = 4.3  # device-to-device copy rate measured on one H200: the ceiling of a memory-bound kernel


def require_cuda(script: str) -> None:
    """Exit with a message naming ``script`` when no CUDA GPU is visible (the kernels are GPU-only)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU")


def median_ms(fn, rep_ms: float = 300.0) -> float:
    """Median of the timed calls (CUDA events) that fit in ``rep_ms`` (at least 10), after warm-up."""
    import triton

    fn()
    torch.cuda.synchronize()
    est = triton.testing.do_bench(fn, warmup=5, rep=5, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=max(rep_ms, 12 * est), return_mode="median")


def graph_us(fn, steps: int = 100) -> float:
    """Per-call time in microseconds of ``steps`` calls captured in one CUDA graph (as generate() runs them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    return median_ms(graph.replay) * 1e3 / steps


def write_json(path: str | None, result: dict) -> None:
    """Write ``result`` to ``path`` (the --json flag; nothing when it is empty)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
