"""Context parallelism by state passing: the SEQUENCE is sharded over ``cp`` ranks, with no cap but its length.

``apply_context_parallel(model, cp_mesh)`` turns an unmodified single-device ``MambaLMHeadModel`` into its CP form
in place. Every rank receives a contiguous slice of every sequence (rank 0 the first; ``input_ids``, ``targets``,
``seq_idx``, ``position_ids`` are slices of the global ones) and returns its slice of the logits or the GLOBAL mean
loss. Only through the model's seams (layers/seq_ops.py, ``model.loss_fn``), it installs:

- per mixer, its class's strategy from ``CP_STRATEGIES`` as ``mixer.seq_ops``: for Mamba / Mamba2 a conv taking
  the previous rank's last d_conv - 1 inputs (halo) and a scan run from zero, then folding in the earlier ranks'
  state after ONE all-gather of (final state, slice decay) (cp_ops.py, cp_exchange.py); for Mamba3 its scan
  the same way, the gathered state carrying its rotary phase and last token (cp_mamba3.py); for attention, keys /
  values all-gathered (cp_attention.py); a new mixer adds its entry;
- ``model.loss_fn``: the sum of the loss in place (vocab-parallel under TP) over the cp group / the number of
  targets of the whole sequence; its backward all-reduces over cp, so FSDP's average over (dp_shard, cp) gives
  the single-process gradient;
- forward pre-hooks refusing what a slice cannot do: ``cu_seqlens``, ``labels=`` (pass ``targets=``), caches.

Packed sequences: ``seq_idx`` slices (a boundary may fall inside a slice or at a rank boundary). Composes with
tensor parallelism applied before it and FSDP after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from mamba_parallel.distributed.collectives import all_reduce_both
from mamba_parallel.distributed.cp_attention import CPAttentionOps
from mamba_parallel.distributed.cp_exchange import SeqMeta
from mamba_parallel.distributed.cp_mamba3 import CPMamba3Ops
from mamba_parallel.distributed.cp_ops import cp_causal_conv1d, cp_selective_scan, cp_ssd_chunk_scan
from mamba_parallel.distributed.parallel_dims import ParallelConfigError
from mamba_parallel.layers.attention import MHA
from mamba_parallel.layers.mamba1 import Mamba, Mamba1Ops
from mamba_parallel.layers.mamba2 import Mamba2, Mamba2Ops
from mamba_parallel.layers.mamba3 import Mamba3
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


def _refuse_cu_seqlens(cu_seqlens) -> None:
    if cu_seqlens is not None:
        raise ValueError("context parallel: pass packed sequences as this rank's slice of the global seq_idx, not "
                         "cu_seqlens (its offsets would be local to the slice)")


# ---- the mixers' strategies (layers/seq_ops.py) ------------------------------------------------------------------
class _CPConv:
    """The conv over this rank's slice: the previous rank's last ``halo`` (= d_conv - 1) inputs are its initial
    state. ``inner``: the strategy this one replaces (ops it does not change go there, e.g. TP's channel sum)."""

    local = False
    local_conv = False  # the halo exchange communicates: the backward does not run it again

    def __init__(self, ctx: CPContext, halo: int, inner):
        self.ctx, self.halo, self.inner = ctx, halo, inner

    def conv(self, x, weight, bias=None, activation=None, seq_idx=None, initial_state=None,
             return_final_state=False):
        """x (b, d, L_local) -> (b, d, L_local) [, final_state (b, d, w-1): the whole sequence's last inputs]."""
        return cp_causal_conv1d(x, weight, bias, activation=activation, initial_state=initial_state,
                                seq_idx=seq_idx, return_final_state=return_final_state, group=self.ctx.group,
                                meta=self.ctx.meta(seq_idx, self.halo))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cp={self.ctx.size}, inner={self.inner!r})"


class CPMamba1Ops(_CPConv, Mamba1Ops):
    def scan(self, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
             return_last_state=False, seq_idx=None):
        """``Mamba1Ops.scan`` over this rank's slice; the last state is the whole sequence's."""
        return cp_selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                                 initial_state=initial_state, return_last_state=return_last_state, seq_idx=seq_idx,
                                 group=self.ctx.group, meta=self.ctx.meta(seq_idx, self.halo))

    def channel_sum(self, t):
        return self.inner.channel_sum(t)


class CPMamba2Ops(_CPConv, Mamba2Ops):
    def scan(self, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), initial_states=None, seq_idx=None, cu_seqlens=None,
             return_final_states=False, recompute_states=False):
        """``Mamba2Ops.scan`` over this rank's slice; final states are the whole sequence's."""
        _refuse_cu_seqlens(cu_seqlens)
        return cp_ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                 dt_limit=dt_limit, initial_states=initial_states, seq_idx=seq_idx,
                                 return_final_states=return_final_states, group=self.ctx.group,
                                 meta=self.ctx.meta(seq_idx, self.halo), recompute_states=recompute_states)


def _mamba_ops(cls):
    return lambda mixer, ctx: cls(ctx, mixer.conv1d.weight.shape[-1] - 1, mixer.seq_ops)


# mixer class -> (mixer, CPContext) -> its context-parallel sequence ops; None: the mixer is token-local (an MLP
# block), a slice of the sequence needs nothing from the other ranks. A new mixer adds its entry here.
CP_STRATEGIES = {
    Mamba: _mamba_ops(CPMamba1Ops),
    Mamba2: _mamba_ops(CPMamba2Ops),
    Mamba3: lambda mixer, ctx: CPMamba3Ops(ctx),  # no conv: the state-passing scan alone (cp_mamba3.py)
    MHA: lambda mixer, ctx: CPAttentionOps(ctx.group, ctx.rank, ctx.size),
    GatedMLP: None,
    MLP: None,
}


# ---- the model's loss and refusals -------------------------------------------------------------------------------
class ContextParallelLoss:
    """``model.loss_fn`` of a cp model: hidden (N_local, d), weight, targets (N_local,) already shifted -> the
    mean CE over the targets != -100 of the WHOLE sequences (the same scalar on every cp rank); ``inner``: the
    loss in place before (single-device or vocab-parallel), called with reduction="sum"."""

    def __init__(self, inner, group):
        self.inner, self.group = inner, group

    def __call__(self, hidden, weight, targets, reduction: str = "mean"):
        local = self.inner(hidden, weight, targets, reduction="sum")
        total = all_reduce_both(local, self.group)
        if reduction == "sum":
            return total
        if reduction != "mean":
            raise ValueError(f"context parallel loss: reduction must be mean or sum, got {reduction!r}")
        count = (targets != -100).sum().to(local.dtype)
        dist.all_reduce(count, group=self.group)
        return total / count


def _refuse_labels(module, args, kwargs):
    if kwargs.get("labels") is not None:
        raise ValueError("context parallel: pass targets= (this rank's slice of the already shifted targets), "
                         "not labels=: a slice cannot be shifted across its boundary with the next rank")
    return None


def _backbone_pre_hook(module, args, kwargs):
    _refuse_cu_seqlens(kwargs.get("cu_seqlens") if len(args) < 4 else args[3])
    if (kwargs.get("inference_params") if len(args) < 2 else args[1]) is not None:
        raise RuntimeError("context parallel: generate() / inference caches are not supported on a cp-sharded "
                           "model (each rank holds a slice of the sequence); load the checkpoint in one process "
                           "to generate")
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
    try:
        layers = model.backbone.layers
    except AttributeError:
        raise TypeError(f"apply_context_parallel expects a MambaLMHeadModel (model.backbone.layers), got "
                        f"{type(model).__name__}") from None
    if isinstance(model.loss_fn, ContextParallelLoss):
        raise RuntimeError("apply_context_parallel: the model is already context-parallel")
    ctx = CPContext(cp_mesh)
    strategies = []
    for i, block in enumerate(layers):
        mixer = block.mixer
        cls = next((c for c in CP_STRATEGIES if isinstance(mixer, c)), None)
        if cls is None:
            raise ParallelConfigError(f"context parallel: layer {i} has a {type(mixer).__name__} mixer, which has no "
                                      f"cp form (CP_STRATEGIES has {', '.join(c.__name__ for c in CP_STRATEGIES)})")
        if CP_STRATEGIES[cls] is not None:
            strategies.append((mixer, CP_STRATEGIES[cls](mixer, ctx)))
    for mixer, ops_ in strategies:  # all or nothing
        mixer.seq_ops = ops_
    model.backbone.register_forward_pre_hook(_backbone_pre_hook, with_kwargs=True)
    model.register_forward_pre_hook(_refuse_labels, with_kwargs=True)
    model.loss_fn = ContextParallelLoss(model.loss_fn, ctx.group)
    return model
