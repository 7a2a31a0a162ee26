"""Output folders that cannot take what we write: not writable, or full. One clear error with the path and the
bytes needed, before the work starts when the size is known, and when a write fails anyway."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

from mamba_parallel.config import ConfigError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)


class OutputError(ConfigError):
    """An output folder that is not writable or has no room; the message names the path and the bytes."""


def human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} bytes" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n}"


def free_bytes(path: str) -> int:
    """Free space of the filesystem holding ``path`` (or its nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def check_space(path: str, needed: int, what: str) -> None:
    """OutputError when the filesystem of ``path`` has fewer than ``needed`` bytes free."""
    free = free_bytes(path)
    if free < needed:
        raise OutputError(f"no space left on the device of {path}: about {human(needed)} needed for {what}, "
                          f"{human(free)} free")


def explain(e: BaseException, path: str, what: str, needed: int | None = None) -> OutputError | None:
    """The clear error for an OSError (possibly wrapped, as DCP wraps each rank's) of writing to ``path``."""
    seen, todo = set(), [e]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _FULL:
            return _full(path, what, needed)
        if isinstance(err, OSError) and err.errno in _DENIED:
            return OutputError(f"{path}: not writable ({err.strerror}: {err.filename or path}); {what} needs a "
                               f"folder this process may write to")
        todo += [err.__cause__, err.__context__]
        for failure in (getattr(err, "failures", None) or {}).values():  # DCP's CheckpointException
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return _full(path, what, needed) if "No space left on device" in str(e) else None


def _full(path: str, what: str, needed: int | None) -> OutputError:
    need = f"about {human(needed)} needed in all for {what}" if needed else f"{what} needs more room"
    return OutputError(f"no space left on the device of {path} ({human(free_bytes(path))} free): {need}")


@contextlib.contextmanager
def output_errors(path: str, what: str, needed: int | None = None):
    """Turn a failed write under ``path`` (full, not writable) into one OutputError naming it."""
    try:
        yield
    except BaseException as e:  # DCP raises CheckpointException (a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit, OutputError)):
            raise
        clear = explain(e, path, what, needed)
        if clear is None:
            raise
        raise clear from None
