"""Training checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, resumable at any world size.

Layout: ``<out>/checkpoints/step-N/`` is a DCP folder holding
  - ``model.*`` and ``optim.*``: through ``mamba_parallel.distributed.state_dict`` (layout-independent keys and
    global shapes, so a save at one world size loads at another);
  - ``train.json``: step, global samples consumed (the data position), the scheduler state, the model config;
  - ``train.rng``: every rank's RNG states (torch, cuda, numpy, python), gathered on save; on load rank r takes
    entry ``r mod saved_world_size``;
  - ``mamba-parallel-manifest.json`` (mamba_parallel/manifest.py): every file's size and SHA-256, written last.
A save is written to ``step-N.tmp/``; the ranks hash its files (each a share of the pieces), rank 0 writes the
manifest and renames the folder to ``step-N/``, so a folder named ``step-N`` is always complete. ``--resume``
verifies the newest checkpoint against its manifest and falls back to the newest one that verifies, renaming each
one it skips to ``step-N.corrupt`` (kept for inspection, never deleted). The model config recorded in train.json
must equal the run's, and the model's keys and shapes must equal the checkpoint's (both: an error naming what
differs, before anything is loaded).
"""

from __future__ import annotations

import hashlib
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

from mamba_parallel import manifest as mf
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
WRITER = "train checkpoint"


class CheckpointIntegrityError(ConfigError):
    """No checkpoint of a run verifies against its manifest; the message lists each one and why."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _same_on_all(obj):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _hash_workers() -> int:
    """Hashing threads per rank: the node's cores shared by its ranks."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


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


def step_folders(out: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step-N`` folder (complete or not), oldest first."""
    root = checkpoints_dir(out)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root) for m in [_STEP_DIR.match(n)] if m]
    return sorted(f for f in found if os.path.isdir(f[1]))


# ---- integrity ---------------------------------------------------------------------------------------------------
def _write_manifest(folder: str) -> None:
    """Every rank hashes its share of the folder's pieces; rank 0 writes the manifest (collective)."""
    sizes = _same_on_all(mf.file_sizes(folder, mf.list_files(folder)) if _rank() == 0 else None)
    pieces = {}
    for part in _all_gather(mf.hash_pieces(folder, sizes, workers=_hash_workers(), part=(_rank(), _world()),
                                                    fsync=True)):
        pieces.update(part)
    if _rank() == 0:
        mf.write_manifest_records(folder, mf.file_records(sizes, pieces), WRITER)


def read_train_json(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "train.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def checkpoint_problem(path: str, hashes: bool = True) -> str | None:
    """Why the checkpoint folder ``path`` cannot be trusted, or None when it verifies (collective: the ranks share
    the hashing and agree on the answer). A checkpoint of an older version (no manifest) passes when DCP's
    ``.metadata`` is there: its integrity cannot be checked."""
    problem = None
    try:
        manifest = mf.read_manifest(path)
    except mf.ManifestError as e:
        manifest, problem = None, str(e)
    if manifest is None and problem is None:
        train = read_train_json(path)
        if train is None:
            problem = f"{path}: incomplete (no {mf.MANIFEST}, no readable train.json)"
        elif "manifest" in train:
            problem = f"{os.path.join(path, mf.MANIFEST)}: missing (this checkpoint was written with one)"
        elif not os.path.isfile(os.path.join(path, ".metadata")):
            problem = f"{path}: incomplete (no DCP .metadata)"
    if manifest is not None:
        problems = mf.check_sizes(path, manifest)
        if not problems and hashes:
            problems = mf.check_hashes(path, manifest, _hash_workers(), part=(_rank(), _world()))
        problem = "; ".join(problems) or None
    everyone = _all_gather(problem)  # every rank hashed its share: the answer is the union
    found = [p for p in everyone if p]
    return "; ".join(dict.fromkeys(found)) if found else None


def _set_aside(path: str) -> str:
    """Rename a checkpoint that failed verification to ``step-N.corrupt`` (rank 0; never deleted)."""
    target, i = path + ".corrupt", 1
    while os.path.exists(target):
        i += 1
        target = f"{path}.corrupt-{i}"
    if _rank() == 0:
        os.replace(path, target)
    _barrier()
    return target


def choose_checkpoint(out: str, log=print) -> tuple[int, str] | None:
    """The newest checkpoint of ``out`` that verifies (collective). Each one skipped is said, with why, and set
    aside; None when there is none at all; CheckpointIntegrityError when there are some and none verifies."""
    skipped = []
    for step, path in reversed(step_folders(out)):
        problem = checkpoint_problem(path)
        if problem is None:
            if not mf.has_manifest(path):
                log(f"--resume: {path} has no {mf.MANIFEST} (written by an older version): its integrity is not "
                    f"checked")
            return step, path
        aside = _set_aside(path)
        skipped.append(f"step-{step}: {problem}")
        log(f"--resume: skipped {path}: {problem} (moved to {os.path.basename(aside)})")
    if skipped:
        raise CheckpointIntegrityError(f"--resume: no checkpoint in {checkpoints_dir(out)!r} verifies ("
                                       f"{'; '.join(skipped)}); the skipped ones were renamed *.corrupt")
    return None


# ---- the same model ----------------------------------------------------------------------------------------------
def config_record(config) -> dict:
    """The model config as train.json records it (JSON-safe, as ``MambaConfig.to_json`` writes it)."""
    return json.loads(config.to_json())


def tokenizer_record(tokenizer) -> dict:
    """What identifies a tokenizer: "byte", or the SHA-256 of its tokenizer.json (its path may move)."""
    if tokenizer.spec == "byte":
        return {"kind": "byte"}
    with open(tokenizer.spec, "rb") as fh:
        return {"kind": "tokenizer.json", "sha256": hashlib.sha256(fh.read()).hexdigest(),
                "vocab_size": tokenizer.vocab_size}


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            name = f"{prefix}{k}"
            if k not in a:
                out.append(f"{name}: not set in the checkpoint, {b[k]!r} now")
            elif k not in b:
                out.append(f"{name}: {a[k]!r} in the checkpoint, not set now")
            else:
                out += _diff(a[k], b[k], name + ".")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} in the checkpoint, {b!r} now"]


def check_same_model(path: str, config, tokenizer=None) -> None:
    """ConfigError naming every model field that differs between the checkpoint ``path`` and ``config``, or the
    tokenizer when it is another one (its ids would mean other text)."""
    train = read_train_json(path) or {}
    saved = train.get("model_config")
    if saved is not None:  # an older checkpoint: the key / shape check of load_checkpoint still applies
        diff = _diff(saved, config_record(config))
        if diff:
            raise ConfigError(f"--resume: {path} holds a different model ({'; '.join(diff)}); resume with the run's "
                              f"own model settings (its config.toml), or start a new run in another --out")
    if tokenizer is not None and train.get("tokenizer") not in (None, tokenizer_record(tokenizer)):
        raise ConfigError(f"--resume: {path} was trained with another tokenizer ({train['tokenizer']}; now "
                          f"{tokenizer_record(tokenizer)}); resume with the run's own --tokenizer / --data")


def _names(keys: list[str], limit: int = 8) -> str:
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_keys(path: str, model_sd: dict, whole: bool = True) -> None:
    """Strict: the checkpoint's model tensors must be exactly the model's (names and global shapes). ``whole``
    False (a pipeline stage holds some of the layers): only the stage's tensors must be there, at their shapes."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: m for k, m in meta.items() if k.startswith("model.")}
    missing = sorted(set(model_sd) - set(saved))
    unexpected = sorted(set(saved) - set(model_sd)) if whole else []
    shapes = sorted(f"{k} {tuple(saved[k].size)} in the checkpoint, {tuple(model_sd[k].shape)} now"
                    for k in set(saved) & set(model_sd)
                    if hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(model_sd[k].shape))
    parts = ([f"missing from the checkpoint: {_names(missing)}"] if missing else []) + \
        ([f"unexpected in the checkpoint: {_names(unexpected)}"] if unexpected else []) + \
        ([f"shape mismatch: {_names(shapes, 4)}"] if shapes else [])
    if parts:
        raise ConfigError(f"--resume: {path} does not hold this model's tensors ({'; '.join(parts)})")


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
def save_checkpoint(out: str, step: int, model, optimizer, scheduler, consumed: int, keep: int,
                    model_config=None, tokenizer=None) -> str:
    """Write ``<out>/checkpoints/step-<step>`` (collective: every rank calls it); prune to the newest ``keep``.

    ``model_config`` (a MambaConfig) and ``tokenizer`` are recorded in train.json, so a resume can refuse a
    different model or tokenizer."""
    root = checkpoints_dir(out)
    final = os.path.join(root, f"step-{step}")
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    train = {"step": step, "consumed": consumed, "scheduler": scheduler.state_dict(), "world_size": _world(),
             "manifest": mf.MANIFEST}
    if model_config is not None:
        train["model_config"] = config_record(model_config)
    if tokenizer is not None:
        train["tokenizer"] = tokenizer_record(tokenizer)
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
    _barrier()
    _write_manifest(tmp)  # last: a folder with a manifest is complete
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        mf.fsync_dir(root)
        for _, old in complete_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Load a checkpoint into the (already parallelized) model, optimizer and scheduler; restore this rank's RNG.

    Returns the train state: ``{"step", "consumed", "world_size"}``. Strict: missing, unexpected or mis-shaped
    model tensors are a ConfigError naming them (DCP alone would skip tensors the model does not ask for).
    """
    model_sd, optim_sd, load_optim = _state_fns(model)
    model_state = model_sd(model)
    check_keys(path, model_state, whole=not isinstance(model, pipeline.PipelineModel))
    state = {
        "model": model_state,
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
