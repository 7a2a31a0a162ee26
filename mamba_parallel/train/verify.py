"""`mamba-parallel verify PATH`: check a folder we wrote against its manifest, on demand.

PATH may be a model folder (``save_pretrained``, ``<out>/final``), a token folder (``prepare-data``), one DCP
checkpoint (``<out>/checkpoints/step-N``), or a whole run folder (``--out``: every checkpoint, ``final/`` and
``data/`` in it). One line per folder: ``ok`` with its size and the time the check took, or ``FAILED`` naming the
file at fault; exit 1 when anything failed or could not be checked.
"""

from __future__ import annotations

import os
import time

from mamba_parallel import manifest as mf
from mamba_parallel.config import ConfigError
from mamba_parallel.train.checkpoint import step_folders


def _parts(path: str) -> list[str]:
    """The folders to check for PATH: a folder whose manifest lists files is itself; a run folder (its manifest
    owns sub-folders, or an older one without manifest) is its checkpoints, final/ and data/."""
    try:
        manifest = mf.read_manifest(path)
    except mf.ManifestError:
        return [path]  # reported as corrupt
    if manifest is not None and manifest["files"]:
        return [path]
    parts = [p for _, p in step_folders(path)]
    parts += [os.path.join(path, d) for d in ("final", "data") if os.path.isdir(os.path.join(path, d))]
    return parts or [path]


def verify_one(folder: str, workers: int | None = None) -> tuple[bool, str]:
    """(ok, one line) for one folder."""
    t0 = time.perf_counter()
    try:
        manifest = mf.verify_folder(folder, workers=workers)
    except mf.ManifestError as e:
        return False, f"FAILED {folder}: {e}"
    dt = time.perf_counter() - t0
    n = mf.manifest_bytes(manifest)
    rate = f", {n / dt / 1e9:.2f} GB/s" if dt > 0 and n > 1e8 else ""
    return True, (f"ok     {folder}: {len(manifest['files'])} files, {n / 1e9:.3f} GB verified in {dt:.2f} s{rate} "
                  f"({manifest.get('writer', '?')}, {manifest.get('created', '?')})")


def verify_path(path: str, out=print, workers: int | None = None) -> int:
    """Verify PATH (see the module docstring); print one line per folder; return the exit code (0 / 1)."""
    if not os.path.isdir(path):
        raise ConfigError(f"verify: {path!r} is not a folder")
    parts = _parts(path)
    failed = 0
    for folder in parts:
        ok, line = verify_one(folder, workers)
        failed += not ok
        out(line)
    return 1 if failed else 0
