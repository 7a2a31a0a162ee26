"""Layout-independent state dicts for DCP checkpoints: the same keys and global shapes at every parallel layout.

The trainer saves and loads only through these four functions, so a checkpoint written at one (dp, tp, cp)
layout loads at another. For data parallelism alone, torch's own ``get_*_state_dict`` already gives that (FSDP2
parameters are DTensors whose global shape is the unsharded one, DDP's are plain tensors).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state_dict(model: torch.nn.Module) -> dict:
    """The model's state for DCP (sharded tensors stay sharded; keys are the single-device model's)."""
    return get_model_state_dict(model, options=_OPTS)


def load_model_state_dict(model: torch.nn.Module, state: dict) -> None:
    set_model_state_dict(model, state, options=_OPTS)


def optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state for DCP, keyed by parameter names (flattened: ``state.<fqn>.exp_avg`` ...)."""
    return get_optimizer_state_dict(model, optimizer, options=_OPTS)


def load_optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=_OPTS)
