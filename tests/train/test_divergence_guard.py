"""The divergence guard never saves a non-finite or exploded step, and says how to resume with a lower lr."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train import trainer
from mamba_parallel.train.checkpoint import checkpoint_problem, complete_checkpoints
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    (root / "corpus.txt").write_text(inspect.getsource(json) * 2)
    prepare_data(str(root / "corpus.txt"), str(root / "tokens"), ByteTokenizer(), val_fraction=0.05)
    return str(root / "tokens")


def _flags(out, data, *extra):
    return ["train", "--preset", "tiny-mamba2", "--data", data, "--out", str(out), "--seq-len", "16",
            "--batch-size", "2", "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--device", "cpu", "--no-progress", "--steps", "5", "--save-every", "1",
            "--lr", "0.002", *extra]


def _stopped(capsys, out, step: int) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert f"the last checkpoint, {out / 'checkpoints' / 'step-2'} (step 2), is finite" in err, err
    assert f"mamba-parallel train --out {out} --resume --lr 0.001" in err, err
    assert [s for s, _ in complete_checkpoints(str(out))] == [1, 2]  # nothing saved of the bad step
    assert all(checkpoint_problem(p) is None for _, p in complete_checkpoints(str(out)))
    return err


def test_weights_that_blew_up_in_the_update_are_never_saved(tmp_path, data, monkeypatch, capsys):
    build, calls = trainer.build_optimizer, {"n": 0}

    def poisoned_optimizer(*a, **k):
        opt = build(*a, **k)

        def blow_up(optimizer, args, kwargs):
            calls["n"] += 1
            if calls["n"] == 3:  # the loss of step 3 was fine; its update leaves a NaN weight
                with torch.no_grad():
                    optimizer.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        opt.register_step_post_hook(blow_up)
        return opt

    monkeypatch.setattr(trainer, "build_optimizer", poisoned_optimizer)
    out = tmp_path / "run"
    assert cli.main(_flags(out, data)) == 1
    err = _stopped(capsys, out, 3)
    assert "step 3: the weights are no longer finite after the update: stopped without saving it" in err


def test_an_exploded_loss_is_never_saved(tmp_path, data, monkeypatch, capsys):
    orig, calls = MambaLMHeadModel.lm_loss, {"n": 0}

    def exploding(self, hidden, targets):
        calls["n"] += 1
        loss = orig(self, hidden, targets)
        return loss * 4 if calls["n"] == 3 else loss  # finite, but far above ln(256) x 2

    monkeypatch.setattr(MambaLMHeadModel, "lm_loss", exploding)
    out = tmp_path / "run"
    assert cli.main(_flags(out, data)) == 1
    assert "exploded (above 2 x ln(vocab 256)" in _stopped(capsys, out, 3)


def test_a_non_finite_loss_names_the_last_checkpoint_and_a_lower_lr(tmp_path, data, monkeypatch, capsys):
    orig, calls = MambaLMHeadModel.lm_loss, {"n": 0}

    def poisoned(self, hidden, targets):
        calls["n"] += 1
        loss = orig(self, hidden, targets)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(MambaLMHeadModel, "lm_loss", poisoned)
    out = tmp_path / "run"
    assert cli.main(_flags(out, data)) == 1
    assert "non-finite loss at step 3" in _stopped(capsys, out, 3)
