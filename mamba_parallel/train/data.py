"""Token files and deterministic per-rank batches.

A prepared data folder holds ``train.bin`` and ``val.bin`` (flat token ids, a numpy memmap of the smallest of
uint8 / uint16 / uint32 that fits the vocabulary), ``train.docs.npy`` / ``val.docs.npy`` (the token offset where
each document starts), ``header.json`` (dtype, token counts, tokenizer) and a manifest (mamba_parallel/manifest.py:
the files ``prepare-data`` wrote, with their sizes and SHA-256). Documents are joined with the tokenizer's
end-of-text token. The validation split is held out by document (a hash of the document's name, so it does not
depend on file order); with too few documents, the tail of the stream instead. ``prepare-data`` replaces only the
files its manifest lists: anything else in the folder stays, and a folder holding other files of those names is
refused, naming them.

Sampling: the train stream is cut into windows of ``seq_len + 1`` tokens (stride ``seq_len``); each epoch visits
them in a permutation seeded by ``(seed, epoch)``. Global sample ``i`` is fixed by the seed alone, and a micro-step
takes the next ``batch_size x dp`` global samples, rank ``r`` the contiguous ``r``-th slice. The data position is
one integer, the number of global samples consumed, so resume is exact and does not depend on the world size.

Document boundaries (``doc_boundaries=True``): each window knows which document each token belongs to (from the
``*.docs.npy`` offsets, or for older folders from the end-of-text tokens); ``RankBatches.batch_docs`` gives it as
``seq_idx`` (b, L) int32, and the target of a document's last token (the next document's first token) is -100,
so a packed batch scores exactly what its documents would score one by one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sysconfig
import zlib
from typing import Iterator

import numpy as np
import torch

from mamba_parallel import manifest as mf

HEADER = "header.json"
FORMAT = "mamba-parallel-tokens/1"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".js", ".ts", ".html", ".css", ".tex", ".json",
                 ".toml", ".yaml", ".yml", ".csv", ".sh"}


DOCS = "{split}.docs.npy"
WRITER = "prepare-data"
# What prepare-data writes (tokenizer.json only for HF tokenizers).
OWN_FILES = ("train.bin", "val.bin", "train.docs.npy", "val.docs.npy", HEADER, "tokenizer.json")
_STAGE = ".prepare-data.tmp"


class DataError(ValueError):
    """Unusable data; the message names the path or flag."""


# ---- reading documents -------------------------------------------------------------------------------------------
def stdlib_sources() -> list[str]:
    """The Python standard library's own .py files (no tests, no site-packages), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    if not out:
        raise DataError(f"no .py files found in the standard library folder {root!r}")
    return out


def _read_text(path: str, allow_binary: bool = False) -> str:
    """The file as text; DataError when it is not UTF-8 text (NUL bytes, invalid UTF-8), unless ``allow_binary``
    (bad bytes then become U+FFFD)."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if allow_binary:
        return raw.decode("utf-8", errors="replace")
    force = "leave it out, or pass --allow-binary to tokenize it anyway (bad bytes become U+FFFD)"
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path}: binary data, not text (a NUL byte at offset {nul:,}); {force}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start:,}); convert it to "
                        f"UTF-8, {force}") from None


def iter_documents(source: str, text_field: str = "text", allow_binary: bool = False) -> Iterator[tuple[str, str]]:
    """(name, text) of every document in ``source``: a text file, a folder (recursively), .jsonl or .parquet.

    Text files must be UTF-8 (see ``_read_text``); ``allow_binary`` decodes anything, bad bytes as U+FFFD."""
    if source == "stdlib":
        for p in stdlib_sources():
            yield p, _read_text(p, allow_binary=True)
        return
    if not os.path.exists(source):
        raise DataError(f"--data: {source!r} does not exist")
    if os.path.isdir(source):
        found = False
        for d, dirs, files in os.walk(source):
            dirs[:] = sorted(x for x in dirs if not x.startswith("."))
            for f in sorted(files):
                ext = os.path.splitext(f)[1].lower()
                if ext in TEXT_SUFFIXES or ext in (".jsonl", ".parquet"):
                    found = True
                    yield from iter_documents(os.path.join(d, f), text_field, allow_binary)
        if not found:
            raise DataError(f"--data: folder {source!r} holds no text, .jsonl or .parquet files")
        return
    ext = os.path.splitext(source)[1].lower()
    if ext == ".jsonl":
        with open(source, "rb") as fh:
            for i, raw in enumerate(fh):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{source}:{i + 1}: not UTF-8 (byte 0x{raw[e.start]:02x}); a .jsonl file is "
                                    f"UTF-8 JSON, one object per line") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{source}:{i + 1}: invalid JSON ({e})") from None
                if not isinstance(row, dict) or text_field not in row:
                    raise DataError(f"{source}:{i + 1}: no {text_field!r} field")
                yield f"{source}:{i}", str(row[text_field])
    elif ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError("reading .parquet needs pyarrow: pip install 'mamba-parallel[data]'") from e
        try:
            pf = pq.ParquetFile(source)
        except Exception as e:  # pyarrow's own error types
            raise DataError(f"{source}: not a readable parquet file ({e})") from None
        if text_field not in pf.schema_arrow.names:
            raise DataError(f"{source}: no column {text_field!r} (columns: {pf.schema_arrow.names})")
        i = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield f"{source}:{i}", str(text)
                i += 1
    else:
        yield source, _read_text(source, allow_binary)


# ---- writing token files -----------------------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise DataError(f"vocab_size {vocab_size} does not fit uint32")


def _is_val(name: str, val_fraction: float) -> bool:
    return (zlib.crc32(name.encode("utf-8", errors="replace")) % 100_000) < val_fraction * 100_000


def prepare_data(source: str, out_dir: str, tokenizer, val_fraction: float = 0.005, text_field: str = "text",
                 on_document=None, allow_binary: bool = False) -> dict:
    """Tokenize ``source`` into ``out_dir`` (train.bin, val.bin, *.docs.npy, header.json); return the header.
    ``on_document(name)`` is called after each document (a progress bar).

    The files are written to a staging folder inside ``out_dir`` and moved in place when complete, the manifest
    last; only the files of an earlier ``prepare-data`` there (its manifest lists them) are replaced, and a
    killed run leaves no half-written token folder (``is_prepared`` is False until the manifest is complete).
    """
    from mamba_parallel.train.disk import check_space, output_errors

    dtype = token_dtype(tokenizer.vocab_size)
    if source != "stdlib" and not os.path.exists(source):
        raise DataError(f"--data: {source!r} does not exist")
    _check_out_dir(out_dir, source)
    stage = os.path.join(out_dir, _STAGE)
    created = not os.path.exists(out_dir)
    with output_errors(out_dir, "prepare-data"):
        try:
            os.makedirs(stage, exist_ok=True)
            check_space(out_dir, _bytes_needed(source, dtype), "the token files")
            header = _write_token_folder(source, stage, tokenizer, dtype, val_fraction, text_field, allow_binary,
                                         on_document or (lambda name: None))
            _install(stage, out_dir)
        finally:
            shutil.rmtree(stage, ignore_errors=True)  # a failed run leaves nothing behind
            if created and os.path.isdir(out_dir) and not os.listdir(out_dir):
                os.rmdir(out_dir)
    return header


def _bytes_needed(source: str, dtype: np.dtype) -> int:
    """About the size of the token files: at most one token per source byte (bytes; BPE needs fewer)."""
    if source == "stdlib":
        return 64 << 20
    if os.path.isdir(source):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(source) for f in files)
    else:
        size = os.path.getsize(source)
    return int(size * dtype.itemsize * 1.05) + (1 << 20)


def _legacy_names(folder: str) -> set[str]:
    """The files of a token folder written by an older version (no manifest, our header format)."""
    try:
        read_header(folder)
    except DataError:
        return set()
    return {n for n in OWN_FILES if os.path.exists(os.path.join(folder, n))}


def _check_out_dir(out_dir: str, source: str) -> None:
    """Refuse a folder where prepare-data would replace files it did not write (the names are listed)."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise DataError(f"--out {out_dir!r} is a file, not a folder")
    if source != "stdlib" and os.path.isdir(source):
        src, out = os.path.realpath(source), os.path.realpath(out_dir)
        if out == src or out.startswith(src + os.sep):
            raise DataError(f"--out {out_dir!r} is inside the raw data folder {source!r}: the token files would be "
                            f"read as text by the next run; choose a folder outside it")
    try:
        manifest = mf.read_manifest(out_dir)
    except mf.ManifestError as e:
        raise DataError(f"--out {out_dir!r}: {e}") from None
    if manifest is not None and manifest.get("writer") != WRITER:
        raise DataError(f"--out {out_dir!r} was written by {manifest.get('writer')!r}, not prepare-data; choose "
                        f"another folder")
    ours = _legacy_names(out_dir) if manifest is None else set()
    foreign = [n for n in mf.foreign_names(out_dir, OWN_FILES) if n not in ours]
    if foreign:
        raise DataError(f"--out {out_dir!r} holds {', '.join(foreign)}, which prepare-data would write but did not "
                        f"write (no manifest of an earlier prepare-data lists them); move them away or choose "
                        f"another folder (nothing was changed)")


def _install(stage: str, out_dir: str) -> None:
    """Move the staged files into ``out_dir``: claim their names first, replace, drop our stale ones, hash last."""
    new = sorted(os.listdir(stage))
    old = mf.owned_names(out_dir) & set(OWN_FILES) if mf.has_manifest(out_dir) else _legacy_names(out_dir)
    mf.write_manifest_records(out_dir, {}, WRITER, owned=sorted(set(new) | old))  # incomplete: not yet prepared
    for name in new:
        os.replace(os.path.join(stage, name), os.path.join(out_dir, name))
    for name in sorted(old - set(new)):  # e.g. tokenizer.json of an earlier, non-byte tokenizer
        os.unlink(os.path.join(out_dir, name))
    mf.write_manifest(out_dir, new, writer=WRITER)


def _write_token_folder(source: str, folder: str, tokenizer, dtype, val_fraction: float, text_field: str,
                        allow_binary: bool, on_document) -> dict:
    counts = {"train": 0, "val": 0}
    starts: dict[str, list[int]] = {"train": [], "val": []}
    eos = tokenizer.eos_token_id
    with open(os.path.join(folder, "train.bin"), "wb") as ftrain, \
            open(os.path.join(folder, "val.bin"), "wb") as fval:
        for name, text in iter_documents(source, text_field, allow_binary):
            if not text:  # an empty file or record is no document
                continue
            if tokenizer.spec == "byte":  # fast path: the bytes are the ids
                ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
            else:
                ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
            if eos is not None:
                ids = np.append(ids, eos)
            if len(ids) == 0:
                continue
            split = "val" if _is_val(name, val_fraction) else "train"
            (fval if split == "val" else ftrain).write(ids.astype(dtype).tobytes())
            starts[split].append(counts[split])
            counts[split] += len(ids)
            on_document(name)
    if counts["train"] == 0 and counts["val"] == 0:
        raise DataError(f"--data: {source!r} holds no text")
    docs = {k: len(v) for k, v in starts.items()}
    offsets = {k: np.asarray(v, dtype=np.int64) for k, v in starts.items()}
    if val_fraction > 0 and (counts["val"] == 0 or counts["train"] == 0):
        # Too few documents for a split by document: hold out the tail of the whole stream instead.
        total = np.concatenate([np.fromfile(os.path.join(folder, f"{s}.bin"), dtype=dtype) for s in ("train", "val")])
        every = np.concatenate([offsets["train"], offsets["val"] + counts["train"]])
        n_val = max(1, int(round(len(total) * val_fraction)))
        cut = len(total) - n_val
        total[:cut].tofile(os.path.join(folder, "train.bin"))
        total[cut:].tofile(os.path.join(folder, "val.bin"))
        counts = {"train": cut, "val": n_val}
        val = every[every >= cut] - cut
        offsets = {"train": every[every < cut], "val": val if len(val) and val[0] == 0 else np.r_[0, val]}
    for split, arr in offsets.items():
        np.save(os.path.join(folder, DOCS.format(split=split)), arr.astype(np.int64))
    header = {"format": FORMAT, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
              "tokenizer": tokenizer.spec, "eos_token_id": eos, "source": os.path.abspath(source)
              if source != "stdlib" else "stdlib", "tokens": counts, "documents": docs,
              "val_fraction": val_fraction, "doc_index": DOCS}
    with open(os.path.join(folder, HEADER), "w") as fh:
        json.dump(header, fh, indent=2)
    if tokenizer.spec != "byte":  # the folder carries its own copy: moving the original breaks nothing
        tokenizer.save(folder)
    return header


def is_prepared(folder: str) -> bool:
    """A complete token folder: its header, and a manifest of prepare-data listing it (older folders: no
    manifest at all). A folder whose manifest claims names but lists no files was interrupted."""
    if not os.path.isfile(os.path.join(folder, HEADER)):
        return False
    try:
        manifest = mf.read_manifest(folder)
    except mf.ManifestError:
        return False
    return manifest is None or HEADER in manifest["files"]


def read_header(folder: str) -> dict:
    path = os.path.join(folder, HEADER)
    try:
        with open(path) as fh:
            header = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read token header {path!r}: {e}") from None
    if header.get("format") != FORMAT:
        raise DataError(f"{path}: format {header.get('format')!r} is not {FORMAT!r}")
    return header


def folder_tokenizer(folder: str, header: dict) -> str:
    """The tokenizer spec of a token folder: "byte", its own tokenizer.json copy, or (older folders) the path
    recorded when it was prepared."""
    if header["tokenizer"] == "byte":
        return "byte"
    own = os.path.join(folder, "tokenizer.json")
    return own if os.path.isfile(own) else header["tokenizer"]


def check_token_folder(folder: str) -> None:
    """The quick checks of a token folder before training: the files its manifest lists are there at their
    sizes (``mamba-parallel verify`` also checks their SHA-256); DataError naming the file otherwise."""
    try:
        manifest = mf.read_manifest(folder)
    except mf.ManifestError as e:
        raise DataError(str(e)) from None
    problems = mf.check_sizes(folder, manifest) if manifest is not None else []
    if problems:
        raise DataError(f"token folder {folder!r}: {'; '.join(problems)}; prepare it again (prepare-data)")


def open_split(folder: str, split: str) -> np.ndarray:
    """The tokens of one split as a read-only memmap (an empty array when the split is empty); DataError naming
    the file when its size is not what the header says (truncated or overwritten)."""
    header = read_header(folder)
    n = header["tokens"][split]
    if n == 0:
        return np.zeros(0, dtype=header["dtype"])
    path = os.path.join(folder, f"{split}.bin")
    want = n * np.dtype(header["dtype"]).itemsize
    try:
        size = os.path.getsize(path)
    except OSError:
        raise DataError(f"{path}: missing ({HEADER} counts {n:,} {split} tokens); prepare the folder again") from None
    if size != want:
        raise DataError(f"{path}: {size:,} bytes, but {HEADER} counts {n:,} tokens = {want:,} bytes (truncated or "
                        f"overwritten); prepare the folder again")
    return np.memmap(path, dtype=header["dtype"], mode="r", shape=(n,))


def open_docs(folder: str, split: str, n_tokens: int) -> np.ndarray | None:
    """The start offsets (int64, increasing, the first 0) of the documents of one split; None for a folder
    written before they were recorded (then the end-of-text tokens tell, see ``TokenWindows``)."""
    path = os.path.join(folder, DOCS.format(split=split))
    if not os.path.isfile(path):
        return None
    try:
        starts = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable document index ({e}); prepare the folder again") from None
    if starts.ndim != 1 or (len(starts) and (starts[0] != 0 or starts[-1] >= max(n_tokens, 1))):
        raise DataError(f"{path}: not a document index of {n_tokens:,} tokens; prepare the folder again")
    return starts


# ---- batches -----------------------------------------------------------------------------------------------------
class TokenWindows:
    """Global samples of ``seq_len + 1`` tokens from a flat token array, shuffled per epoch (or in order).

    ``doc_starts``: the document start offsets of the array (``open_docs``); without them, ``eos_token_id`` marks
    where documents end (the token after it starts the next one); with neither, documents are not known.
    ``source``: the file named in errors."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool = True, what: str = "train",
                 doc_starts: np.ndarray | None = None, eos_token_id: int | None = None, source: str | None = None):
        if len(tokens) < seq_len + 1:
            where = f" ({source})" if source else ""
            raise DataError(f"the {what} split{where} has {len(tokens)} tokens; --seq-len {seq_len} needs at least "
                            f"{seq_len + 1} (one sequence plus its next-token label)")
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.doc_starts, self.eos_token_id = doc_starts, eos_token_id
        self.num_windows = (len(tokens) - 1) // seq_len
        self._perm_epoch, self._perm = -1, None

    @property
    def knows_documents(self) -> bool:
        return self.doc_starts is not None or self.eos_token_id is not None

    def window(self, sample: int) -> int:
        epoch, within = divmod(sample, self.num_windows)
        if not self.shuffle:
            return within
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return int(self._perm[within])

    def sample(self, sample: int) -> np.ndarray:
        start = self.window(sample) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def boundaries(self, sample: int) -> int:
        """How many targets of the sample start another document (O(log n) with the index)."""
        start = self.window(sample) * self.seq_len
        if self.doc_starts is not None:  # document starts at positions start+1 .. start+seq_len
            lo, hi = np.searchsorted(self.doc_starts, [start, start + self.seq_len], side="right")
            return int(hi - lo)
        if self.eos_token_id is not None:
            return int(np.count_nonzero(np.asarray(self.tokens[start:start + self.seq_len]) == self.eos_token_id))
        return 0

    def documents(self, sample: int, tokens: np.ndarray) -> np.ndarray:
        """(seq_len + 1,) int32: the document of each token of the sample (0 for the first one), counted within
        the window; all zeros when documents are not known."""
        if self.doc_starts is not None:
            start = self.window(sample) * self.seq_len
            pos = np.arange(start, start + len(tokens))
            doc = np.searchsorted(self.doc_starts, pos, side="right")
            return (doc - doc[0]).astype(np.int32)
        if self.eos_token_id is not None:
            return np.concatenate([[0], np.cumsum(tokens[:-1] == self.eos_token_id)]).astype(np.int32)
        return np.zeros(len(tokens), dtype=np.int32)


class RankBatches:
    """This rank's micro-batches: ``batch(first)`` covers global samples ``first .. first + batch_size*dp``.

    ``dp_rank``/``dp_size`` pick the slice of the global micro-batch; ``cp_rank``/``cp_size`` then keep a contiguous
    ``seq_len / cp`` slice of every sequence (ranks of one tp / cp group get the same samples).
    ``doc_boundaries``: labels whose next token starts another document are -100, and ``batch_docs`` also gives
    the documents as ``seq_idx`` (the global numbering sliced, as context parallelism expects).
    """

    def __init__(self, windows: TokenWindows, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 cp_rank: int = 0, cp_size: int = 1, doc_boundaries: bool = False):
        self.w, self.batch_size = windows, batch_size
        self.dp_rank, self.dp_size, self.cp_rank, self.cp_size = dp_rank, dp_size, cp_rank, cp_size
        self.doc_boundaries = doc_boundaries

    @property
    def global_batch(self) -> int:
        """Samples per micro-step over all data-parallel ranks."""
        return self.batch_size * self.dp_size

    def n_targets(self, first: int, every_rank: bool = False) -> int:
        """Targets that count (labels != -100) in this rank's micro-batch at ``first`` over its whole rows (the cp
        slices together), or with ``every_rank`` in the micro-batch of all data-parallel ranks. Host-side only."""
        start = first if every_rank else first + self.dp_rank * self.batch_size
        rows = self.global_batch if every_rank else self.batch_size
        if not self.doc_boundaries:
            return rows * self.w.seq_len
        return rows * self.w.seq_len - sum(self.w.boundaries(i) for i in range(start, start + rows))

    def batch(self, first: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, labels: (batch_size, seq_len / cp) int64 each; labels[t] is the token after input[t]."""
        return self.batch_docs(first, device)[:2]

    def batch_docs(self, first: int, device: torch.device | str = "cpu"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """input_ids, labels (batch_size, seq_len / cp) int64 and seq_idx (batch_size, seq_len / cp) int32 (None
        without ``doc_boundaries``, or when no row of the micro-batch crosses a document boundary)."""
        start = first + self.dp_rank * self.batch_size
        rows = [self.w.sample(start + i) for i in range(self.batch_size)]
        t = torch.from_numpy(np.stack(rows))
        inputs, labels = t[:, :-1], t[:, 1:]
        seq_idx = None
        if self.doc_boundaries:
            docs = torch.from_numpy(np.stack([self.w.documents(start + i, r) for i, r in enumerate(rows)]))
            if docs.any():  # else one document per row: nothing to keep apart (the kernels' plain path)
                seq_idx = docs[:, :-1]
                labels = labels.masked_fill(docs[:, 1:] != seq_idx, -100)  # no target across a document boundary
        if self.cp_size > 1:
            n = self.w.seq_len // self.cp_size
            sl = slice(self.cp_rank * n, (self.cp_rank + 1) * n)
            inputs, labels = inputs[:, sl], labels[:, sl]
            seq_idx = seq_idx[:, sl] if seq_idx is not None else None
        out = [inputs.contiguous().to(device, non_blocking=True), labels.contiguous().to(device, non_blocking=True)]
        return (*out, seq_idx.contiguous().to(device, non_blocking=True) if seq_idx is not None else None)
