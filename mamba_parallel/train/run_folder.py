"""The output folder of a run: one run at a time, and only our own files touched.

- **Lock.** ``train.lock`` (JSON: pid, host, process start time, command) is created exclusively when a run starts
  and removed when it ends. A second run on the same folder is refused naming the holder. A lock whose process is
  gone (same host, the pid dead or reused by another process) is stale: it is taken over, with a note. A lock of
  another host cannot be checked from here: refused, saying how to remove it if that run is gone.
- **Ownership.** The run folder's manifest (mamba_parallel/manifest.py) records the names the run owns
  (config.toml, metrics.jsonl, checkpoints/, final/, ...). A name the run would write that exists but is not
  recorded belongs to someone else: the run is refused naming it, and nothing is changed. Everything else in the
  folder is never touched. A folder written by an older version (config.toml + checkpoints, no manifest) is
  adopted on ``--resume``.

Under torchrun rank 0 does the folder work; the others learn the outcome (``agree``) so every rank fails alike.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch.distributed as dist

from mamba_parallel import manifest as mf
from mamba_parallel.config import ConfigError

LOCK = "train.lock"
WRITER = "train"


class FolderError(ConfigError):
    """An output folder that is in use, or that holds files which are not ours to replace."""


def agree(fn, *args):
    """Run ``fn(*args)`` on rank 0; every rank returns its result or raises its FolderError / ConfigError."""
    result, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn(*args)
        except ConfigError as e:
            error = (type(e), str(e))
    if dist.is_initialized():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error:
        raise error[0](error[1])
    return result


# ---- the lock ----------------------------------------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot be checked from here
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = holder.get("start_time")
    return started is None or _start_time(pid) in (None, started)


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}"
            f" ({holder.get('command', '?')})")


def _read_lock(path: str) -> dict | None:
    try:
        with open(path) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def acquire_lock(folder: str, log=print) -> str:
    """Create ``folder/train.lock`` for this process; FolderError when another live run holds it."""
    path = os.path.join(folder, LOCK)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": _start_time(os.getpid()),
          "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:300]}
    for _ in range(20):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:  # being written this instant, or not ours: look again shortly
                time.sleep(0.05)
                continue
            if _alive(holder):
                other_host = holder.get("host") != socket.gethostname()
                raise FolderError(f"--out {folder!r} is in use by another run: {_describe(holder)}; wait for it to "
                                  f"end or choose another --out" + (f" (if that run is gone, delete {path})"
                                                                    if other_host else ""))
            stale = f"{path}.stale-{holder.get('pid')}"
            try:
                os.replace(path, stale)  # of two takers, one renames; the other finds no file and retries
            except FileNotFoundError:
                continue
            os.unlink(stale)
            log(f"--out {folder!r}: took over the stale lock of a run that is gone ({_describe(holder)})")
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(me, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return path
    raise FolderError(f"{path}: cannot be read as a lock of mamba-parallel; if no run uses {folder!r}, delete it")


def release_lock(folder: str) -> None:
    """Remove the lock if this process holds it."""
    path = os.path.join(folder, LOCK)
    holder = _read_lock(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        os.unlink(path)


def write_text(path: str, text: str) -> None:
    """Replace a file of ours atomically (a crash leaves the old or the new content, never half)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ---- ownership ---------------------------------------------------------------------------------------------------
def _legacy_run(folder: str) -> bool:
    """A run folder of an older version: config.toml and checkpoints/, no manifest."""
    return (not mf.has_manifest(folder) and os.path.isfile(os.path.join(folder, "config.toml"))
            and os.path.isdir(os.path.join(folder, "checkpoints")))


def claim(folder: str, names, resume: bool, log=print) -> None:
    """Record ``names`` (top-level names the run will write) as the run's in ``folder``'s manifest.

    FolderError naming those that exist without being recorded as ours (the folder is left as it was)."""
    names = sorted(set(names))
    if _legacy_run(folder) and resume:
        log(f"--out {folder!r}: a run folder of an older version (no {mf.MANIFEST}): adopted")
        foreign = []
    else:
        try:
            manifest = mf.read_manifest(folder)
        except mf.ManifestError as e:
            raise FolderError(f"--out {folder!r}: {e}; move it away if the folder is a run of ours") from None
        if manifest is not None and manifest.get("writer") != WRITER:
            raise FolderError(f"--out {folder!r} is a folder written by {manifest.get('writer')!r}, not a run "
                              f"folder; choose another --out")
        foreign = mf.foreign_names(folder, names)
    if foreign:
        raise FolderError(f"--out {folder!r} holds {', '.join(foreign)}, which this run would write but did not "
                          f"write (not in its {mf.MANIFEST}); move them away or choose another --out (nothing was "
                          f"changed)")
    owned = sorted(set(names) | (mf.owned_names(folder) - {mf.MANIFEST}))
    mf.write_manifest_records(folder, {}, WRITER, owned=owned)


def check_fresh_start(folder: str) -> None:
    """A run that starts from step 0 in a folder of ours: a final model of an earlier run there is not replaced."""
    if os.path.isdir(os.path.join(folder, "final")):
        raise FolderError(f"--out {folder!r} holds final/, the model of an earlier run; resume that run (--resume), "
                          f"or choose another --out")
