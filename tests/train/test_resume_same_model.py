"""Resume means the same model: a different model config is refused with the fields; tensors load strictly."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from mamba_parallel import cli
from mamba_parallel.config import ConfigError, get_preset
from mamba_parallel.distributed.state_dict import model_state_dict
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train import checkpoint as ckpt


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("same")
    (root / "corpus.txt").write_text(inspect.getsource(json))
    (root / "four.toml").write_text('preset = "tiny-mamba2"\n[model]\nn_layer = 4\n')
    out = root / "run"
    argv = ["train", "--config", str(root / "four.toml"), "--data", str(root / "corpus.txt"), "--out", str(out),
            "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--device", "cpu", "--sample-tokens", "0",
            "--no-progress", "--eval-every", "0", "--eval-batches", "1"]
    assert cli.main(argv) == 0
    return root, out


def test_resume_with_fewer_layers_is_refused_and_nothing_is_overwritten(run, capsys):
    root, out = run
    capsys.readouterr()
    (root / "two.toml").write_text('preset = "tiny-mamba2"\n[model]\nn_layer = 2\n')
    before = {p: (out / p).read_bytes() for p in ("config.toml", "final/pytorch_model.bin")}
    rc = cli.main(["train", "--config", str(root / "two.toml"), "--out", str(out), "--resume", "--steps", "3",
                   "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "holds a different model (n_layer: 4 in the checkpoint, 2 now)" in err, err
    assert {p: (out / p).read_bytes() for p in before} == before
    assert [s for s, _ in ckpt.complete_checkpoints(str(out))] == [2]


@pytest.mark.parametrize("n_layer,needle", [(2, "unexpected in the checkpoint: backbone.layers.2."),
                                            (5, "missing from the checkpoint: backbone.layers.4.")])
def test_strict_keys_name_missing_and_unexpected_tensors(run, n_layer, needle):
    _, out = run
    path = ckpt.latest_checkpoint(str(out))[1]
    with torch.device("meta"):
        model = MambaLMHeadModel(get_preset("tiny-mamba2", n_layer=n_layer))
    with pytest.raises(ConfigError, match="does not hold this model's tensors") as e:
        ckpt.check_keys(path, model_state_dict(model))
    assert needle in str(e.value)
    with torch.device("meta"):
        same = MambaLMHeadModel(get_preset("tiny-mamba2", n_layer=4))
    ckpt.check_keys(path, model_state_dict(same))


def test_shapes_are_checked_too(run):
    _, out = run
    path = ckpt.latest_checkpoint(str(out))[1]
    with torch.device("meta"):
        wide = MambaLMHeadModel(get_preset("tiny-mamba2", n_layer=4, d_model=96))
    with pytest.raises(ConfigError, match=r"shape mismatch: backbone.embedding.weight \(256, 64\) in the checkpoint, "
                                          r"\(256, 96\) now"):
        ckpt.check_keys(path, model_state_dict(wide))
