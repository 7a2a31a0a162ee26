"""`mamba-parallel train --preset tiny-mamba3` on CPU end to end (shortened), then generate from its model."""

from __future__ import annotations

import json

import pytest

from mamba_parallel import cli
from mamba_parallel.models import MambaLMHeadModel


@pytest.mark.parametrize("preset", ["tiny-mamba3", "tiny-mamba3-mimo"])
def test_train_then_generate(tmp_path, capsys, preset):
    data = tmp_path / "text.txt"
    data.write_text("the trapezoid feeds each token in twice; the phase turns the state. " * 40)
    out = tmp_path / "run"
    rc = cli.main(["train", "--preset", preset, "--data", str(data), "--out", str(out), "--steps", "5",
                   "--seq-len", "32", "--batch-size", "2", "--warmup", "2", "--lr", "0.01", "--log-every", "1",
                   "--eval-every", "0", "--sample-tokens", "0", "--no-progress"])
    assert rc == 0
    losses = [x["loss"] for x in map(json.loads, open(out / "metrics.jsonl")) if "loss" in x]
    assert len(losses) == 5 and losses[-1] < losses[0]
    model = MambaLMHeadModel.from_pretrained(str(out / "final"))
    assert model.config.layer == "Mamba3"
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(out / "final"), "--prompt", "the ", "--max-new-tokens", "6",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("the ")
