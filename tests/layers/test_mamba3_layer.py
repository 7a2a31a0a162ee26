"""The Mamba3 mixer: mamba_ssm's parameter names, forward / backward, decode and chunked prefill equal to the full
forward, packed sequences, and clear errors."""

from __future__ import annotations

import pytest
import torch

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.layers.mamba3 import Mamba3, rope_angle_count

VARIANTS = {
    "siso": dict(),
    "siso_outproj_norm": dict(is_outproj_norm=True, ngroups=2),
    "mimo": dict(is_mimo=True, mimo_rank=2, chunk_size=4),
    "mimo_outproj_norm": dict(is_mimo=True, mimo_rank=3, chunk_size=4, is_outproj_norm=True, rope_fraction=1.0),
}
F64 = torch.float64


def make(variant, dtype=F64, seed=0):
    torch.manual_seed(seed)
    kw = dict(dict(chunk_size=8), **VARIANTS[variant])
    m = Mamba3(32, d_state=8, headdim=8, layer_idx=0, dtype=dtype, **kw)
    with torch.no_grad():  # move every parameter off its init value, so none is a silent constant
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def test_parameter_names_and_shapes_are_mamba_ssms():
    siso = Mamba3(64, d_state=16, headdim=16, ngroups=2)  # d_inner 128, 8 heads, 4 rotated pairs
    shapes = {k: tuple(v.shape) for k, v in siso.state_dict().items()}
    assert shapes == {"in_proj.weight": (2 * 128 + 2 * 2 * 16 + 3 * 8 + 4, 64), "dt_bias": (8,), "B_bias": (8, 1, 16),
                      "C_bias": (8, 1, 16), "B_norm.weight": (16,), "C_norm.weight": (16,), "D": (8,),
                      "out_proj.weight": (64, 128)}
    mimo = Mamba3(64, d_state=16, headdim=16, is_mimo=True, mimo_rank=4, is_outproj_norm=True)
    shapes = {k: tuple(v.shape) for k, v in mimo.state_dict().items()}
    assert shapes["in_proj.weight"] == (2 * 128 + 2 * 4 * 16 + 3 * 8 + 4, 64)
    for name in ("mimo_x", "mimo_z", "mimo_o"):
        assert shapes[name] == (8, 4, 16)
    assert shapes["B_bias"] == (8, 4, 16) and shapes["norm.weight"] == (128,)
    assert rope_angle_count(128, 0.5) == 32 and rope_angle_count(128, 1.0) == 64 and rope_angle_count(6, 0.5) == 1


def test_init_matches_mamba_ssm():
    m = Mamba3(64, d_state=16, headdim=16, is_mimo=True, mimo_rank=4)
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert (m.B_bias == 1).all() and (m.C_bias == 1).all() and (m.D == 1).all() and (m.mimo_z == 1).all()
    assert torch.allclose(m.mimo_x, torch.full_like(m.mimo_x, 0.25)) and torch.allclose(m.mimo_o, m.mimo_x)
    assert m.dt_bias._no_weight_decay and m.D._no_weight_decay


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_backward_reach_every_parameter(variant):
    m = make(variant, dtype=torch.float32)
    x = torch.randn(2, 13, 32)
    y = m(x)
    assert y.shape == x.shape
    y.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_and_chunked_prefill_equal_the_forward(variant):
    m = make(variant)
    x = torch.randn(2, 12, 32, dtype=F64)
    full = m(x)
    cache = InferenceParams(max_seqlen=12, max_batch_size=2)
    cache.key_value_memory_dict[0] = m.allocate_inference_cache(2, 12, dtype=F64)
    outs = []
    for lo, hi in ((0, 5), (5, 8)):  # prefill, then a second prefill chunk resuming from the cache
        outs.append(m(x[:, lo:hi], inference_params=cache))
        cache.seqlen_offset = hi
    for t in range(8, 12):  # one token at a time
        outs.append(m(x[:, t:t + 1], inference_params=cache))
        cache.seqlen_offset = t + 1
    torch.testing.assert_close(torch.cat(outs, 1), full)


@pytest.mark.parametrize("variant", ["siso", "mimo"])
def test_packed_sequences_equal_separate_calls(variant):
    m = make(variant)
    a, b = torch.randn(1, 7, 32, dtype=F64), torch.randn(1, 10, 32, dtype=F64)
    packed = torch.cat([a, b], 1)
    cu = torch.tensor([0, 7, 17], dtype=torch.int32)
    seq_idx = torch.tensor([[0] * 7 + [1] * 10], dtype=torch.int32)
    want = torch.cat([m(a), m(b)], 1)
    torch.testing.assert_close(m(packed, cu_seqlens=cu), want)
    torch.testing.assert_close(m(packed, seq_idx=seq_idx), want)


def test_clear_errors():
    with pytest.raises(ValueError, match="rope_fraction must be 0.5 or 1.0"):
        Mamba3(32, d_state=8, headdim=8, rope_fraction=0.7)
    with pytest.raises(ValueError, match="not divisible by headdim"):
        Mamba3(32, d_state=8, headdim=24)
    with pytest.raises(ValueError, match="not divisible by ngroups"):
        Mamba3(32, d_state=8, headdim=8, ngroups=3)
    m = make("siso")
    cache = InferenceParams(max_seqlen=8, max_batch_size=1)
    cache.key_value_memory_dict[0] = m.allocate_inference_cache(1, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.randn(1, 4, 32, dtype=F64), inference_params=cache, cu_seqlens=torch.tensor([0, 4]))
