"""`--recompute ITEMS` (train config, trainer, bench_train, bench_scaling): validation, MAMBA_PARALLEL_RECOMPUTE set
for the run and restored after it (left alone without the flag), the warnings, and a CPU bench_train run whose
loss after an optimizer step equals the run without the option."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import warnings

import pytest

from mamba_parallel.bench import bench_scaling, bench_train
from mamba_parallel.config import ConfigError
from mamba_parallel.layers import recompute
from mamba_parallel.layers.recompute import RECOMPUTE_ENV, RECOMPUTE_ITEMS, recompute_items, set_recompute
from mamba_parallel.train import trainer
from mamba_parallel.train.config import MACHINE_FIELDS, add_train_flags, resolve_config
from mamba_parallel.train.trainer import recompute_option


# ---- config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, bad", [("conv,bogus", "bogus"), ("Gate", "Gate"), ("conv;gate", "conv;gate")])
def test_config_refuses_unknown_items(value, bad, tmp_path):
    with pytest.raises(ConfigError, match=rf"--recompute: unknown item\(s\) {bad} .*conv, dt, gate, states"):
        resolve_config(recompute=value, out=str(tmp_path))


def test_config_accepts_and_is_a_machine_setting(tmp_path):
    cfg = resolve_config(recompute=" conv, gate ", out=str(tmp_path))
    assert cfg.recompute == " conv, gate " and 'recompute = " conv, gate "' in cfg.to_toml()
    assert resolve_config(out=str(tmp_path)).recompute == ""
    assert "recompute" in MACHINE_FIELDS  # a resume may change it, like --activation-checkpointing
    (tmp_path / "config.toml").write_text('recompute = "states"\nsteps = 7\n')
    resumed = resolve_config(resume=True, out=str(tmp_path))
    assert resumed.recompute == "" and resumed.steps == 7  # not taken from the run's config.toml


def test_flag_and_help():
    p = argparse.ArgumentParser()
    add_train_flags(p)
    assert p.parse_args(["--recompute", "conv,dt"]).recompute == "conv,dt"
    assert p.parse_args([]).recompute is None  # not given: the config default (""), the variable decides
    text = " ".join(p.format_help().split())
    assert "--recompute ITEMS" in text and "Default: keep everything" in text and "(default: )" not in text
    for item in RECOMPUTE_ITEMS:  # the help's list cannot drift from layers/recompute.py
        assert f"{item} = " in text, item


# ---- set_recompute and the run's context ---------------------------------------------------------------------------
def test_set_recompute_validates_and_returns_previous(monkeypatch):
    monkeypatch.setenv(RECOMPUTE_ENV, "gate")
    assert set_recompute("conv,states") == "gate"
    assert recompute_items() == {"conv", "states"}
    with pytest.raises(ValueError, match="bogus"):
        set_recompute("conv,bogus")
    assert os.environ[RECOMPUTE_ENV] == "conv,states"  # a refused value leaves the variable as it was
    assert set_recompute(None) == "conv,states" and RECOMPUTE_ENV not in os.environ
    assert recompute_items() == frozenset()


@pytest.mark.parametrize("user", [None, "states", "gate , conv"])
def test_flag_sets_the_variable_for_the_run_and_restores_it(user, monkeypatch):
    if user is None:
        monkeypatch.delenv(RECOMPUTE_ENV, raising=False)
    else:
        monkeypatch.setenv(RECOMPUTE_ENV, user)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recompute_option("conv,gate") as active:
            assert os.environ[RECOMPUTE_ENV] == "conv,gate" and recompute_items() == {"conv", "gate"}
            assert active == "conv,gate"
    assert os.environ.get(RECOMPUTE_ENV) == user
    overrides = [str(w.message) for w in caught if "overrides" in str(w.message)]
    if user == "states":  # a different value: the flag wins, with a warning
        assert overrides == [f"--recompute conv,gate overrides {RECOMPUTE_ENV}=states for this run"]
    else:  # unset, or the same items in another spelling: nothing to say
        assert overrides == []


def test_no_flag_leaves_the_variable_alone(monkeypatch):
    monkeypatch.setenv(RECOMPUTE_ENV, "dt,conv")
    with recompute_option("") as active:
        assert os.environ[RECOMPUTE_ENV] == "dt,conv" and active == "conv,dt"  # reported in RECOMPUTE_ITEMS order
    assert os.environ[RECOMPUTE_ENV] == "dt,conv"
    monkeypatch.setenv(RECOMPUTE_ENV, "conv,nope")  # a bad variable fails before the run, naming it
    with pytest.raises(ConfigError, match=f"{RECOMPUTE_ENV}='conv,nope': unknown nope"):
        with recompute_option(""):
            pass
    assert os.environ[RECOMPUTE_ENV] == "conv,nope"


def test_compile_warns_for_eager_only_items(monkeypatch):
    monkeypatch.delenv(RECOMPUTE_ENV, raising=False)
    with pytest.warns(UserWarning, match=r"--compile: recompute item\(s\) conv, gate have no effect"):
        with recompute_option("gate,conv,states", compiled=True):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "states" works compiled: no warning, no error
        with recompute_option("states", compiled=True):
            pass
    assert RECOMPUTE_ENV not in os.environ


def test_train_runs_under_the_flag(tmp_path, monkeypatch):
    """train() holds the flag's value while the loop (_train) runs and restores the variable afterwards."""
    monkeypatch.setenv(RECOMPUTE_ENV, "states")
    seen = []
    monkeypatch.setattr(trainer, "_train", lambda cfg: seen.append(os.environ.get(RECOMPUTE_ENV)) or {"step": 0})
    with pytest.warns(UserWarning, match="overrides"):
        trainer.train(resolve_config(recompute="conv,gate", out=str(tmp_path)))
    trainer.train(resolve_config(out=str(tmp_path)))
    assert seen == ["conv,gate", "states"] and os.environ[RECOMPUTE_ENV] == "states"


# ---- benchmarks ----------------------------------------------------------------------------------------------------
def _bench(tmp_path, name: str, *flags: str, warmup: int = 1) -> dict:
    path = tmp_path / f"{name}.json"
    assert bench_train.main(["--preset", "tiny-mamba2", "--device", "cpu", "--seq-len", "32", "--batch-size", "2",
                             "--steps", "1", "--warmup-steps", str(warmup), "--dtype", "fp32", "--json", str(path),
                             *flags]) == 0
    return json.loads(path.read_text())


def test_bench_train_records_flag_and_keeps_the_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    monkeypatch.delenv(RECOMPUTE_ENV, raising=False)
    added = []
    orig_add = recompute.RecomputeInBackward.add
    monkeypatch.setattr(recompute.RecomputeInBackward, "add", lambda self, out, fn: added.append(1)
                        or orig_add(self, out, fn))
    plain = _bench(tmp_path, "plain")
    assert plain["recompute"] == "" and not added
    rebuilt = _bench(tmp_path, "rebuilt", "--recompute", "gate,conv")
    assert rebuilt["recompute"] == "conv,gate" and added  # the layers saw the option
    assert RECOMPUTE_ENV not in os.environ  # restored after the run
    # the timed step follows one optimizer step (warm-up): its loss depends on the first step's gradients, by far
    # more than the JSON's 4 decimals (a wrongly rebuilt tensor would show)
    first = _bench(tmp_path, "first", "--recompute", "conv,gate", warmup=0)
    assert abs(first["final_loss"] - plain["final_loss"]) > 1e-2
    assert rebuilt["final_loss"] == plain["final_loss"]
    monkeypatch.setenv(RECOMPUTE_ENV, "gate")  # no flag: the user's variable decides and is recorded
    assert _bench(tmp_path, "env")["recompute"] == "gate" and os.environ[RECOMPUTE_ENV] == "gate"


def test_bench_train_refuses_unknown_items(tmp_path):
    with pytest.raises(ConfigError, match=r"--recompute: unknown item\(s\) nope"):
        bench_train.main(["--preset", "tiny-mamba2", "--device", "cpu", "--recompute", "conv,nope"])


def test_bench_scaling_forwards_the_flag(capsys):
    assert bench_scaling.main(["--dry-run", "--models", "tiny-mamba2", "--layouts", "1gpu", "--gpus", "1",
                               "--recompute", "conv,gate"]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert cmd[cmd.index("--recompute") + 1] == "conv,gate"
    with pytest.raises(SystemExit):
        bench_scaling.main(["--dry-run", "--gpus", "1", "--recompute", "conv,nope"])
    assert "--recompute: unknown item(s) nope" in capsys.readouterr().err
