"""On one GPU: FSDP2 CPU offload with bf16 weights and activation checkpointing trains (the 7B recipe, on a small
model), and --batch-size auto measures a micro-batch that fits."""

import os

import pytest
import torch

from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer
from mamba_parallel.train.trainer import train

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path_factory.mktemp("offload")
    src = root / "corpus.txt"
    src.write_text(open(os.__file__).read() * 4)
    out = str(root / "tokens")
    prepare_data(str(src), out, ByteTokenizer(), val_fraction=0.05)
    return out


def _cfg(out, data, **kw):
    base = dict(preset="mamba2-130m", data=data, out=str(out), steps=8, seq_len=512, batch_size=4, lr=3e-3,
                warmup=1, log_every=1, eval_every=0, eval_batches=1, save_every=0, sample_tokens=0, progress=False,
                device="cuda", dtype="bf16", save_final=False)
    base.update(kw)
    return resolve_config(**base)


def test_offload_bf16_weights_and_checkpointing_train(tmp_path, data):
    res = train(_cfg(tmp_path / "off", data, cpu_offload=True, param_dtype="bf16", activation_checkpointing=True))
    losses = res["losses"]
    assert all(v == v for v in losses.values()) and losses[8] < losses[1] - 0.5, losses
    assert any("host" in line for line in res["log"] if line.startswith("step "))


def test_batch_size_auto_is_measured(tmp_path, data):
    res = train(_cfg(tmp_path / "auto", data, batch_size="auto", steps=1, seq_len=2048))
    line = next(x for x in res["log"] if x.startswith("--batch-size auto:"))
    assert "measured" in line and int(line.split()[2]) >= 2, line


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-hybrid", "tiny-mamba"])
def test_host_model_drawn_on_the_gpu_gets_the_gpu_models_values(preset):
    """Under --cpu-offload the weights live on the host but are drawn on the GPU (the CPU generator is serial):
    they equal the single-device model initialised on that GPU under the same seed."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mamba_parallel.config import get_preset
    from mamba_parallel.distributed.materialize import materialize
    from mamba_parallel.models.lm import MambaLMHeadModel
    from mamba_parallel.train.trainer import init_model

    config = get_preset(preset)
    ref = init_model(config, torch.device("cuda"), seed=3).state_dict()
    with torch.device("meta"):
        host = MambaLMHeadModel(config)
    materialize(host, config, "cpu", seed=3, draw_device="cuda")
    got = host.state_dict()
    assert sorted(got) == sorted(ref)
    for k, v in got.items():
        assert v.device.type == "cpu" and torch.equal(v, ref[k].cpu()), k
