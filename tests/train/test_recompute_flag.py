"""`--recompute ITEMS` (train config, trainer, bench_train, bench_scaling): validation, the layers of the built
model carry the items (no environment variable), the --compile warning, and a CPU bench_train run whose loss after
an optimizer step equals the run without the option. `--tp-overlap` reaches apply_tensor_parallel."""

from __future__ import annotations

import argparse
import json
import shlex
import warnings

import pytest
import torch

from mamba_parallel.bench import bench_scaling, bench_train
from mamba_parallel.config import ConfigError
from mamba_parallel.distributed.data_parallel import DistEnv
from mamba_parallel.distributed.parallel_dims import ParallelDims
from mamba_parallel.layers import recompute
from mamba_parallel.layers.recompute import RECOMPUTE_ITEMS
from mamba_parallel.train import trainer
from mamba_parallel.train.config import DEFAULT_RECOMPUTE, MACHINE_FIELDS, add_train_flags, resolve_config
from mamba_parallel.train.trainer import build_parallel_model, resolve_recompute


# ---- config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, bad", [("conv,bogus", "bogus"), ("Gate", "Gate"), ("conv;gate", "conv;gate")])
def test_config_refuses_unknown_items(value, bad, tmp_path):
    with pytest.raises(ConfigError, match=rf"--recompute: unknown item\(s\) {bad} .*conv, dt, gate, states"):
        resolve_config(recompute=value, out=str(tmp_path))


def test_config_accepts_and_is_a_machine_setting(tmp_path):
    cfg = resolve_config(recompute=" conv, gate ", out=str(tmp_path))
    assert cfg.recompute == " conv, gate " and 'recompute = " conv, gate "' in cfg.to_toml()
    assert resolve_config(out=str(tmp_path)).recompute == DEFAULT_RECOMPUTE == "conv"
    assert resolve_config(recompute="none", out=str(tmp_path)).recompute == "none"
    assert "recompute" in MACHINE_FIELDS  # a resume may change it, like --activation-checkpointing
    (tmp_path / "config.toml").write_text('recompute = "states"\nsteps = 7\n')
    resumed = resolve_config(resume=True, out=str(tmp_path))
    assert resumed.recompute == "conv" and resumed.steps == 7  # not taken from the run's config.toml


def test_flag_and_help():
    p = argparse.ArgumentParser()
    add_train_flags(p)
    assert p.parse_args(["--recompute", "conv,dt"]).recompute == "conv,dt"
    assert p.parse_args([]).recompute is None  # not given: the config default ("conv")
    text = " ".join(p.format_help().split())
    assert "--recompute ITEMS" in text and "none = keep everything." in text and "(default: conv)" in text
    for item in RECOMPUTE_ITEMS:  # the help's list cannot drift from layers/recompute.py
        assert f"{item} = " in text, item


# ---- the trainer -------------------------------------------------------------------------------------------------
def test_resolve_recompute_orders_validates_and_warns():
    assert resolve_recompute(" gate, conv") == "conv,gate" and resolve_recompute("") == ""
    assert resolve_recompute("none") == resolve_recompute(" none ") == ""
    with pytest.raises(ConfigError, match=r"--recompute: unknown item\(s\) nope; .*states, or none"):
        resolve_recompute("conv,nope")
    with pytest.raises(ConfigError, match=r"unknown item\(s\) none"):  # "none" is a whole value, not an item
        resolve_recompute("conv,none")
    with pytest.warns(UserWarning, match=r"--compile: recompute item\(s\) conv, gate have no effect"):
        resolve_recompute("gate,conv,states", compiled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "states" works compiled: no warning, no error
        resolve_recompute("states", compiled=True)
        # the default's conv under --compile: compiled blocks keep the conv output, nothing to warn about
        assert resolve_recompute(DEFAULT_RECOMPUTE, compiled=True) == "conv"


def test_built_model_carries_the_items(tmp_path):
    cfg = resolve_config(preset="tiny-hybrid", recompute="gate,conv", device="cpu", out=str(tmp_path))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    _, model = build_parallel_model(cfg.model_config(), cfg, env, ParallelDims(world_size=1), resuming=False)
    mixers = [b.mixer for b in model.backbone.layers if hasattr(b.mixer, "recompute")]
    assert mixers and all(m.recompute == {"conv", "gate"} for m in mixers)


def test_tp_overlap_flag_reaches_parallelize(tmp_path, monkeypatch):
    p = argparse.ArgumentParser()
    add_train_flags(p)
    assert p.parse_args(["--tp-overlap"]).tp_overlap is True
    assert "tp_overlap" in MACHINE_FIELDS
    seen = {}
    monkeypatch.setattr(trainer, "parallelize", lambda model, dims, **kw: seen.update(kw) or model)
    cfg = resolve_config(preset="tiny-mamba2", tp_overlap=True, device="cpu", out=str(tmp_path))
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    build_parallel_model(cfg.model_config(), cfg, env, ParallelDims(world_size=1), resuming=False)
    assert seen["tp_overlap"] is True


# ---- benchmarks ----------------------------------------------------------------------------------------------------
def _bench(tmp_path, name: str, *flags: str, warmup: int = 1) -> dict:
    path = tmp_path / f"{name}.json"
    assert bench_train.main(["--preset", "tiny-mamba2", "--device", "cpu", "--seq-len", "32", "--batch-size", "2",
                             "--steps", "1", "--warmup-steps", str(warmup), "--dtype", "fp32", "--json", str(path),
                             *flags]) == 0
    return json.loads(path.read_text())


def test_bench_train_records_flag_and_keeps_the_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    added = []
    orig_add = recompute.RecomputeInBackward.add
    monkeypatch.setattr(recompute.RecomputeInBackward, "add", lambda self, out, fn: added.append(1)
                        or orig_add(self, out, fn))
    plain = _bench(tmp_path, "plain", "--recompute", "none")
    assert plain["recompute"] == "" and not added
    default = _bench(tmp_path, "default")
    assert default["recompute"] == "conv" and added  # the training default rebuilds the conv output
    added.clear()
    rebuilt = _bench(tmp_path, "rebuilt", "--recompute", "gate,conv")
    assert rebuilt["recompute"] == "conv,gate" and added  # the layers saw the option
    # the timed step follows one optimizer step (warm-up): its loss depends on the first step's gradients, by far
    # more than the JSON's 4 decimals (a wrongly rebuilt tensor would show)
    first = _bench(tmp_path, "first", "--recompute", "conv,gate", warmup=0)
    assert abs(first["final_loss"] - plain["final_loss"]) > 1e-2
    assert rebuilt["final_loss"] == default["final_loss"] == plain["final_loss"]


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
