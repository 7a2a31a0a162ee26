"""No silent flags: a setting with no effect in the chosen mode is an error or a one-line warning; --dist-timeout
reaches the process group."""

from __future__ import annotations

import pytest

from mamba_parallel import cli
from mamba_parallel.config import ConfigError
from mamba_parallel.train import flag_effects, trainer
from mamba_parallel.train.config import resolve_config


def _check(world_size=1, prepared=False, **kw):
    return flag_effects.check(resolve_config(**kw), world_size, prepared)


@pytest.mark.parametrize("kw,needle", [
    (dict(parallel="auto", tp=2), "--tp 2 with --parallel auto: auto chooses tp, cp and pp itself"),
    (dict(parallel="auto", cp=2, seq_len=64), "--cp 2 with --parallel auto"),
    (dict(dp_mode="ddp", dp_replicate=2), "--dp-replicate 2 with --dp-mode ddp"),
])
def test_flags_that_would_be_ignored_are_errors(kw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _check(world_size=4, **kw)


@pytest.mark.parametrize("world,kw,needle", [
    (1, dict(fsdp_param_dtype="bf16"), "--fsdp-param-dtype bf16: no effect without data parallelism"),
    (1, dict(ddp_bf16_grads=True), "--ddp-bf16-grads: no effect without data parallelism"),
    (2, dict(tp=2, reshard_after_forward=False), "--no-reshard-after-forward: no effect without data parallelism"),
    (2, dict(dp_mode="ddp", fsdp_blocks_per_unit=2), "--fsdp-blocks-per-unit 2: FSDP options, no effect with "
                                                     "--dp-mode ddp"),
    (2, dict(ddp_bucket_mb=50.0), "--ddp-bucket-mb 50.0: DDP options, no effect with --dp-mode fsdp"),
    (1, dict(sample_tokens=0, sample_prompt="x"), "--sample-prompt: no effect with --sample-tokens 0"),
])
def test_flags_without_effect_warn_in_one_line(world, kw, needle):
    assert _check(world_size=world, **kw) == [needle]


def test_nothing_is_said_of_settings_that_act():
    assert _check(world_size=2, fsdp_param_dtype="bf16", reshard_after_forward=False) == []
    assert _check(world_size=2, dp_mode="ddp", ddp_bf16_grads=True) == []
    assert _check(world_size=1) == []
    assert _check(prepared=True, data="tok", val_fraction=0.1) == [
        "--val-fraction 0.1: no effect on a prepared token folder (--data tok); its split was made when it was "
        "prepared"]


def test_the_warning_reaches_the_run_log(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text to learn from " * 60)
    rc = cli.main(["train", "--preset", "tiny-mamba2", "--data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"),
                   "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--device", "cpu", "--sample-tokens", "0",
                   "--no-progress", "--ddp-bf16-grads"])
    assert rc == 0
    assert "warning: --ddp-bf16-grads: no effect without data parallelism" in capsys.readouterr().out
    rc = cli.main(["train", "--preset", "tiny-mamba2", "--out", str(tmp_path / "p"), "--device", "cpu",
                   "--parallel", "auto", "--tp", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tp 2 with --parallel auto" in err and len(err.strip().splitlines()) == 1, err


def test_dist_timeout_reaches_the_process_group(tmp_path, monkeypatch):
    corpus = tmp_path / "a.txt"
    corpus.write_text("text to learn from " * 60)
    asked = {}
    orig = trainer.init_distributed

    def spy(device=None, timeout_s=None, **kw):
        asked["timeout_s"] = timeout_s
        return orig(device, timeout_s=timeout_s, **kw)

    monkeypatch.setattr(trainer, "init_distributed", spy)
    trainer.train(resolve_config(preset="tiny-mamba2", data=str(corpus), out=str(tmp_path / "t"), steps=1, seq_len=16,
                                 batch_size=2, sample_tokens=0, progress=False, device="cpu", eval_batches=1,
                                 dist_timeout=77))
    assert asked == {"timeout_s": 77}
