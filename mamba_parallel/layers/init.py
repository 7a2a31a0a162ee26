"""Deterministic parameter initialisation, shared by every layer.

Each value is drawn at the parameter's FULL (global) shape from the torch RNG and then written into the
parameter, so the values never depend on the layout: a model parallelized on ``meta`` is materialised by
``distributed/materialize.py``, which runs these helpers block by block on a single-device twin and keeps each
rank's shard.
"""

from __future__ import annotations

import math

import torch

# Parameters the optimizer must not decay (marked with ``_no_weight_decay = True``, as mamba_ssm does).
NO_WEIGHT_DECAY_NAMES = ("A_log", "D", "dt_bias")


def is_meta(device) -> bool:
    """True when modules built with ``device`` (None: the current default, e.g. ``with torch.device("meta")``) hold
    no data, so initialising them is left to ``init_weights`` after ``to_empty``."""
    return torch.empty(0, device=device).is_meta


def assign_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` (param's global shape) into ``param``."""
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def _device(param: torch.Tensor) -> torch.device:
    return param.device  # a sharded parameter reports its local device


def uniform_(param: torch.Tensor, low: float, high: float) -> None:
    assign_(param, torch.empty(param.shape, device=_device(param)).uniform_(low, high))


def normal_(param: torch.Tensor, std: float) -> None:
    assign_(param, torch.empty(param.shape, device=_device(param)).normal_(0.0, std))


def constant_(param: torch.Tensor, value: float) -> None:
    assign_(param, torch.full(param.shape, float(value), device=_device(param)))


def linear_default_(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """PyTorch's default Linear / Conv init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias."""
    fan_in = math.prod(weight.shape[1:])
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    uniform_(weight, -bound, bound)
    if bias is not None:
        uniform_(bias, -bound, bound)


def linear_zero_bias_(linear: torch.nn.Linear) -> None:
    """A projection as mamba_ssm initialises it: PyTorch's default weight init, a zero bias when there is one."""
    linear_default_(linear.weight)
    if linear.bias is not None:
        constant_(linear.bias, 0.0)


def dt_bias_(param: torch.Tensor, dt_min: float, dt_max: float, dt_init_floor: float) -> None:
    """Bias whose softplus is log-uniform in [dt_min, dt_max] (floored at dt_init_floor), as in the papers.

    inverse softplus: dt + log(-expm1(-dt)).
    """
    n = param.shape[0]
    u = torch.rand(n, device=_device(param), dtype=torch.float32)
    dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_init_floor)
    assign_(param, dt + torch.log(-torch.expm1(-dt)))


def mark_no_weight_decay(module: torch.nn.Module) -> None:
    """Set ``_no_weight_decay = True`` on the module's A_log / D / dt_bias (re-done after ``to_empty``)."""
    for name, p in module.named_parameters():
        if name.rsplit(".", 1)[-1] in NO_WEIGHT_DECAY_NAMES:
            p._no_weight_decay = True
