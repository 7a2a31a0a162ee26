"""Tensor-parallel building blocks with the names and arguments of mamba_ssm / flash-attn, the same
layers the model's plan (tp_plan.py) builds.

- ``sequence_parallel=True``: activations between parallel regions are sharded along ``seq_dim`` (0 as in
  mamba_ssm: flatten (batch, seqlen) first; 1 for the model's (batch, seqlen, d)): a column-parallel layer all-gathers
  its input along it, a row-parallel layer reduce-scatters its output. ``False``: activations are replicated; the
  column layer all-reduces its input gradient, the row layer its output.
- Parameters are this rank's shard (as mamba_ssm's layers build them with a ``process_group``) or, for layers made by
  ``from_linear`` / ``from_embedding``, DTensor segments behind a ShardView (global shapes for FSDP2 and DCP); the
  computation runs on the local shard.
- ``parallel_linear_func``'s backward re-gathers the sequence-sharded input while it computes the input gradient,
  then reduce-scatters (or all-reduces) that gradient while it computes the weight gradient: both collectives
  hide behind a matmul. ``overlap_comm=True`` (opt-in until a GPU run shows it pays; ``train --tp-overlap``) also
  splits the forward gather into ``tp - 1`` ring steps behind the per-shard matmuls (the same products, so the
  same output).
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mamba_parallel.distributed.collectives import (
    all_gather_raw,
    all_reduce,
    all_reduce_raw,
    copy_to_group,
    group_rank,
    group_size,
    reduce_scatter,
    reduce_scatter_raw,
    ring_exchange,
)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch < 2.4
    DTensor = ()

def local_tensor(t: Tensor | None) -> Tensor | None:
    """The local shard of a DTensor parameter (differentiable), or the tensor itself."""
    if t is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """Size of this rank's slice when ``dim`` is split into units of ``multiple_of`` over ``world_size`` ranks.

    Units are spread as evenly as possible; the first ``units % world_size`` ranks take one more.
    """
    if world_size < 1 or not 0 <= local_rank < world_size:
        raise ValueError(f"get_dim_for_local_rank: need 0 <= local_rank={local_rank} < world_size={world_size}")
    if multiple_of < 1 or dim % multiple_of:
        raise ValueError(f"get_dim_for_local_rank: dim={dim} is not a multiple of multiple_of={multiple_of}")
    units = dim // multiple_of
    return (units // world_size + int(local_rank < units % world_size)) * multiple_of


def local_offset(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """Start of this rank's slice in the layout of ``get_dim_for_local_rank``."""
    return sum(get_dim_for_local_rank(dim, world_size, r, multiple_of) for r in range(local_rank))


# ---- linear layers ----------------------------------------------------------------------------------------------
class ParallelLinearFunc(torch.autograd.Function):
    """Column-parallel matmul: (all-gather x along ``dim`` if sp) then x @ W^T + b, with an overlapped backward.

    Only the local shard of x is saved (re-gathered in backward), so SP keeps its activation-memory saving.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, process_group, sequence_parallel, dim=0, overlap=False):
        dtype = autocast_dtype(x)
        if dtype is not None:  # autocast does not reach into a custom Function's backward: cast once, here
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        x = x.contiguous()
        ctx.process_group, ctx.sequence_parallel, ctx.dim = process_group, sequence_parallel, dim
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        if sequence_parallel and overlap:
            return _ring_gather_linear(x, weight, bias, process_group, dim)
        if sequence_parallel:
            x = _moved_back(all_gather_raw(_moved(x, dim), process_group)[0], dim)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sp, dim = ctx.process_group, ctx.sequence_parallel, ctx.dim
        grad_out = grad_out.contiguous()
        total_x, gather_handle = x, None
        if sp and ctx.needs_input_grad[1]:
            total_x, gather_handle = all_gather_raw(_moved(x, dim), group, async_op=True)  # behind grad_input mm
        grad_input, reduce_handle = None, None
        if ctx.needs_input_grad[0]:
            grad_input = grad_out @ weight
        if gather_handle is not None:
            gather_handle.wait()
            total_x = _moved_back(total_x, dim)
        if grad_input is not None:  # hides behind the grad_weight matmul
            if sp:
                grad_input, reduce_handle = reduce_scatter_raw(_moved(grad_input, dim), group, async_op=True)
            else:
                grad_input, reduce_handle = all_reduce_raw(grad_input, group, async_op=True)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            grad_weight = g2.t() @ total_x.reshape(-1, total_x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        if reduce_handle is not None:
            reduce_handle.wait()
        if sp and grad_input is not None:
            grad_input = _moved_back(grad_input, dim)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _ring_gather_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group, dim: int) -> Tensor:
    """F.linear(all_gather(x, dim), weight, bias) with the gather split into ring steps behind the matmuls.

    x: this rank's shard, n_local along ``dim`` (contiguous); weight (out_local, in) -> output with world * n_local
    along ``dim``, rank r's rows at [r * n_local, (r + 1) * n_local). At step s the shard of rank (rank - s) is
    multiplied while the shard of rank (rank - s - 1) is received from the previous rank.
    """
    world, rank = group_size(group), group_rank(group)
    n = x.shape[dim]
    shape = list(x.shape)
    shape[dim], shape[-1] = world * n, weight.shape[0]
    out = x.new_empty(shape)
    held = _moved(x, dim)  # (n, ...) contiguous: what travels around the ring
    spare = [torch.empty_like(held), torch.empty_like(held)] if world > 2 else [torch.empty_like(held)]
    for step in range(world):
        reqs, incoming = [], None
        if step < world - 1:  # x itself is never written: the received shards land in the spare buffers
            incoming = spare[step % len(spare)]
            reqs = ring_exchange(held, incoming, group)
        src = (rank - step) % world
        # A view of out: each partial product goes straight to its rows (copied when rows are strided, dim > 0).
        out.narrow(dim, src * n, n).copy_(F.linear(_moved_back(held, dim), weight, bias))
        for req in reqs:
            req.wait()
        held = incoming
    return out


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The autocast compute dtype for ``x``'s device type when autocast is on there, else None."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _moved(x: Tensor, dim: int) -> Tensor:
    """x with ``dim`` first, contiguous (collectives work on dim 0)."""
    return x if dim == 0 else x.movedim(dim, 0).contiguous()


def _moved_back(x: Tensor, dim: int) -> Tensor:
    return x if dim == 0 else x.movedim(0, dim)


def parallel_linear_func(x: Tensor, weight: Tensor, bias: Tensor | None = None, process_group=None,
                         sequence_parallel: bool = True, dim: int = 0, overlap_comm: bool = False) -> Tensor:
    """Column-parallel linear: x (n_local, ..., in) if sequence_parallel else (n, ..., in); weight
    (out_local, in); bias (out_local,) -> (n, ..., out_local) where n = world * n_local. ``dim``: the sharded
    activation dim (0 for flattened (batch * seqlen, d); 1 for (batch, seqlen, d) activations sharded along the sequence).

    The three-argument call ``parallel_linear_func(x, weight, process_group)`` works: a process group passed in the bias slot is
    taken as the process group. ``overlap_comm``: with sequence_parallel, ring-gather x behind the per-shard matmuls
    instead of gathering first (see the module docstring).
    """
    if bias is not None and not isinstance(bias, Tensor):
        if process_group is not None:
            raise TypeError("parallel_linear_func: bias must be a Tensor or None")
        bias, process_group = None, bias
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"parallel_linear_func: x {tuple(x.shape)} does not match weight {tuple(weight.shape)} "
                         f"(last dims differ)")
    if group_size(process_group) == 1:
        return F.linear(x, weight, bias)
    if sequence_parallel and (not -x.dim() <= dim < x.dim() or dim % x.dim() == x.dim() - 1):
        raise ValueError(f"parallel_linear_func: dim={dim} must index a non-feature dim of x {tuple(x.shape)}")
    overlap = sequence_parallel and bool(overlap_comm)
    return ParallelLinearFunc.apply(x, weight, bias, process_group, sequence_parallel,
                                    dim % x.dim() if sequence_parallel else 0, overlap)


class _ParallelLinear(nn.Module):
    """Shared constructor of the column / row layers: weight (out_features, in_features) with dim ``split_dim``
    split over ``process_group`` in units of ``multiple_of``; bias (weight rows,). ``seq_dim``: the activation
    dim sequence parallelism shards (0 for flattened (batch * seqlen, d); 1 for (b, L, d))."""

    split_dim: int

    def __init__(self, in_features: int, out_features: int, process_group=None, bias: bool = True,
                 sequence_parallel: bool = True, multiple_of: int = 1, device=None, dtype=None, *,
                 seq_dim: int = 0):
        super().__init__()
        self.process_group, self.sequence_parallel, self.seq_dim = process_group, sequence_parallel, seq_dim
        self.in_features, self.out_features = in_features, out_features
        shape = [out_features, in_features]
        shape[self.split_dim] = get_dim_for_local_rank(shape[self.split_dim], group_size(process_group),
                                                       group_rank(process_group), multiple_of)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype)) if bias else None
        # nn.Linear's default init, with the GLOBAL fan-in so a shard matches the unsharded layer's distribution.
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
                nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group, sequence_parallel: bool = True, seq_dim: int = 1):
        """The layer taking over ``linear``'s parameters as they are (same names ``weight`` / ``bias``, so the
        same state-dict keys): the caller shards them (``apply_tensor_parallel`` stores them as DTensor
        segments behind a ShardView, whose local views are what the forward reads)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.process_group, layer.sequence_parallel, layer.seq_dim = process_group, sequence_parallel, seq_dim
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        return layer


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (out_features) split over ``process_group``.

    forward: x (n_local, ..., in_features) [sequence_parallel: all-gathered along ``seq_dim``] or
    (n, ..., in_features) [replicated: the input gradient is all-reduced] -> (n, ..., out_local). Only the local
    shard of x is saved for backward; the backward overlaps its collectives with the matmuls.
    ``multiple_of``: each rank's share of out_features is a multiple of this (e.g. a head size).
    ``overlap_comm``: set True to ring-gather x behind the matmul under SP.
    """

    split_dim = 0
    overlap_comm = False

    def forward(self, x: Tensor) -> Tensor:
        return parallel_linear_func(x, local_tensor(self.weight), local_tensor(self.bias), self.process_group,
                                    self.sequence_parallel, dim=self.seq_dim, overlap_comm=self.overlap_comm)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.weight.shape[0]}), sequence_parallel={self.sequence_parallel}, overlap_comm="
                f"{self.overlap_comm}")


class RowParallelLinear(_ParallelLinear):
    """y = sum over ranks of x_r W_r^T, + b, with W's columns (in_features) split over ``process_group``.

    forward: x (n, ..., in_local) -> (n_local, ..., out_features) [sequence_parallel: reduce-scatter along
    ``seq_dim``] or (n, ..., out_features) [all-reduce]. The bias is added once, after the reduction, in the
    product's dtype (as nn.Linear under autocast).
    ``multiple_of``: each rank's share of in_features is a multiple of this.
    """

    split_dim = 1

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, local_tensor(self.weight))
        out = reduce_scatter(out, self.process_group, self.seq_dim) if self.sequence_parallel else \
            all_reduce(out, self.process_group)
        if self.bias is not None:
            bias = local_tensor(self.bias)
            if self.sequence_parallel:  # each rank adds it to its own rows: its gradient is a sum over ranks
                bias = copy_to_group(bias, self.process_group)
            out = out + bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}"
                f", sequence_parallel={self.sequence_parallel}")


# ---- embeddings -------------------------------------------------------------------------------------------------
class VocabParallelEmbedding(nn.Embedding):
    """Embedding whose rows (the vocabulary) are split evenly over ``process_group``.

    forward: ids (...) int64 with GLOBAL token ids -> (..., embedding_dim): with ``reduce=None`` (mamba_ssm's
    layer) PARTIAL sums, rows of ids owned by other ranks zero (sum over ranks to get the embedding, as
    ``ParallelEmbeddings`` does); with ``reduce="all_reduce"`` the summed embedding, replicated; with
    ``reduce="reduce_scatter"`` (sequence parallel) this rank's slice of it along ``seq_dim``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, process_group=None, padding_idx: int | None = None,
                 device=None, dtype=None, *, reduce: str | None = None, seq_dim: int = 0):
        if reduce not in (None, "all_reduce", "reduce_scatter"):
            raise ValueError(f"VocabParallelEmbedding: reduce must be None, 'all_reduce' or 'reduce_scatter', got "
                             f"{reduce!r}")
        world, rank = group_size(process_group), group_rank(process_group)
        if num_embeddings % world:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={num_embeddings} is not divisible by the "
                             f"process group size {world}")
        per = num_embeddings // world
        self.vocab_start, self.vocab_end = rank * per, (rank + 1) * per
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        super().__init__(per, embedding_dim, padding_idx=local_pad, device=device, dtype=dtype)
        self.process_group, self.num_embeddings_global = process_group, num_embeddings
        self.reduce, self.seq_dim = reduce, seq_dim

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, process_group, reduce: str, seq_dim: int = 1):
        """The layer taking over ``emb``'s (V, d) ``weight`` as it is (same state-dict key): the caller shards
        it along the vocabulary (``apply_tensor_parallel``: a DTensor behind a ShardView)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, process_group, emb.padding_idx, device="meta",
                    dtype=emb.weight.dtype, reduce=reduce, seq_dim=seq_dim)
        layer.weight = emb.weight
        return layer

    def forward(self, input_ids: Tensor) -> Tensor:
        out = vocab_parallel_embedding(input_ids, local_tensor(self.weight), self.vocab_start, self.padding_idx)
        if self.reduce == "all_reduce":
            return all_reduce(out, self.process_group)
        if self.reduce == "reduce_scatter":
            world = group_size(self.process_group)
            if input_ids.shape[self.seq_dim] % world:
                raise ValueError(f"sequence parallel needs seqlen divisible by tp={world}, got input_ids of shape "
                                 f"{tuple(input_ids.shape)} (pad the batch, or apply tp with "
                                 f"sequence_parallel=False)")
            return reduce_scatter(out, self.process_group, self.seq_dim)
        return out


def vocab_parallel_embedding(input_ids: Tensor, weight: Tensor, vocab_start: int,
                             padding_idx: int | None = None) -> Tensor:
    """ids (...) global -> (..., d): rows of ``weight`` (V_local, d) for ids in [vocab_start, vocab_start+V_local),
    zero elsewhere."""
    local_ids = input_ids - vocab_start
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    out = F.embedding(local_ids.masked_fill(outside, 0), weight, padding_idx)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class ColumnParallelEmbedding(nn.Embedding):
    """Embedding whose columns (embedding_dim) are split evenly: ids (...) -> (..., embedding_dim / world)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, process_group=None, padding_idx: int | None = None,
                 device=None, dtype=None):
        world = group_size(process_group)
        if embedding_dim % world:
            raise ValueError(f"ColumnParallelEmbedding: embedding_dim={embedding_dim} is not divisible by the "
                             f"process group size {world}")
        super().__init__(num_embeddings, embedding_dim // world, padding_idx=padding_idx, device=device,
                         dtype=dtype)
        self.process_group = process_group


class ParallelEmbeddings(nn.Module):
    """Word embeddings (vocab-parallel) plus optional learned positions (column-parallel), summed over ranks.

    forward(input_ids (b, L), position_ids=None, combine_batch_seqlen_dim=False):
    -> (b, L, d) replicated [sequence_parallel=False], or its dim-0 shard [sequence_parallel=True]:
    (b / world, L, d), or ((b * L) / world, d) with combine_batch_seqlen_dim.
    ``max_position_embeddings=0`` means no position embeddings.
    """

    def __init__(self, embed_dim: int, vocab_size: int, max_position_embeddings: int = 0, process_group=None,
                 padding_idx: int | None = None, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        self.process_group, self.sequence_parallel, self.embed_dim = process_group, sequence_parallel, embed_dim
        self.word_embeddings = VocabParallelEmbedding(vocab_size, embed_dim, process_group, padding_idx,
                                                      device=device, dtype=dtype)
        self.max_position_embeddings = max_position_embeddings
        self.position_embeddings = None
        if max_position_embeddings > 0:
            self.position_embeddings = ColumnParallelEmbedding(max_position_embeddings, embed_dim, process_group,
                                                               device=device, dtype=dtype)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None,
                combine_batch_seqlen_dim: bool = False) -> Tensor:
        b, seqlen = input_ids.shape
        emb = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(seqlen, dtype=torch.long, device=input_ids.device)
            pos = F.embedding(position_ids, local_tensor(self.position_embeddings.weight))
            part = pos.shape[-1]
            start = group_rank(self.process_group) * part
            emb = torch.cat([emb[..., :start], emb[..., start:start + part] + pos, emb[..., start + part:]], -1)
        if combine_batch_seqlen_dim:
            emb = emb.reshape(b * seqlen, self.embed_dim)
        if self.sequence_parallel:
            return reduce_scatter(emb, self.process_group, 0)
        return all_reduce(emb, self.process_group)


# ---- vocab-parallel cross-entropy -------------------------------------------------------------------------------
def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, process_group=None, ignore_index: int = -100,
                                 reduction: str = "mean") -> Tensor:
    """Cross-entropy over a vocabulary split across ranks, without gathering the logits.

    logits: (N, V_local), this rank's vocabulary slice [rank*V_local, (rank+1)*V_local); labels: (N,) GLOBAL ids
    (``ignore_index`` skipped) -> scalar (mean over kept labels, or sum) or (N,) for reduction="none", identical on
    every rank. Three all-reduces of N floats each (max, sum of exp, target logit).
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy: need logits (N, V_local) and labels (N,), got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be mean|sum|none, got {reduction!r}")
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()  # fp32 math, fp64 kept
    v_local = logits.shape[1]
    start = group_rank(process_group) * v_local
    with torch.no_grad():  # the shift cancels out of the loss: no gradient through it
        row_max = logits.max(dim=-1).values
        if group_size(process_group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=process_group)
    shifted = logits - row_max.unsqueeze(-1)
    sum_exp = all_reduce(shifted.exp().sum(-1), process_group)
    local_labels = labels - start
    mine = (local_labels >= 0) & (local_labels < v_local)
    target = shifted.gather(1, local_labels.clamp(0, v_local - 1).unsqueeze(1)).squeeze(1)
    target = all_reduce(target.masked_fill(~mine, 0.0), process_group)
    keep = labels != ignore_index
    loss = (sum_exp.log() - target).masked_fill(~keep, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / keep.sum().clamp_min(1)


def vocab_parallel_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, process_group=None,
                                        ignore_index: int = -100, reduction: str = "mean",
                                        chunk_size: int | None = 4096) -> Tensor:
    """Cross-entropy of ``hidden @ weight^T`` with the vocabulary split over ranks, chunk by chunk of tokens.

    hidden: (N, d) replicated on every rank; weight: (V_local, d) this rank's vocabulary rows; labels: (N,) global
    ids -> scalar (mean over kept labels / sum) or (N,). Each chunk's (chunk, V_local) fp32 logits are recomputed
    in backward (activation checkpointing), so only one chunk of logits is alive at a time.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: need hidden (N, d) and weight (V_local, d), got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"vocab_parallel_linear_cross_entropy: labels {tuple(labels.shape)} must be (N,) = "
                         f"({hidden.shape[0]},)")
    n = hidden.shape[0]
    step = n if not chunk_size or chunk_size >= n else chunk_size

    def chunk_loss(h, w, lab):
        return vocab_parallel_cross_entropy(F.linear(h, w), lab, process_group, ignore_index, "none")

    parts = []
    for s in range(0, n, step):
        h, lab = hidden[s:s + step], labels[s:s + step]
        if step < n and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            parts.append(torch.utils.checkpoint.checkpoint(chunk_loss, h, weight, lab, use_reentrant=False))
        else:
            parts.append(chunk_loss(h, weight, lab))
    loss = torch.cat(parts)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum().clamp_min(1)
