"""Per-layer block kinds (Nemotron-H's layout): Mamba-2, attention and MLP-only blocks, squared-ReLU MLP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from mamba_parallel import MambaLMHeadModel, get_preset
from mamba_parallel.config import ConfigError, MambaConfig
from mamba_parallel.layers.mlp import MLP, GatedMLP
from mamba_parallel.models.formats import load_pretrained, save_pretrained


def _model(name="tiny-nemotron-h", **overrides):
    torch.manual_seed(0)
    return MambaLMHeadModel(get_preset(name, **overrides)).eval()


def test_layer_kinds_and_modules():
    model = _model()
    cfg = model.config
    assert [cfg.layer_kind(i) for i in range(cfg.n_layer)] == ["Mamba2", "attention", "mlp", "Mamba2", "mlp"]
    kinds = [type(b.mixer).__name__ for b in model.backbone.layers]
    assert kinds == ["Mamba2", "MHA", "MLP", "Mamba2", "MLP"]
    assert all(b.mlp is None and b.norm2 is None for b in model.backbone.layers)  # no MLP after the mixers


def test_relu2_mlp_math():
    mlp = MLP(8, 16, bias=True, multiple_of=1)
    x = torch.randn(3, 5, 8)
    ref = F.linear(torch.relu(F.linear(x, mlp.fc1.weight, mlp.fc1.bias)) ** 2, mlp.fc2.weight, mlp.fc2.bias)
    assert_close(mlp(x), ref, name="relu2 mlp")
    assert MLP(8, 20).hidden_features == 128 and MLP(8, 20, multiple_of=1).hidden_features == 20


def test_decode_matches_full_forward():
    model = _model()
    b, L = 2, 13
    ids = torch.randint(0, 256, (b, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_inference_cache(b, L)
        assert sorted(cache.key_value_memory_dict) == [0, 1, 3]  # MLP blocks keep no state
        pieces = [model(ids[:, :6], inference_params=cache).logits]
        cache.seqlen_offset = 6
        for t in range(6, L):
            pieces.append(model(ids[:, t:t + 1], inference_params=cache).logits)
            cache.seqlen_offset += 1
    assert_close(torch.cat(pieces, dim=1), full, name="recurrent logits")
    out = model.generate(ids[:, :4], max_new_tokens=5, temperature=0.0)
    assert out.shape == (2, 9) and torch.equal(out[:, :4], ids[:, :4])


def test_packed_sequences_and_gradients():
    model = _model().train()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (1, n), generator=g) for n in (5, 7)]
    with torch.no_grad():
        separate = torch.cat([model(s).logits for s in seqs], dim=1)
        packed = model(torch.cat(seqs, 1), cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32)).logits
    assert_close(packed, separate, name="packed")
    ids = torch.cat(seqs, 1)
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_init_rescales_every_residual_writer():
    """rescale_prenorm_residual divides out_proj of mixers and fc2 of MLP blocks by sqrt(n_layer) (one residual
    per layer here), from the same draw as without it."""
    scaled, plain = _model(), _model(rescale_prenorm_residual=False)
    n = scaled.config.n_layer
    for bs, bp in zip(scaled.backbone.layers, plain.backbone.layers):
        out = "fc2" if isinstance(bs.mixer, (MLP, GatedMLP)) else "out_proj"
        ws, wp = getattr(bs.mixer, out).weight, getattr(bp.mixer, out).weight
        assert_close(ws, wp / n ** 0.5, name=out)


def test_our_format_round_trip_keeps_the_block_pattern(tmp_path):
    model = _model()
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert back.config == model.config
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


@pytest.mark.parametrize("overrides, match", [
    (dict(mlp_layer_idx=[1]), "mlp_layer_idx.*attn_layer_idx"),
    (dict(mlp_layer_idx=[9]), "outside"),
    (dict(d_intermediate=0), "d_intermediate"),
    (dict(mlp_cfg={"activation": "gelu"}), "activation"),
    (dict(mlp_cfg={"act": "relu2"}), "unknown key"),
])
def test_bad_block_configs_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        get_preset("tiny-nemotron-h", **overrides)


def test_swiglu_mlp_blocks_work_too():
    cfg = MambaConfig(d_model=32, n_layer=3, d_intermediate=64, vocab_size=64, mlp_layer_idx=[1],
                      ssm_cfg={"layer": "Mamba1", "d_state": 4})
    model = MambaLMHeadModel(cfg)
    assert isinstance(model.backbone.layers[1].mixer, GatedMLP)
    ids = torch.randint(0, 64, (2, 7))
    assert model(ids).logits.shape == (2, 7, 64)
