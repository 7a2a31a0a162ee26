"""--deterministic: bitwise-repeatable steps, for the run only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mamba_parallel.ops.backend import autotune_enabled
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train import trainer
from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.determinism import CUBLAS_ENV


def _cfg(out, **kw):
    base = dict(preset="tiny-mamba2", out=str(out), steps=1, seq_len=16, batch_size=2, warmup=1, log_every=1,
                eval_every=0, eval_batches=1, save_every=0, sample_tokens=0, progress=False, device="cpu")
    return resolve_config(**{**base, **kw})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("det") / "a.txt"
    path.write_text(json.__doc__ * 4)
    return str(path)


def test_deterministic_holds_for_the_run_only(tmp_path, corpus, monkeypatch):
    seen = []
    orig = MambaLMHeadModel.forward

    def spy(self, *a, **k):
        seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get(CUBLAS_ENV),
                     autotune_enabled()))
        return orig(self, *a, **k)

    monkeypatch.setattr(MambaLMHeadModel, "forward", spy)
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    trainer.train(_cfg(tmp_path / "on", data=corpus, deterministic=True))
    assert seen and all(s == (True, ":4096:8", False) for s in seen)
    assert not torch.are_deterministic_algorithms_enabled() and CUBLAS_ENV not in os.environ
    seen.clear()
    trainer.train(_cfg(tmp_path / "off", data=corpus))
    assert seen and not any(s[0] for s in seen)


@pytest.mark.gpu
def test_two_deterministic_runs_are_bitwise_equal(tmp_path, corpus):
    """Two processes (so the kernels' launch configurations are chosen twice), bf16, Mamba-2 and Mamba-1."""
    for preset in ("tiny-mamba2", "tiny-mamba"):
        finals = []
        for run in ("a", "b"):
            out = tmp_path / f"{preset}-{run}"
            argv = [sys.executable, "-m", "mamba_parallel.cli", "train", "--preset", preset, "--data", corpus,
                    "--out", str(out), "--steps", "4", "--seq-len", "128", "--batch-size", "4", "--dtype", "bf16",
                    "--device", "cuda", "--deterministic", "--sample-tokens", "0", "--no-progress", "--log-every",
                    "1", "--eval-every", "0", "--eval-batches", "1"]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
                      if '"loss"' in x]
            finals.append((losses, MambaLMHeadModel.from_pretrained(str(out / "final")).state_dict()))
        (la, sa), (lb, sb) = finals
        assert la == lb, f"{preset}: losses differ between two deterministic runs: {la} vs {lb}"
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{preset}: final weight {k} differs between two deterministic runs"
