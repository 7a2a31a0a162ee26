"""Parallelism applied from outside to the single-device model: TP/SP, CP, FSDP2 / DDP, on DeviceMeshes."""

from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims, dims_from_world

__all__ = ["ParallelDims", "ParallelConfigError", "dims_from_world"]
