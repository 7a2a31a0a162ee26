"""Token files and deterministic per-rank batches.

A prepared data folder holds ``train.bin`` and ``val.bin`` (flat token ids, a numpy memmap of the smallest of
uint8 / uint16 / uint32 that fits the vocabulary) and ``header.json`` (dtype, token counts, tokenizer). Documents
are joined with the tokenizer's end-of-text token. The validation split is held out by document (a hash of the
document's name, so it does not depend on file order); with too few documents, the tail of the stream instead.

Sampling: the train stream is cut into windows of ``seq_len + 1`` tokens (stride ``seq_len``); each epoch visits
them in a permutation seeded by ``(seed, epoch)``. Global sample ``i`` is fixed by the seed alone, and a micro-step
takes the next ``batch_size x dp`` global samples, rank ``r`` the contiguous ``r``-th slice. The data position is
one integer, the number of global samples consumed, so resume is exact and does not depend on the world size.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import zlib
from typing import Iterator

import numpy as np
import torch

HEADER = "header.json"
FORMAT = "mamba-parallel-tokens/1"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".js", ".ts", ".html", ".css", ".tex", ".json",
                 ".toml", ".yaml", ".yml", ".csv", ".sh"}


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


def _read_text(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.read().decode("utf-8", errors="replace")


def iter_documents(source: str, text_field: str = "text") -> Iterator[tuple[str, str]]:
    """(name, text) of every document in ``source``: a text file, a folder (recursively), .jsonl or .parquet."""
    if source == "stdlib":
        for p in stdlib_sources():
            yield p, _read_text(p)
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
                    yield from iter_documents(os.path.join(d, f), text_field)
        if not found:
            raise DataError(f"--data: folder {source!r} holds no text, .jsonl or .parquet files")
        return
    ext = os.path.splitext(source)[1].lower()
    if ext == ".jsonl":
        with open(source, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
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
        pf = pq.ParquetFile(source)
        if text_field not in pf.schema_arrow.names:
            raise DataError(f"{source}: no column {text_field!r} (columns: {pf.schema_arrow.names})")
        i = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield f"{source}:{i}", str(text)
                i += 1
    else:
        yield source, _read_text(source)


# ---- writing token files -----------------------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise DataError(f"vocab_size {vocab_size} does not fit uint32")


def _is_val(name: str, val_fraction: float) -> bool:
    return (zlib.crc32(name.encode("utf-8", errors="replace")) % 100_000) < val_fraction * 100_000


def prepare_data(source: str, out_dir: str, tokenizer, val_fraction: float = 0.005,
                 text_field: str = "text", on_document=None) -> dict:
    """Tokenize ``source`` into ``out_dir`` (train.bin, val.bin, header.json); return the header.
    ``on_document(name)`` is called after each document (a progress bar).

    Written to ``out_dir.tmp`` and renamed when complete, so a killed run never leaves a half-written folder.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    _check_out_dir(out_dir)
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        return _write_token_folder(source, out_dir, tmp, tokenizer, dtype, val_fraction, text_field,
                                   on_document or (lambda name: None))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed run leaves nothing behind
        raise


def _check_out_dir(out_dir: str) -> None:
    """Refuse to replace anything but an earlier token folder (``--out .`` must never wipe a user's files)."""
    if not os.path.exists(out_dir) or is_prepared(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise DataError(f"--out {out_dir!r} is a file, not a folder")
    if os.listdir(out_dir):
        raise DataError(f"--out {out_dir!r} is a non-empty folder without {HEADER}: it would be replaced; "
                        f"choose a new or empty folder")


def _write_token_folder(source: str, out_dir: str, tmp: str, tokenizer, dtype, val_fraction: float,
                        text_field: str, on_document) -> dict:
    counts = {"train": 0, "val": 0}
    docs = {"train": 0, "val": 0}
    eos = tokenizer.eos_token_id
    with open(os.path.join(tmp, "train.bin"), "wb") as ftrain, open(os.path.join(tmp, "val.bin"), "wb") as fval:
        for name, text in iter_documents(source, text_field):
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
            counts[split] += len(ids)
            docs[split] += 1
            on_document(name)
    if counts["train"] == 0 and counts["val"] == 0:
        raise DataError(f"--data: {source!r} holds no text")
    if val_fraction > 0 and (counts["val"] == 0 or counts["train"] == 0):
        # Too few documents for a split by document: hold out the tail of the whole stream instead.
        total = np.concatenate([np.fromfile(os.path.join(tmp, f"{s}.bin"), dtype=dtype) for s in ("train", "val")])
        n_val = max(1, int(round(len(total) * val_fraction)))
        total[:-n_val].tofile(os.path.join(tmp, "train.bin"))
        total[-n_val:].tofile(os.path.join(tmp, "val.bin"))
        counts = {"train": len(total) - n_val, "val": n_val}
    header = {"format": FORMAT, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
              "tokenizer": tokenizer.spec, "eos_token_id": eos, "source": os.path.abspath(source)
              if source != "stdlib" else "stdlib", "tokens": counts, "documents": docs,
              "val_fraction": val_fraction}
    with open(os.path.join(tmp, HEADER), "w") as fh:
        json.dump(header, fh, indent=2)
    if tokenizer.spec != "byte":  # the folder carries its own copy: moving the original breaks nothing
        tokenizer.save(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return header


def is_prepared(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, HEADER))


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


def open_split(folder: str, split: str) -> np.ndarray:
    """The tokens of one split as a read-only memmap (an empty array when the split is empty)."""
    header = read_header(folder)
    n = header["tokens"][split]
    if n == 0:
        return np.zeros(0, dtype=header["dtype"])
    return np.memmap(os.path.join(folder, f"{split}.bin"), dtype=header["dtype"], mode="r", shape=(n,))


# ---- batches -----------------------------------------------------------------------------------------------------
class TokenWindows:
    """Global samples of ``seq_len + 1`` tokens from a flat token array, shuffled per epoch (or in order)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool = True, what: str = "train"):
        if len(tokens) < seq_len + 1:
            raise DataError(f"the {what} split has {len(tokens)} tokens; --seq-len {seq_len} needs at least "
                            f"{seq_len + 1} (one sequence plus its next-token label)")
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.num_windows = (len(tokens) - 1) // seq_len
        self._perm_epoch, self._perm = -1, None

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


class RankBatches:
    """This rank's micro-batches: ``batch(first)`` covers global samples ``first .. first + batch_size*dp``.

    ``dp_rank``/``dp_size`` pick the slice of the global micro-batch; ``cp_rank``/``cp_size`` then keep a contiguous
    ``seq_len / cp`` slice of every sequence (ranks of one tp / cp group get the same samples).
    """

    def __init__(self, windows: TokenWindows, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 cp_rank: int = 0, cp_size: int = 1):
        self.w, self.batch_size = windows, batch_size
        self.dp_rank, self.dp_size, self.cp_rank, self.cp_size = dp_rank, dp_size, cp_rank, cp_size

    @property
    def global_batch(self) -> int:
        """Samples per micro-step over all data-parallel ranks."""
        return self.batch_size * self.dp_size

    def batch(self, first: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, labels: (batch_size, seq_len / cp) int64 each; labels[t] is the token after input[t]."""
        start = first + self.dp_rank * self.batch_size
        rows = np.stack([self.w.sample(start + i) for i in range(self.batch_size)])
        t = torch.from_numpy(rows)
        inputs, labels = t[:, :-1], t[:, 1:]
        if self.cp_size > 1:
            n = self.w.seq_len // self.cp_size
            sl = slice(self.cp_rank * n, (self.cp_rank + 1) * n)
            inputs, labels = inputs[:, sl], labels[:, sl]
        return (inputs.contiguous().to(device, non_blocking=True), labels.contiguous().to(device, non_blocking=True))
