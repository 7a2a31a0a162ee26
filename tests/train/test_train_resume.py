"""Checkpoints on one process: exact resume, incomplete checkpoints skipped, pruning, the NaN guard, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.checkpoint import complete_checkpoints, latest_checkpoint
from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer
from mamba_parallel.train import trainer
from mamba_parallel.train.trainer import train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import inspect
    root = tmp_path_factory.mktemp("resume")
    src = root / "corpus.txt"
    src.write_text(inspect.getsource(json) * 3)
    folder = str(root / "tokens")
    prepare_data(str(src), folder, ByteTokenizer(), val_fraction=0.05)
    return folder


def _cfg(out, data, **kw):
    base = dict(preset="tiny-mamba2", data=data, out=str(out), steps=4, seq_len=32, batch_size=2, lr=3e-3, warmup=1,
                log_every=1, eval_every=0, eval_batches=1, save_every=2, keep=3, sample_tokens=0, progress=False,
                device="cpu")
    base.update(kw)
    return resolve_config(**base)


def _flags(out, data, *extra):
    return ["train", "--preset", "tiny-mamba2", "--data", data, "--out", str(out), "--seq-len", "32",
            "--batch-size", "2", "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--device", "cpu", "--no-progress", *extra]


def test_resume_is_bit_exact(tmp_path, data, monkeypatch):
    straight = train(_cfg(tmp_path / "a", data, steps=6, save_every=3))
    # The same 6-step run interrupted during step 3 (as SIGTERM's handler would), then resumed for 3 more.
    orig, calls = MambaLMHeadModel.lm_loss, {"n": 0}

    def interrupt_at_3(self, hidden, labels):
        calls["n"] += 1
        if calls["n"] == 3:
            trainer._STOP["sigterm"] = True
        return orig(self, hidden, labels)

    monkeypatch.setattr(MambaLMHeadModel, "lm_loss", interrupt_at_3)
    first = train(_cfg(tmp_path / "b", data, steps=6, save_every=0))
    monkeypatch.undo()
    assert first["stopped"] and sorted(first["losses"]) == [1, 2, 3]
    second = train(_cfg(tmp_path / "b", data, steps=6, save_every=3, resume=True))
    assert sorted(second["losses"]) == [4, 5, 6]
    assert {**first["losses"], **second["losses"]} == straight["losses"]  # bit-exact fp32
    a = MambaLMHeadModel.from_pretrained(str(tmp_path / "a" / "final")).state_dict()
    b = MambaLMHeadModel.from_pretrained(str(tmp_path / "b" / "final")).state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), f"final weight {k} differs after resume"


def test_incomplete_checkpoints_are_skipped_and_pruned(tmp_path, data):
    out = tmp_path / "run"
    train(_cfg(out, data, steps=4, save_every=2))
    ck = out / "checkpoints"
    (ck / "step-6.tmp").mkdir()  # an interrupted save
    (ck / "step-8").mkdir()  # a folder without DCP's .metadata
    (ck / "step-8" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(str(out))[0] == 4
    resumed = train(_cfg(out, data, steps=7, save_every=1, keep=2, resume=True))
    assert sorted(resumed["losses"]) == [5, 6, 7]
    assert [s for s, _ in complete_checkpoints(str(out))] == [6, 7]  # --keep 2 pruned the rest
    assert not (ck / "step-6.tmp").exists()


def test_existing_run_needs_resume(tmp_path, data, capsys):
    out = tmp_path / "run"
    train(_cfg(out, data, steps=2, save_every=2))
    assert cli.main(_flags(out, data, "--steps", "3")) == 2
    assert "--resume" in capsys.readouterr().err


def test_nan_guard_stops_before_the_update(tmp_path, data, monkeypatch, capsys):
    out = tmp_path / "run"
    train(_cfg(out, data, steps=2, save_every=2))
    before = sorted(os.listdir(out / "checkpoints" / "step-2"))
    orig, calls = MambaLMHeadModel.lm_loss, {"n": 0}

    def poisoned(self, hidden, labels):
        calls["n"] += 1
        loss = orig(self, hidden, labels)
        return loss * float("nan") if calls["n"] == 2 else loss  # the 2nd resumed step = step 4

    monkeypatch.setattr(MambaLMHeadModel, "lm_loss", poisoned)
    rc = cli.main(_flags(out, data, "--steps", "6", "--save-every", "1", "--resume"))
    err = capsys.readouterr().err
    assert rc == 1 and "non-finite loss at step 4" in err, err
    assert [s for s, _ in complete_checkpoints(str(out))] == [2, 3]  # nothing saved for the bad step
    assert sorted(os.listdir(out / "checkpoints" / "step-2")) == before
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert max(x["step"] for x in lines) == 3


def test_sigterm_saves_a_loadable_checkpoint_and_exits_0(tmp_path, data):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mamba_parallel.cli", *_flags(out, data, "--steps", "100000",
                                                                                 "--save-every", "0")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "SIGTERM" in output
    step, _ = latest_checkpoint(str(out))
    assert step >= 2
    resumed = train(_cfg(out, data, steps=step + 1, resume=True))
    assert sorted(resumed["losses"]) == [step + 1]
