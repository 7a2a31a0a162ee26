"""Collectives for tensor / sequence parallelism: raw calls that can run asynchronously, and autograd versions.

Raw calls (``*_raw``) work on dim 0, return ``(tensor, handle)`` and, with ``async_op=True``, let the caller
compute while the collective runs (``handle.wait()`` before reading the tensor; ``handle`` is None when
``async_op=False`` or the group has one rank). The autograd functions pair each forward collective with the
backward collective that makes gradients right:

| function            | forward            | backward           | used for                                          |
|---------------------|--------------------|--------------------|---------------------------------------------------|
| ``all_gather``      | all-gather on dim  | reduce-scatter     | SP: sequence shard -> full sequence (mixer input) |
| ``reduce_scatter``  | reduce-scatter     | all-gather         | SP: partial sums -> summed sequence shard         |
| ``all_reduce``      | all-reduce (sum)   | identity           | partial sums -> replicated value, replicated use  |
| ``copy_to_group``   | identity           | all-reduce (sum)   | replicated input used by rank-local computations  |
| ``all_reduce_both`` | all-reduce (sum)   | all-reduce (sum)   | summed value then used rank-locally (x_proj, norm)|
| ``gather_from_group``| all-gather on dim | keep own slice     | shards -> a full tensor used identically (logits) |

``ring_exchange`` is the one P2P step (send to the next rank, receive from the previous) that the overlapped
column-parallel forward (tensor_parallel.py) builds its ring all-gather from.

``process_group=None`` means the default (world) group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.13 renames the flat collectives (the old names warn); torch 2.11 only has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(process_group) -> int:
    """Ranks in ``process_group`` (1 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(process_group)


def group_rank(process_group) -> int:
    """This rank's index in ``process_group`` (0 when torch.distributed is not initialised)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(process_group)


# ---- raw collectives (dim 0) -----------------------------------------------------------------------------------
def all_gather_raw(input_: Tensor, process_group=None, async_op: bool = False):
    """Concatenate every rank's ``input_`` along dim 0.

    input_: (n, ...) -> output (world * n, ...), rank r's rows at [r*n, (r+1)*n). Returns ``(output, handle)``.
    """
    world = group_size(process_group)
    if world == 1:
        return input_, None
    input_ = input_.contiguous()
    output = input_.new_empty((world * input_.shape[0], *input_.shape[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        handle = _all_gather_flat(output, input_, group=process_group, async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: Tensor, process_group=None, async_op: bool = False):
    """Sum ``input_`` over ranks and keep this rank's slice of dim 0.

    input_: (world * n, ...) -> output (n, ...). Returns ``(output, handle)``.
    """
    world = group_size(process_group)
    if world == 1:
        return input_, None
    if input_.shape[0] % world:
        raise ValueError(f"reduce_scatter_raw: dim 0 of input {tuple(input_.shape)} is not divisible by the "
                         f"group size {world}")
    input_ = input_.contiguous()
    output = input_.new_empty((input_.shape[0] // world, *input_.shape[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        handle = _reduce_scatter_flat(output, input_, group=process_group, async_op=async_op)
    return output, handle


def all_reduce_raw(input_: Tensor, process_group=None, async_op: bool = False):
    """Sum ``input_`` over ranks (any shape). Works IN PLACE on ``input_`` when it is contiguous.

    Returns ``(output, handle)``.
    """
    if group_size(process_group) == 1:
        return input_, None
    input_ = input_.contiguous()
    handle = dist.all_reduce(input_, group=process_group, async_op=async_op)
    return input_, handle


def ring_exchange(send: Tensor, recv: Tensor, process_group=None) -> list:
    """Start sending ``send`` to the next rank of ``process_group`` and receiving ``recv`` from the previous one.

    send, recv: same shape and dtype (recv is written). Returns the requests: ``wait()`` each before reading
    ``recv`` or writing ``send``. P2P works on gloo and NCCL; peers are named by global rank (torch 2.11 has no
    group-relative P2P arguments on every backend).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world, rank = group_size(group), group_rank(group)
    nxt, prv = (dist.get_global_rank(group, (rank + step) % world) for step in (1, -1))
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return dist.batch_isend_irecv(ops)


# ---- any-dim helpers ------------------------------------------------------------------------------------------
def _gather_dim(x: Tensor, group, dim: int) -> Tensor:
    """x: (..., n, ...) at ``dim`` -> (..., world*n, ...)."""
    return all_gather_raw(x.movedim(dim, 0), group)[0].movedim(0, dim)


def _scatter_dim(x: Tensor, group, dim: int) -> Tensor:
    """x: (..., world*n, ...) at ``dim`` -> (..., n, ...) summed over ranks."""
    return reduce_scatter_raw(x.movedim(dim, 0), group)[0].movedim(0, dim)


def _own_slice(x: Tensor, group, dim: int) -> Tensor:
    """x: (..., world*n, ...) -> this rank's (..., n, ...) at ``dim``."""
    n = x.shape[dim] // group_size(group)
    return x.narrow(dim, group_rank(group) * n, n).contiguous()


def _check_dim(x: Tensor, dim: int, name: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{name}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


# ---- autograd functions -----------------------------------------------------------------------------------------
# One Function per family; the pairing of forward and backward (the table above) is picked by constant arguments,
# which torch.compile treats as constants.
_DIM_OPS = {"gather": _gather_dim, "scatter": _scatter_dim, "own_slice": _own_slice}


class DimCollectiveFunc(torch.autograd.Function):
    """forward: ``_DIM_OPS[fwd]`` along ``dim``; backward: ``_DIM_OPS[bwd]`` along the same dim."""

    @staticmethod
    def forward(ctx, x, group, dim, fwd, bwd):
        ctx.group, ctx.dim, ctx.bwd = group, dim, bwd
        return _DIM_OPS[fwd](x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _DIM_OPS[ctx.bwd](grad, ctx.group, ctx.dim), None, None, None, None


def _sum(x: Tensor, group) -> Tensor:
    return all_reduce_raw(x.clone(), group)[0]  # the clone keeps the in-place all-reduce off autograd's tensors


class SumFunc(torch.autograd.Function):
    """Sum over ranks in forward if ``in_forward``, in backward if ``in_backward``; identity otherwise."""

    @staticmethod
    def forward(ctx, x, group, in_forward, in_backward):
        ctx.group, ctx.in_backward = group, in_backward
        return _sum(x, group) if in_forward else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (_sum(grad, ctx.group) if ctx.in_backward else grad), None, None, None


def all_gather(x: Tensor, process_group=None, dim: int = 0) -> Tensor:
    """x: (..., n, ...) at ``dim`` -> (..., world*n, ...); backward reduce-scatters."""
    if group_size(process_group) == 1:
        return x
    return DimCollectiveFunc.apply(x, process_group, _check_dim(x, dim, "all_gather"), "gather", "scatter")


def reduce_scatter(x: Tensor, process_group=None, dim: int = 0) -> Tensor:
    """x: (..., world*n, ...) partial sums -> (..., n, ...) summed slice of this rank; backward all-gathers."""
    world = group_size(process_group)
    if world == 1:
        return x
    dim = _check_dim(x, dim, "reduce_scatter")
    if x.shape[dim] % world:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) is not "
                         f"divisible by the group size {world}")
    return DimCollectiveFunc.apply(x, process_group, dim, "scatter", "gather")


def all_reduce(x: Tensor, process_group=None) -> Tensor:
    """Sum over ranks; the result is used identically on every rank, so the backward is the identity."""
    return x if group_size(process_group) == 1 else SumFunc.apply(x, process_group, True, False)


def copy_to_group(x: Tensor, process_group=None) -> Tensor:
    """Identity forward; backward sums the gradient over ranks (a replicated tensor used rank-locally)."""
    return x if group_size(process_group) == 1 else SumFunc.apply(x, process_group, False, True)


def all_reduce_both(x: Tensor, process_group=None) -> Tensor:
    """Sum over ranks in forward AND backward: a summed value that each rank then uses for its own shard."""
    return x if group_size(process_group) == 1 else SumFunc.apply(x, process_group, True, True)


def gather_from_group(x: Tensor, process_group=None, dim: int = -1) -> Tensor:
    """x: (..., n, ...) -> (..., world*n, ...) used identically on every rank; backward keeps this rank's slice."""
    if group_size(process_group) == 1:
        return x
    dim = _check_dim(x, dim, "gather_from_group")
    return DimCollectiveFunc.apply(x, process_group, dim, "gather", "own_slice")
