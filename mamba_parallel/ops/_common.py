"""What every op's public function shares: finding its Triton kernel module and checking argument shapes."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F

_KERNELS: dict[str, ModuleType | None] = {}


def kernel_module(package: str) -> ModuleType | None:
    """``<package>.triton_impl`` imported once, or None when the op has no such file.

    A missing file or a missing Triton install means "no kernel"; an ImportError raised inside an existing
    triton_impl (Triton installed) propagates.
    """
    name = package + ".triton_impl"
    if name not in _KERNELS:
        from mamba_parallel.ops.backend import triton_available

        # Triton is optional (the `gpu` extra): without it every op runs its reference.
        exists = triton_available() and importlib.util.find_spec(name) is not None
        _KERNELS[name] = importlib.import_module(name) if exists else None
    return _KERNELS[name]


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32 for half / bf16 / fp32 inputs, fp64 when any input is fp64 (so gradcheck runs in float64)."""
    dt = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _fmt(dims) -> str:
    names = ", ".join(str(n) for n, _ in dims)
    vals = ", ".join(str(v) for _, v in dims)
    return f"({names}) = ({vals})"


def check_shape(op: str, name: str, t: torch.Tensor | None, *dims: tuple[str, int]) -> None:
    """Raise ValueError unless ``t`` (when given) has exactly the shape ``dims`` (pairs of symbol, size)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(v for _, v in dims):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {_fmt(dims)}")


def check_ndim(op: str, name: str, t: torch.Tensor, ndims: tuple[int, ...], layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ndims:
        raise ValueError(f"{op}: {name} must be {layout}, got shape {tuple(t.shape)}")


_INT32_SPAN = 2 ** 31


def check_int32_span(op: str, per_row: bool = False, **tensors: torch.Tensor | None) -> None:
    """Raise ValueError when a tensor's farthest element lies 2^31 or more elements from its start (``per_row``:
    from the start of its batch row, for kernels that offset the batch in int64): the Triton kernels index
    positions x strides in int32, which would silently wrap."""
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        dims = list(zip(t.shape, t.stride()))[1 if per_row else 0:]
        span = sum((s - 1) * abs(st) for s, st in dims)
        if span >= _INT32_SPAN:
            raise ValueError(f"{op}: {name} of shape {tuple(t.shape)} (strides {tuple(t.stride())}) spans {span} "
                             f"elements, over the Triton kernels' int32 indexing limit of 2^31; use a smaller "
                             f"batch or a shorter sequence per rank (context parallelism, --cp, splits it)")


def check_int(op: str, name: str, t: torch.Tensor | None) -> None:
    if t is not None and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{op}: {name} must be an integer tensor, got {t.dtype}")


def check_divides(op: str, name: str, g: int, what: str, d: int) -> None:
    if g <= 0 or d % g != 0:
        raise ValueError(f"{op}: {name} = {g} must divide {what} = {d}")


def check_cu_seqlens(op: str, cu_seqlens: torch.Tensor | None, batch: int) -> int | None:
    """Number of packed sequences, after checking cu_seqlens is a 1-D integer tensor and the batch is 1."""
    if cu_seqlens is None:
        return None
    check_int(op, "cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must be 1-D (nseq + 1,) with nseq >= 1, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"{op}: cu_seqlens needs packed inputs with batch size 1, got batch {batch}")
    return cu_seqlens.numel() - 1


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, dt_limit=(0.0, float("inf")),
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dt (..., c), dt_bias (c,) -> clamp(softplus(dt + dt_bias), *dt_limit) in ``dtype``; no clamp for (0, inf)."""
    out = dt.to(dtype)
    if dt_bias is not None:
        out = out + dt_bias.to(dtype)
    if softplus:
        out = torch.nn.functional.softplus(out)
    lo, hi = dt_limit
    if (lo, hi) != (0.0, float("inf")):
        out = out.clamp(min=lo, max=hi)
    return out


def linear_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, weight) computes in: autocast's for x's device type when autocast is on there, else
    the promotion of both dtypes (where F.linear would need them equal)."""
    dev = x.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, weight.dtype)


def linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """F.linear(x, weight, bias) with all three cast to ``dtype`` (e.g. ``linear_dtype``: what nn.Linear computes)."""
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def fp32_math(fn):
    """Run a reference op with autocast off, so its fp32 math stays fp32 inside a caller's autocast region."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
