"""Attention (GQA + rotary vs an explicit reference), rotary's relative-position property, the pre-norm Block."""

import torch
import torch.nn.functional as F
from helpers import assert_close

from mamba_parallel.layers import MHA, Block, GatedMLP, Mamba2
from mamba_parallel.layers.packing import position_ids_from_seq_idx, seq_idx_from_cu_seqlens
from mamba_parallel.layers.rotary import apply_rotary, rotary_cos_sin


def test_rotary_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def score(m, n):
        cq, sq = rotary_cos_sin(torch.tensor([[m]]), 12)
        ck, sk = rotary_cos_sin(torch.tensor([[n]]), 12)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    assert torch.allclose(score(7, 3), score(104, 100), atol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-3)
    cos, sin = rotary_cos_sin(torch.tensor([[5]]), 12)
    assert torch.equal(apply_rotary(q, cos, sin)[..., 12:], q[..., 12:])  # dims past rotary_dim untouched
    assert torch.allclose(apply_rotary(q, cos, sin).norm(), q.norm())  # a rotation


def test_mha_matches_explicit_attention():
    torch.manual_seed(0)
    h, hkv, d, rot = 4, 2, 8, 4
    mha = MHA(32, h, num_heads_kv=hkv, head_dim=d, rotary_emb_dim=rot)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        mha.in_proj.bias.normal_()  # non-zero biases (they start at zero) so they are checked too
        mha.out_proj.bias.normal_()
        qkv = x @ mha.in_proj.weight.T + mha.in_proj.bias
        q = qkv[..., :h * d].unflatten(-1, (h, d))
        k = qkv[..., h * d:(h + hkv) * d].unflatten(-1, (hkv, d))
        v = qkv[..., (h + hkv) * d:].unflatten(-1, (hkv, d))
        cos, sin = rotary_cos_sin(torch.arange(7).expand(2, 7), rot)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = k.repeat_interleave(h // hkv, dim=2), v.repeat_interleave(h // hkv, dim=2)  # q head i -> kv i // 2
        s = torch.einsum("blhd,bmhd->bhlm", q, k) / d ** 0.5
        s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("bhlm,bmhd->blhd", s.softmax(-1), v).flatten(-2) @ mha.out_proj.weight.T
        ref = ref + mha.out_proj.bias
        assert_close(mha(x), ref, name="MHA output")


def test_packing_helpers():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    seq_idx = seq_idx_from_cu_seqlens(cu, 8)
    assert seq_idx.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]] and seq_idx.dtype == torch.int32
    assert position_ids_from_seq_idx(seq_idx).tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]


def test_block_is_prenorm_with_fp32_residual():
    torch.manual_seed(0)
    mixer = Mamba2(32, d_state=8, headdim=8, chunk_size=8)
    block = Block(32, mixer, GatedMLP(32, 64), residual_in_fp32=True).to(torch.float16)
    x = torch.randn(2, 5, 32, dtype=torch.float16)
    res_in = torch.randn(2, 5, 32)
    out, res = block(x, res_in)
    assert res.dtype == torch.float32 and out.dtype == torch.float16
    with torch.no_grad():
        r1 = x.float() + res_in
        h = block.mixer(F.rms_norm(r1, (32,), block.norm.weight.float(), 1e-5).half())
        r2 = h.float() + r1
        ref = block.mlp(F.rms_norm(r2, (32,), block.norm2.weight.float(), 1e-5).half())
    assert_close(res, r2, dtype=torch.float16, name="residual")
    assert_close(out, ref, dtype=torch.float16, factor=2, name="block output")
    plain = Block(32, Mamba2(32, d_state=8, headdim=8, chunk_size=8), None)
    first_out, first_res = plain(x.float(), None)  # first block: the residual is the input itself
    assert torch.equal(first_res, x.float())
    assert_close(first_out, plain.mixer(plain.norm(x.float())), name="first block output")
