"""Tensor + sequence parallelism applied from outside to an unmodified single-device ``MambaLMHeadModel``.

``apply_tensor_parallel(model, tp_mesh, sequence_parallel=True)`` rewrites the model in place:

- Every sharded or replicated parameter becomes a DTensor on ``tp_mesh`` (global shape = the single-device
  shape), stored behind a ``torch.nn.utils.parametrize`` view (``ShardView``) so the model code, which reads
  ``self.A_log`` or calls ``self.in_proj(x)``, sees this rank's plain local tensor. FSDP2 then shards those
  DTensors again over the dp mesh (2-D), and gradient clipping sees global norms.
- Fused projections are sharded PER SEGMENT: Mamba-2 ``in_proj`` = [z | x | B | C | dt] and ``conv1d`` =
  [x | B | C], Mamba-1 ``in_proj`` = [x | z], attention ``in_proj`` = [q | k | v], MLP ``fc1`` = [value | gate]:
  one DTensor per segment (``<module>.parametrizations.weight.original{i}``), concatenated locally.
  ``state_dict.py`` turns them back into the canonical fused tensor, so checkpoints do not depend on tp.
- Mamba-2: heads (and groups when ngroups % tp == 0) split; with ngroups = 1, B and C (in_proj rows, conv
  channels) are replicated and their gradients summed over tp; the gated norm then spans every channel, so its
  sum of squares is all-reduced. Mamba-1: d_inner channels split; x_proj (a reduction over d_inner) keeps its
  input columns and its output is all-reduced in forward AND backward by the mixer's ``seq_ops.channel_sum``
  (``TPMamba1Ops``; dt_proj / B / C consumers are rank-local). Attention: heads; MLP: hidden.
- out_proj / fc2 are row-parallel: reduce-scatter along the sequence (SP) or all-reduce; bias added after.
- Embedding and LM head are vocab-parallel (tied stays tied); ``model.loss_fn`` becomes a vocab-parallel
  cross-entropy that never gathers the logits; ``model(ids)`` logits are gathered.
- Sequence parallel: the residual stream between blocks is (b, L / tp, d); each mixer / MLP all-gathers its input
  along the sequence (backward: reduce-scatter) and reduce-scatters its output; norms and residual adds run on the
  local shard, their replicated weights' gradients summed over tp. Without SP the stream is replicated and the
  mixer input's gradient is all-reduced. Mamba / Mamba-2 / MLP: the gather happens inside the fused first
  projection (``TPColumnLinear`` -> ``parallel_linear_func``): only the local shard is saved for backward, and
  the backward overlaps the input-gradient reduce-scatter with the weight-gradient matmul (and the re-gather with
  the input-gradient matmul). Attention reads seqlen from its input, so it gathers in a forward pre-hook.
- ``overlap_comm=True``: those entry projections also overlap the FORWARD
  gather, as ring steps behind per-shard matmuls (tensor_parallel.py). Off by default until a GPU run shows it pays;
  attention's pre-hook gather is not overlapped.

Either the model holds real, identical weights on every tp rank (tp rank 0's are scattered), or it is on the meta
device: then ``to_empty`` + ``init_parallel_weights(model)`` afterwards give the same values as the
single-device model built from the same seed. SP needs seqlen % tp == 0: decode (generate) with a model made
with ``sequence_parallel=False``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from mamba_parallel.distributed.collectives import all_gather, all_reduce_both, copy_to_group
from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims
from mamba_parallel.distributed.tp_modules import (  # noqa: F401  (ShardView: re-exported for callers)
    SEQ_DIM,
    ShardView,
    TPColumnLinear,
    TPEmbedding,
    TPGatedRMSNorm,
    TPLMHead,
    TPRowLinear,
    TPTiedLMHead,
    VocabParallelLoss,
)
from mamba_parallel.layers.attention import MHA
from mamba_parallel.layers.mamba1 import Mamba, Mamba1Ops
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.mlp import MLP, GatedMLP


# ---- parameter helpers ------------------------------------------------------------------------------------------
def _shard(module: nn.Module, name: str, mesh: DeviceMesh, segments, dim: int = 0) -> None:
    old = getattr(module, name, None)
    if old is None:
        return
    parametrize.register_parametrization(module, name, ShardView(mesh, dim, segments), unsafe=True)
    if getattr(old, "_no_weight_decay", False):  # the optimizer's grouping flag (A_log, D, dt_bias)
        for p in module.parametrizations[name].parameters():
            p._no_weight_decay = True


def _split(size: int, tp: int, what: str) -> Placement:
    if size % tp:
        raise ParallelConfigError(f"tp={tp} does not divide {what}={size}")
    return Shard(0)


def _replicated(module: nn.Module, mesh: DeviceMesh, grad_sum: bool) -> None:
    """Norm weights / biases: replicated; under SP each rank sees other tokens, so gradients are summed."""
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if isinstance(p, nn.Parameter):
            _shard(module, name, mesh, [(p.shape[0], Replicate(), grad_sum)])


# ---- per-module plans -------------------------------------------------------------------------------------------
def _row(linear: nn.Linear, mesh: DeviceMesh, reduce: str, bias_grad_sum: bool) -> TPRowLinear:
    row = TPRowLinear(linear, mesh.get_group(), reduce)
    _shard(row, "weight", mesh, [(linear.in_features, Shard(1), False)], dim=1)
    if row.bias is not None:
        _shard(row, "bias", mesh, [(linear.out_features, Replicate(), bias_grad_sum)])
    return row


def _column(linear: nn.Linear, mesh: DeviceMesh, segments) -> None:
    _shard(linear, "weight", mesh, segments)
    _shard(linear, "bias", mesh, segments)


def _entry_column(linear: nn.Linear, mesh: DeviceMesh, segments, sp: bool,
                  overlap: bool = False) -> TPColumnLinear:
    """The first projection of a mixer / MLP: column-parallel AND the gather of its input (see TPColumnLinear)."""
    col = TPColumnLinear(linear, mesh.get_group(), sp, overlap)
    _column(col, mesh, segments)
    return col


def _out_reduce(sp: bool) -> str:
    return "reduce_scatter" if sp else "all_reduce"


class TPMamba1Ops(Mamba1Ops):
    """Mamba's sequence ops when its d_inner channels are split over tp (layers/seq_ops.py): conv and scan stay
    local; x_proj's partial products are summed over tp in forward and backward (each rank then uses the sum for
    its own channels)."""

    local = False  # the channel sum communicates: the fused middle (which bypasses it) must not run

    def __init__(self, group):
        self.group = group

    def channel_sum(self, t):
        return all_reduce_both(t, self.group)


def _plan_mamba1(m: Mamba, mesh: DeviceMesh, sp: bool, overlap: bool = False) -> None:
    tp, d = mesh.size(), m.d_inner
    S = _split(d, tp, "d_inner")
    m.in_proj = _entry_column(m.in_proj, mesh, [(d, S, False), (d, S, False)], sp, overlap)  # [x | z]
    _shard(m.conv1d, "weight", mesh, [(d, S, False)])
    _shard(m.conv1d, "bias", mesh, [(d, S, False)])
    if m.x_proj.bias is not None:
        raise ParallelConfigError("apply_tensor_parallel: Mamba's x_proj has a bias, which the channel sum would add "
                                  "tp times")
    _shard(m.x_proj, "weight", mesh, [(d, Shard(1), False)], dim=1)  # input columns; the sum: seq_ops.channel_sum
    m.seq_ops = TPMamba1Ops(mesh.get_group())
    _column(m.dt_proj, mesh, [(d, S, False)])
    _shard(m, "A_log", mesh, [(d, S, False)])
    _shard(m, "D", mesh, [(d, S, False)])
    m.out_proj = _row(m.out_proj, mesh, _out_reduce(sp), bias_grad_sum=sp)
    m.d_inner = d // tp


def _plan_mamba2(m: Mamba2, mesh: DeviceMesh, sp: bool, overlap: bool = False) -> None:
    tp = mesh.size()
    d, h, g, n = m.d_inner, m.nheads, m.ngroups, m.d_state
    S = _split(h, tp, "nheads")
    if g == 1:
        bc = (n, Replicate(), True)  # every rank's heads read the one group: replicated, gradient summed
    else:
        bc = (g * n, _split(g, tp, "ngroups (must be 1 or a multiple of tp)"), False)
    m.in_proj = _entry_column(m.in_proj, mesh, [(d, S, False), (d, S, False), bc, bc, (h, S, False)],
                              sp, overlap)  # [z | x | B | C | dt]
    _shard(m.conv1d, "weight", mesh, [(d, S, False), bc, bc])  # [x | B | C]
    _shard(m.conv1d, "bias", mesh, [(d, S, False), bc, bc])
    _shard(m, "dt_bias", mesh, [(h, S, False)])
    _shard(m, "A_log", mesh, [(h, S, False)])
    _shard(m, "D", mesh, [(m.D.shape[0], S, False)])
    if m.rmsnorm:
        if g == 1:
            m.norm = TPGatedRMSNorm(m.norm, mesh.get_group(), d)
        _shard(m.norm, "weight", mesh, [(d, S, False)])
    m.out_proj = _row(m.out_proj, mesh, _out_reduce(sp), bias_grad_sum=sp)
    m.d_inner, m.nheads, m.ngroups = d // tp, h // tp, (g // tp if g > 1 else 1)


def _plan_mha(m: MHA, mesh: DeviceMesh, sp: bool) -> None:
    tp, hd = mesh.size(), m.head_dim
    S = _split(m.num_heads, tp, "attn num_heads")
    _split(m.num_heads_kv, tp, "attn num_heads_kv")
    q, kv = m.num_heads * hd, m.num_heads_kv * hd
    _column(m.in_proj, mesh, [(q, S, False), (kv, S, False), (kv, S, False)])  # [q | k | v]
    m.out_proj = _row(m.out_proj, mesh, _out_reduce(sp), bias_grad_sum=sp)
    m.num_heads, m.num_heads_kv = m.num_heads // tp, m.num_heads_kv // tp


def _plan_mlp(m: GatedMLP | MLP, mesh: DeviceMesh, sp: bool, overlap: bool = False) -> None:
    """A feed-forward after a mixer or as a block of its own: fc1 column-parallel (per segment: [value | gate]
    for the gated one), fc2 row-parallel."""
    tp, hid = mesh.size(), m.hidden_features
    S = _split(hid, tp, "MLP hidden_features")
    segments = [(hid, S, False), (hid, S, False)] if isinstance(m, GatedMLP) else [(hid, S, False)]
    m.fc1 = _entry_column(m.fc1, mesh, segments, sp, overlap)
    m.fc2 = _row(m.fc2, mesh, _out_reduce(sp), bias_grad_sum=sp)
    m.hidden_features = hid // tp


def _enter_parallel_region(module: nn.Module, group, sp: bool) -> None:
    """The module's first input becomes the full sequence (SP: all-gather) whose gradient is summed over tp."""
    gather = functools.partial(all_gather, process_group=group, dim=SEQ_DIM) if sp else \
        functools.partial(copy_to_group, process_group=group)

    def hook(mod, args, kwargs):
        return (gather(args[0]), *args[1:]), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _leave_backbone(backbone: nn.Module, group, sp: bool) -> None:
    """The final hidden states become full on every rank (each rank's LM-head shard reads all of them)."""
    gather = functools.partial(all_gather, process_group=group, dim=SEQ_DIM) if sp else \
        functools.partial(copy_to_group, process_group=group)
    backbone.register_forward_hook(lambda mod, args, out: gather(out))


# ---- entry point ------------------------------------------------------------------------------------------------
def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True,
                          overlap_comm: bool = False) -> nn.Module:
    """Shard ``model`` (a single-device MambaLMHeadModel with real weights) over the 1-D ``tp_mesh``, in place.

    ``overlap_comm``: the SP entry projections (Mamba / Mamba-2 in_proj, MLP fc1) ring-gather their input behind
    per-shard matmuls (opt-in, off by default; ``train --tp-overlap``).

    Returns the model. tp = 1 leaves it untouched. Raises ParallelConfigError naming the size tp does not divide.
    """
    if tp_mesh.ndim != 1:
        raise ParallelConfigError(f"apply_tensor_parallel needs a 1-D tp mesh, got {tp_mesh.ndim}-D "
                                  f"{tp_mesh.mesh_dim_names}")
    tp = tp_mesh.size()
    if tp == 1:
        return model
    if isinstance(model.lm_head, TPLMHead):
        raise RuntimeError("apply_tensor_parallel: the model is already tensor-parallel")
    ParallelDims(dp_shard=1, tp=tp, world_size=tp).validate_for_model(model.config)
    group, sp = tp_mesh.get_group(), sequence_parallel
    backbone = model.backbone
    for block in backbone.layers:
        _replicated(block.norm, tp_mesh, grad_sum=sp)
        mixer = block.mixer
        if isinstance(mixer, Mamba2):
            _plan_mamba2(mixer, tp_mesh, sp, overlap_comm)
        elif isinstance(mixer, Mamba):
            _plan_mamba1(mixer, tp_mesh, sp, overlap_comm)
        elif isinstance(mixer, MHA):
            _plan_mha(mixer, tp_mesh, sp)
        elif isinstance(mixer, (GatedMLP, MLP)):  # an MLP block
            _plan_mlp(mixer, tp_mesh, sp, overlap_comm)
        else:
            raise ParallelConfigError(f"apply_tensor_parallel: no tp plan for mixer {type(mixer).__name__}")
        if isinstance(mixer, MHA):  # reads seqlen from its input: gather before it (its in_proj stays local)
            _enter_parallel_region(mixer, group, sp)
        if block.mlp is not None:
            _replicated(block.norm2, tp_mesh, grad_sum=sp)
            _plan_mlp(block.mlp, tp_mesh, sp, overlap_comm)
    _replicated(backbone.norm_f, tp_mesh, grad_sum=sp)
    _leave_backbone(backbone, group, sp)

    emb = backbone.embedding
    tied = model.lm_head.weight is emb.weight
    tp_rank = tp_mesh.get_local_rank()
    backbone.embedding = TPEmbedding(emb, group, tp_rank, tp, sp)
    vocab = emb.num_embeddings
    _shard(backbone.embedding, "weight", tp_mesh, [(vocab, _split(vocab, tp, "padded vocab_size"), False)])
    if tied:
        model.lm_head = TPTiedLMHead(backbone.embedding, group)
    else:
        model.lm_head = TPLMHead(model.lm_head, group)
        _shard(model.lm_head, "weight", tp_mesh, [(vocab, Shard(0), False)])
    model.loss_fn = VocabParallelLoss(group)
    return model


@torch.no_grad()
def init_parallel_weights(model: nn.Module) -> None:
    """``model.init_weights()`` for a model of any layout (e.g. built on meta, parallelized, then ``to_empty``).

    Data parallel alone: the model's own ``init_weights`` (its helpers draw every value at the global shape and
    write each rank's shard). Tensor parallel: the layers see only local views of their parameters, so a
    single-device twin is initialised from the same RNG stream (same values as the single-device model for the
    same seed) and its weights are scattered into the shards; costs one unsharded copy of the model meanwhile."""
    from mamba_parallel.distributed.state_dict import load_model_state_dict
    from mamba_parallel.models import MambaLMHeadModel

    if not any(isinstance(m, TPLMHead) for m in model.modules()):
        model.init_weights()
        return
    ref = next(p for p in model.parameters())
    dev = (ref.to_local() if isinstance(ref, DTensor) else ref).device
    twin = MambaLMHeadModel(model.config, device=dev, dtype=ref.dtype)
    load_model_state_dict(model, twin.state_dict())
    del twin
