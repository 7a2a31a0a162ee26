"""Data parallelism with torch.distributed's own tools: the torchrun process group, FSDP2 ``fully_shard`` and DDP.

Under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK in the environment) one process drives one GPU
(``cuda:LOCAL_RANK``, NCCL) or one CPU process (gloo).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None = None, timeout_s: int = 1800, single_rank_group: bool = False) -> DistEnv:
    """Join the torchrun process group when WORLD_SIZE > 1 (or reuse one already made); pick this rank's device.

    ``device``: "cpu", "cuda" or None (cuda when available). NCCL on CUDA, gloo on CPU. ``single_rank_group``: a
    process group of one also when WORLD_SIZE is 1 (FSDP2 over one rank, for CPU offload).
    """
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible to torch")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                               f"use --nproc_per_node <= the GPU count")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev)
    if world_size > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    elif single_rank_group:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank, world_size, local_rank, dev)


def fsdp_units(blocks, blocks_per_unit: int = 1) -> list[list[torch.nn.Module]]:
    """Consecutive blocks grouped ``blocks_per_unit`` at a time (the last unit may be shorter): FSDP2's units.

    blocks: n modules -> ceil(n / blocks_per_unit) lists of modules, in order."""
    if isinstance(blocks_per_unit, bool) or not isinstance(blocks_per_unit, int) or blocks_per_unit < 1:
        raise ValueError(f"fsdp blocks_per_unit must be an integer >= 1, got {blocks_per_unit!r}")
    blocks = list(blocks)
    return [blocks[i:i + blocks_per_unit] for i in range(0, len(blocks), blocks_per_unit)]


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, blocks, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True,
               blocks_per_unit: int = 1, cpu_offload: bool = False) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each unit of ``blocks_per_unit`` consecutive blocks, then the root (embedding, final
    norm, lm_head) over ``mesh``.

    ``mesh`` is 1-D (shard) or 2-D (replicate, shard) = HSDP. ``param_dtype`` None keeps fp32 compute params
    (bf16 then comes from autocast); bf16 here is FSDP's own mixed precision with fp32 gradient reduction.
    ``reshard_after_forward`` applies to the units but the last (False: one all-gather per unit and step
    instead of two, for the memory of the full unit params).
    ``blocks_per_unit`` > 1 groups blocks into one FSDP parameter group (``fully_shard([block, ...])``): one
    all-gather, one reduce-scatter and one set of unshard / reshard hooks per unit instead of per block, which
    cuts the host time FSDP2 spends per step, for the memory of k blocks' full params (2k with prefetch). The
    modules are not re-parented: parameter and state-dict names stay those of the plain model.
    ``cpu_offload``: FSDP2's CPUOffloadPolicy: sharded parameters, their gradients and so the optimizer state live in
    pinned host memory; each unit is copied to the GPU for its forward / backward (the optimizer steps on the CPU).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    units = fsdp_units(blocks, blocks_per_unit)
    for i, unit in enumerate(units):
        # The last unit's params are needed again at once by the backward pass: keep them gathered.
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward and i < len(units) - 1)
    # The root (embedding, tied lm_head, final norm) is the first thing backward needs: never reshard it after
    # forward. Passing a bool here overrides FSDP2's own root exemption (it applies only to the None default), so
    # the old `reshard_after_forward=True` re-gathered the vocab-sized weight, exposed, at every backward start.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    # Issue unit i+1's all-gather when unit i starts (not when the CPU reaches unit i+1), so the gather overlaps
    # unit i's compute even when the host is barely ahead of the GPU. Backward prefetches one already. The
    # modules of a unit share one FSDP state, so its first module stands for the unit.
    for unit, nxt in zip(units, units[1:]):
        unit[0].set_modules_to_forward_prefetch([nxt[0]])
    return model


def apply_ddp(model: torch.nn.Module, mesh: DeviceMesh, bucket_cap_mb: float | None = None,
              bf16_grads: bool = False) -> torch.nn.Module:
    """torch DDP over a 1-D data-parallel mesh (its process group); gradients averaged in fp32.

    ``bucket_cap_mb``: DDP's all-reduce bucket size (None: torch's 25 MB; bigger means fewer, larger
    all-reduces). ``bf16_grads``: all-reduce gradients in bf16 (half the bytes; results differ from the fp32
    reduction by bf16 rounding), for links too slow to hide the fp32 all-reduce behind the backward pass.
    """
    from torch.nn.parallel import DistributedDataParallel

    if mesh.ndim != 1:
        raise ValueError(f"DDP needs a 1-D data-parallel mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    dev = next(model.parameters()).device
    ids = [dev.index] if dev.type == "cuda" else None
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = DistributedDataParallel(model, device_ids=ids, process_group=mesh.get_group(),
                                  gradient_as_bucket_view=True, **kwargs)
    if bf16_grads:
        ddp.register_comm_hook(mesh.get_group(), _bf16_allreduce_hook)
    return ddp


def _bf16_allreduce_hook(group, bucket):
    """DDP comm hook: average one gradient bucket in bf16 (divided before the sum so it cannot overflow), then
    write it back into the fp32 bucket. torch's own bf16 hook is NCCL-only; this one also runs on gloo."""
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(low, group=group, async_op=True).get_future()

    def unpack(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(unpack)
