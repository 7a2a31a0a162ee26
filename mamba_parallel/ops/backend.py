"""Which implementation an op runs: ``MAMBA_PARALLEL_BACKEND=auto|naive|triton`` (read at every call).

auto   -> the Triton kernel for CUDA tensors when the op has one and Triton imports, else the naive reference.
naive  -> always the pure-PyTorch reference (the specification).
triton -> always the kernel; on CPU tensors this needs ``TRITON_INTERPRET=1`` (tests use it).
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "naive", "triton")


class BackendError(RuntimeError):
    pass


def requested_backend() -> str:
    b = os.environ.get("MAMBA_PARALLEL_BACKEND", "auto").strip().lower() or "auto"
    if b not in BACKENDS:
        raise BackendError(f"MAMBA_PARALLEL_BACKEND={b!r} is not one of {BACKENDS}")
    return b


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor | None, op: str = "op", has_kernel: bool = True) -> bool:
    """True when ``op`` should run its Triton kernel for these tensors."""
    b = requested_backend()
    if b == "naive":
        return False
    on_cuda = any(t is not None and t.is_cuda for t in tensors)
    if b == "auto":
        return has_kernel and on_cuda and triton_available()
    # forced triton
    if not has_kernel:
        raise BackendError(f"MAMBA_PARALLEL_BACKEND=triton but {op} has no Triton kernel")
    if not triton_available():
        raise BackendError(f"MAMBA_PARALLEL_BACKEND=triton but triton is not installed (needed by {op})")
    if not on_cuda and not interpret_mode():
        raise BackendError(f"MAMBA_PARALLEL_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 ({op})")
    return True
