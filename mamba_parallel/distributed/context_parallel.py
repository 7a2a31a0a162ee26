"""Context parallelism by state passing: the SEQUENCE is sharded over ``cp`` ranks, with no cap but its length.

``apply_context_parallel(model, cp_mesh)`` turns an unmodified single-device ``MambaLMHeadModel`` into its CP form
in place. Every rank then receives a contiguous slice of every sequence (rank 0 the first; ``input_ids``,
``targets``, ``seq_idx`` and ``position_ids`` are slices of the global ones) and returns its slice of the logits or
the GLOBAL mean loss. Per instance it overrides:

- ``mixer.run_conv`` (Mamba / Mamba2): halo exchange of the last d_conv - 1 conv inputs (distributed/cp_ops.py);
- ``mixer.run_scan``: local scan from zero, one all-gather of (final state, slice decay), the true initial state
  folded from the earlier ranks' contributions, outputs corrected (distributed/cp_exchange.py, cp_ops.py);
- ``mixer.forward`` of attention layers: keys / values all-gathered over cp (distributed/cp_attention.py);
- ``model.lm_loss``: sum of the local cross-entropy over the cp group / number of labels of the whole sequence.
  Its backward all-reduces over cp, so every rank's gradient is cp x its share of the global mean's; FSDP's
  average over the (dp_shard, cp) mesh then gives exactly the single-process gradient.

Packed sequences: ``seq_idx`` slices (a boundary may fall inside a slice or exactly at a rank boundary);
``cu_seqlens`` is refused (its offsets are local). Composes with tensor parallelism applied before it (the mixers'
local sizes come from their attributes, the loss becomes the vocab-parallel one) and with FSDP applied after it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from mamba_parallel import ops
from mamba_parallel.distributed.collectives import all_reduce_both
from mamba_parallel.distributed.cp_attention import cp_mha_forward
from mamba_parallel.distributed.cp_exchange import SeqMeta
from mamba_parallel.distributed.cp_ops import cp_causal_conv1d, cp_selective_scan, cp_ssd_chunk_scan
from mamba_parallel.distributed.parallel_dims import ParallelConfigError
from mamba_parallel.layers.attention import MHA
from mamba_parallel.layers.mamba1 import Mamba
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.mlp import MLP, GatedMLP


class CPContext:
    """The cp group of a model, and the packed-sequence metadata of the current forward (one all-gather per
    forward, shared by the layers: they all receive the same ``seq_idx`` tensor, also when recomputed by
    activation checkpointing)."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.mesh = cp_mesh
        self.group = cp_mesh.get_group()
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()
        self._key, self._meta = None, None

    def meta(self, seq_idx: torch.Tensor | None, k: int) -> SeqMeta | None:
        if seq_idx is None:
            return None
        if self._key is None or self._key[0] is not seq_idx or self._key[1] != k:
            self._meta = SeqMeta(seq_idx, max(k, 1), self.group, self.rank)
            self._key = (seq_idx, k)  # holds seq_idx: its identity cannot be reused while cached
        return self._meta


def _conv_width(mixer: nn.Module) -> int:
    return mixer.conv1d.weight.shape[-1]


def _refuse_cu_seqlens(cu_seqlens) -> None:
    if cu_seqlens is not None:
        raise ValueError("context parallel: pass packed sequences as this rank's slice of the global seq_idx, not "
                         "cu_seqlens (its offsets would be local to the slice)")


# ---- per-instance overrides --------------------------------------------------------------------------------------
def _run_conv(mixer, ctx: CPContext, x, seq_idx=None, initial_state=None, return_final_state=False):
    """x (b, conv_dim, L_local) -> silu(causal conv) (b, conv_dim, L_local), halo from the previous cp rank."""
    w = _conv_width(mixer)
    return cp_causal_conv1d(x, mixer.conv1d.weight[:, 0, :], mixer.conv1d.bias, activation="silu",
                            initial_state=initial_state, seq_idx=seq_idx, return_final_state=return_final_state,
                            group=ctx.group, meta=ctx.meta(seq_idx, w - 1))


def _run_scan_mamba2(mixer: Mamba2, ctx: CPContext, x, dt, A, B, C, D=None, z=None, dt_bias=None, seq_idx=None,
                     cu_seqlens=None, recompute_states=False, initial_states=None, return_final_states=False):
    """Mamba2.run_scan over this rank's slice (same arguments); final states are the whole sequence's."""
    _refuse_cu_seqlens(cu_seqlens)
    return cp_ssd_chunk_scan(x, dt, A, B, C, mixer.chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                             dt_limit=mixer.dt_limit, initial_states=initial_states, seq_idx=seq_idx,
                             return_final_states=return_final_states, group=ctx.group,
                             meta=ctx.meta(seq_idx, _conv_width(mixer) - 1), recompute_states=recompute_states)


def _run_scan_mamba1(mixer: Mamba, ctx: CPContext, u, delta, A, B, C, D=None, z=None, delta_bias=None,
                     seq_idx=None, initial_state=None, return_last_state=False):
    """Mamba.run_scan over this rank's slice (same arguments); the last state is the whole sequence's."""
    return cp_selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True,
                             initial_state=initial_state, return_last_state=return_last_state, seq_idx=seq_idx,
                             group=ctx.group, meta=ctx.meta(seq_idx, _conv_width(mixer) - 1))


def _cp_lm_loss(model: nn.Module, ctx: CPContext, hidden_states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """hidden_states (b, L_local, d), targets (b, L_local) already shifted -> the mean CE over the targets != -100
    of the WHOLE sequences (the same scalar on every cp rank)."""
    hidden, flat = hidden_states.flatten(0, 1), targets.flatten()
    if getattr(model, "_tp_applied", False):
        from mamba_parallel.distributed.tensor_parallel import vocab_parallel_linear_cross_entropy

        local = vocab_parallel_linear_cross_entropy(hidden, model.lm_head.local_weight(), flat,
                                                    model.tp_mesh.get_group(), reduction="sum")
    else:
        local = ops.linear_cross_entropy(hidden, model.lm_head.weight, flat, reduction="sum")
    count = (flat != -100).sum().to(local.dtype)
    dist.all_reduce(count, group=ctx.group)
    return all_reduce_both(local, ctx.group) / count


def _refuse_generate(*args, **kwargs):
    raise RuntimeError("context parallel: generate() is not supported on a cp-sharded model (each rank holds a "
                       "slice of the sequence); load the checkpoint in one process to generate")


def _refuse_labels(module, args, kwargs):
    if kwargs.get("labels") is not None:
        raise ValueError("context parallel: pass targets= (this rank's slice of the already shifted targets), "
                         "not labels=: a slice cannot be shifted across its boundary with the next rank")
    return None


def _backbone_pre_hook(module, args, kwargs):
    _refuse_cu_seqlens(kwargs.get("cu_seqlens") if len(args) < 4 else args[3])
    return None


# ---- entry point -------------------------------------------------------------------------------------------------
def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make ``model`` (a MambaLMHeadModel, real or on meta, possibly tensor-parallel) context-parallel over the
    1-D ``cp_mesh``, in place; returns it. cp = 1 leaves it untouched."""
    if cp_mesh.ndim != 1:
        raise ParallelConfigError(f"apply_context_parallel needs a 1-D cp mesh, got {cp_mesh.ndim}-D "
                                  f"{cp_mesh.mesh_dim_names}")
    if cp_mesh.size() == 1:
        return model
    if getattr(model, "_cp_applied", False):
        raise RuntimeError("apply_context_parallel: the model is already context-parallel")
    try:
        layers = model.backbone.layers
    except AttributeError:
        raise TypeError(f"apply_context_parallel expects a MambaLMHeadModel (model.backbone.layers), got "
                        f"{type(model).__name__}") from None
    ctx = CPContext(cp_mesh)
    for i, block in enumerate(layers):
        mixer = block.mixer
        if isinstance(mixer, Mamba2):
            mixer.run_conv = functools.partial(_run_conv, mixer, ctx)
            mixer.run_scan = functools.partial(_run_scan_mamba2, mixer, ctx)
        elif isinstance(mixer, Mamba):
            mixer.run_conv = functools.partial(_run_conv, mixer, ctx)
            mixer.run_scan = functools.partial(_run_scan_mamba1, mixer, ctx)
        elif isinstance(mixer, MHA):
            mixer.forward = functools.partial(cp_mha_forward, mixer, ctx.group, ctx.rank, ctx.size)
        elif isinstance(mixer, (GatedMLP, MLP)):
            pass  # an MLP block is token-local: a slice of the sequence needs nothing from the other ranks
        else:
            raise ParallelConfigError(f"context parallel: layer {i} has a {type(mixer).__name__} mixer, which has no "
                                      f"cp form (cp > 1 supports Mamba, Mamba2 and MHA layers)")
    model.backbone.register_forward_pre_hook(_backbone_pre_hook, with_kwargs=True)
    model.register_forward_pre_hook(_refuse_labels, with_kwargs=True)
    model.lm_loss = functools.partial(_cp_lm_loss, model, ctx)
    model.generate = _refuse_generate
    model._cp_applied, model.cp_mesh, model.cp_context = True, cp_mesh, ctx
    return model
