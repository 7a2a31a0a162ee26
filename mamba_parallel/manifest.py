"""Manifests: what a folder written by mamba-parallel holds, so nothing loads silently wrong.

``mamba-parallel-manifest.json`` lists the files its writer put in the folder, each with its size and the SHA-256
of every ``chunk_bytes`` piece (chunked so that one large file is hashed on every core at once; the pieces of all
files are verified by a thread pool). It is written LAST, atomically (``.tmp`` + rename, the files and the folder
fsynced first), so a folder whose manifest verifies is complete and unchanged since it was written. The manifest
checks itself too (``self_sha256``: the digest of its own content), so a flipped byte in it is caught as well.

    {"format": "mamba-parallel-manifest/1", "writer": "save_pretrained", "chunk_bytes": 67108864,
     "files": {"model.safetensors": {"size": 14000000000, "sha256": ["<hex of piece 0>", ...]}, ...},
     "owned": ["metrics.jsonl", "checkpoints"],          # optional: names the writer owns but does not hash
     "self_sha256": "<hex>"}

``files`` are verified; ``owned`` names things the writer also owns but that change (a run folder's
metrics.jsonl, its sub-folders, which carry their own manifests). A writer replaces or deletes only names listed
in its folder's manifest (``foreign_names``): everything else in a folder belongs to the user.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

MANIFEST = "mamba-parallel-manifest.json"
FORMAT = "mamba-parallel-manifest/1"
CHUNK_BYTES = 64 << 20
_READ_BYTES = 8 << 20


class ManifestError(ValueError):
    """A folder does not match its manifest (or the manifest is unreadable); the message names the file."""


# ---- hashing -----------------------------------------------------------------------------------------------------
def _workers(workers: int | None) -> int:
    return max(1, workers or min(32, os.cpu_count() or 1))


def _chunk_digest(path: str, start: int, length: int) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            piece = os.pread(fd, min(_READ_BYTES, length - done), start + done)
            if not piece:  # the file shrank while being read
                h.update(b"\0truncated")
                break
            h.update(piece)  # hashlib releases the GIL on large buffers: threads hash in parallel
            done += len(piece)
    finally:
        os.close(fd)
    return h.hexdigest()


def _tasks(sizes: dict[str, int], chunk_bytes: int) -> list[tuple[str, int, int, int]]:
    """(name, chunk index, start, length) of every piece, in a fixed order (every rank computes the same list)."""
    out = []
    for name in sorted(sizes):
        n = max(1, -(-sizes[name] // chunk_bytes))
        out += [(name, i, i * chunk_bytes, min(chunk_bytes, sizes[name] - i * chunk_bytes)) for i in range(n)]
    return out


def hash_pieces(folder: str, sizes: dict[str, int], chunk_bytes: int = CHUNK_BYTES, workers: int | None = None,
                part: tuple[int, int] = (0, 1), fsync: bool = False) -> dict[tuple[str, int], str]:
    """{(name, chunk index): hex SHA-256} of the pieces of the files ``sizes`` (name -> bytes) in ``folder``.

    ``part = (r, n)``: only every n-th piece starting at r (ranks share the work; merge their dicts).
    ``fsync``: flush each file to disk first (before a manifest promises it is there)."""
    rank, n = part
    mine = _tasks(sizes, chunk_bytes)[rank::n]
    if fsync:
        for name in sorted({t[0] for t in mine}):
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    with ThreadPoolExecutor(_workers(workers)) as pool:
        digests = pool.map(lambda t: _chunk_digest(os.path.join(folder, t[0]), t[2], t[3]), mine)
        return {(t[0], t[1]): d for t, d in zip(mine, digests)}


def file_records(sizes: dict[str, int], pieces: dict[tuple[str, int], str],
                 chunk_bytes: int = CHUNK_BYTES) -> dict[str, dict]:
    """The manifest's ``files`` entries from the sizes and the (merged) piece digests."""
    out = {name: {"size": size, "sha256": []} for name, size in sorted(sizes.items())}
    for name, i, _, _ in _tasks(sizes, chunk_bytes):
        out[name]["sha256"].append(pieces[(name, i)])
    return out


def file_sizes(folder: str, names) -> dict[str, int]:
    """name -> size in bytes of each of ``names`` (relative to ``folder``); ManifestError naming a missing one."""
    out = {}
    for name in names:
        try:
            out[name] = os.stat(os.path.join(folder, name)).st_size
        except FileNotFoundError:
            raise ManifestError(f"{os.path.join(folder, name)}: missing (cannot be recorded in the manifest)") \
                from None
    return out


def list_files(folder: str) -> list[str]:
    """Every regular file under ``folder`` (relative names, sorted), leaving out the manifest and ``*.tmp``."""
    out = []
    for d, dirs, files in os.walk(folder):
        dirs.sort()
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), folder)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


# ---- writing -----------------------------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _self_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _serialize(body: dict) -> str:
    """The manifest's exact text: read back, it must be byte for byte this (so any altered byte is caught)."""
    return json.dumps({**body, "self_sha256": _self_digest(body)}, indent=1) + "\n"


def write_manifest_records(folder: str, files: dict[str, dict], writer: str, owned=(), extra: dict | None = None,
                           chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Write the manifest from ready ``files`` records (see ``file_records``); atomic, fsynced with its folder."""
    body = {"format": FORMAT, "writer": writer, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "chunk_bytes": chunk_bytes, "files": files}
    if owned:
        body["owned"] = sorted(set(owned))
    if extra:
        body.update(extra)
    text = _serialize(body)
    path = os.path.join(folder, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)
    return body


def write_manifest(folder: str, names=None, writer: str = "mamba-parallel", owned=(), extra: dict | None = None,
                   workers: int | None = None, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """Hash ``names`` (relative to ``folder``; default: every file in it) and write the manifest last.

    The files are fsynced before the manifest is written: a manifest on disk means its files are on disk."""
    names = list_files(folder) if names is None else sorted(set(names))
    sizes = file_sizes(folder, names)
    pieces = hash_pieces(folder, sizes, chunk_bytes, workers, fsync=True)
    return write_manifest_records(folder, file_records(sizes, pieces, chunk_bytes), writer, owned, extra,
                                  chunk_bytes)


def update_manifest(folder: str, names, writer: str | None = None, workers: int | None = None) -> dict:
    """Add (or re-hash) ``names`` in the folder's manifest, keeping the other entries; creates it when absent."""
    old = read_manifest(folder) or {}
    chunk = old.get("chunk_bytes", CHUNK_BYTES)
    sizes = file_sizes(folder, sorted(set(names)))
    files = {**old.get("files", {}), **file_records(sizes, hash_pieces(folder, sizes, chunk, workers, fsync=True),
                                                    chunk)}
    extra = {k: v for k, v in old.items() if k not in ("format", "writer", "created", "chunk_bytes", "files",
                                                        "owned")}
    return write_manifest_records(folder, files, writer or old.get("writer", "mamba-parallel"),
                                  old.get("owned", ()), extra, chunk)


# ---- reading and verifying ---------------------------------------------------------------------------------------
def has_manifest(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST))


def read_manifest(folder: str) -> dict | None:
    """The folder's manifest, None when it has none; ManifestError when it is unreadable or altered."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"{path}: the manifest is corrupt (not valid JSON: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "self_sha256" not in data:
        raise ManifestError(f"{path}: the manifest is corrupt (not a {FORMAT} manifest)")
    digest = data.pop("self_sha256")
    if digest != _self_digest(data) or raw != _serialize(data).encode():
        raise ManifestError(f"{path}: the manifest is corrupt (its content does not match its own checksum)")
    files = data.get("files")
    if not isinstance(files, dict) or not all(isinstance(r, dict) and isinstance(r.get("size"), int)
                                              and isinstance(r.get("sha256"), list) for r in files.values()):
        raise ManifestError(f"{path}: the manifest is corrupt (malformed 'files' entries)")
    return data


def check_sizes(folder: str, manifest: dict) -> list[str]:
    """Problems found without reading data: missing files, wrong sizes (truncated or overwritten)."""
    problems = []
    for name, rec in sorted(manifest["files"].items()):
        path = os.path.join(folder, name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing (listed in {MANIFEST})")
            continue
        if size != rec["size"]:
            problems.append(f"{path}: {size:,} bytes, the manifest says {rec['size']:,} (truncated or overwritten)")
    return problems


def check_hashes(folder: str, manifest: dict, workers: int | None = None, part: tuple[int, int] = (0, 1)) -> list[str]:
    """Problems found by hashing this part (see ``hash_pieces``) of the files; call after ``check_sizes``."""
    chunk = manifest.get("chunk_bytes", CHUNK_BYTES)
    sizes = {name: rec["size"] for name, rec in manifest["files"].items()}
    got = hash_pieces(folder, sizes, chunk, workers, part)
    bad = {}
    for (name, i), digest in got.items():
        want = manifest["files"][name]["sha256"]
        if i >= len(want) or want[i] != digest:
            bad.setdefault(name, []).append(i)
    return [f"{os.path.join(folder, name)}: content differs from the manifest (SHA-256 of bytes "
            f"{idx[0] * chunk:,}..{min((idx[0] + 1) * chunk, sizes[name]):,}"
            f"{f' and {len(idx) - 1} more piece(s)' if len(idx) > 1 else ''}): the file changed after it was "
            f"written (disk, copy or transfer error)" for name, idx in sorted(bad.items())]


def verify_folder(folder: str, hashes: bool = True, workers: int | None = None) -> dict:
    """Check ``folder`` against its manifest; returns the manifest. ManifestError naming the file(s) at fault,
    or saying there is no manifest."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ManifestError(f"{folder}: no {MANIFEST} (not written by mamba-parallel, or written by an older "
                            f"version): nothing to verify against")
    problems = check_sizes(folder, manifest)
    if not problems and hashes:
        problems = check_hashes(folder, manifest, workers)
    if problems:
        raise ManifestError("; ".join(problems))
    return manifest


def manifest_bytes(manifest: dict) -> int:
    return sum(r["size"] for r in manifest["files"].values())


# ---- ownership ---------------------------------------------------------------------------------------------------
def owned_names(folder: str) -> set[str]:
    """Top-level names the folder's manifest says its writer owns (files and ``owned``); empty without one."""
    try:
        manifest = read_manifest(folder)
    except ManifestError:
        return set()
    if manifest is None:
        return set()
    names = set(manifest.get("owned", ())) | set(manifest["files"])
    return {n.split(os.sep)[0] for n in names}


def foreign_names(folder: str, names) -> list[str]:
    """Those of ``names`` that exist in ``folder`` but are not recorded in its manifest: not ours to replace."""
    if not os.path.isdir(folder):
        return []
    ours = owned_names(folder) | {MANIFEST}
    return sorted(n for n in names if n not in ours and os.path.lexists(os.path.join(folder, n)))


# ---- loading -----------------------------------------------------------------------------------------------------
_NOTED: set[str] = set()


def verify_before_load(folder: str, workers: int | None = None) -> bool:
    """Verify a folder about to be loaded: ManifestError on any mismatch; True when verified. A folder without a
    manifest (weights from elsewhere: mamba_ssm, HF, an older version) loads unchecked, said once per folder."""
    if has_manifest(folder):
        verify_folder(folder, workers=workers)
        return True
    key = os.path.abspath(folder)
    if key not in _NOTED:
        _NOTED.add(key)
        import warnings

        warnings.warn(f"{folder}: no {MANIFEST} (weights from elsewhere or an older version): loaded without an "
                      f"integrity check", stacklevel=3)
    return False
