"""parallelize(): make a single-device MambaLMHeadModel parallel from outside, in a fixed order.

1. tensor (+ sequence) parallel over the ``tp`` mesh dim     (mamba_parallel.distributed.tp_plan)
2. context parallel over the ``cp`` mesh dim                 (mamba_parallel.distributed.context_parallel)
3. per-block activation checkpointing                        (torch's checkpoint_wrapper, non-reentrant)
4. per-block torch.compile
5. data parallel: FSDP2 ``fully_shard`` per block (or per unit of k consecutive blocks) + root over the flattened
   (dp_shard, cp) mesh, HSDP when dp_replicate > 1; or DDP over the dp_replicate mesh.

Works on a model built on the meta device (FSDP / TP / CP shard meta params; materialise afterwards with
``distributed.materialize``); DDP needs materialised params: pass ``materialize`` (called on the model once its
own shards are laid out: before DDP wraps it, after FSDP shards it) so every layout builds on meta and no rank
holds the full model. ``parallelize_pipeline`` cuts the model into pipeline stages between the TP/CP and the data
parallel steps (distributed/pipeline.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from mamba_parallel.distributed.data_parallel import apply_ddp, apply_fsdp
from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims
from mamba_parallel.distributed.pipeline import PipelinePlan


def _optional(module: str, attr: str, flag: str):
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise ParallelConfigError(f"{flag} needs {module}.{attr}, which this build does not have yet") from None
    return getattr(mod, attr)


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    try:
        return model.backbone.layers
    except AttributeError:
        raise TypeError(f"parallelize expects a MambaLMHeadModel (model.backbone.layers), got "
                        f"{type(model).__name__}") from None


def dp_mesh(dims: ParallelDims):
    """The FSDP mesh: (dp_shard x cp) flattened, with dp_replicate as an outer dim when > 1 (HSDP)."""
    shard = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    if dims.cp > 1:
        dims.submesh("dp_shard", "cp")  # creates the flattened dim on the world mesh
    if dims.dp_replicate > 1:
        return dims.mesh["dp_replicate", shard]
    return dims.mesh[shard]


def apply_model_parallel(model: torch.nn.Module, dims: ParallelDims, tp_overlap: bool = False) -> torch.nn.Module:
    """Steps 1-2: tensor (+ sequence) parallel over ``tp``, then context parallel over ``cp``; in place.
    ``tp_overlap``: the sequence-parallel entry projections ring-gather their input behind per-shard matmuls
    (``apply_tensor_parallel``'s ``overlap_comm``)."""
    if dims.tp > 1:
        apply_tp = _optional("mamba_parallel.distributed.tp_plan", "apply_tensor_parallel", "--tp > 1")
        apply_tp(model, dims.submesh("tp"), sequence_parallel=True, overlap_comm=tp_overlap)
    if dims.cp > 1:
        apply_cp = _optional("mamba_parallel.distributed.context_parallel", "apply_context_parallel", "--cp > 1")
        apply_cp(model, dims.submesh("cp"))
    return model


def _check_dp_options(dp_mode: str, fsdp_blocks_per_unit) -> None:
    if dp_mode not in ("fsdp", "ddp"):
        raise ParallelConfigError(f"--dp-mode must be fsdp or ddp, got {dp_mode!r}")
    if isinstance(fsdp_blocks_per_unit, bool) or not isinstance(fsdp_blocks_per_unit, int) \
            or fsdp_blocks_per_unit < 1:
        raise ParallelConfigError(f"--fsdp-blocks-per-unit must be an integer >= 1, got {fsdp_blocks_per_unit!r}")


def apply_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Step 3 alone: every block of ``model`` (a whole model or a pipeline stage) wrapped in torch's non-reentrant
    ``checkpoint_wrapper``, so its backward runs the block's forward again instead of keeping its activations.
    In place; returns the model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = _blocks(model)
    for i, block in enumerate(layers):
        layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model


def apply_data_parallel(model: torch.nn.Module, dims: ParallelDims, *, dp_mode: str = "fsdp",
                        activation_checkpointing: bool = False, compile: bool = False,
                        param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                        ddp_bucket_cap_mb: float | None = None, ddp_bf16_grads: bool = False,
                        fsdp_blocks_per_unit: int = 1, cpu_offload: bool = False,
                        materialize: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """Steps 3-5 on ``model`` (a whole model or one pipeline stage): activation checkpointing, compile, then FSDP2
    or DDP over the rank's data-parallel mesh. ``cpu_offload``: FSDP2 keeps parameters, gradients and the optimizer
    state in pinned host memory (also on one rank: FSDP over a mesh of one). ``materialize(model)``: see the
    module docstring. Returns the model, or its DDP wrapper."""
    _check_dp_options(dp_mode, fsdp_blocks_per_unit)
    layers = _blocks(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        for i, block in enumerate(layers):
            layers[i] = torch.compile(block)

    if dp_mode == "ddp":
        if cpu_offload:
            raise ParallelConfigError("--cpu-offload is FSDP2's: use --dp-mode fsdp")
        if dims.tp > 1 or dims.cp > 1 or dims.dp_shard > 1:
            raise ParallelConfigError(f"--dp-mode ddp replicates whole models: it needs tp = cp = 1 and "
                                      f"dp_shard = 1 ({dims.describe()}); use --dp-mode fsdp")
        if materialize is not None:
            materialize(model)
        if dims.dp_replicate > 1:
            return apply_ddp(model, dims.mesh["dp_replicate"], bucket_cap_mb=ddp_bucket_cap_mb,
                             bf16_grads=ddp_bf16_grads)
        return model
    if dims.fsdp_enabled or dims.dp_replicate > 1 or cpu_offload:
        apply_fsdp(model, dp_mesh(dims), layers, param_dtype=param_dtype,
                   reshard_after_forward=reshard_after_forward, blocks_per_unit=fsdp_blocks_per_unit,
                   cpu_offload=cpu_offload)
    if materialize is not None:
        materialize(model)
    return model


def parallelize(model: torch.nn.Module, dims: ParallelDims, *, dp_mode: str = "fsdp",
                activation_checkpointing: bool = False, compile: bool = False,
                param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                ddp_bucket_cap_mb: float | None = None, ddp_bf16_grads: bool = False,
                fsdp_blocks_per_unit: int = 1, cpu_offload: bool = False,
                materialize: Callable[[torch.nn.Module], None] | None = None,
                tp_overlap: bool = False) -> torch.nn.Module:
    """Apply TP/SP, CP, activation checkpointing, compile and FSDP2/DDP (in that order); return the model.

    ``dp_mode="ddp"`` returns a DistributedDataParallel wrapper (``.module`` is the model); otherwise the model
    itself (modified in place). FSDP only: ``param_dtype`` is FSDP's compute dtype (None keeps fp32 params;
    bf16 all-gathers half the bytes, gradients still reduced in fp32); ``reshard_after_forward=False`` keeps
    each block gathered from forward to backward (one all-gather per block and step instead of two, for the
    memory of the full params); ``fsdp_blocks_per_unit`` k > 1 shards k consecutive blocks as one FSDP unit (one
    all-gather / reduce-scatter per unit, same state-dict names; see ``apply_fsdp``); ``cpu_offload``: FSDP2's
    CPUOffloadPolicy. DDP only: ``ddp_bucket_cap_mb`` and ``ddp_bf16_grads`` (see ``apply_ddp``).
    ``materialize``: called once the model holds only its own shards (see the module docstring). ``tp_overlap``:
    see ``apply_model_parallel``.
    """
    _check_dp_options(dp_mode, fsdp_blocks_per_unit)
    apply_model_parallel(model, dims, tp_overlap)
    return apply_data_parallel(model, dims, dp_mode=dp_mode, activation_checkpointing=activation_checkpointing,
                               compile=compile, param_dtype=param_dtype,
                               reshard_after_forward=reshard_after_forward, ddp_bucket_cap_mb=ddp_bucket_cap_mb,
                               ddp_bf16_grads=ddp_bf16_grads, fsdp_blocks_per_unit=fsdp_blocks_per_unit,
                               cpu_offload=cpu_offload, materialize=materialize)


def parallelize_pipeline(model: torch.nn.Module, dims: ParallelDims, plan: PipelinePlan, device: torch.device,
                         *, materialize: Callable[[torch.nn.Module], None], timed: bool = False,
                         tp_overlap: bool = False, **dp_options):
    """A meta ``MambaLMHeadModel`` -> this rank's ``PipelineModel``: TP/CP on the whole (meta) model, the cut
    into stages, then per stage activation checkpointing / compile / FSDP2 or DDP (``dp_options``: those of
    ``apply_data_parallel``), ``materialize(pipeline_model)`` once every stage is laid out, and the schedule
    (``timed``: with the stages' busy time, see ``pipeline.StageTimer``)."""
    from mamba_parallel.distributed.pipeline import build_pipeline_model, build_schedule, untie_for_pipeline

    if not next(model.parameters()).is_meta:
        raise ParallelConfigError("parallelize_pipeline builds each rank's stages from a model on the meta device")
    dims.validate_for_model(model.config, plan.stages_per_rank)
    tied = untie_for_pipeline(model)
    apply_model_parallel(model, dims, tp_overlap)
    pm = build_pipeline_model(model, plan, dims, dims.submesh("pp").get_local_rank(), tied)
    if dp_options.get("dp_mode") == "ddp":
        # Whole replicas of each stage through FSDP2's replicate mesh (dp_shard = 1): torch's DDP reducer does not
        # follow the schedule's per-micro-batch backward calls. Same all-reduce, same result.
        if dims.dp_shard != 1 or dims.cp > 1 or dims.tp > 1:
            raise ParallelConfigError(f"--dp-mode ddp replicates whole stages: it needs tp = cp = 1 and "
                                      f"dp_shard = 1 ({dims.describe()}); use --dp-mode fsdp")
        dp_options = {**dp_options, "dp_mode": "fsdp"}
    wrapped = [apply_data_parallel(part, dims, **dp_options) for part in pm.parts]
    materialize(pm)
    pm.__dict__["parts"] = wrapped
    build_schedule(pm, dims, device, timed=timed)
    return pm
