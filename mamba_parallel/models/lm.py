"""``MambaLMHeadModel``: embedding -> N residual blocks -> final norm -> (tied) LM head, mamba_ssm's layout.

State-dict names are mamba_ssm's (``backbone.embedding.weight``, ``backbone.layers.{i}.mixer.*``,
``backbone.norm_f.weight``, ``lm_head.weight``), so its checkpoints load without renaming. No distributed code
here: parallelism is applied from outside (mamba_parallel/distributed).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from mamba_parallel import ops
from mamba_parallel.config import MambaConfig
from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.inference.generation_config import GenerationConfig
from mamba_parallel.layers import init
from mamba_parallel.layers.attention import MHA
from mamba_parallel.layers.block import create_block
from mamba_parallel.layers.mamba1 import Mamba
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.mamba3 import Mamba3
from mamba_parallel.layers.mlp import MLP, GatedMLP
from mamba_parallel.layers.norm import RMSNorm, add_norm, make_norm
from mamba_parallel.layers.packing import seq_idx_from_cu_seqlens
from mamba_parallel.models.outputs import CausalLMOutput
from mamba_parallel.ops.backend import use_triton


def shift_labels(labels: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """labels (b, L) in transformers' form -> targets (b, L): targets[:, t] = labels[:, t + 1], the last position
    -100 (no target); with packed sequences (seq_idx (b, L)) also each sequence's last position, so no position
    is scored against the next sequence's first token."""
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    if seq_idx is not None:
        boundary = torch.nn.functional.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (0, 1), value=False)
        targets = targets.masked_fill(boundary, -100)
    return targets


# The modules whose reset_parameters() init_weights calls, in self.modules() order (distributed/materialize.py
# replays the same order block by block to initialise a sharded model without building it whole).
INIT_MODULE_TYPES = (Mamba, Mamba2, Mamba3, MHA, GatedMLP, MLP, RMSNorm, nn.LayerNorm)


@torch.no_grad()
def rescale_residual_writers(block: nn.Module, config: MambaConfig) -> None:
    """Divide the weights of a block's layers that write into the residual stream (out_proj / fc2) by
    sqrt(n_residuals_per_layer * n_layer): GPT-2's scheme, as mamba_ssm (``rescale_prenorm_residual``)."""
    n_residuals_per_layer = 2 if config.mlp_after_mixer else 1
    scale = 1.0 / math.sqrt(n_residuals_per_layer * config.n_layer)
    for m in (block.mixer, block.mlp):
        if m is not None:
            (m.fc2 if isinstance(m, (GatedMLP, MLP)) else m.out_proj).weight.mul_(scale)


class MixerModel(nn.Module):
    """The backbone: input_ids (b, L) -> hidden states (b, L, d_model) after the final norm."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.residual_in_fp32 = config.residual_in_fp32
        # _weight: skip nn.Embedding's own init (the model's init_weights sets it; on meta it would pull in dynamo)
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model,
                                      _weight=torch.empty(config.padded_vocab_size, config.d_model, **fk))
        self.layers = nn.ModuleList(create_block(config, i, **fk) for i in range(config.n_layer))
        self.norm_f = make_norm(config.d_model, config.rms_norm, config.norm_epsilon, **fk)
        # A one-token decode step of a Mamba / Mamba-2 stack at batch 1 on the kernels runs three or four kernels
        # per block (the mixers' ``fused_step``) instead of the block's ops one by one; False: always the ops.
        # Read at each step; a CUDA-graph decoder (inference/cuda_graph.py) keeps what it captured.
        self.fused_decode = True

    def forward(self, input_ids: torch.Tensor, inference_params=None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (b, L) -> (b, L, d_model).

        Packed sequences: seq_idx (b, L) int32 and/or cu_seqlens (nseq + 1,) int32 with b == 1 (seq_idx is
        derived from cu_seqlens when missing). position_ids (b, L) only matter to attention layers (rotary).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        b, L = input_ids.shape
        if cu_seqlens is not None:
            if b != 1:
                raise ValueError(f"cu_seqlens needs packed input_ids of batch size 1, got batch {b}")
            cu_seqlens = cu_seqlens.to(torch.int32)
            if seq_idx is None:
                seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, L)
        if seq_idx is not None:
            if tuple(seq_idx.shape) != (b, L):
                raise ValueError(f"seq_idx must have the shape of input_ids {(b, L)}, got {tuple(seq_idx.shape)}")
            seq_idx = seq_idx.to(torch.int32)
        if inference_params is not None and L == 1 and inference_params.seqlen_offset > 0 \
                and self._fused_decode_ok(b):
            return self._fused_decode_step(input_ids, inference_params)
        hidden_states, residual = self.embedding(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, inference_params=inference_params,
                                            seq_idx=seq_idx, cu_seqlens=cu_seqlens, position_ids=position_ids)
        hidden_states, _ = add_norm(hidden_states, residual, self.norm_f, self.residual_in_fp32)
        return hidden_states


    def _fused_decode_ok(self, batch: int) -> bool:
        """Whether a decode step of ``batch`` rows runs fused: ``fused_decode`` on, batch 1 (at larger batches the
        projections are matrix products that read each weight once for all rows: the ops one by one), the
        kernels in use, and every block a Mamba / Mamba-2 mixer behind an RMSNorm, without an MLP, that can fuse
        its step, with an fp32 residual stream."""
        if not (self.fused_decode and batch == 1 and self.residual_in_fp32 and isinstance(self.norm_f, RMSNorm)
                and use_triton(self.embedding.weight, op="fused decode step")):
            return False
        return all(isinstance(layer.mixer, (Mamba, Mamba2)) and layer.mlp is None and isinstance(layer.norm, RMSNorm)
                   and layer.mixer.fused_step_ok() for layer in self.layers)

    def _fused_decode_step(self, input_ids: torch.Tensor, inference_params) -> torch.Tensor:
        """input_ids (b, 1) -> hidden states (b, 1, d_model): the fp32 residual stream through every block's
        ``fused_step``, then the final norm (what the blocks' add + norm and the mixers' ``step`` compute)."""
        residual = self.embedding(input_ids[:, 0]).float()
        for layer in self.layers:
            conv_state, ssm_state = inference_params.states(layer.mixer.layer_idx)
            layer.mixer.fused_step(residual, layer.norm, conv_state, ssm_state)
        hidden = ops.rms_norm(residual, self.norm_f.weight, self.norm_f.eps)
        return hidden.to(self.embedding.weight.dtype)[:, None]


class MambaLMHeadModel(nn.Module):
    """A Mamba-1 / Mamba-2 / hybrid language model described by a ``MambaConfig``.

    Built on ``device="meta"`` it holds no memory; ``to_empty(device=...)`` then ``init_weights()`` makes it real
    (parallelized on meta: ``distributed.materialize.materialize`` gives each rank its shards of those values).
    On any other device it is initialised at construction.
    """

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, MambaConfig):
            raise TypeError(f"MambaLMHeadModel: config must be a MambaConfig, got {type(config).__name__}")
        self.config = config
        # Generation defaults (special token ids, ...), read from / written to generation_config.json
        self.generation_config = GenerationConfig()
        # The folder this model was loaded from when it holds tokenizer files (save_pretrained copies them)
        self.tokenizer_folder = None
        # The loss: (hidden (N, d), lm_head weight (V, d), targets (N,), reduction="mean") -> fp32 scalar, logits
        # formed chunk by chunk. The model's parallel seam: tensor / context parallelism replace this attribute.
        self.loss_fn = ops.linear_cross_entropy
        # Build on meta, then materialise once: every parameter is initialised exactly once, by init_weights.
        target = torch.empty(0, device=device).device  # honours a `with torch.device(...)` default
        self.backbone = MixerModel(config, device="meta", dtype=dtype)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False, device="meta", dtype=dtype)
        self.tie_weights()
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()
        init.mark_no_weight_decay(self)

    # ---- weights ------------------------------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """lm_head.weight IS backbone.embedding.weight when config.tie_embeddings (re-done after to_empty)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter from the torch RNG, deterministically (same seed -> same model).

        Mixers: the papers' init (A_log, D, dt bias, dt_proj); linear / conv weights: PyTorch's default; norms: 1;
        embedding: N(0, initializer_range); out_proj / fc2 (the layers writing into the residual stream) divided
        by sqrt(n_residuals_per_layer * n_layer) (GPT-2's scheme, as mamba_ssm). Re-ties the embeddings.
        """
        cfg = self.config
        self.tie_weights()
        for m in self.modules():
            if isinstance(m, INIT_MODULE_TYPES):
                m.reset_parameters()
        init.normal_(self.backbone.embedding.weight, cfg.initializer_range)
        if not cfg.tie_embeddings:
            init.linear_default_(self.lm_head.weight)
        if cfg.rescale_prenorm_residual:
            for block in self.backbone.layers:
                rescale_residual_writers(block, cfg)
        init.mark_no_weight_decay(self)

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, return_logits: bool | None = None, inference_params=None,
                num_last_tokens: int = 0, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids (b, L) -> ``CausalLMOutput(loss, logits)`` (models/outputs.py).

        labels (b, L): transformers' meaning: shifted here, so position t is scored against labels[:, t + 1];
        -100 is ignored; loss = the mean cross-entropy over the kept positions. targets (b, L): the same loss
        with targets ALREADY shifted (targets[:, t] is the target of position t), what a data loader of
        (inputs, next tokens) gives, and the only form context parallel accepts (a rank cannot shift across its
        slice). With either, the loss is formed chunk by chunk (``lm_loss``) and ``logits`` is None unless
        ``return_logits=True``; without, logits (b, L, padded_vocab) in the hidden dtype (the last
        ``num_last_tokens`` positions only when > 0) and loss None.

        attention_mask (b, L) is accepted for ``model(**tokenizer(...))`` calls; it must be all ones (a Mamba
        layer has no padding mask: pass unpadded rows, or packed sequences through seq_idx / cu_seqlens).
        """
        if labels is not None and targets is not None:
            raise ValueError("pass labels (shifted inside, as in transformers) or targets (already shifted), "
                             "not both")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("attention_mask has zeros: padded rows are not supported (a Mamba layer would read "
                             "the padding into its state); pass rows without padding, or pack the sequences "
                             "with seq_idx / cu_seqlens")
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got "
                                 f"{tuple(labels.shape)}")
            if seq_idx is None and cu_seqlens is not None:
                seq_idx = seq_idx_from_cu_seqlens(cu_seqlens.to(torch.int32), input_ids.shape[1])
            targets = shift_labels(labels, seq_idx)
        elif targets is not None and targets.shape != input_ids.shape:
            raise ValueError(f"targets must have the shape of input_ids {tuple(input_ids.shape)}, got "
                             f"{tuple(targets.shape)}")
        hidden_states = self.backbone(input_ids, inference_params=inference_params, seq_idx=seq_idx,
                                      cu_seqlens=cu_seqlens, position_ids=position_ids)
        loss = logits = None
        if targets is not None:
            loss = self.lm_loss(hidden_states, targets)
        if targets is None or return_logits:
            if num_last_tokens > 0:
                hidden_states = hidden_states[:, -num_last_tokens:]
            logits = self.lm_head(hidden_states)
        return CausalLMOutput(loss=loss, logits=logits)

    def lm_loss(self, hidden_states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden_states (b, L, d_model), targets (b, L) int64, already shifted -> mean CE over targets != -100
        (scalar, fp32).

        Logits are formed chunk by chunk inside ``loss_fn``, never all at once; tensor / context parallelism
        replace ``loss_fn`` with their own (vocab-parallel, sequence-sharded).
        """
        return self.loss_fn(hidden_states.flatten(0, 1), self.lm_head.weight, targets.flatten())

    # ---- inference ----------------------------------------------------------------------------------------------
    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, device=None,
                                 state_dtype=None) -> InferenceParams:
        """A fresh cache for ``batch_size`` rows and up to ``max_seqlen`` positions (see inference/cache.py): conv
        states / KV caches in ``dtype`` (the weights' by default), recurrent SSM states in ``state_dtype`` (fp32 by
        default; bf16 halves the bytes a decode step moves at large batch, at bf16 rounding of the state)."""
        if state_dtype is not None and (not isinstance(state_dtype, torch.dtype) or not state_dtype.is_floating_point):
            raise ValueError(f"allocate_inference_cache: state_dtype must be a floating torch.dtype (e.g. "
                             f"torch.bfloat16), got {state_dtype!r}")
        position = None
        if self.config.attn_layer_idx:  # attention's one-token step reads seqlen_offset from the device
            position = torch.zeros((), dtype=torch.long, device=device or self.lm_head.weight.device)
        cache = InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch_size, position=position)
        for i, layer in enumerate(self.backbone.layers):
            state = layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, device=device,
                                                   state_dtype=state_dtype)
            if state is not None:  # MLP blocks keep no state
                idx = getattr(layer.mixer, "layer_idx", None)
                cache.key_value_memory_dict[i if idx is None else idx] = state
        return cache

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor | list[torch.Tensor] | None = None, *args, inputs=None, **kwargs):
        """input_ids (b, L) -> token ids (b, L + n); or a list of 1-D prompts of any lengths (ragged requests, pure
        Mamba / Mamba2 models) -> a list. transformers' and mamba_ssm's keywords: greedy by default,
        ``max_new_tokens`` or ``max_length``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty``, ``eos_token_id``, ``streamer``, ``cg``, ``return_dict_in_generate`` ... (see
        inference/generate.py); defaults from ``self.generation_config``."""
        from mamba_parallel.inference.generate import generate

        if input_ids is None:
            input_ids = inputs  # transformers' name for the prompt
        return generate(self, input_ids, *args, **kwargs)

    # ---- checkpoints (models/formats.py) ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, device=None, dtype="auto", **kwargs) -> "MambaLMHeadModel":
        """A model from a mamba_ssm, HF transformers or Mistral checkpoint folder, or a hub name; dtype "auto" keeps
        the saved dtype. ``kwargs``: format, revision, torch_dtype (see models/formats.py load_pretrained)."""
        from mamba_parallel.models.formats import load_pretrained

        return load_pretrained(path, device=device, dtype=dtype, model_cls=cls, **kwargs)

    def save_pretrained(self, path, format: str = "mamba_ssm", **kwargs) -> None:
        """Write config + weights to folder ``path`` in ``format`` ("mamba_ssm", "hf" or "mistral"); ``kwargs``:
        safe_serialization, max_shard_size, tokenizer (see models/formats.py save_pretrained)."""
        from mamba_parallel.models.formats import save_pretrained

        save_pretrained(self, path, format=format, **kwargs)
