"""Mamba-3 language models: presets, pure and hybrid stacks, mamba_ssm checkpoint folders (bit-identical round trip),
generation equal to the full forward, clear config errors."""

from __future__ import annotations

import json

import pytest
import torch

from mamba_parallel.config import ConfigError, MambaConfig, get_preset
from mamba_parallel.manifest import MANIFEST
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.models.formats import CheckpointError, load_pretrained, save_pretrained


def _model(name_or_cfg, seed=0, **ssm) -> MambaLMHeadModel:
    cfg = get_preset(name_or_cfg).to_dict() if isinstance(name_or_cfg, str) else dict(name_or_cfg)
    cfg["ssm_cfg"] = dict(cfg["ssm_cfg"], **ssm)
    torch.manual_seed(seed)
    model = MambaLMHeadModel(MambaConfig.from_dict(cfg)).eval()
    with torch.no_grad():  # biases / norms start at constants: make every tensor matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ids(b=2, L=13):
    return torch.randint(0, 256, (b, L), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name,ssm,safe", [("tiny-mamba3", {}, False), ("tiny-mamba3-mimo", {}, True),
                                           ("tiny-mamba3", {"is_outproj_norm": True, "ngroups": 2}, True)])
def test_mamba_ssm_round_trip_is_bit_identical(tmp_path, name, ssm, safe):
    model = _model(name, **ssm)
    save_pretrained(model, tmp_path, format="mamba_ssm", safe_serialization=safe)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["ssm_cfg"]["layer"] == "Mamba3" and raw["d_model"] == 64
    loaded = load_pretrained(tmp_path).eval()
    assert loaded.config == model.config
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, model(_ids()).logits)
    # and written again from the loaded model: the same files
    again = tmp_path / "again"
    save_pretrained(loaded, again, format="mamba_ssm", safe_serialization=safe)
    assert (again / "config.json").read_text() == (tmp_path / "config.json").read_text()


def test_mamba_ssm_config_with_mamba3s_ignored_arguments_loads(tmp_path):
    model = _model("tiny-mamba3")
    save_pretrained(model, tmp_path, format="mamba_ssm")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["ssm_cfg"].update(dropout=0.0, n_layer=2, layer_idx=None)  # what mamba_ssm's Mamba3 absorbs
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / MANIFEST).unlink()  # edited by hand: now like a folder mamba_ssm wrote
    assert load_pretrained(tmp_path).config == model.config


def test_hf_format_is_refused_with_the_reason(tmp_path):
    with pytest.raises(CheckpointError, match="transformers has no Mamba-3 model.*format='mamba_ssm'"):
        save_pretrained(_model("tiny-mamba3"), tmp_path, format="hf")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("name", ["tiny-mamba3", "tiny-mamba3-mimo"])
def test_greedy_generation_equals_argmax_of_the_full_forward(name):
    model = _model(name).double()
    prompt = _ids(2, 6)
    out = model.generate(prompt, max_new_tokens=5, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():
        logits = model(out).logits[:, 5:-1, :model.config.vocab_size]
    assert torch.equal(logits.argmax(-1), out[:, 6:])


def test_hybrid_stack_with_attention_and_mlp_trains():
    cfg = dict(get_preset("tiny-hybrid").to_dict(), ssm_cfg=get_preset("tiny-mamba3").ssm_cfg)
    model = _model(cfg).train()
    assert type(model.backbone.layers[0].mixer).__name__ == "Mamba3"
    assert type(model.backbone.layers[1].mixer).__name__ == "MHA"
    ids = _ids()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_presets_have_the_papers_sizes():
    with torch.device("meta"):
        sizes = {n: sum(p.numel() for p in MambaLMHeadModel(get_preset(n)).parameters()) / 1e6
                 for n in ("mamba3-180m", "mamba3-440m", "mamba3-880m", "mamba3-1.5b")}
    assert 180 < sizes["mamba3-180m"] < 200 and 440 < sizes["mamba3-440m"] < 460
    assert 880 < sizes["mamba3-880m"] < 920 and 1480 < sizes["mamba3-1.5b"] < 1540


@pytest.mark.parametrize("ssm,match", [
    ({"rope_fraction": 0.25}, "rope_fraction: must be 0.5 or 1.0"),
    ({"d_conv": 4}, r"unknown key\(s\) \['d_conv'\] for layer Mamba3"),
    ({"headdim": 24}, "not divisible by headdim"),
    ({"mimo_rank": 0}, "mimo_rank: must be an integer >= 1"),
    ({"d_state": 1}, "ssm_cfg.d_state"),
])
def test_config_errors_name_the_field(ssm, match):
    cfg = get_preset("tiny-mamba3").to_dict()
    cfg["ssm_cfg"] = dict(cfg["ssm_cfg"], **ssm)
    with pytest.raises(ConfigError, match=match):
        MambaConfig.from_dict(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-mamba3", "tiny-mamba3-mimo"])
def test_gpu_triton_kernels_match_reference_ops(name, monkeypatch):
    """The same model on CUDA: Triton kernels (scan, decode step) vs the reference ops; logits, loss, every
    parameter's gradient, and greedy generation (prefill + decode steps)."""
    from helpers import assert_close

    model = _model(name).cuda()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 45), generator=g).cuda()
    targets = torch.randint(0, 256, (2, 45), generator=g).cuda()
    results = {}
    for backend in ("naive", "triton"):
        monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", backend)
        model.zero_grad()
        loss = model(ids, targets=targets).loss
        loss.backward()
        with torch.no_grad():
            logits = model(ids).logits
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[backend] = (logits, loss.detach(), grads, model.generate(ids[:, :7], max_new_tokens=6,
                                                                         temperature=0))
    (lr, sr, gr, outr), (lt, st, gt, outt) = results["naive"], results["triton"]
    assert_close(lt, lr, dtype=torch.float16, name="logits")
    assert_close(st, sr, dtype=torch.float16, name="loss")
    for k in gr:
        assert_close(gt[k], gr[k], dtype=torch.float16, grad=True, factor=2, name=f"d{k}")
    assert torch.equal(outt, outr)
    with torch.no_grad():  # the decode step captured in a CUDA graph (the kernel updates the static cache in place)
        graphed = model.generate(ids[:, :7], max_new_tokens=6, temperature=0, cuda_graph=True)
    assert torch.equal(graphed, outt)
