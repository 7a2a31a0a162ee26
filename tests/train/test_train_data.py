"""prepare-data inputs (text, folder, .jsonl, .parquet, HF tokenizer.json) and the per-rank sampler."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.train.data import DataError, RankBatches, TokenWindows, open_split, prepare_data, read_header
from mamba_parallel.train.tokenizer import ByteTokenizer, HFTokenizer

DOCS = [f"document number {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 4) for i in range(40)]


def _all_tokens(folder: str) -> np.ndarray:
    return np.concatenate([open_split(folder, "train"), open_split(folder, "val")])


def _docs_of(folder: str) -> list[str]:
    """Documents back from a byte token folder (NUL separates them), in any split order."""
    text = bytes(_all_tokens(folder).astype(np.uint8).tolist()).decode()
    return sorted(d for d in text.split("\0") if d)


def test_prepare_jsonl_parquet_and_folder_hold_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(tmp_path / "docs.jsonl", "w") as fh:
        for d in DOCS:
            fh.write(json.dumps({"text": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "docs.parquet")
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(d)
    for src in ("docs.jsonl", "docs.parquet", "txt"):
        out = str(tmp_path / f"tok-{src}")
        assert cli.main(["prepare-data", str(tmp_path / src), "--out", out, "--val-fraction", "0.2"]) == 0
        header = read_header(out)
        assert header["dtype"] == "uint8" and header["vocab_size"] == 256
        assert header["documents"]["val"] > 0 and header["documents"]["train"] > header["documents"]["val"]
        assert _docs_of(out) == sorted(DOCS), src


def test_single_file_holds_out_the_tail(tmp_path):
    src = tmp_path / "one.txt"
    src.write_text("abcdefghij" * 100)
    header = prepare_data(str(src), str(tmp_path / "tok"), ByteTokenizer(), val_fraction=0.1)
    assert header["tokens"] == {"train": 901, "val": 100}  # 1000 bytes + the end-of-text token, 10% held out


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "[UNK]"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path))
    assert hf.eos_token_id == 0 and hf.vocab_size > 256
    assert hf.decode(hf.encode(DOCS[3])) == DOCS[3]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("\n".join(DOCS))
    out = str(tmp_path / "tok")
    assert cli.main(["prepare-data", str(tmp_path / "docs"), "--out", out, "--tokenizer",
                     str(tmp_path / "tokenizer.json")]) == 0
    header = read_header(out)
    assert header["dtype"] == "uint16" and header["tokenizer"] == hf.spec
    assert hf.decode(_all_tokens(out).tolist()).startswith(DOCS[0])
    # The token folder carries its own tokenizer copy: training from it works after the original is gone.
    (tmp_path / "tokenizer.json").rename(tmp_path / "moved.json")
    run = tmp_path / "run"
    assert cli.main(["train", "--data", out, "--out", str(run), "--steps", "2", "--seq-len", "16", "--batch-size",
                     "2", "--warmup", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
                     "--no-progress"]) == 0
    assert (run / "final" / "tokenizer.json").read_bytes() == (tmp_path / "moved.json").read_bytes()
    # Naming the same tokenizer (same contents, another path) is accepted; a different one is refused.
    assert cli.main(["train", "--data", out, "--out", str(tmp_path / "run2"), "--tokenizer",
                     str(tmp_path / "moved.json"), "--steps", "1", "--seq-len", "16", "--batch-size", "2",
                     "--warmup", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
                     "--no-progress"]) == 0
    other = tmp_path / "other.json"
    other.write_text((tmp_path / "moved.json").read_text() + "\n")  # another file: not the folder's tokenizer
    assert cli.main(["train", "--data", out, "--out", str(tmp_path / "run3"), "--tokenizer", str(other),
                     "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--no-progress"]) == 2


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(str(tmp_path / "nope"), str(tmp_path / "out"), ByteTokenizer())
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match="no 'text' field"):
        prepare_data(str(tmp_path / "bad.jsonl"), str(tmp_path / "out"), ByteTokenizer())


def test_rank_slices_make_up_the_global_batch():
    tokens = np.arange(1000, dtype=np.uint16)
    w = TokenWindows(tokens, seq_len=8, seed=3)
    full = RankBatches(w, batch_size=4)
    for first in (0, 4, 120, 124):  # 124 crosses the epoch boundary (124 windows per epoch)
        x, y = full.batch(first)
        parts = [RankBatches(w, 2, dp_rank=r, dp_size=2).batch(first) for r in range(2)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(y[:, :-1], x[:, 1:])  # labels are the inputs shifted by one
        cp = [RankBatches(w, 4, cp_rank=c, cp_size=2).batch(first) for c in range(2)]
        assert torch.equal(torch.cat([c[0] for c in cp], dim=1), x)
        assert torch.equal(torch.cat([c[1] for c in cp], dim=1), y)
    epoch0 = sorted(w.window(i) for i in range(w.num_windows))
    assert epoch0 == list(range(w.num_windows))  # every window once per epoch
    assert [w.window(i) for i in range(10)] != list(range(10))  # shuffled
    assert [TokenWindows(tokens, 8, seed=3).window(i) for i in range(10)] == [w.window(i) for i in range(10)]


def test_short_data_is_a_clear_error():
    with pytest.raises(DataError, match="--seq-len 32 needs at least 33"):
        TokenWindows(np.arange(20, dtype=np.uint8), seq_len=32, seed=0)
