"""Parallelism applied from outside to the single-device model: TP/SP, CP, FSDP2 / DDP, on DeviceMeshes.

The tensor-parallel API keeps the names and arguments mamba_ssm / flash-attn users know: ``ColumnParallelLinear``,
``RowParallelLinear``, ``parallel_linear_func``, ``VocabParallelEmbedding``, ``ParallelEmbeddings``,
``get_dim_for_local_rank``, ``all_gather_raw`` / ``reduce_scatter_raw`` / ``all_reduce_raw``.
``apply_tensor_parallel`` shards a whole ``MambaLMHeadModel``; ``choose_parallel`` is ``--parallel auto``.
"""

from mamba_parallel.distributed.auto import choose_parallel
from mamba_parallel.distributed.collectives import (
    all_gather,
    all_gather_raw,
    all_reduce,
    all_reduce_both,
    all_reduce_raw,
    copy_to_group,
    gather_from_group,
    reduce_scatter,
    reduce_scatter_raw,
)
from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims, dims_from_world
# The function, bound after its submodule is loaded, so ``distributed.parallelize`` is callable.
from mamba_parallel.distributed.parallelize import parallelize
from mamba_parallel.distributed.tensor_parallel import (
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    ParallelEmbeddings,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_dim_for_local_rank,
    parallel_linear_func,
    vocab_parallel_cross_entropy,
    vocab_parallel_linear_cross_entropy,
)


def __getattr__(name):  # the tp plan imports the model layers: load it only when asked for
    if name == "apply_tensor_parallel":
        from mamba_parallel.distributed.tp_plan import apply_tensor_parallel

        return apply_tensor_parallel
    raise AttributeError(name)


__all__ = [
    "ParallelDims", "ParallelConfigError", "dims_from_world", "choose_parallel", "apply_tensor_parallel",
    "parallelize",
    "ColumnParallelLinear", "RowParallelLinear", "parallel_linear_func", "VocabParallelEmbedding",
    "ColumnParallelEmbedding", "ParallelEmbeddings", "get_dim_for_local_rank", "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy", "all_gather_raw", "reduce_scatter_raw", "all_reduce_raw", "all_gather",
    "reduce_scatter", "all_reduce", "copy_to_group", "all_reduce_both", "gather_from_group",
]
