"""The trainer's pipeline-parallel path (``--pp N``): build this rank's stages, one training step through the
schedule, evaluation, and the single-device copy for ``final/``.

A step's ``grad_accum`` micro-batches of ``batch_size`` sequences are the pipeline's micro-batches, read in the
same order as the eager path's micro-steps, so losses and gradients equal those of one process on the same
global batch.
"""

from __future__ import annotations

import torch

from mamba_parallel.distributed.materialize import materialize
from mamba_parallel.distributed.parallel_dims import ParallelDims
from mamba_parallel.distributed.parallelize import parallelize_pipeline
from mamba_parallel.distributed.pipeline import (
    PipelineModel,
    PipelinePlan,
    gather_full_state,
    parse_split,
    pipeline_eval_loss,
    pipeline_step,
)


def init_device(cfg, env) -> torch.device:
    """Where a meta-built model is materialised: the host under --cpu-offload (FSDP2 keeps its shards there, the
    values are still drawn on the rank's device), else the rank's device."""
    return torch.device("cpu") if cfg.cpu_offload else env.device


def pipeline_plan(cfg, config=None) -> PipelinePlan:
    plan = PipelinePlan(cfg.pp, cfg.pp_schedule, cfg.grad_accum, cfg.pp_stages_per_rank, parse_split(cfg.pp_split))
    if config is not None:
        plan.ranges(config)  # a bad --pp-split fails here, naming the flag
    return plan


def build_pipelined_model(config, cfg, env, dims: ParallelDims, dp_options: dict,
                          timed: bool = False) -> PipelineModel:
    """This rank's stages, built on meta and materialised shard by shard (initial values = ``init_model``'s)."""
    from mamba_parallel.layers.recompute import apply_recompute
    from mamba_parallel.models import MambaLMHeadModel

    plan = pipeline_plan(cfg, config)
    dtype = torch.bfloat16 if cfg.param_dtype == "bf16" else None
    with torch.device("meta"):
        model = apply_recompute(MambaLMHeadModel(config, dtype=dtype), cfg.recompute)
    return parallelize_pipeline(model, dims, plan, env.device, tp_overlap=cfg.tp_overlap,
                                materialize=lambda m: materialize(m, config, init_device(cfg, env), cfg.seed,
                                                                  draw_device=env.device,
                                                                  buffer_device=env.device),
                                dp_mode=cfg.dp_mode, activation_checkpointing=cfg.activation_checkpointing,
                                compile=cfg.compile, cpu_offload=cfg.cpu_offload, timed=timed, **dp_options)


def _step_batch(batches, consumed: int, n: int, device):
    parts = [batches.batch(consumed + m * batches.global_batch, device) for m in range(n)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def pipelined_step(pm: PipelineModel, batches, consumed: int, cfg, device, autocast) -> torch.Tensor:
    """Forward + backward of one step's micro-batches through the schedule -> their mean loss (0-d fp32)."""
    inputs, targets = _step_batch(batches, consumed, cfg.grad_accum, device)
    with autocast:
        return pipeline_step(pm, inputs, targets)


@torch.no_grad()
def pipelined_evaluate(pm: PipelineModel, batches, n_batches: int, cfg, device, autocast) -> float:
    """Mean loss over the validation split's first global micro-batches, ``grad_accum`` at a time (``n_batches``
    rounded up to a multiple of it: the schedule runs a fixed number of micro-batches)."""
    import torch.distributed as dist

    n = cfg.grad_accum
    calls = max(1, -(-n_batches // n))
    total = torch.zeros((), device=device, dtype=torch.float64)
    for c in range(calls):
        inputs, targets = _step_batch(batches, c * n * batches.global_batch, n, device)
        with autocast:
            total += pipeline_eval_loss(pm, inputs, targets).double()
    total /= calls
    dist.all_reduce(total)
    total /= dist.get_world_size()
    return total.item()


def gather_pipelined_for_save(pm: PipelineModel, config, dims: ParallelDims):
    """A plain single-device copy of the trained weights on rank 0's CPU (None elsewhere); collective."""
    from mamba_parallel.models import MambaLMHeadModel

    full = gather_full_state(pm, dims)
    if full is None:
        return None
    with torch.device("meta"):
        plain = MambaLMHeadModel(config)
    plain.load_state_dict(full, assign=True, strict=True)
    plain.tie_weights()
    return plain
