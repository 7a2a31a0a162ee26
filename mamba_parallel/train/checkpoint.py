"""Training checkpoints with torch.distributed.checkpoint (DCP): atomic, prunable, resumable at any world size.

Layout: ``<out>/checkpoints/step-N/`` is a DCP folder holding
  - ``model.*`` and ``optim.*``: through ``mamba_parallel.distributed.state_dict`` (layout-independent keys and
    global shapes, so a save at one world size loads at another);
  - ``train.json``: step, global samples consumed (the data position), the scheduler state;
  - ``train.rng``: every rank's RNG states (torch, cuda, numpy, python), gathered on save; on load rank r takes
    entry ``r mod saved_world_size``.
A save is written to ``step-N.tmp/`` and renamed to ``step-N/`` by rank 0 after every rank finished (a barrier),
so a folder named ``step-N`` is always complete; resume also requires DCP's ``.metadata`` file, written last.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mamba_parallel.config import ConfigError
from mamba_parallel.distributed import pipeline
from mamba_parallel.distributed.state_dict import (
    load_model_state_dict,
    load_optim_state_dict,
    model_state_dict,
    optim_state_dict,
)


def _state_fns(model):
    """(model state, optimizer state, optimizer load) for ``model``: pipeline stages keep single-device names."""
    if isinstance(model, pipeline.PipelineModel):
        return pipeline.stage_model_state_dict, pipeline.stage_optim_state_dict, pipeline.load_stage_optim_state_dict
    return model_state_dict, optim_state_dict, load_optim_state_dict

_STEP_DIR = re.compile(r"^step-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoints_dir(out: str) -> str:
    return os.path.join(out, "checkpoints")


def complete_checkpoints(out: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``<out>/checkpoints``, oldest first."""
    root = checkpoints_dir(out)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, ".metadata")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(out: str) -> tuple[int, str] | None:
    found = complete_checkpoints(out)
    return found[-1] if found else None


# ---- RNG ---------------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_rng() -> bytes:
    mine = rng_state()
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    buf = io.BytesIO()
    torch.save(everyone, buf)
    return buf.getvalue()


# ---- save / load -------------------------------------------------------------------------------------------------
def save_checkpoint(out: str, step: int, model, optimizer, scheduler, consumed: int, keep: int) -> str:
    """Write ``<out>/checkpoints/step-<step>`` (collective: every rank calls it); prune to the newest ``keep``."""
    root = checkpoints_dir(out)
    final = os.path.join(root, f"step-{step}")
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    train = {"step": step, "consumed": consumed, "scheduler": scheduler.state_dict(),
             "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    model_sd, optim_sd, _ = _state_fns(model)
    state = {
        "model": model_sd(model),
        "optim": optim_sd(model, optimizer),
        "train": {"json": json.dumps(train), "rng": _gather_rng()},
    }
    with warnings.catch_warnings():  # one process without a process group is a supported case, not a problem
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=tmp)
    _barrier()
    if _rank() == 0:
        with open(os.path.join(tmp, "train.json"), "w") as fh:  # a readable copy of the train state
            json.dump(train, fh, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in complete_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Load a checkpoint into the (already parallelized) model, optimizer and scheduler; restore this rank's RNG.

    Returns the train state: ``{"step", "consumed", "world_size"}``.
    """
    model_sd, optim_sd, load_optim = _state_fns(model)
    state = {
        "model": model_sd(model),
        "optim": optim_sd(model, optimizer),
        "train": {"json": "", "rng": b""},
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=path)
        except (Exception, CheckpointException) as e:  # noqa: B014 (CheckpointException is a BaseException)
            raise ConfigError(f"--resume: {path} does not fit this model / layout: {_first_cause(e)}") from None
    load_model_state_dict(model, state["model"])
    load_optim(model, optimizer, state["optim"])
    train = json.loads(state["train"]["json"])
    scheduler.load_state_dict(train.pop("scheduler"))
    rngs = torch.load(io.BytesIO(state["train"]["rng"]), weights_only=False)
    set_rng_state(rngs[_rank() % len(rngs)])
    return train


def _first_cause(e: BaseException) -> str:
    """The telling line of a DCP load failure (its message may hold every rank's traceback)."""
    text = str(e)
    m = re.search(r"(Size mismatch[^\n]*|Missing key[^\n]*|Unexpected key[^\n]*)", text)
    line = m.group(1) if m else (text.strip().splitlines() or [type(e).__name__])[-1]
    return line[:400]


def remove_stale_tmp(out: str) -> None:
    """Delete ``step-N.tmp`` folders left by an interrupted save (rank 0 only)."""
    root = checkpoints_dir(out)
    if _rank() != 0 or not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
