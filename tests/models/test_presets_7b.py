"""The 7B-8B presets: built on the meta device (no memory), their parameter counts equal the published
checkpoints' and those of transformers' own classes built from the same shapes."""

from __future__ import annotations

import math

import pytest
import torch

from mamba_parallel import MambaLMHeadModel, get_preset

# Parameter counts of the published checkpoints (every tensor of the safetensors files).
PUBLISHED = {"falcon-mamba-7b": 7_272_665_088, "mamba-codestral-7b": 7_285_403_648, "nemotron-h-8b": 8_100_852_736}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_meta_build_matches_the_published_count(name):
    model = MambaLMHeadModel(get_preset(name), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert _count(model) == PUBLISHED[name]


def _hf_twin(name: str):
    transformers = pytest.importorskip("transformers")
    if name == "falcon-mamba-7b":  # tiiuae/falcon-mamba-7b's config.json shapes
        cfg = transformers.FalconMambaConfig(hidden_size=4096, num_hidden_layers=64, vocab_size=65024, state_size=16,
                                             expand=2, time_step_rank=256, tie_word_embeddings=False)
        return transformers.FalconMambaForCausalLM, cfg
    if name == "mamba-codestral-7b":  # the HF config.json shipped beside Mistral's params.json
        cfg = transformers.Mamba2Config(hidden_size=4096, num_hidden_layers=64, vocab_size=32768, n_groups=8,
                                        num_heads=128, head_dim=64, state_size=128, tie_word_embeddings=False)
        return transformers.Mamba2ForCausalLM, cfg
    from mamba_parallel.config import NEMOTRON_H_8B_PATTERN

    cfg = transformers.NemotronHConfig(
        hidden_size=4096, vocab_size=131072, hybrid_override_pattern=NEMOTRON_H_8B_PATTERN, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=21504, mamba_num_heads=128, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, chunk_size=128, tie_word_embeddings=False)
    return transformers.NemotronHForCausalLM, cfg


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_count_equals_transformers_class(name):
    cls, cfg = _hf_twin(name)
    with torch.device("meta"):
        hf = cls(cfg)
    assert _count(hf) == PUBLISHED[name]
    ours = {n: tuple(p.shape) for n, p in MambaLMHeadModel(get_preset(name), device="meta").named_parameters()}
    # every tensor size of ours appears in theirs as often (fused projections aside: compare totals per layer)
    per_layer_hf = sorted(sum(math.prod(p.shape) for p in layer.parameters()) for layer in hf.base_model.layers)
    model = MambaLMHeadModel(get_preset(name), device="meta")
    per_layer_ours = sorted(sum(p.numel() for p in layer.parameters()) for layer in model.backbone.layers)
    assert per_layer_ours == per_layer_hf
    assert ours["lm_head.weight"] == tuple(hf.lm_head.weight.shape)
