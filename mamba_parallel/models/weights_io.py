"""Weight files of a checkpoint folder: find them, read tensors one at a time, write them atomically.

Accepted in any folder: ``model.safetensors``, ``pytorch_model.bin`` (read with ``weights_only=True``), and their
sharded forms (``*.index.json`` with a ``weight_map``); Mistral's ``consolidated.safetensors``. Shapes and dtypes
are known before any data is read, so a checkpoint is checked against the model first; ``.bin`` files are
memory-mapped, so only one tensor at a time is materialised, and ``read(..., index=)`` materialises only a box of
one (safetensors' ``get_slice``; of a ``.bin``, a view of the mapped file). Writing shards past a size, as
transformers does (``model-00001-of-00003.safetensors`` + ``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

SAFETENSORS = "model.safetensors"
TORCH_BIN = "pytorch_model.bin"
# In the order a folder's weights are looked for.
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS + ".index.json", TORCH_BIN, TORCH_BIN + ".index.json")
MISTRAL_WEIGHTS = "consolidated.safetensors"
_SHARD = re.compile(r"^(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)$")
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class WeightsFileError(ValueError):
    """A missing, unreadable or inconsistent weights file; the message names the file."""


def folder_listing(folder: Path, limit: int = 20) -> str:
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return (", ".join(names[:limit]) + more) if names else "nothing"


def find_weights(folder: Path, names: tuple[str, ...] = WEIGHT_FILES) -> Path:
    """The weights file (or shard index) of ``folder``, by the priority of ``names``."""
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise WeightsFileError(f"{folder}: no weights file; expected one of {', '.join(names)}; the folder "
                           f"holds: {folder_listing(folder)}")


def weight_files_in(folder: Path) -> list[str]:
    """Every weights file, shard index and shard in ``folder`` (what a save there must not leave ambiguous)."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name in WEIGHT_FILES or _SHARD.match(p.name))


class WeightReader:
    """Lazy access to the tensors of one weights file or shard index: ``shapes`` first, then ``read(name)``.

    ``lazy_only``: refuse a file that can only be read whole (a legacy, pre-zip torch file cannot be memory-mapped)
    rather than load all of it."""

    def __init__(self, path: Path, lazy_only: bool = False):
        self.path = path
        self.lazy_only = lazy_only
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype | None] = {}  # None: a dtype torch has no name for
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
                sl = handle.get_slice(name)
                self.shapes[name] = tuple(sl.get_shape())
                self.dtypes[name] = getattr(torch, _SAFETENSORS_DTYPES.get(sl.get_dtype(), ""), None)
                self._source[name] = handle
            return
        state = _torch_load(file, self.lazy_only)
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise WeightsFileError(f"{file}: entry {name!r} is a {type(t).__name__}, not a tensor")
            self.shapes[name] = tuple(t.shape)
            self.dtypes[name] = t.dtype
            self._source[name] = t

    def floating_dtype(self) -> torch.dtype | None:
        """The floating dtype holding most of the file's elements (None when it has no floating tensor)."""
        count: dict[torch.dtype, int] = {}
        for name, dt in self.dtypes.items():
            if dt is not None and dt.is_floating_point:
                n = 1
                for s in self.shapes[name]:
                    n *= s
                count[dt] = count.get(dt, 0) + n
        return max(count, key=count.get) if count else None

    def same_storage(self, a: str, b: str) -> bool:
        """True when two entries are one tensor in the file (torch.save keeps tied weights shared)."""
        ta, tb = self._source[a], self._source[b]
        return (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor) and ta.shape == tb.shape
                and ta.stride() == tb.stride() and ta.data_ptr() == tb.data_ptr())

    def read(self, name: str, device: torch.device, dtype: torch.dtype | None,
             index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """A fresh tensor (never backed by the file) on ``device``; floating tensors cast to ``dtype``.
        ``index``: one slice per dim; only that box is read off the file."""
        src = self._source[name]
        from_file = isinstance(src, torch.Tensor)  # memory-mapped: must be copied off the file
        if from_file:
            t = src if index is None else src[index]  # a view: pages are read by the copy below
        else:  # safetensors hands out a fresh tensor already, reading only the slice's bytes
            t = src.get_tensor(name) if index is None else src.get_slice(name)[index]
        cast = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        return t.to(device=device, dtype=cast, copy=from_file)


def _torch_load(file: Path, lazy_only: bool = False) -> dict:
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e) and "zipfile" not in str(e):
                raise
            if lazy_only:
                raise WeightsFileError(
                    f"{file}: a legacy (pre-zip) torch file, which cannot be memory-mapped and would be read whole "
                    f"into memory; re-save it (mamba-parallel convert SRC DST --format mamba_ssm) first") from None
            state = torch.load(file, map_location="cpu", weights_only=True)  # legacy (pre-zip) format
    except WeightsFileError:
        raise
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


def parse_size(size: int | str) -> int:
    """``5GB`` / ``500MB`` / ``2GiB`` / an int -> bytes (transformers' max_shard_size spelling)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B\s*", str(size).upper())
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: expected bytes or a size like '5GB' / '500MB'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_"))


def write_sharded(state: dict[str, torch.Tensor], folder: Path, safe: bool, max_shard_bytes: int,
                  on_file=None) -> list[Path]:
    """Write ``state`` as one file, or as shards of at most ``max_shard_bytes`` (a bigger tensor gets a shard of its
    own) with transformers' index; tensors sharing a storage stay in one shard. Returns the files written (the
    single file, or the index first then the shards); ``on_file()`` is called after each weights file."""
    on_file = on_file or (lambda: None)
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes, home = [0], {}
    for name, t in state.items():
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in home:  # shares storage with a tensor already placed: same shard, no extra bytes
            shards[home[key]][name] = t
            continue
        nbytes = t.numel() * t.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = t
        sizes[-1] += nbytes
        home[key] = len(shards) - 1
    if len(shards) == 1:
        file = folder / f"{stem}.{ext}"
        write_weights(shards[0], file)
        on_file()
        return [file]
    n = len(shards)
    files = [folder / f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
    for shard, file in zip(shards, files):
        write_weights(shard, file)
        on_file()
    index = {"metadata": {"total_size": sum(sizes)},
             "weight_map": {name: file.name for shard, file in zip(shards, files) for name in shard}}
    index_file = folder / f"{stem}.{ext}.index.json"
    write_text(json.dumps(index, indent=2), index_file)
    return [index_file, *files]
