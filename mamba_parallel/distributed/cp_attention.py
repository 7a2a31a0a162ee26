"""Attention layers of hybrid stacks under context parallelism: keys / values all-gathered over the cp group.

Each rank keeps its queries (its slice of the sequence) and attends to the keys / values of the whole sequence
with the causal offset of its slice. Memory for K/V is that of the full sequence on every rank (fine for the few
attention layers of a hybrid; a ring would be needed for attention-heavy stacks). Slices must be of equal length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mamba_parallel.distributed.collectives import all_gather, all_gather_raw
from mamba_parallel.layers.packing import position_ids_from_seq_idx
from mamba_parallel.layers.rotary import apply_rotary, rotary_cos_sin


def cp_mha_forward(mha, group, rank: int, size: int, hidden_states: Tensor, inference_params=None,
                   seq_idx: Tensor | None = None, cu_seqlens: Tensor | None = None,
                   position_ids: Tensor | None = None) -> Tensor:
    """``MHA.forward`` of this rank's slice: hidden_states (b, L_local, d_model) -> (b, L_local, d_model).

    seq_idx / position_ids are this rank's slices of the global ones; rotary positions are global (offset by the
    slices before this one, or restarting per packed sequence).
    """
    if inference_params is not None:
        raise ValueError("context parallel: attention layers cannot fill an inference cache with cp > 1 "
                         "(generate in one process)")
    if cu_seqlens is not None:
        raise ValueError("context parallel: pass packed sequences as seq_idx slices, not cu_seqlens")
    b, L, _ = hidden_states.shape
    lengths = all_gather_raw(torch.tensor([L], device=hidden_states.device), group)[0]
    if (lengths != L).any():
        raise ValueError(f"context parallel: attention layers need equal slices on every cp rank, got lengths "
                         f"{lengths.tolist()}")
    q, k, v = mha.project_qkv(hidden_states)
    offset = rank * L
    full_seq = None
    if seq_idx is not None:  # (b, L * cp): the global packing, for positions and the mask
        full_seq = all_gather_raw(seq_idx.t().contiguous(), group)[0].t()
    if mha.rotary_emb_dim > 0:
        if position_ids is None:
            if full_seq is not None:
                position_ids = position_ids_from_seq_idx(full_seq)[:, offset:offset + L]
            else:
                position_ids = torch.arange(offset, offset + L, device=q.device).expand(b, L)
        cos, sin = rotary_cos_sin(position_ids, mha.rotary_emb_dim, mha.rotary_emb_base)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = all_gather(k, group, 1), all_gather(v, group, 1)  # (b, L * cp, hkv, d); backward reduce-scatters

    mask = None
    if mha.causal:  # query i sits at offset + i: it sees keys j <= offset + i
        mask = (torch.arange(L * size, device=q.device)[None] <= offset + torch.arange(L, device=q.device)[:, None])
        mask = mask[None, None]
    if full_seq is not None:
        same = (seq_idx[:, :, None] == full_seq[:, None, :])[:, None]  # (b, 1, L, L * cp)
        mask = same if mask is None else mask & same
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=mha.softmax_scale, enable_gqa=mha.num_heads != mha.num_heads_kv)
    return mha.out_proj(out.transpose(1, 2).flatten(-2))
