"""Tensor + sequence parallelism applied from outside to an unmodified single-device ``MambaLMHeadModel``.

``apply_tensor_parallel(model, tp_mesh, sequence_parallel=True, overlap_comm=False)`` rewrites the model in place by
a declarative plan, as torchtitan's are: ``TP_PLANS`` maps each layer class to a function giving an instance's
``LayerPlan``: a style per sub-module / parameter name, the size attributes that become local and, for Mamba, its
sequence-ops strategy (the parallel seam, layers/seq_ops.py). A new layer adds its entry. ``Entry``: the first
projection becomes a ``ColumnParallelLinear`` that gathers the (b, L / tp, d) stream inside its matmul under SP
(only the local shard saved; all-reduced input gradient without SP); ``Rowwise``: the projection back to the
residual stream becomes a ``RowParallelLinear``; ``Colwise`` / ``Sharded``: nn.Linear rows / one parameter sharded
in place; ``NormAcrossRanks``: Mamba-2's gated norm over channels on every rank (ngroups = 1).

Parameters become DTensor segments on ``tp_mesh`` (global shapes) behind a ``parametrize`` view (``ShardView``): the
model code sees this rank's local tensor, FSDP2 shards the DTensors again over the dp mesh. Fused projections are
sharded PER SEGMENT (``split(n)`` / ``shared(n)``: replicated, gradient summed; e.g. Mamba-2 in_proj [z | x | B | C |
dt]), one DTensor each (``<module>.parametrizations.weight.original{i}``), fused back by state_dict.py: checkpoints
do not depend on tp. Norms are replicated (gradients summed under SP); the embedding is a VocabParallelEmbedding;
the final hidden states are all-gathered for the vocab-parallel LM head (tied stays tied) and ``model.loss_fn``.
A model built on meta: ``distributed.materialize`` fills its shards. SP needs seqlen % tp == 0 (decode with
``sequence_parallel=False``).
"""

from __future__ import annotations

from collections import namedtuple
from typing import Callable, NamedTuple

import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from mamba_parallel.distributed.collectives import all_gather, copy_to_group
from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims
from mamba_parallel.distributed.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mamba_parallel.distributed.tp_modules import (SEQ_DIM, ShardView, TPGatedRMSNorm, TPLMHead, TPMamba1Ops,
                                                   TPTiedLMHead, VocabParallelLoss)
from mamba_parallel.layers.attention import MHA
from mamba_parallel.layers.mamba1 import Mamba
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.mamba3 import Mamba3
from mamba_parallel.layers.mlp import MLP, GatedMLP


# ---- the plan's vocabulary ----------------------------------------------------------------------------------------
def split(n: int) -> tuple[int, bool, bool]:
    """A segment of n rows (or channels) split over tp: (size, replicated, gradient summed over tp)."""
    return n, False, False


def shared(n: int) -> tuple[int, bool, bool]:
    """A segment of n rows replicated on every tp rank, its gradient summed over tp (read by every rank)."""
    return n, True, True


def replicated(n: int, grad_sum: bool = False) -> tuple[int, bool, bool]:
    """A segment of n rows replicated on every tp rank; ``grad_sum``: its gradient summed over tp."""
    return n, True, grad_sum


Entry = namedtuple("Entry", "segments")  # a first projection: ColumnParallelLinear, rows split per segment
Rowwise = namedtuple("Rowwise", "")  # the projection back to the residual stream: RowParallelLinear
Colwise = namedtuple("Colwise", "segments")  # an nn.Linear's weight rows and bias sharded per segment
Sharded = namedtuple("Sharded", "segments dim", defaults=[0])  # one parameter, per segment along dim
NormAcrossRanks = namedtuple("NormAcrossRanks", "channels")  # a gated norm over every rank's channels


class LayerPlan(NamedTuple):
    styles: dict  # sub-module or parameter name ("in_proj", "conv1d.weight") -> style
    local: dict = {}  # size attributes -> their local values
    seq_ops: Callable | None = None  # tp process group -> the layer's sequence-ops strategy


def _divides(tp: int, n: int, what: str) -> None:
    if n % tp:
        raise ParallelConfigError(f"tp={tp} does not divide {what}={n}")


# ---- the plans, per layer class -------------------------------------------------------------------------------------
def mamba1_plan(m: Mamba, tp: int) -> LayerPlan:
    d = m.d_inner
    _divides(tp, d, "d_inner")
    if m.x_proj.bias is not None:
        raise ParallelConfigError("apply_tensor_parallel: Mamba's x_proj has a bias, which its channel sum over "
                                  "tp would add tp times")
    return LayerPlan({
        "in_proj": Entry([split(d), split(d)]),  # [x | z]
        "conv1d.weight": Sharded([split(d)]), "conv1d.bias": Sharded([split(d)]),
        "x_proj.weight": Sharded([split(d)], dim=1),  # its input channels: the sum over tp is seq_ops.channel_sum
        "dt_proj": Colwise([split(d)]),
        "A_log": Sharded([split(d)]), "D": Sharded([split(d)]),
        "out_proj": Rowwise(),
    }, local={"d_inner": d // tp}, seq_ops=TPMamba1Ops)


def mamba2_plan(m: Mamba2, tp: int) -> LayerPlan:
    d, h, g, n = m.d_inner, m.nheads, m.ngroups, m.d_state
    _divides(tp, h, "nheads")
    if g == 1:
        bc = shared(n)  # every rank's heads read the one group
    else:
        _divides(tp, g, "ngroups (must be 1 or a multiple of tp)")
        bc = split(g * n)
    styles = {
        "in_proj": Entry([split(d), split(d), bc, bc, split(h)]),  # [z | x | B | C | dt]
        "conv1d.weight": Sharded([split(d), bc, bc]), "conv1d.bias": Sharded([split(d), bc, bc]),  # [x | B | C]
        "dt_bias": Sharded([split(h)]), "A_log": Sharded([split(h)]), "D": Sharded([split(m.D.shape[0])]),
        "out_proj": Rowwise(),
    }
    if m.rmsnorm:
        styles.update({"norm": NormAcrossRanks(d)} if g == 1 else {"norm.weight": Sharded([split(d)])})
    return LayerPlan(styles, local={"d_inner": d // tp, "nheads": h // tp, "ngroups": g // tp if g > 1 else 1})


def mamba3_plan(m: Mamba3, tp: int) -> LayerPlan:
    """Heads split. in_proj = [z | x | B | C | dt | A | trap | angles]: B / C (rank-major (R, g, n)) shared with
    ngroups = 1 (every head reads the one group) or split per group; the rotary angles are shared by all heads.
    B_norm / C_norm weights: replicated, gradient summed (every rank's heads use them). The per-head gated norm
    (is_outproj_norm) stays rank-local. No conv: the scan is head-local, its sequence ops stay as they are."""
    d, h, g, n, R = m.d_inner, m.nheads, m.ngroups, m.d_state, m.mimo_rank
    _divides(tp, h, "nheads")
    if g == 1:
        bc = [shared(R * n)]
    else:
        _divides(tp, g, "ngroups (must be 1 or a multiple of tp)")
        bc = [split(g * n)] * R
    styles = {
        "in_proj": Entry([split(d), split(d), *bc, *bc, split(h), split(h), split(h), shared(m.num_rope_angles)]),
        "B_norm.weight": Sharded([shared(n)]), "C_norm.weight": Sharded([shared(n)]),
        "out_proj": Rowwise(),
    }
    per_head = ("dt_bias", "B_bias", "C_bias", "D", "mimo_x", "mimo_z", "mimo_o")
    styles.update({name: Sharded([split(h)]) for name in per_head if getattr(m, name, None) is not None})
    if m.is_outproj_norm:
        styles["norm.weight"] = Sharded([split(d)])
    return LayerPlan(styles, local={"d_inner": d // tp, "nheads": h // tp, "ngroups": g // tp if g > 1 else 1})


def mha_plan(m: MHA, tp: int) -> LayerPlan:
    _divides(tp, m.num_heads, "attn num_heads")
    _divides(tp, m.num_heads_kv, "attn num_heads_kv")
    q, kv = m.num_heads * m.head_dim, m.num_heads_kv * m.head_dim
    return LayerPlan({"in_proj": Entry([split(q), split(kv), split(kv)]), "out_proj": Rowwise()},  # [q | k | v]
                     local={"num_heads": m.num_heads // tp, "num_heads_kv": m.num_heads_kv // tp})


def mlp_plan(m: GatedMLP | MLP, tp: int) -> LayerPlan:
    """A feed-forward after a mixer or as a block of its own: fc1 by columns ([value | gate] segments for the gated
    one), fc2 by rows."""
    hid = m.hidden_features
    _divides(tp, hid, "MLP hidden_features")
    fc1 = [split(hid)] * m.fc1_parts  # GatedMLP: [value | gate], each split alike
    return LayerPlan({"fc1": Entry(fc1), "fc2": Rowwise()}, local={"hidden_features": hid // tp})


# layer class -> (instance, tp) -> its LayerPlan. A new mixer / MLP adds its entry here.
TP_PLANS: dict[type, Callable[[nn.Module, int], LayerPlan]] = {
    Mamba: mamba1_plan, Mamba2: mamba2_plan, Mamba3: mamba3_plan, MHA: mha_plan, GatedMLP: mlp_plan, MLP: mlp_plan,
}


# ---- applying a plan --------------------------------------------------------------------------------------------
def _shard(module: nn.Module, name: str, mesh: DeviceMesh, segments, dim: int = 0) -> None:
    """module.<name> (a parameter) -> DTensor segment(s) behind a ShardView (nothing when it is None)."""
    old = getattr(module, name, None)
    if old is None:
        return
    views = [(size, Replicate() if rep else Shard(dim), grad_sum) for size, rep, grad_sum in segments]
    parametrize.register_parametrization(module, name, ShardView(mesh, dim, views), unsafe=True)
    if getattr(old, "_no_weight_decay", False):  # the optimizer's grouping flag (A_log, D, dt_bias)
        for p in module.parametrizations[name].parameters():
            p._no_weight_decay = True


def _replicated(module: nn.Module, mesh: DeviceMesh, grad_sum: bool) -> None:
    """Norm weights / biases: replicated; under SP each rank sees other tokens, so their gradients are summed."""
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if isinstance(p, nn.Parameter):
            _shard(module, name, mesh, [replicated(p.shape[0], grad_sum)])


def _column(linear: nn.Module, mesh: DeviceMesh, segments) -> None:
    _shard(linear, "weight", mesh, segments)
    _shard(linear, "bias", mesh, segments)


def _apply_style(parent: nn.Module, name: str, style, mesh: DeviceMesh, sp: bool, overlap: bool) -> None:
    group, old = mesh.get_group(), getattr(parent, name)
    if isinstance(style, Entry):
        new = ColumnParallelLinear.from_linear(old, group, sp, seq_dim=SEQ_DIM)
        new.overlap_comm = overlap
        _column(new, mesh, style.segments)
    elif isinstance(style, Rowwise):
        new = RowParallelLinear.from_linear(old, group, sp, seq_dim=SEQ_DIM)
        _shard(new, "weight", mesh, [split(old.in_features)], dim=1)
        _shard(new, "bias", mesh, [replicated(old.out_features)])  # under SP the layer sums its gradient itself
    elif isinstance(style, Colwise):
        new = old
        _column(new, mesh, style.segments)
    elif isinstance(style, Sharded):
        _shard(parent, name, mesh, style.segments, style.dim)
        return
    elif isinstance(style, NormAcrossRanks):
        new = TPGatedRMSNorm(old, group, style.channels)
        _shard(new, "weight", mesh, [split(style.channels)])
    else:
        raise TypeError(f"tp plan: unknown style {style!r} for {name}")
    setattr(parent, name, new)


def apply_plan(layer: nn.Module, plan: LayerPlan, mesh: DeviceMesh, sp: bool, overlap: bool = False) -> None:
    """Shard ``layer`` in place as ``plan`` says (names with a dot reach into sub-modules: "conv1d.weight")."""
    for name, style in plan.styles.items():
        path, _, leaf = name.rpartition(".")
        _apply_style(layer.get_submodule(path) if path else layer, leaf, style, mesh, sp, overlap)
    for attr, value in plan.local.items():
        setattr(layer, attr, value)
    if plan.seq_ops is not None:
        layer.seq_ops = plan.seq_ops(mesh.get_group())


def _layer_plan(layer: nn.Module, tp: int, where: str) -> LayerPlan:
    make = next((f for cls, f in TP_PLANS.items() if isinstance(layer, cls)), None)
    if make is None:
        raise ParallelConfigError(f"apply_tensor_parallel: no tp plan for {where} {type(layer).__name__} "
                                  f"(TP_PLANS has {', '.join(c.__name__ for c in TP_PLANS)})")
    return make(layer, tp)


# ---- entry point ------------------------------------------------------------------------------------------------
def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = True,
                          overlap_comm: bool = False) -> nn.Module:
    """Shard ``model`` (a single-device MambaLMHeadModel with real weights, or on meta) over the 1-D ``tp_mesh``,
    in place; returns it. tp = 1 leaves it untouched.

    ``overlap_comm``: the SP entry projections (in_proj of every mixer, MLP fc1) ring-gather their input behind
    per-shard matmuls (opt-in, off by default; ``train --tp-overlap``). Raises ParallelConfigError naming the size
    tp does not divide, or a layer without a plan.
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
    plans = []  # every plan first: a refused layer leaves the model untouched
    for i, block in enumerate(backbone.layers):
        plans.append((block.mixer, _layer_plan(block.mixer, tp, f"layer {i}'s mixer")))
        if block.mlp is not None:
            plans.append((block.mlp, _layer_plan(block.mlp, tp, f"layer {i}'s mlp")))
    vocab = backbone.embedding.num_embeddings
    _divides(tp, vocab, "padded vocab_size")
    for layer, plan in plans:
        apply_plan(layer, plan, tp_mesh, sp, overlap_comm)
    for block in backbone.layers:
        for norm in (block.norm, block.norm2):
            if norm is not None:
                _replicated(norm, tp_mesh, grad_sum=sp)
    _replicated(backbone.norm_f, tp_mesh, grad_sum=sp)
    backbone.register_forward_hook(_gather_final_hidden(group, sp))

    emb = backbone.embedding
    tied = model.lm_head.weight is emb.weight
    backbone.embedding = VocabParallelEmbedding.from_embedding(emb, group, "reduce_scatter" if sp else "all_reduce",
                                                               seq_dim=SEQ_DIM)
    _shard(backbone.embedding, "weight", tp_mesh, [split(vocab)])
    if tied:
        model.lm_head = TPTiedLMHead(backbone.embedding, group)
    else:
        model.lm_head = TPLMHead(model.lm_head, group)
        _shard(model.lm_head, "weight", tp_mesh, [split(vocab)])
    model.loss_fn = VocabParallelLoss(group)
    return model


def _gather_final_hidden(group, sp: bool):
    """Backbone output hook: the final hidden states become full on every rank (each rank's LM-head shard reads
    all of them); backward: reduce-scatter (SP) or all-reduce of their gradient."""
    def hook(module, args, out):
        return all_gather(out, group, SEQ_DIM) if sp else copy_to_group(out, group)
    return hook
