"""Checkpoint folders (mamba_ssm and HF layouts): round trips, detection, loading options and every error."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mamba_parallel.config import MambaConfig, get_preset
from mamba_parallel.manifest import MANIFEST
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.models.formats import CheckpointError, detect_format, load_config, load_pretrained, save_pretrained

M1 = dict(d_model=32, n_layer=2, vocab_size=50, ssm_cfg={"layer": "Mamba1", "d_state": 4}, pad_vocab_size_multiple=8)
M2 = dict(d_model=32, n_layer=2, vocab_size=50, pad_vocab_size_multiple=8, tie_embeddings=False,
          ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 16, "ngroups": 2, "chunk_size": 8,
                   "dt_limit": (0.0, 0.5), "conv_bias": False, "bias": True})
# Mamba-2 + attention (rotary on half of each head) + an MLP after every mixer: transformers' Bamba layout.
HYBRID = dict(get_preset("tiny-hybrid").to_dict(), d_model=32, d_intermediate=32,
              attn_cfg={"num_heads": 2, "num_heads_kv": 1, "rotary_emb_dim": 8})


def _model(cfg: dict, seed: int = 0) -> MambaLMHeadModel:
    torch.manual_seed(seed)
    model = MambaLMHeadModel(MambaConfig.from_dict(cfg)).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor matter
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _edited_by_hand(folder) -> None:
    """Drop the manifest of a saved folder: it is then like one from elsewhere, which the tests below edit."""
    (folder / MANIFEST).unlink()


def _ids(vocab: int = 50) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(1))


# Every (format, serialization) pair on two configs, each config in both formats (forwards are slow on CI).
@pytest.mark.parametrize("cfg,fmt,safe", [
    (M1, "mamba_ssm", None), (M1, "hf", None), (M2, "mamba_ssm", True), (M2, "hf", False),
    (HYBRID, "mamba_ssm", None), (HYBRID, "hf", None)],
    ids=["mamba1-ssm-bin", "mamba1-hf-safe", "mamba2-ssm-safe", "mamba2-hf-bin", "hybrid-ssm-bin", "hybrid-hf"])
def test_round_trip_identical_logits(tmp_path, cfg, fmt, safe):
    model = _model(cfg)
    weights = save_pretrained(model, tmp_path, format=fmt, safe_serialization=safe)
    expected_file = "model.safetensors" if (safe if safe is not None else fmt == "hf") else "pytorch_model.bin"
    written = ["config.json", expected_file, MANIFEST] + (["generation_config.json"] if fmt == "hf" else [])
    assert weights.name == expected_file and sorted(p.name for p in tmp_path.iterdir()) == sorted(written)
    assert detect_format(tmp_path) == fmt
    loaded = load_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, model(_ids()).logits)
    if fmt == "mamba_ssm":
        assert loaded.config == model.config
    else:  # HF keeps only the padded vocabulary
        assert loaded.config.padded_vocab_size == model.config.padded_vocab_size
    tied = model.config.tie_embeddings
    assert (loaded.lm_head.weight is loaded.backbone.embedding.weight) == tied
    assert loaded.backbone.layers[0].mixer.A_log._no_weight_decay  # attributes set by the model survive loading


def test_mamba_ssm_files_match_mamba_ssm(tmp_path):
    model = _model(M1)
    save_pretrained(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert list(raw) == ["d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx",
                         "attn_cfg", "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple",
                         "tie_embeddings"]
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert set(state) == set(model.state_dict())  # mamba_ssm's names, lm_head.weight included ...
    assert state["lm_head.weight"].data_ptr() == state["backbone.embedding.weight"].data_ptr()  # ... sharing storage


def test_hf_files_use_transformers_names_and_fields(tmp_path):
    model = _model(M2)
    save_pretrained(model, tmp_path, format="hf")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Mamba2ForCausalLM"] and raw["model_type"] == "mamba2"
    assert (raw["vocab_size"], raw["num_heads"], raw["head_dim"], raw["n_groups"]) == (56, 4, 16, 2)
    assert (raw["use_bias"], raw["use_conv_bias"], raw["tie_word_embeddings"]) == (True, False, False)
    assert raw["time_step_limit"] == [0.0, 0.5] and raw["dtype"] == "float32"
    state = load_file(tmp_path / "model.safetensors")
    assert "backbone.embeddings.weight" in state and "backbone.embedding.weight" not in state
    assert set(state) - {"backbone.embeddings.weight"} == set(model.state_dict()) - {"backbone.embedding.weight"}


def test_old_mamba_ssm_config_and_safetensors_weights(tmp_path):
    """mamba-130m's published config.json (no tie_embeddings, ssm_cfg {}) with model.safetensors weights."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"d_model": 32, "n_layer": 2, "vocab_size": 50, "ssm_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
         "fused_add_norm": True, "pad_vocab_size_multiple": 8}))
    model = _model(dict(M1, ssm_cfg={}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    config, fmt = load_config(tmp_path)
    assert fmt == "mamba_ssm" and config.layer == "Mamba1" and config.tie_embeddings and config.d_intermediate == 0
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(_ids()).logits, model(_ids()).logits)


def test_mamba_ssm_runtime_keys_are_ignored_and_unsupported_ones_named(tmp_path):
    save_pretrained(_model(M2), tmp_path)
    _edited_by_hand(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["ssm_cfg"].update(use_mem_eff_path=True, layer_idx=None, activation="swish", d_ssm=64)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path)[0].mixer_cfg["ngroups"] == 2
    raw["ssm_cfg"]["d_ssm"] = 32
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config.json: ssm_cfg.d_ssm=32 != expand \* d_model = 64"):
        load_pretrained(tmp_path)


def test_sharded_index_loads(tmp_path):
    model = _model(M2)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (tmp_path / "config.json").write_text(model.config.to_json())
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(_ids()).logits, model(_ids()).logits)


def test_device_and_dtype(tmp_path):
    model = _model(M1)
    save_pretrained(model.to(torch.bfloat16), tmp_path / "bf16")
    loaded = load_pretrained(tmp_path / "bf16", device="cpu", dtype=torch.float64)
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert torch.equal(loaded.backbone.norm_f.weight, model.backbone.norm_f.weight.double())
    # dtype="auto" (the default, as transformers): as saved; a dtype asked for wins
    assert {p.dtype for p in load_pretrained(tmp_path / "bf16").parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_pretrained(tmp_path / "bf16", torch_dtype="float32").parameters()} == {
        torch.float32}
    with pytest.raises(CheckpointError, match="dtype='int8' is not a floating torch dtype"):
        load_pretrained(tmp_path / "bf16", dtype="int8")


# ---- errors -----------------------------------------------------------------------------------------------------
def test_neither_format(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden": 3, "layers": 2}))
    with pytest.raises(CheckpointError, match=r"neither an HF .* nor a mamba_ssm config .*\['hidden', 'layers'\]"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"model_type='llama'.*supported are .*'mamba' \(MambaForCausalLM\)"):
        detect_format(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "weights.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no config.json; the folder holds: weights.pt"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="not a folder"):
        load_pretrained(tmp_path / "absent")


def test_missing_weights_file(tmp_path):
    save_pretrained(_model(M1), tmp_path)
    _edited_by_hand(tmp_path)
    (tmp_path / "pytorch_model.bin").rename(tmp_path / "weights.bin")
    with pytest.raises(CheckpointError, match=r"no weights file; expected one of model.safetensors, .*"
                                              r"pytorch_model.bin.*holds: config.json, weights.bin"):
        load_pretrained(tmp_path)


def test_shape_mismatch_lists_every_tensor(tmp_path):
    save_pretrained(_model(M2), tmp_path, format="hf")
    _edited_by_hand(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["state_size"] = 4  # in_proj weight + bias and conv1d weight of every layer now differ
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(tmp_path)
    msg = str(err.value)
    assert "do not match config.json (Mamba2, d_model=32, n_layer=2, vocab=56, d_state=4" in msg
    assert "shape mismatch (6):" in msg and "missing" not in msg and "unexpected" not in msg
    for i in range(2):
        assert f"backbone.layers.{i}.mixer.in_proj.weight: expected (148, 32), found (164, 32)" in msg
        assert f"backbone.layers.{i}.mixer.in_proj.bias: expected (148,), found (164,)" in msg
        assert f"backbone.layers.{i}.mixer.conv1d.weight: expected (80, 1, 4), found (96, 1, 4)" in msg


def test_missing_and_unexpected_keys_listed(tmp_path):
    model = _model(M2)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    del state["backbone.norm_f.weight"], state["lm_head.weight"]
    state["backbone.layers.0.mixer.extra"] = torch.zeros(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(model.config.to_json())
    with pytest.raises(CheckpointError, match=r"missing \(2\): backbone.norm_f.weight, lm_head.weight\n"
                                              r"  unexpected \(1\): backbone.layers.0.mixer.extra"):
        load_pretrained(tmp_path)


def test_tied_head_must_equal_embedding(tmp_path):
    model = _model(M1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] += 1
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(model.config.to_json())
    with pytest.raises(CheckpointError, match="ties the embeddings but lm_head.weight differs"):
        load_pretrained(tmp_path)


def test_unsafe_pickle_and_conflicting_files(tmp_path):
    save_pretrained(_model(M1), tmp_path)
    _edited_by_hand(tmp_path)
    torch.save({"backbone.embedding.weight": argparse.Namespace()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: cannot be read as a weights-only"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="already holds pytorch_model.bin; writing model.safetensors"):
        save_pretrained(_model(M1), tmp_path, format="hf")
    with pytest.raises(CheckpointError, match="format='onnx' is not one of"):
        save_pretrained(_model(M1), tmp_path, format="onnx")


def test_hf_cannot_express(tmp_path):
    cfg = dict(M2, norm_epsilon=1e-6, ssm_cfg=dict(M2["ssm_cfg"], norm_before_gate=True, D_has_hdim=True))
    with pytest.raises(CheckpointError, match=r"norm_before_gate=True.*norm_epsilon=1e-06.*D_has_hdim=True"):
        save_pretrained(_model(cfg), tmp_path, format="hf")


def test_model_methods_call_these(tmp_path):
    """MambaLMHeadModel.save_pretrained / from_pretrained are thin wrappers of this module."""
    model = _model(M1)
    model.save_pretrained(tmp_path, format="hf")
    assert detect_format(tmp_path) == "hf"
    with torch.no_grad():
        assert torch.equal(MambaLMHeadModel.from_pretrained(tmp_path)(_ids()).logits, model(_ids()).logits)


def test_sharded_save_writes_an_index_and_reloads(tmp_path):
    model = _model(M2)
    weights = save_pretrained(model, tmp_path, format="hf", max_shard_size=20_000)
    index = json.loads(weights.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert weights.name == "model.safetensors.index.json" and len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(_ids()).logits, model(_ids()).logits)
    bin_dir = tmp_path / "bin"
    save_pretrained(_model(M1), bin_dir, max_shard_size="10KB")  # mamba_ssm .bin shards keep the tie in one shard
    assert (bin_dir / "pytorch_model.bin.index.json").is_file()
    loaded = load_pretrained(bin_dir)
    assert loaded.lm_head.weight is loaded.backbone.embedding.weight
    with pytest.raises(CheckpointError, match="already holds .*model-00001-of"):
        save_pretrained(model, tmp_path, format="hf")  # one file beside the shards would be ambiguous
    transformers = pytest.importorskip("transformers")
    hf = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(_ids()).logits
    assert ((model(_ids()).logits - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_generation_defaults_and_tokenizer_travel_with_the_model(tmp_path):
    from mamba_parallel.inference.generation_config import GenerationConfig

    model = _model(M1)
    model.generation_config = GenerationConfig(eos_token_id=[3, 4], pad_token_id=1)
    src = tmp_path / "src"
    save_pretrained(model, src, format="hf", tokenizer=None)
    assert json.loads((src / "config.json").read_text())["eos_token_id"] == [3, 4]
    assert json.loads((src / "generation_config.json").read_text()) == {
        "_from_model_config": True, "eos_token_id": [3, 4], "pad_token_id": 1}
    (src / "tokenizer.json").write_text("{}")
    loaded = load_pretrained(src)
    assert loaded.generation_config.eos_token_id == [3, 4] and loaded.tokenizer_folder == src
    save_pretrained(loaded, tmp_path / "dst")  # the tokenizer files come along, in any format
    assert (tmp_path / "dst" / "tokenizer.json").read_text() == "{}"
    assert json.loads((tmp_path / "dst" / "generation_config.json").read_text())["pad_token_id"] == 1
    save_pretrained(_model(M1), tmp_path / "explicit", tokenizer=src / "tokenizer.json")
    assert (tmp_path / "explicit" / "tokenizer.json").is_file()


def test_hub_names_say_what_is_missing(tmp_path, monkeypatch):
    import sys

    monkeypatch.chdir(tmp_path)  # "org/model" is not a folder here
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(CheckpointError, match=r"'org/model' is not a local folder.*install huggingface_hub"):
        load_pretrained("org/model")
    monkeypatch.delitem(sys.modules, "huggingface_hub")
    hub = pytest.importorskip("huggingface_hub")

    def offline(*args, **kwargs):  # what huggingface_hub raises without a network (tests never reach the hub)
        raise ConnectionError("offline")

    monkeypatch.setattr(hub, "list_repo_files", offline)
    with pytest.raises(CheckpointError, match=r"'org/model' is not a local folder and could not be fetched.*offline"):
        load_pretrained("org/model")
