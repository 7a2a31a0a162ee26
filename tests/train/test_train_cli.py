"""The `mamba-parallel` command line: the default train run end to end (shortened), generate, flags and TOML."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.config import ConfigError
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.config import resolve_config


def test_default_train_end_to_end_then_generate(tmp_path, capsys):
    out = tmp_path / "default"
    # The no-argument default (small-byte-mamba2 on the stdlib sources), shortened for CI.
    rc = cli.main(["train", "--out", str(out), "--steps", "24", "--seq-len", "32", "--batch-size", "4",
                   "--warmup", "3", "--log-every", "4", "--eval-every", "12", "--eval-batches", "1",
                   "--sample-tokens", "16", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    train_lines = [x for x in lines if "loss" in x]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gib"):
        assert key in train_lines[0], key
    assert [x["step"] for x in lines if "eval_loss" in x] == [12, 24]
    first, last = train_lines[0]["loss"], train_lines[-1]["loss"]
    assert last < first - 0.5, f"loss did not fall: {first} -> {last}"
    assert "---- sample ----\ndef " in printed
    assert (out / "config.toml").is_file() and (out / "checkpoints" / "step-24" / ".metadata").is_file()
    try:  # loss.png beside metrics.jsonl, or one line naming the missing plotting extra
        import matplotlib  # noqa: F401
        assert (out / "loss.png").is_file() and f"loss curve: {out / 'loss.png'}" in printed
    except ImportError:
        assert not (out / "loss.png").exists() and "no loss curve: matplotlib is not installed" in printed
    again = resolve_config(toml_path=str(out / "config.toml"))  # the resolved config reads back as it was
    assert again.steps == 24 and again.seq_len == 32 and again.preset == "small-byte-mamba2"

    model = MambaLMHeadModel.from_pretrained(str(out / "final"))
    assert model.config.d_model == 128
    assert cli.main(["generate", "--checkpoint", str(out / "final"), "--prompt", "import ", "--max-new-tokens",
                     "8", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("import ")
    assert cli.main(["convert", str(out / "final"), str(out / "hf"), "--format", "hf"]) == 0
    hf = MambaLMHeadModel.from_pretrained(str(out / "hf")).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(hf[k], v), k


@pytest.mark.parametrize("argv, message", [
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--preset", "nope"], "invalid choice: 'nope'"),
    (["train", "--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["train", "--steps", "x"], "invalid int value"),
])
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_config_file_then_flags(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny-mamba2"\nsteps = 7\nbatch-size = 3\nlr = 1\n\n[model]\nd_model = 32\n')
    args = cli.build_parser().parse_args(["train", "--config", str(toml), "--steps", "9"])
    cfg = resolve_config(args)
    assert (cfg.steps, cfg.batch_size, cfg.lr, cfg.preset) == (9, 3, 1.0, "tiny-mamba2")
    assert cfg.model_config().d_model == 32
    for body, message in [("stepz = 3\n", "unknown key 'stepz'"), ("steps = 'many'\n", "steps: expected int"),
                          ("[model]\nd_modl = 3\n", "unknown field(s) ['d_modl']"), ("steps = [\n", "invalid TOML")]:
        toml.write_text(body)
        with pytest.raises(ConfigError, match=re.escape(message)):
            resolve_config(toml_path=str(toml))
        assert cli.main(["train", "--config", str(toml), "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(["train", "--seq-len", "30", "--cp", "4", "--out", str(tmp_path / "x")]) == 2
    assert "not divisible by --cp 4" in capsys.readouterr().err


def test_short_data_exits_2(tmp_path, capsys):
    src = tmp_path / "short.txt"
    src.write_text("tiny")
    rc = cli.main(["train", "--preset", "tiny-mamba2", "--data", str(src), "--out", str(tmp_path / "o"),
                   "--seq-len", "32", "--device", "cpu"])
    assert rc == 2
    assert "--seq-len 32 needs at least 33" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / "checkpoints")


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--config", "--preset", "--steps", "--batch-size", "--grad-accum", "--seq-len", "--lr", "--warmup",
                 "--seed", "--device", "--dtype", "--out", "--resume", "--data", "--tokenizer", "--log-every",
                 "--eval-every", "--save-every", "--keep", "--dp-mode", "--activation-checkpointing", "--compile",
                 "--tp", "--cp", "--parallel"):
        assert flag in text, flag


def test_example_configs_resolve():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    names = sorted(f for f in os.listdir(root) if f.endswith(".toml"))
    assert "small-byte-mamba2.toml" in names
    for name in names:
        cfg = resolve_config(toml_path=os.path.join(root, name))
        cfg.model_config()
    # The spelled-out default is the no-argument default.
    assert resolve_config(toml_path=os.path.join(root, "small-byte-mamba2.toml")).to_toml() == \
        resolve_config().to_toml()


@pytest.mark.gpu
def test_gpu_bf16_compile_checkpointing(tmp_path):
    out = tmp_path / "gpu"
    rc = cli.main(["train", "--preset", "tiny-mamba2", "--out", str(out), "--device", "cuda", "--dtype", "bf16",
                   "--compile", "--activation-checkpointing", "--steps", "6", "--seq-len", "64", "--batch-size", "4",
                   "--log-every", "1", "--sample-tokens", "8", "--no-progress"])
    assert rc == 0
    lines = [json.loads(x) for x in open(out / "metrics.jsonl") if '"loss"' in x]
    assert len(lines) == 6 and all(x["loss"] == x["loss"] for x in lines)
    assert lines[-1]["mem_gib"] > 0
