"""Fault injection: flip, truncate and delete each file of a checkpoint and of a saved model folder in turn.

Every fault is detected (the message names the file), ``--resume`` falls back to the newest checkpoint that
verifies, and nothing is lost: the faulty checkpoint is set aside, byte for byte, never deleted.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import warnings

import pytest

from mamba_parallel import manifest as mf
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.models.formats import CheckpointError
from mamba_parallel.train import checkpoint as ckpt
from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer
from mamba_parallel.train.trainer import train

FAULTS = ("flip", "truncate", "delete")


def _cfg(out, data, **kw):
    base = dict(preset="tiny-mamba2", data=data, out=str(out), steps=4, seq_len=32, batch_size=2, warmup=1,
                log_every=1, eval_every=0, eval_batches=1, save_every=2, keep=3, sample_tokens=0, progress=False,
                device="cpu")
    return resolve_config(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 4-step run: checkpoints step-2 and step-4, final/."""
    root = tmp_path_factory.mktemp("faults")
    (root / "corpus.txt").write_text(inspect.getsource(json) * 2)
    data = str(root / "tokens")
    prepare_data(str(root / "corpus.txt"), data, ByteTokenizer(), val_fraction=0.05)
    train(_cfg(root / "run", data))
    return root / "run", data


def inject(path: str, fault: str) -> None:
    """One fault in one file: a flipped bit in the middle, the last byte cut off, or the file gone."""
    if fault == "delete":
        os.unlink(path)
        return
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    if fault == "flip":
        data[len(data) // 2] ^= 0x04
    else:
        data = data[:-1]
    with open(path, "wb") as fh:
        fh.write(bytes(data))


def _files(folder) -> list[str]:
    return mf.list_files(str(folder)) + [mf.MANIFEST]


def test_every_fault_of_every_checkpoint_file_is_detected(run, tmp_path):
    out, _ = run
    source = out / "checkpoints" / "step-4"
    names = _files(source)
    assert {".metadata", "__0_0.distcp", "train.json", mf.MANIFEST} <= set(names), names
    detected = 0
    for name in names:
        for fault in FAULTS:
            copy = tmp_path / f"{name}-{fault}"
            shutil.copytree(source, copy)
            inject(str(copy / name), fault)
            problem = ckpt.checkpoint_problem(str(copy))
            assert problem is not None, (name, fault)
            assert name in problem or (name == mf.MANIFEST and "manifest" in problem), (name, fault, problem)
            detected += 1
            shutil.rmtree(copy)
    assert detected == len(names) * len(FAULTS)  # 100%
    assert ckpt.checkpoint_problem(str(source)) is None


def test_every_fault_of_every_model_file_is_detected(run, tmp_path):
    out, _ = run
    source = out / "final"
    names = _files(source)
    assert {"config.json", "pytorch_model.bin", mf.MANIFEST} <= set(names), names
    for name in names:
        for fault in FAULTS:
            copy = tmp_path / f"{name}-{fault}"
            shutil.copytree(source, copy)
            inject(str(copy / name), fault)
            if name == mf.MANIFEST and fault == "delete":
                # without its manifest a folder looks like one from elsewhere: it loads, saying it is unchecked,
                # and `verify` fails
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    MambaLMHeadModel.from_pretrained(str(copy))
                assert any("without an integrity check" in str(w.message) for w in seen)
                with pytest.raises(mf.ManifestError, match="no " + mf.MANIFEST):
                    mf.verify_folder(str(copy))
            else:
                with pytest.raises(CheckpointError) as e:
                    MambaLMHeadModel.from_pretrained(str(copy))
                assert name in str(e.value) or "manifest" in str(e.value), (name, fault, str(e.value))
            shutil.rmtree(copy)


@pytest.mark.parametrize("victim,fault", [("__0_0.distcp", "flip"), (".metadata", "truncate"),
                                          (mf.MANIFEST, "delete")])
def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(run, tmp_path, victim, fault):
    finished, data = run
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "final")
    bad = out / "checkpoints" / "step-4"
    inject(str(bad / victim), fault)
    kept = {n: (bad / n).read_bytes() for n in os.listdir(bad)}
    result = train(_cfg(out, data, steps=5, resume=True))
    log = "\n".join(result["log"])
    assert f"skipped {bad}" in log and victim in log.split("skipped", 1)[1].splitlines()[0], log
    assert "resumed from " + str(out / "checkpoints" / "step-2") in log, log
    assert sorted(result["losses"]) == [3, 4, 5]
    aside = out / "checkpoints" / "step-4.corrupt"
    assert {n: (aside / n).read_bytes() for n in os.listdir(aside)} == kept  # nothing lost
    assert [s for s, _ in ckpt.complete_checkpoints(str(out))] == [2, 4, 5]
    assert all(ckpt.checkpoint_problem(p) is None for _, p in ckpt.complete_checkpoints(str(out)))


def test_resume_refuses_when_no_checkpoint_verifies(run, tmp_path, capsys):
    from mamba_parallel import cli

    finished, data = run
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    for step in (2, 4):
        inject(str(out / "checkpoints" / f"step-{step}" / "__0_0.distcp"), "flip")
    rc = cli.main(["train", "--out", str(out), "--resume", "--steps", "6", "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "no checkpoint" in err and "step-4: " in err and "step-2: " in err, err
    assert sorted(os.listdir(out / "checkpoints")) == ["step-2.corrupt", "step-4.corrupt"]
