"""Weight files of a checkpoint folder: find them, read tensors one at a time, write them atomically.

Accepted in any folder: ``model.safetensors``, ``pytorch_model.bin`` (read with ``weights_only=True``), and their
sharded forms (``*.index.json`` with a ``weight_map``). Shapes are known before any data is read, so a checkpoint
is checked against the model first; ``.bin`` files are memory-mapped, so only one tensor at a time is materialised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

SAFETENSORS = "model.safetensors"
TORCH_BIN = "pytorch_model.bin"
# In the order a folder's weights are looked for.
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS + ".index.json", TORCH_BIN, TORCH_BIN + ".index.json")


class WeightsFileError(ValueError):
    """A missing, unreadable or inconsistent weights file; the message names the file."""


def folder_listing(folder: Path, limit: int = 20) -> str:
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return (", ".join(names[:limit]) + more) if names else "nothing"


def find_weights(folder: Path) -> Path:
    """The weights file (or shard index) of ``folder``, by the priority of WEIGHT_FILES."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise WeightsFileError(f"{folder}: no weights file; expected one of {', '.join(WEIGHT_FILES)}; the folder "
                           f"holds: {folder_listing(folder)}")


class WeightReader:
    """Lazy access to the tensors of one weights file or shard index: ``shapes`` first, then ``read(name)``."""

    def __init__(self, path: Path):
        self.path = path
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._source: dict[str, object] = {}  # name -> safe_open handle or (mmapped) tensor
        if path.name.endswith(".index.json"):
            try:
                weight_map = json.loads(path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsFileError(f"{path}: not a shard index with a 'weight_map' ({e})") from e
            for shard in sorted(set(weight_map.values())):
                if not (path.parent / shard).is_file():
                    raise WeightsFileError(f"{path}: lists shard {shard!r}, which is missing from {path.parent}")
                self._open(path.parent / shard)
        else:
            self._open(path)

    def _open(self, file: Path) -> None:
        if file.name.endswith(".safetensors"):
            from safetensors import safe_open

            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise WeightsFileError(f"{file}: not a readable safetensors file ({e})") from e
            for name in handle.keys():
                self.shapes[name] = tuple(handle.get_slice(name).get_shape())
                self._source[name] = handle
            return
        state = _torch_load(file)
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise WeightsFileError(f"{file}: entry {name!r} is a {type(t).__name__}, not a tensor")
            self.shapes[name] = tuple(t.shape)
            self._source[name] = t

    def same_storage(self, a: str, b: str) -> bool:
        """True when two entries are one tensor in the file (torch.save keeps tied weights shared)."""
        ta, tb = self._source[a], self._source[b]
        return (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor) and ta.shape == tb.shape
                and ta.stride() == tb.stride() and ta.data_ptr() == tb.data_ptr())

    def read(self, name: str, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        """A fresh tensor (never backed by the file) on ``device``; floating tensors cast to ``dtype``."""
        src = self._source[name]
        from_file = isinstance(src, torch.Tensor)  # memory-mapped: must be copied off the file
        t = src if from_file else src.get_tensor(name)  # safetensors hands out a fresh tensor already
        cast = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        return t.to(device=device, dtype=cast, copy=from_file)


def _torch_load(file: Path) -> dict:
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e) and "zipfile" not in str(e):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)  # legacy (pre-zip) format
    except Exception as e:
        raise WeightsFileError(f"{file}: cannot be read as a weights-only torch checkpoint ({e})") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise WeightsFileError(f"{file}: holds a {type(state).__name__}, not a state dict")
    return state


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write a state dict as safetensors or torch's zip format, by the file name; replaces the file atomically."""
    if path.name.endswith(".safetensors"):
        from safetensors.torch import save_file

        _atomic(path, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    else:
        _atomic(path, lambda p: torch.save(state, p))


def write_text(text: str, path: Path) -> None:
    _atomic(path, lambda p: p.write_text(text + ("" if text.endswith("\n") else "\n")))
