"""``Block``: one pre-norm residual layer (mamba_ssm's layout), and ``create_block`` which builds layer i of a
config (Mamba / Mamba2 / MHA mixer, optional MLP after it; or an MLP block, whose "mixer" is the MLP).

    residual = hidden + residual;  hidden = mixer(norm(residual))
    [MLP after the mixer]  residual = hidden + residual;  hidden = mlp(norm2(residual))

The block returns (hidden, residual) un-added: the next block's norm (or the final norm) does the add, fused.

In a training forward the add + norm and a Mamba / Mamba2 mixer's in_proj run as one autograd node
(``ops.add_rms_norm_linear``): in_proj's input, the norm output, is not kept for the backward (the norm's backward
writes it again), nor is autocast's bf16 copy of in_proj's weight. It applies where in_proj is a plain nn.Linear
(layers/out_proj.py's ``fusable_linear``); tensor parallelism's sharded in_proj keeps the module call.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mamba_parallel import ops
from mamba_parallel.config import MambaConfig
from mamba_parallel.layers.attention import MHA
from mamba_parallel.layers.mamba1 import Mamba
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.mamba3 import Mamba3
from mamba_parallel.layers.mlp import MLP, GatedMLP, create_mlp
from mamba_parallel.layers.norm import RMSNorm, add_norm, make_norm
from mamba_parallel.layers.out_proj import fusable_linear, no_hooks


class Block(nn.Module):
    def __init__(self, dim: int, mixer: nn.Module, mlp: nn.Module | None = None, rms_norm: bool = True,
                 norm_epsilon: float = 1e-5, residual_in_fp32: bool = True, device=None, dtype=None):
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        # An MLP block (Nemotron-H's "-" layers): the mixer is a feed-forward, blind to positions and caches.
        self.mixer_is_mlp = isinstance(mixer, (GatedMLP, MLP))
        self.mixer_takes_in_proj_out = isinstance(mixer, (Mamba, Mamba2))
        self.norm = make_norm(dim, rms_norm, norm_epsilon, device=device, dtype=dtype)
        self.mixer = mixer
        if mlp is not None:
            self.norm2 = make_norm(dim, rms_norm, norm_epsilon, device=device, dtype=dtype)
            self.mlp = mlp
        else:
            self.norm2 = self.mlp = None

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None, inference_params=None,
                **mixer_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (b, L, d), residual (b, L, d) or None (first block) -> (hidden_states, residual).

        ``mixer_kwargs``: seq_idx, cu_seqlens, position_ids (passed to the mixer).
        """
        if self._norm_in_proj_node(inference_params):
            in_proj = self.mixer.in_proj
            projected, residual = ops.add_rms_norm_linear(hidden_states, residual, self.norm.weight, in_proj.weight,
                                                          in_proj.bias, self.norm.eps, self.residual_in_fp32)
            hidden_states = self.mixer(None, in_proj_out=projected, **mixer_kwargs)
            return self._mlp(hidden_states, residual)
        hidden_states, residual = add_norm(hidden_states, residual, self.norm, self.residual_in_fp32)
        if self.mixer_is_mlp:
            hidden_states = self.mixer(hidden_states)
        else:
            hidden_states = self.mixer(hidden_states, inference_params=inference_params, **mixer_kwargs)
        return self._mlp(hidden_states, residual)

    def _norm_in_proj_node(self, inference_params) -> bool:
        """Whether this forward runs the add + norm and the mixer's in_proj as one node: a training forward
        (autograd on, no inference cache) of a Mamba / Mamba2 mixer without hooks of its own (a hook would see no
        hidden_states) whose in_proj is a plain nn.Linear without hooks, after an RMSNorm (decided per call:
        ``parallelize`` may swap in_proj after construction)."""
        return (self.mixer_takes_in_proj_out and inference_params is None and torch.is_grad_enabled()
                and isinstance(self.norm, RMSNorm) and no_hooks(self.mixer) and fusable_linear(self.mixer.in_proj))

    def _mlp(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The optional MLP after the mixer."""
        if self.mlp is not None:
            hidden_states, residual = add_norm(hidden_states, residual, self.norm2, self.residual_in_fp32)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, device=None,
                                 state_dtype=None):
        """The mixer's cache entry; None for an MLP block (it keeps no state). ``state_dtype``: the recurrent SSM
        state's dtype of a Mamba mixer (fp32 when None); attention's KV cache follows ``dtype``."""
        if self.mixer_is_mlp:
            return None
        if isinstance(self.mixer, MHA):
            return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, device=device)
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, device=device,
                                                   state_dtype=state_dtype)


def create_mixer(config: MambaConfig, layer_idx: int, device=None, dtype=None) -> nn.Module:
    """Layer ``layer_idx``'s mixer: MHA when listed in ``config.attn_layer_idx``, the MLP when listed in
    ``config.mlp_layer_idx``, else Mamba / Mamba2 / Mamba3."""
    fk = dict(device=device, dtype=dtype)
    kind = config.layer_kind(layer_idx)
    if kind == "mlp":
        return create_mlp(config.d_model, config.d_intermediate, **config.mlp_params, **fk)
    if kind == "attention":
        a = dict(config.attn_params)
        return MHA(config.d_model, a["num_heads"], num_heads_kv=a["num_heads_kv"], head_dim=a["head_dim"],
                   qkv_proj_bias=a["qkv_proj_bias"], out_proj_bias=a["out_proj_bias"], causal=a["causal"],
                   rotary_emb_dim=a["rotary_emb_dim"], rotary_emb_base=a["rotary_emb_base"], layer_idx=layer_idx,
                   **fk)
    cls = {"Mamba2": Mamba2, "Mamba3": Mamba3}.get(config.layer, Mamba)
    return cls(config.d_model, layer_idx=layer_idx, **config.mixer_cfg, **fk)


def create_block(config: MambaConfig, layer_idx: int, device=None, dtype=None) -> Block:
    """Block ``layer_idx`` of the model described by ``config``."""
    mixer = create_mixer(config, layer_idx, device=device, dtype=dtype)
    mlp = None
    if config.mlp_after_mixer:
        mlp = create_mlp(config.d_model, config.d_intermediate, **config.mlp_params, device=device, dtype=dtype)
    return Block(config.d_model, mixer, mlp, rms_norm=config.rms_norm, norm_epsilon=config.norm_epsilon,
                 residual_in_fp32=config.residual_in_fp32, device=device, dtype=dtype)
