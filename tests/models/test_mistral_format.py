"""Mistral's Mamba-Codestral layout (params.json + consolidated.safetensors) beside its HF form, as the published
repository holds both: either loads, to the same model, equal to transformers' Mamba2ForCausalLM."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mamba_parallel.config import MambaConfig
from mamba_parallel.manifest import MANIFEST
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.models.formats import CheckpointError, detect_format, load_pretrained, save_pretrained

# mistral-inference builds Mamba-2 at mamba_ssm's defaults but n_groups: only sizes are ours to pick.
CODESTRAL_TINY = dict(d_model=64, n_layer=2, vocab_size=96, ssm_cfg={"layer": "Mamba2", "ngroups": 2},
                      pad_vocab_size_multiple=1, tie_embeddings=False)


def _model(**overrides) -> MambaLMHeadModel:
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig.from_dict({**CODESTRAL_TINY, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ids():
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))


def test_mistral_files_are_mistral_inference_names(tmp_path):
    model = _model()
    save_pretrained(model, tmp_path, format="mistral")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["consolidated.safetensors", MANIFEST, "params.json"]
    params = json.loads((tmp_path / "params.json").read_text())
    assert params == dict(dim=64, n_layers=2, vocab_size=96, n_groups=2, rms_norm=True, residual_in_fp32=True,
                          fused_add_norm=True, pad_vocab_size_multiple=1, tie_embeddings=False, model_type="mamba")
    state = load_file(tmp_path / "consolidated.safetensors")
    assert set(state) == {"model." + k for k in model.state_dict()}  # every tensor: its loader is strict
    assert detect_format(tmp_path) == "mistral"
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(_ids()).logits, model(_ids()).logits)


def test_both_layouts_in_one_folder_load_the_same_model_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = _model()
    save_pretrained(model, tmp_path / "hf", format="hf")
    save_pretrained(model, tmp_path / "mistral", format="mistral")
    repo = tmp_path / "repo"  # what the published repository holds: both sets of files
    shutil.copytree(tmp_path / "hf", repo)
    for f in ("params.json", "consolidated.safetensors"):
        shutil.copyfile(tmp_path / "mistral" / f, repo / f)
    assert detect_format(repo) == "hf"
    from_hf, from_mistral = load_pretrained(repo), load_pretrained(repo, format="mistral")
    assert from_mistral.config.to_dict() == model.config.to_dict()
    hf = transformers.Mamba2ForCausalLM.from_pretrained(repo, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(_ids()).logits
        for ours in (from_hf, from_mistral):
            out = ours(_ids()).logits
            assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-4
        assert torch.equal(from_hf(_ids()).logits, from_mistral(_ids()).logits)


def test_unprefixed_names_tied_head_and_what_the_layout_cannot_hold(tmp_path):
    model = _model(tie_embeddings=True)
    save_pretrained(model, tmp_path, format="mistral")
    state = load_file(tmp_path / "consolidated.safetensors")
    assert torch.equal(state["model.lm_head.weight"], state["model.backbone.embedding.weight"])
    save_file({k.removeprefix("model."): v for k, v in state.items()}, str(tmp_path / "consolidated.safetensors"))
    (tmp_path / MANIFEST).unlink()  # edited by hand: now like a folder from elsewhere
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.backbone.embedding.weight
    with pytest.raises(CheckpointError, match=r"format 'mistral'.*\['headdim'\] differ from mamba_ssm's defaults"):
        save_pretrained(_model(ssm_cfg={"layer": "Mamba2", "ngroups": 2, "headdim": 32}), tmp_path / "x",
                        format="mistral")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "params.json").write_text(json.dumps({"dim": 64}))
    with pytest.raises(CheckpointError, match=r"params.json: missing \['n_layers', 'vocab_size'\]"):
        load_pretrained(tmp_path / "bad")
