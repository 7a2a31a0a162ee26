"""Mixers derive their sizes from parameters / attributes: a hand-made 2-way tensor-parallel split (half the
heads per shard, out_proj by columns) runs, and the shards' outputs sum to the full layer's output."""

import copy

import torch
import torch.nn as nn
from helpers import assert_close

from mamba_parallel.inference import InferenceParams
from mamba_parallel.layers import MHA, GatedMLP, Mamba2


def _param(t):
    return nn.Parameter(t.detach().clone())


def _shard_mamba2(full: Mamba2, r: int, tp: int = 2) -> Mamba2:
    """Rank r's shard: heads [r·h/tp, (r+1)·h/tp) and B/C groups [r·g/tp, ...), out_proj columns to match."""
    m = copy.deepcopy(full)
    di, g, n, h = full.d_inner, full.ngroups, full.d_state, full.nheads
    dl, gl, hl = di // tp, g // tp, h // tp

    def seg(start, size_local):  # rank r's rows of one segment that is split evenly
        return torch.arange(start + r * size_local, start + (r + 1) * size_local)

    z, x = seg(0, dl), seg(di, dl)
    B, C = seg(2 * di, gl * n), seg(2 * di + g * n, gl * n)
    dt = seg(2 * di + 2 * g * n, hl)
    m.in_proj.weight = _param(full.in_proj.weight[torch.cat([z, x, B, C, dt])])
    conv_rows = torch.cat([seg(0, dl), seg(di, gl * n), seg(di + g * n, gl * n)])
    m.conv1d.weight = _param(full.conv1d.weight[conv_rows])
    m.conv1d.bias = _param(full.conv1d.bias[conv_rows])
    heads = seg(0, hl)
    for name in ("dt_bias", "A_log", "D"):
        setattr(m, name, _param(getattr(full, name)[heads]))
    m.norm.weight = _param(full.norm.weight[seg(0, dl)])  # group size d_inner / ngroups is unchanged
    m.out_proj.weight = _param(full.out_proj.weight[:, seg(0, dl)])
    m.d_inner, m.nheads, m.ngroups = dl, hl, gl
    return m


def test_mamba2_half_heads_shards_sum_to_full_layer():
    torch.manual_seed(0)
    full = Mamba2(32, d_state=8, headdim=8, ngroups=2, chunk_size=8, layer_idx=0)  # d_inner 64, 8 heads
    shards = [_shard_mamba2(full, r) for r in range(2)]
    assert shards[0].in_proj.weight.shape[0] == (2 * 64 + 2 * 2 * 8 + 8) // 2
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        assert_close(sum(s(x) for s in shards), full(x), name="sum of shard outputs")
        # The decode path (cache sizes from the attributes, step through ssd_state_update) shards the same way.
        caches = []
        for m in [full] + shards:
            c = InferenceParams(max_seqlen=12, max_batch_size=2)
            c.key_value_memory_dict[0] = m.allocate_inference_cache(2, 12)
            m(x, inference_params=c)
            c.seqlen_offset = 11
            caches.append(c)
        assert caches[1].key_value_memory_dict[0][1].shape == (2, 4, 8, 8)
        tok = torch.randn(2, 1, 32)
        ref = full(tok, inference_params=caches[0])
        got = sum(s(tok, inference_params=c) for s, c in zip(shards, caches[1:]))
    assert_close(got, ref, name="sum of shard decode steps")


def test_mha_kv_head_shards_sum_to_full_layer():
    torch.manual_seed(0)
    hd, h, hkv = 8, 4, 2
    full = MHA(32, h, num_heads_kv=hkv, head_dim=hd, rotary_emb_dim=4, layer_idx=0)
    shards = []
    for r in range(2):
        m = copy.deepcopy(full)
        q = torch.arange(r * 2 * hd, (r + 1) * 2 * hd)
        k = h * hd + torch.arange(r * hd, (r + 1) * hd)
        rows = torch.cat([q, k, k + hkv * hd])
        m.in_proj.weight, m.in_proj.bias = _param(full.in_proj.weight[rows]), _param(full.in_proj.bias[rows])
        m.out_proj.weight = _param(full.out_proj.weight[:, q])
        m.out_proj.bias = _param(full.out_proj.bias * (r == 0))  # the bias is added once
        m.num_heads, m.num_heads_kv = 2, 1
        shards.append(m)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        assert_close(sum(s(x) for s in shards), full(x), name="sum of MHA shard outputs")


def test_gated_mlp_shards_sum_to_full_layer():
    torch.manual_seed(0)
    full = GatedMLP(32, 256)
    hidden = full.hidden_features
    shards = []
    for r in range(2):
        m = copy.deepcopy(full)
        half = torch.arange(r * hidden // 2, (r + 1) * hidden // 2)
        m.fc1.weight = _param(full.fc1.weight[torch.cat([half, half + hidden])])
        m.fc2.weight = _param(full.fc2.weight[:, half])
        shards.append(m)
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert_close(sum(s(x) for s in shards), full(x), name="sum of MLP shard outputs")
