"""Which implementation an op runs: ``auto``, ``naive`` or ``triton``.

auto   -> the Triton kernel for CUDA tensors when the op has one and Triton imports, else the naive reference.
naive  -> always the pure-PyTorch reference (the specification).
triton -> always the kernel; on CPU tensors this needs ``TRITON_INTERPRET=1`` (tests use it).

``use_backend(name)`` chooses for a block of code (``with ops.use_backend("naive"): ...``); outside any such block
the process default applies: ``MAMBA_PARALLEL_BACKEND`` (auto when unset; docs/kernels/README.md). The choice is
made when an op's forward runs; its backward is the one that forward recorded.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch

BACKENDS = ("auto", "naive", "triton")
ENV = "MAMBA_PARALLEL_BACKEND"

_chosen: list[str] = []  # the use_backend() blocks entered, innermost last
_autotune = [True]  # the use_autotune() blocks entered, innermost last


class BackendError(RuntimeError):
    pass


def _checked(name: str, source: str) -> str:
    b = name.strip().lower() if isinstance(name, str) else name
    if b not in BACKENDS:
        raise BackendError(f"{source}={name!r} is not one of {BACKENDS}")
    return b


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the ops inside the block on ``name`` ("auto" | "naive" | "triton"); blocks nest (the innermost wins)."""
    _chosen.append(_checked(name, "use_backend"))
    try:
        yield
    finally:
        _chosen.pop()


def requested_backend() -> str:
    """The innermost ``use_backend`` block's choice, else ``MAMBA_PARALLEL_BACKEND`` (default auto)."""
    if _chosen:
        return _chosen[-1]
    return _checked(os.environ.get(ENV, "auto") or "auto", ENV)


@contextlib.contextmanager
def use_autotune(on: bool) -> Iterator[None]:
    """Inside the block kernels with autotuned launch candidates (the SSD's) tune them on first use (True, the
    default) or take their first candidate (False: fast compiles, e.g. GPU test runs); blocks nest."""
    _autotune.append(bool(on))
    try:
        yield
    finally:
        _autotune.pop()


def autotune_enabled() -> bool:
    return _autotune[-1]


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpret_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (Triton's own ``TRITON_INTERPRET=1``)."""
    if not triton_available():
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def gpu_compiled(t: torch.Tensor) -> bool:
    """Whether kernels on ``t`` are compiled for its GPU (not run by Triton's CPU interpreter): where they may use
    inline PTX (fast exp / cos / sin) and the GPU's tiles."""
    return t.is_cuda and not interpret_mode()


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
        raise BackendError(f"backend 'triton' was requested but {op} has no Triton kernel")
    if not triton_available():
        raise BackendError(f"backend 'triton' was requested but triton is not installed (needed by {op})")
    if not on_cuda and not interpret_mode():
        raise BackendError(f"backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 ({op})")
    return True
