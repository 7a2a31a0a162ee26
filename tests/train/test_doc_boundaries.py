"""Documents stay documents: the loader knows where each starts, state never flows from one into the next, and a
packed batch scores exactly what its documents score one by one. (DP / TP / CP: tests/train/test_train_dp.py runs
every layout on multi-document data with the boundaries on.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import assert_close
from mamba_parallel.config import get_preset
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.data import RankBatches, TokenWindows, open_docs, open_split, prepare_data, read_header
from mamba_parallel.train.tokenizer import ByteTokenizer
from mamba_parallel.train.trainer import train

DOCS = [("doc %d: " % i) + "abcdefghij"[: 3 + i % 7] * (1 + i % 3) for i in range(30)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    with open(root / "docs.jsonl", "w") as fh:
        for d in DOCS:
            fh.write(json.dumps({"text": d}) + "\n")
    prepare_data(str(root / "docs.jsonl"), str(root / "tok"), ByteTokenizer(), val_fraction=0.0)
    return str(root / "tok")


def test_the_index_records_every_document_start(folder):
    tokens = open_split(folder, "train")
    starts = open_docs(folder, "train", len(tokens))
    assert len(starts) == len(DOCS) == read_header(folder)["documents"]["train"]
    assert np.array_equal(starts[1:], np.flatnonzero(np.asarray(tokens) == 0)[:-1] + 1)  # each after an EOS (NUL)


def test_index_and_end_of_text_tokens_agree_and_labels_stop_at_boundaries(folder):
    tokens = open_split(folder, "train")
    by_index = TokenWindows(tokens, 24, seed=1, doc_starts=open_docs(folder, "train", len(tokens)))
    by_eos = TokenWindows(tokens, 24, seed=1, eos_token_id=0)
    unknown = TokenWindows(tokens, 24, seed=1)
    assert by_index.knows_documents and by_eos.knows_documents and not unknown.knows_documents
    for i in range(by_index.num_windows):
        row = by_index.sample(i)
        docs = by_index.documents(i, row)
        assert np.array_equal(docs, by_eos.documents(i, row))
        assert by_index.boundaries(i) == by_eos.boundaries(i) == np.count_nonzero(docs[1:] != docs[:-1])
    batches = RankBatches(by_index, 4, doc_boundaries=True)
    inputs, labels, seq_idx = batches.batch_docs(0)
    assert batches.n_targets(0) == int((labels != -100).sum())
    plain_inputs, plain_labels = RankBatches(by_index, 4).batch(0)
    assert torch.equal(inputs, plain_inputs) and seq_idx.dtype == torch.int32
    crossing = torch.nn.functional.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (0, 1), value=False)
    crossing[:, -1] = False  # the last target is the window's next token: still inside (see below)
    assert crossing.any()
    assert (labels[crossing] == -100).all() and torch.equal(labels[~crossing & (labels != -100)],
                                                            plain_labels[~crossing & (labels != -100)])
    assert (inputs[labels == -100] == 0).all()  # only an EOS (a document's last token) loses its target


def _alone(model, inputs, labels, seq_idx):
    """The same loss with every document of every row run on its own, from a fresh state."""
    total, count = 0.0, 0
    for r in range(inputs.shape[0]):
        for d in seq_idx[r].unique():
            keep = seq_idx[r] == d
            x, y = inputs[r][keep][None], labels[r][keep][None]
            n = int((y != -100).sum())
            if n:
                total = total + model(x, targets=y).loss * n
                count += n
    return total / count


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba", "tiny-hybrid"])
def test_packed_loss_and_gradients_equal_each_document_alone(folder, preset, device):
    """On the GPU the Triton kernels' seq_idx paths (conv, scan, SSD) against the documents run one by one."""
    tokens = open_split(folder, "train")
    w = TokenWindows(tokens, 40, seed=2, doc_starts=open_docs(folder, "train", len(tokens)))
    inputs, labels, seq_idx = RankBatches(w, 2, doc_boundaries=True).batch_docs(0, device)
    assert (seq_idx.amax(1) >= 2).all()  # several documents in every row
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(preset)).to(device)
    packed = model(inputs, targets=labels, seq_idx=seq_idx).loss
    packed.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = _alone(model, inputs, labels, seq_idx)
    alone.backward()
    loose = 100.0 if device == "cuda" else 1.0  # the kernels' fp32 dots may run in TF32 on the GPU
    assert_close(packed.detach(), alone.detach(), name=f"{preset} loss", factor=loose)
    for n, p in model.named_parameters():
        assert_close(grads[n], p.grad, grad=True, name=f"{preset} grad {n}", factor=loose)
    leaky = model(inputs, targets=labels).loss  # without seq_idx, state flows across: another loss
    assert (leaky - packed).abs() > 1e-4


def test_training_uses_the_boundaries_unless_turned_off(folder, tmp_path, monkeypatch):
    seen = []
    orig = MambaLMHeadModel.forward

    def spy(self, input_ids, **kw):
        seen.append(kw.get("seq_idx") is not None)
        return orig(self, input_ids, **kw)

    monkeypatch.setattr(MambaLMHeadModel, "forward", spy)
    base = dict(preset="tiny-mamba2", data=folder, steps=2, seq_len=32, batch_size=2, warmup=1, log_every=1,
                eval_every=0, eval_batches=1, save_every=0, sample_tokens=0, progress=False, device="cpu")
    on = train(resolve_config(out=str(tmp_path / "on"), **base))
    assert seen and all(seen)
    seen.clear()
    off = train(resolve_config(out=str(tmp_path / "off"), doc_boundaries=False, **base))
    assert seen and not any(seen)
    assert on["losses"] != off["losses"]
