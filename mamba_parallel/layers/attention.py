"""``MHA``: causal multi-head attention for hybrid stacks (GQA, rotary, torch SDPA, KV cache), mamba_ssm's names.

in_proj -> [q (h·d) | k (h_kv·d) | v (h_kv·d)]; rotary on the first ``rotary_emb_dim`` dims of q and k;
SDPA with grouped KV heads; out_proj. Local head counts come from the attributes ``num_heads`` /
``num_heads_kv`` (tensor parallelism rewrites them). A forward without an inference cache computes the rotary
positions and the attention through ``seq_ops`` (the parallel seam, layers/seq_ops.py: context parallelism gives
every rank the keys / values of the whole sequence there).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mamba_parallel.layers import init
from mamba_parallel.layers.packing import position_ids_from_seq_idx, resolve_seq_idx
from mamba_parallel.layers.rotary import apply_rotary, rotary_cos_sin
from mamba_parallel.layers.seq_ops import SequenceOps


def attention_mask(seq_idx: torch.Tensor | None, causal: bool, q_pos: torch.Tensor, k_seq: torch.Tensor | None,
                   k_len: int) -> torch.Tensor | None:
    """Boolean SDPA mask (b or 1, 1, Lq, Lk) -> True where query i may see key j: j <= q_pos[i] when ``causal``,
    and the same packed sequence when ``seq_idx`` (b, Lq) / ``k_seq`` (b, Lk) are given. None: no mask needed."""
    mask = None
    if causal:
        mask = (torch.arange(k_len, device=q_pos.device)[None] <= q_pos[:, None])[None, None]
    if seq_idx is not None:
        same = (seq_idx[:, :, None] == k_seq[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


class AttentionOps(SequenceOps):
    """MHA's single-device sequence ops (the parallel seam, layers/seq_ops.py): rotary positions and causal
    attention over the whole sequence, packed sequences kept apart."""

    def positions(self, seq_idx: torch.Tensor | None, b: int, L: int, device) -> torch.Tensor:
        """(b, L) int64: each token's position in its sequence (restarting where seq_idx (b, L) changes)."""
        if seq_idx is not None:
            return position_ids_from_seq_idx(seq_idx)
        return torch.arange(L, device=device).expand(b, L)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_idx: torch.Tensor | None,
                  causal: bool, scale: float | None) -> torch.Tensor:
        """q (b, L, h, d), k / v (b, L, h_kv, d) -> (b, L, h, d); seq_idx (b, L): attend within a sequence."""
        mask, is_causal = None, causal
        if seq_idx is not None:
            L = q.shape[1]
            mask, is_causal = attention_mask(seq_idx, causal, torch.arange(L, device=q.device), seq_idx, L), False
        return sdpa(q, k, v, mask, is_causal, scale)


def sdpa(q, k, v, mask, is_causal: bool, scale: float | None) -> torch.Tensor:
    """q (b, L, h, d), k / v (b, S, h_kv, d), h a multiple of h_kv -> (b, L, h, d) (torch SDPA, grouped KV)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=is_causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


class MHA(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, num_heads_kv: int | None = None, head_dim: int | None = None,
                 qkv_proj_bias: bool = True, out_proj_bias: bool = True, softmax_scale: float | None = None,
                 causal: bool = True, rotary_emb_dim: int | None = 0, rotary_emb_base: float = 10000.0,
                 layer_idx: int | None = None, device=None, dtype=None):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv or num_heads
        if self.num_heads % self.num_heads_kv:
            raise ValueError(f"MHA: num_heads = {num_heads} is not divisible by num_heads_kv = {self.num_heads_kv}")
        self.head_dim = head_dim or embed_dim // num_heads
        self.rotary_emb_dim = rotary_emb_dim or 0
        if self.rotary_emb_dim % 2 or self.rotary_emb_dim > self.head_dim:
            raise ValueError(f"MHA: rotary_emb_dim = {rotary_emb_dim} must be even and <= head_dim = {self.head_dim}")
        self.rotary_emb_base = rotary_emb_base
        self.softmax_scale = softmax_scale
        self.causal = causal
        self.layer_idx = layer_idx
        qkv_dim = self.head_dim * (num_heads + 2 * self.num_heads_kv)
        self.in_proj = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias, **fk)
        self.out_proj = nn.Linear(self.head_dim * num_heads, embed_dim, bias=out_proj_bias, **fk)
        self.seq_ops = AttentionOps()  # positions and attention: what context parallelism replaces
        if not init.is_meta(device):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PyTorch's default Linear weights, zero biases (mamba_ssm's _init_weights)."""
        for lin in (self.in_proj, self.out_proj):
            init.linear_zero_bias_(lin)

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states (b, L, d_model) -> q (b, L, h, d), k and v (b, L, h_kv, d), from this module's (local)
        head counts."""
        h, hkv, d = self.num_heads, self.num_heads_kv, self.head_dim
        qkv = self.in_proj(hidden_states)
        if qkv.shape[-1] != d * (h + 2 * hkv):
            raise ValueError(f"MHA: in_proj gives {qkv.shape[-1]} features, expected head_dim * (num_heads + "
                             f"2 * num_heads_kv) = {d * (h + 2 * hkv)}")
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        return q.unflatten(-1, (h, d)), k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d))

    def forward(self, hidden_states: torch.Tensor, inference_params=None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (b, L, d_model) -> (b, L, d_model).

        seq_idx (b, L): tokens attend only inside their own sequence, and rotary positions restart at each
        sequence unless ``position_ids`` (b, L) are given. With ``inference_params`` the new keys / values are
        written at ``seqlen_offset`` and the queries attend to the whole cached prefix.
        """
        q, k, v = self.project_qkv(hidden_states)
        b, L = q.shape[:2]  # the whole sequence (a tensor-parallel in_proj gathers a sequence-parallel input)
        seq_idx = resolve_seq_idx(seq_idx, cu_seqlens, L)

        if inference_params is None:
            if self.rotary_emb_dim > 0:
                if position_ids is None:
                    position_ids = self.seq_ops.positions(seq_idx, b, L, q.device)
                cos, sin = rotary_cos_sin(position_ids, self.rotary_emb_dim, self.rotary_emb_base)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            out = self.seq_ops.attention(q, k, v, seq_idx, self.causal, self.softmax_scale)
            return self.out_proj(out.flatten(-2))

        if not self.seq_ops.local:
            raise ValueError("MHA: an inference cache needs the whole sequence on this device (the sequence ops "
                             "are sharded, e.g. by context parallelism): generate in one process")
        offset = inference_params.seqlen_offset
        if offset > 0 and L == 1:
            return self.step(q, k, v, inference_params)
        if seq_idx is not None:
            raise ValueError("MHA: seq_idx (packed sequences) cannot fill an inference cache")
        if self.rotary_emb_dim > 0:
            if position_ids is None:
                position_ids = torch.arange(offset, offset + L, device=q.device).expand(b, L)
            cos, sin = rotary_cos_sin(position_ids, self.rotary_emb_dim, self.rotary_emb_base)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv_cache = self._kv_cache(inference_params, offset + L)
        kv_cache[:b, offset:offset + L, 0] = k
        kv_cache[:b, offset:offset + L, 1] = v
        k, v = kv_cache[:b, :offset + L, 0].to(q.dtype), kv_cache[:b, :offset + L, 1].to(q.dtype)
        mask, is_causal = None, self.causal
        if offset > 0:  # query i sits at offset + i: it sees keys j <= offset + i
            mask = attention_mask(None, True, offset + torch.arange(L, device=q.device), None, offset + L) \
                if self.causal else None
            is_causal = False
        return self._attend(q, k, v, mask, is_causal)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inference_params) -> torch.Tensor:
        """One decode token with static shapes (CUDA-graph safe): q (b, 1, h, d), k/v (b, 1, h_kv, d) -> (b, 1,
        d_model). The position is the cache's device tensor; attention runs over all max_seqlen cached slots with
        the unwritten ones masked."""
        b = q.shape[0]
        kv_cache = self._kv_cache(inference_params, inference_params.seqlen_offset + 1)
        pos = inference_params.position_tensor(q.device)  # 0-dim int64 == seqlen_offset
        if self.rotary_emb_dim > 0:
            cos, sin = rotary_cos_sin(pos.expand(b, 1), self.rotary_emb_dim, self.rotary_emb_base)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kv_cache[:b].index_copy_(1, pos.view(1), torch.stack([k, v], dim=2).to(kv_cache.dtype))
        keys, values = kv_cache[:b, :, 0].to(q.dtype), kv_cache[:b, :, 1].to(q.dtype)
        mask = (torch.arange(kv_cache.shape[1], device=q.device) <= pos).view(1, 1, 1, -1)  # (.., max_seqlen)
        return self._attend(q, keys, values, mask, False)

    def _kv_cache(self, inference_params, needed: int) -> torch.Tensor:
        kv_cache = inference_params.states(self.layer_idx)
        if needed > kv_cache.shape[1]:
            raise ValueError(f"MHA: KV cache holds {kv_cache.shape[1]} positions, need {needed} "
                             f"(raise max_seqlen of allocate_inference_cache)")
        return kv_cache

    def _attend(self, q, k, v, mask, is_causal) -> torch.Tensor:
        """q (b, L, h, d), k/v (b, S, h_kv, d) -> out_proj(attention) (b, L, d_model)."""
        return self.out_proj(sdpa(q, k, v, mask, is_causal, self.softmax_scale).flatten(-2))

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, device=None) -> torch.Tensor:
        """-> kv_cache (batch, max_seqlen, 2, num_heads_kv, head_dim) in ``dtype``."""
        w = self.out_proj.weight
        return torch.zeros(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim, device=device or w.device,
                           dtype=dtype or w.dtype)
