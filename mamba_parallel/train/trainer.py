"""The training loop of `mamba-parallel train`: one process per device, any world size under torchrun.

Precision: fp32 master weights (and optimizer state); ``--dtype bf16`` runs forward/backward under
``torch.autocast(bf16)`` (FSDP2 gathers and reduces in fp32). Loss: the model's own chunked cross-entropy
(``model(input_ids, targets=next_tokens).loss``), mean over the micro-batch; averaged over micro-steps and ranks.
``--cuda-graph`` replays the whole step (micro-steps, clipping, AdamW) as one CUDA graph (train/cuda_graph.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from mamba_parallel.config import ConfigError
from mamba_parallel.distributed.data_parallel import DistEnv, init_distributed
from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims
from mamba_parallel.distributed.parallelize import parallelize
from mamba_parallel.distributed.pipeline import stages_per_rank
from mamba_parallel.layers.recompute import RECOMPUTE_ITEMS, apply_recompute, parse_items
from mamba_parallel.manifest import update_manifest
from mamba_parallel.train import checkpoint as ckpt
from mamba_parallel.train import flag_effects, guard, run_folder
from mamba_parallel.train.config import DEFAULT_RECOMPUTE, TrainConfig
from mamba_parallel.train.cuda_graph import GraphedTrainStep, check_graph_layout
from mamba_parallel.train.data import DataError, RankBatches, TokenWindows, check_token_folder, folder_tokenizer, \
    is_prepared, open_docs, open_split, prepare_data, read_header
from mamba_parallel.train.determinism import deterministic_mode
from mamba_parallel.train.disk import OutputError, check_space, human, output_errors
from mamba_parallel.train.flops import peak_flops, train_flops_per_token
from mamba_parallel.train.host_norm import squared_norm
from mamba_parallel.train.metrics import GpuMonitor, MetricsLogger, Progress, Throughput, peak_memory_gib
from mamba_parallel.train.optim import build_optimizer, build_scheduler, restart_schedule
from mamba_parallel.train import pipelined
from mamba_parallel.train.batching import resolve_micro_steps
from mamba_parallel.train.tokenizer import load_tokenizer


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the last complete checkpoint is left intact."""


_STOP = {"sigterm": False}


def _on_sigterm(signum, frame):
    _STOP["sigterm"] = True


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- data --------------------------------------------------------------------------------------------------------
def _same_tokenizer(a: str, b: str) -> bool:
    """Two tokenizer specs ("byte" or tokenizer.json paths) name the same tokenizer (same file contents)."""
    if a == b or "byte" in (a, b):
        return a == b
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def resolve_data(cfg: TrainConfig, env: DistEnv) -> tuple[str, dict, object]:
    """(token folder, header, tokenizer): a prepared folder as is, anything else tokenized into <out>/data."""
    if cfg.data and is_prepared(cfg.data):
        folder = cfg.data
        check_token_folder(folder)
        header = read_header(folder)
        spec = folder_tokenizer(folder, header)
        if cfg.tokenizer and not _same_tokenizer(load_tokenizer(cfg.tokenizer).spec, spec):
            raise DataError(f"--tokenizer {cfg.tokenizer!r} differs from the tokenizer of the token folder "
                            f"{folder!r} ({spec!r})")
        return folder, header, load_tokenizer(spec)
    tokenizer = load_tokenizer(cfg.tokenizer)
    source = cfg.data or "stdlib"
    if source != "stdlib" and not os.path.exists(source):
        raise DataError(f"--data: {source!r} does not exist")
    folder = os.path.join(cfg.out, "data")
    wanted = {"source": os.path.abspath(source) if source != "stdlib" else "stdlib", "tokenizer": tokenizer.spec,
              "val_fraction": cfg.val_fraction}
    error = None
    if env.is_main:
        try:
            fresh = is_prepared(folder) and all(read_header(folder).get(k) == v for k, v in wanted.items())
            if not fresh:
                prepare_data(source, folder, tokenizer, cfg.val_fraction, allow_binary=cfg.allow_binary)
        except (DataError, OutputError) as e:
            error = str(e)
    if dist.is_initialized():  # every rank fails alike instead of waiting for rank 0 forever
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise DataError(error)
    return folder, read_header(folder), tokenizer


# ---- model -------------------------------------------------------------------------------------------------------
def _model_class():
    from mamba_parallel.models import MambaLMHeadModel
    return MambaLMHeadModel


def init_model(config, device: torch.device, seed: int) -> torch.nn.Module:
    """The single-device model: built on meta, materialised on ``device``, ``init_weights`` under ``seed``."""
    with torch.device("meta"):
        model = _model_class()(config)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


def dp_options(cfg: TrainConfig) -> dict:
    """The data-parallel speed options of ``parallelize`` from the config (torch's defaults unless set)."""
    return {"param_dtype": torch.bfloat16 if cfg.fsdp_param_dtype == "bf16" else None,
            "reshard_after_forward": cfg.reshard_after_forward,
            "fsdp_blocks_per_unit": cfg.fsdp_blocks_per_unit,
            "ddp_bucket_cap_mb": cfg.ddp_bucket_mb,
            "ddp_bf16_grads": cfg.ddp_bf16_grads}


def build_parallel_model(config, cfg: TrainConfig, env: DistEnv, dims: ParallelDims, resuming: bool,
                         options: dict | None = None):
    """(model to train, the unwrapped model). Initial weights equal ``init_model``'s at every layout.

    ``options``: keyword arguments of ``parallelize`` for data parallelism (default: ``dp_options(cfg)``).

    One process without sharding builds the plain model. Every other layout (FSDP2, DDP, TP, CP, PP, CPU offload)
    builds on meta, lays out its shards and materialises only those, initialised block by block to the values of
    ``init_model`` (distributed/materialize.py): no rank ever holds the whole model. ``--pp``: the unwrapped
    model is the rank's ``PipelineModel`` (train/pipelined.py)."""
    from mamba_parallel.distributed.materialize import materialize
    from mamba_parallel.train.pipelined import init_device

    options = dp_options(cfg) if options is None else options
    if dims.pp > 1:
        pm = pipelined.build_pipelined_model(config, cfg, env, dims, options)
        return pm, pm
    dtype = torch.bfloat16 if cfg.param_dtype == "bf16" else None  # weights stored in bf16 (fp32 init rounded)
    if env.world_size == 1 and not cfg.cpu_offload:
        model = apply_recompute(init_model(config, env.device, cfg.seed), cfg.recompute)
        if dtype is not None:
            model.to(dtype)
        wrapped = parallelize(model, dims, dp_mode=cfg.dp_mode, activation_checkpointing=cfg.activation_checkpointing,
                              compile=cfg.compile, tp_overlap=cfg.tp_overlap, **options)
        return wrapped, model
    with torch.device("meta"):
        model = apply_recompute(_model_class()(config, dtype=dtype), cfg.recompute)
    wrapped = parallelize(model, dims, dp_mode=cfg.dp_mode, activation_checkpointing=cfg.activation_checkpointing,
                          compile=cfg.compile, cpu_offload=cfg.cpu_offload, tp_overlap=cfg.tp_overlap,
                          materialize=lambda m: materialize(m, config, init_device(cfg, env), cfg.seed,
                                                            draw_device=env.device,
                                                            buffer_device=env.device), **options)
    return wrapped, model


def gather_for_save(model: torch.nn.Module, config) -> torch.nn.Module | None:
    """A plain single-device copy of the trained weights on rank 0's CPU (None on other ranks); collective."""
    from mamba_parallel.distributed.pipeline import PipelineModel
    from mamba_parallel.distributed.state_dict import full_model_state_dict

    if isinstance(model, PipelineModel):
        return pipelined.gather_pipelined_for_save(model, config, model.dims)

    full = full_model_state_dict(model, cpu_offload=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        plain = _model_class()(config)
    plain.load_state_dict(full, assign=True, strict=True)
    plain.tie_weights()
    return plain


# ---- parallel layout ---------------------------------------------------------------------------------------------
def choose_dims(cfg: TrainConfig, config, env: DistEnv, log) -> ParallelDims:
    tp, cp, pp = cfg.tp, cfg.cp, cfg.pp
    if cfg.parallel == "auto":
        from mamba_parallel.distributed.auto import plan_layout

        mem = torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else 0
        micro = 1 if cfg.batch_size == "auto" else cfg.batch_size  # auto: the layout for one sequence, then fill
        try:
            plan = plan_layout(env.world_size, config, mem, seq_len=cfg.seq_len, micro_batch=micro,
                               activation_checkpointing=cfg.activation_checkpointing, param_dtype=cfg.param_dtype,
                               microbatches=cfg.microbatches,
                               local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)))
        except ParallelConfigError as e:
            raise ConfigError(str(e)) from None
        tp, cp, pp = plan.tp, plan.cp, plan.pp
        cfg.tp, cfg.cp, cfg.pp = tp, cp, pp
        cfg.cpu_offload = cfg.cpu_offload or plan.cpu_offload
        log(f"--parallel auto chose tp={tp} cp={cp} pp={pp}{' cpu-offload' if plan.cpu_offload else ''}: "
            f"{plan.reason}")
    flags = f"--tp {tp} --cp {cp}" + (f" --pp {pp}" if pp > 1 else "") + \
        (f" --dp-replicate {cfg.dp_replicate}" if cfg.dp_replicate > 1 else "")
    try:
        if cfg.dp_mode == "ddp":
            if env.world_size % (tp * cp * pp):
                raise ConfigError(f"world size {env.world_size} is not divisible by pp*tp*cp = {pp * tp * cp}")
            dims = ParallelDims(dp_replicate=env.world_size // (tp * cp * pp), dp_shard=1, cp=cp, tp=tp,
                                world_size=env.world_size, pp=pp)
        else:
            dims = ParallelDims(dp_replicate=cfg.dp_replicate, dp_shard=-1, cp=cp, tp=tp, world_size=env.world_size,
                                pp=pp)
        dims.validate_for_model(config, stages_per_rank(cfg.pp_schedule, cfg.pp_stages_per_rank) if pp > 1 else 1)
    except (ParallelConfigError, ConfigError) as e:  # name the flags at fault (the message names the degrees)
        raise ConfigError(f"{flags} on {env.world_size} rank(s): {e}") from None
    return dims


def _windows(folder: str, header: dict, split: str, cfg: TrainConfig, shuffle: bool) -> TokenWindows:
    """The windows of one split, with what is known of its documents (their starts, or the end-of-text token)."""
    tokens = open_split(folder, split)
    return TokenWindows(tokens, cfg.seq_len, cfg.seed, shuffle=shuffle, what=split,
                        doc_starts=open_docs(folder, split, len(tokens)), eos_token_id=header.get("eos_token_id"),
                        source=os.path.join(folder, f"{split}.bin"))


def _stacked_seq_idx(micro: list) -> torch.Tensor:
    """(grad_accum, b, L) int32 documents of the micro-batches (zeros where one holds no boundary)."""
    return torch.stack([s if s is not None else torch.zeros_like(x, dtype=torch.int32) for x, _, s in micro])


def _drop_metrics_after(out: str, step: int) -> None:
    """Forget metrics.jsonl records of steps after ``step`` (on resume: they will be logged again; from scratch:
    all, they were an earlier attempt's)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    with open(path) as fh:
        keep = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
    run_folder.write_text(path, "".join(keep))


# ---- --recompute ------------------------------------------------------------------------------------------------
def resolve_recompute(items: str, compiled: bool = False) -> str:
    """``--recompute ITEMS`` checked: the items as a comma list in RECOMPUTE_ITEMS order ("" for none: "none" or
    empty), which ``build_parallel_model`` sets on the model's layers (``apply_recompute``). Raises ConfigError
    naming an unknown item; warns (rank 0) when ``compiled`` (--compile) leaves eager-only items that were asked
    for without effect (the default's quietly: compiled blocks simply keep the conv output)."""
    active, unknown = parse_items(items or "")
    if unknown:
        raise ConfigError(f"--recompute: unknown item(s) {', '.join(unknown)}; expected a comma list of "
                          f"{', '.join(RECOMPUTE_ITEMS)}, or none")
    eager_only = sorted(active - {"states"})
    if compiled and eager_only and items != DEFAULT_RECOMPUTE and os.environ.get("RANK", "0") == "0":
        warnings.warn(f"--compile: recompute item(s) {', '.join(eager_only)} have no effect in compiled blocks "
                      f"(saved-tensor hooks are eager-only, layers/recompute.py); only 'states' applies there",
                      stacklevel=2)
    return ",".join(k for k in RECOMPUTE_ITEMS if k in active)


# ---- the loop ----------------------------------------------------------------------------------------------------
def _shard_reduce_key(grad: torch.Tensor):
    """For a DTensor gradient: (mesh, the mesh dims its local squared norm must be summed over); None when a
    placement (e.g. Partial) does not allow summing local norms, so the caller falls back to DTensor math."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    dims = []
    for i, pl in enumerate(grad.placements):
        if isinstance(pl, Shard):
            if grad.device_mesh.size(i) > 1:
                dims.append(i)
        elif not isinstance(pl, Replicate):
            return None
    return grad.device_mesh, tuple(dims)


def _comm_device(device: torch.device) -> torch.device:
    """Where a collective's tensor must live: the current CUDA device under NCCL, else where it is."""
    if device.type == "cpu" and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


@torch.no_grad()
def _local_total_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The global 2-norm of sharded (DTensor) gradients from their local shards: one foreach norm per
    (mesh dims, device, dtype) group and one all-reduce per set of sharded mesh dims. None if any placement is
    not Shard / Replicate. Avoids DTensor dispatch over hundreds of gradients (a host cost paid every step)."""
    groups: dict = {}
    for g in grads:
        key = _shard_reduce_key(g)
        if key is None:
            return None
        local = g.to_local()
        groups.setdefault((id(key[0]), key[1], local.device, local.dtype), (key, []))[1].append(local)
    by_reduction: dict = {}
    for (mesh, dims), locals_ in groups.values():
        sq = squared_norm(locals_)  # host shards (CPU offload): on every core
        sq = sq.to(_comm_device(sq.device))  # CPU-offloaded shards: NCCL reduces device tensors
        by_reduction.setdefault((id(mesh), dims), (mesh, dims, []))[2].append(sq)
    total = None
    for mesh, dims, parts in by_reduction.values():  # same order on every rank: parameter order
        sq = torch.stack(parts).sum()
        for d in dims:
            dist.all_reduce(sq, group=mesh.get_group(d))
        total = sq if total is None else total + sq.to(total.device)
    return total.sqrt()


def _grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm (over every shard, fp32 scalar on every rank); clips in place when ``max_norm`` > 0.

    Sharded gradients (FSDP2 / TP DTensors) are handled on their local shards (see ``_local_total_norm``).
    Pipeline stages (``PipelineModel``): their squared norms summed over the pipeline, the head's copy of a tied
    embedding counted once."""
    from mamba_parallel.distributed.pipeline import PipelineModel, tied_duplicates

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    skip = tied_duplicates(model) if isinstance(model, PipelineModel) else set()
    counted = [p.grad for p in params if id(p) not in skip]
    norm = None
    if all(hasattr(g, "device_mesh") for g in counted):
        norm = _local_total_norm(counted)
    if norm is None:
        norm = torch.nn.utils.get_total_norm(counted, foreach=True)
        if hasattr(norm, "full_tensor"):  # mixed / Partial layouts: DTensor norm -> the reduced value on every rank
            norm = norm.full_tensor()
    if isinstance(model, PipelineModel):
        sq = norm.float().pow(2).to(_comm_device(norm.device))
        dist.all_reduce(sq, group=model.pp_group)
        norm = sq.sqrt().to(norm.device)
    if max_norm > 0:
        # torch's clip_grads_with_norm_ formula, applied to the local tensors (no DTensor dispatch).
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        locals_ = [g.to_local() if hasattr(g, "device_mesh") else g for g in grads]
        with torch.no_grad():
            for (dev, _), (group, _) in torch.utils._foreach_utils._group_tensors_by_device_and_dtype(
                    [locals_]).items():
                torch._foreach_mul_(group[0], coef.to(dev))
    return norm


def _peak_host_gib() -> float:
    """This process's peak resident host memory (what CPU offload keeps there shows up here), in GiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_weights(batches: RankBatches, consumed: int, grad_accum: int) -> list[float]:
    """The weight of each micro-batch's mean loss in the step's loss, so that the step's loss (and gradient) is
    the mean over every target of the global batch, whatever the layout: dp x (targets of this rank's micro-batch)
    / (targets of the global batch), as data parallelism averages over the dp ranks. 1 / grad_accum when every
    position has a target; with document boundaries (targets -100) micro-batches weigh by their targets."""
    firsts = [consumed + m * batches.global_batch for m in range(grad_accum)]
    total = max(1, sum(batches.n_targets(f, every_rank=True) for f in firsts))
    return [batches.dp_size * batches.n_targets(f) / total for f in firsts]


def _eager_step(model, batches: RankBatches, consumed: int, cfg: TrainConfig, device, ddp: bool) -> torch.Tensor:
    """Forward + backward of the step's micro-batches (gradients accumulate); -> this rank's share of the step's
    loss (0-d fp32; the mean over the ranks is the step's loss, see ``micro_weights``)."""
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    weights = micro_weights(batches, consumed, cfg.grad_accum)
    for micro, weight in enumerate(weights):
        inputs, labels, seq_idx = batches.batch_docs(consumed + micro * batches.global_batch, device)
        sync = micro == cfg.grad_accum - 1
        with (model.no_sync() if ddp and not sync else contextlib.nullcontext()), _autocast(cfg, device):
            loss = model(inputs, targets=labels, seq_idx=seq_idx).loss
        (loss * weight).backward()
        loss_sum += loss.detach().float() * weight
    return loss_sum


@torch.no_grad()
def evaluate(model, batches: RankBatches, n_batches: int, cfg: TrainConfig, device) -> float:
    """Mean loss over every target of the first ``n_batches`` global micro-batches of the validation split (all
    ranks)."""
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)  # sum of the losses, number of targets
    for i in range(n_batches):
        inputs, labels, seq_idx = batches.batch_docs(i * batches.global_batch, device)
        n = batches.n_targets(i * batches.global_batch)
        with _autocast(cfg, device):
            total[0] += model(inputs, targets=labels, seq_idx=seq_idx).loss.double() * n
        total[1] += n
    model.train()
    if dist.is_initialized():  # tp / cp peers add the same share to both: the ratio stays
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def train(cfg: TrainConfig) -> dict:
    """Run training as configured; return ``{"losses": {step: loss}, "eval": {step: loss}, "step", "stopped"}``.

    Raises TrainingError on a non-finite loss / grad norm (before that step's optimizer update).
    ``--deterministic`` holds for the run only (restored when it returns); the output folder is locked for the run
    (released however it ends).
    """
    resolve_recompute(cfg.recompute, cfg.compile)  # a bad --recompute fails before any work
    had_group = dist.is_initialized()
    try:
        with deterministic_mode(cfg.deterministic), contextlib.ExitStack() as at_exit:
            return _train(cfg, at_exit)
    finally:  # the one-rank group of --cpu-offload is this run's own: leave the process as it was
        if not had_group and dist.is_initialized() and dist.get_world_size() == 1:
            dist.destroy_process_group()


def _open_folder(out: str, log) -> None:
    """Rank 0: create --out (clear errors when it cannot be written) and take its lock."""
    with output_errors(out, "the run"):
        os.makedirs(out, exist_ok=True)
        run_folder.acquire_lock(out, log)


def _checkpoint_bytes(n_params: int) -> int:
    """About the size of one checkpoint: fp32 weights and AdamW's two fp32 moments (+ a little metadata)."""
    return 12 * n_params + (1 << 20)


def _train(cfg: TrainConfig, at_exit: contextlib.ExitStack) -> dict:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible to torch (use --device cpu)")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ConfigError(f"--out {cfg.out!r} is a file, not a folder")
    env = init_distributed(cfg.device, timeout_s=cfg.dist_timeout, single_rank_group=cfg.cpu_offload)
    if cfg.cuda_graph:  # before any data preparation: a wrong device fails at once
        check_graph_layout(env.device, dp=1, cp=1)
    progress = None
    log_lines = []

    def log(text: str) -> None:
        log_lines.append(text)
        if env.is_main:
            (progress.print if progress else print)(text)

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    run_folder.agree(_open_folder, cfg.out, log)  # one run per folder: a second one is refused naming the holder
    at_exit.callback(run_folder.release_lock, cfg.out)

    found = ckpt.latest_checkpoint(cfg.out)
    if found and not cfg.resume:
        raise ConfigError(f"--out {cfg.out!r} already holds checkpoints (newest {found[1]}): pass --resume to "
                          f"continue that run, or choose another --out")
    prepared = bool(cfg.data) and is_prepared(cfg.data)
    # the names this run writes are recorded as its own; any of them already there and not ours: refused
    names = ["config.toml", "metrics.jsonl", "checkpoints", "final", "tensorboard", "loss.png"] + \
        ([] if prepared else ["data"])
    run_folder.agree(run_folder.claim, cfg.out, names, cfg.resume, log)
    ckpt.remove_stale_tmp(cfg.out)

    folder, header, tokenizer = resolve_data(cfg, env)
    config = cfg.model_config()
    if header["vocab_size"] > config.vocab_size:
        log(f"model vocab_size {config.vocab_size} < tokenizer vocab {header['vocab_size']}: using the latter")
        cfg.model = {**cfg.model, "vocab_size": header["vocab_size"]}
        config = cfg.model_config()
    resume_from = ckpt.choose_checkpoint(cfg.out, log) if cfg.resume else None  # verified; falls back
    if cfg.resume and resume_from is None:
        log(f"--resume: no complete checkpoint in {cfg.out!r}; starting from scratch")
    if resume_from is not None:
        ckpt.check_same_model(resume_from[1], config, tokenizer)
    else:
        run_folder.agree(run_folder.check_fresh_start, cfg.out)
    for line in flag_effects.check(cfg, env.world_size, prepared):
        log(f"warning: {line}")

    dims = choose_dims(cfg, config, env, log)
    if cfg.cpu_offload and not dist.is_initialized():  # FSDP2 over one rank (--parallel auto may pick offload)
        env = init_distributed(cfg.device, timeout_s=cfg.dist_timeout, single_rank_group=True)
    if cfg.cuda_graph:
        check_graph_layout(env.device, dims.dp, dims.cp, cfg.dp_mode)
        if dims.pp > 1 or cfg.cpu_offload:
            raise ConfigError("--cuda-graph captures one device's whole step: not with --pp or --cpu-offload")
    if env.world_size > 1 or cfg.cpu_offload:
        dims.build_mesh(env.device.type)
    dp_rank, cp_rank = dims.dp_rank(env.rank), dims.coords(env.rank)["cp"]
    if cfg.batch_size == "auto":
        from mamba_parallel.train.auto_batch import resolve_auto_batch

        cfg.batch_size = resolve_auto_batch(cfg, config, env, dims, log)
    resolve_micro_steps(cfg, dims.dp, dims.pp)
    train_w = _windows(folder, header, "train", cfg, shuffle=True)
    docs = cfg.doc_boundaries and dims.pp == 1 and not cfg.cuda_graph
    if cfg.doc_boundaries and dims.pp > 1:
        log("warning: --doc-boundaries: pipeline stages do not take seq_idx yet: documents are packed as one stream "
            "under --pp (as with --no-doc-boundaries)")
    elif cfg.doc_boundaries and cfg.cuda_graph:  # the kernels' document packing reads its sizes on the host
        log("warning: --doc-boundaries: the kernels' document packing synchronises with the host, which a CUDA graph "
            "cannot capture: documents are packed as one stream under --cuda-graph (as with --no-doc-boundaries)")
    elif cfg.doc_boundaries and not train_w.knows_documents:
        log(f"warning: --doc-boundaries: {folder} records no document starts and no end-of-text token: "
            f"documents are not kept apart (prepare the data again to record them)")
    batches = RankBatches(train_w, cfg.batch_size, dp_rank, dims.dp, cp_rank, dims.cp, docs)
    try:
        val_w = _windows(folder, header, "val", cfg, shuffle=False)
        val_batches = RankBatches(val_w, cfg.batch_size, dp_rank, dims.dp, cp_rank, dims.cp, docs)
    except DataError:
        val_batches = None
        log(f"the validation split has fewer than {cfg.seq_len + 1} tokens: evaluation is off")

    with torch.device("meta"):
        meta_model = _model_class()(config)
    flops_per_token = train_flops_per_token(meta_model, config, cfg.seq_len)
    n_params = sum(p.numel() for p in meta_model.parameters())
    del meta_model
    ckpt_bytes = _checkpoint_bytes(n_params)
    # Room for what this run will write: checkpoints only when it saves them, the final model only with save_final
    # (an interrupted run still tries one checkpoint; its write error then names the folder).
    if cfg.save_final:
        run_folder.agree(check_space, cfg.out, ckpt_bytes + 4 * n_params, "one checkpoint and the final model")
    elif cfg.save_every:
        run_folder.agree(check_space, cfg.out, ckpt_bytes, "one checkpoint")
    model, _ = build_parallel_model(config, cfg, env, dims, resuming=resume_from is not None)
    if dims.pp > 1:
        model.__dict__["dims"] = dims
        log(model.plan.describe(config))
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2),
                                fused=env.device.type == "cuda" and not cfg.cpu_offload,
                                param_dtype=cfg.param_dtype)
    scheduler = build_scheduler(optimizer, cfg.warmup, cfg.steps, cfg.min_lr_ratio)

    step, consumed = 0, 0
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from[1], model, optimizer, scheduler)
        step, consumed = state["step"], state["consumed"]
        restart_schedule(optimizer, scheduler, cfg.lr)
        log(f"resumed from {resume_from[1]} (step {step}, saved by {state['world_size']} rank(s))")
    if env.is_main:
        _drop_metrics_after(cfg.out, step)  # from scratch: an earlier attempt's records go (they are ours)
        run_folder.write_text(os.path.join(cfg.out, "config.toml"), cfg.to_toml())
    # --cuda-graph: built after a resume's load (the lr becomes a device tensor the schedule fills in place);
    # captured at the first step.
    graph_step = None
    if cfg.cuda_graph:
        graph_step = GraphedTrainStep(model, optimizer, grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip,
                                      autocast_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None)

    tokens_per_step = cfg.batch_size * dims.dp * cfg.grad_accum * cfg.seq_len
    mode = f" ({cfg.dp_mode})" if dims.dp > 1 else ""
    log(f"global batch {cfg.global_batch_size} = batch size {cfg.batch_size} x {dims.dp} data-parallel rank(s) x "
        f"{cfg.grad_accum} micro-step(s)")
    log(f"model {cfg.preset}: {n_params / 1e6:.2f}M params | {dims.describe()}{mode} | "
        f"device {env.device} {cfg.dtype} | data {folder}: {header['tokens']['train']:,} train tokens | "
        f"{tokens_per_step:,} tokens/step")

    peak = peak_flops(env.device, cfg.dtype)
    metrics = MetricsLogger(cfg.out, env.is_main)
    gpus = GpuMonitor(env.is_main and env.device.type == "cuda")
    progress = Progress(env.is_main, cfg.steps, step, cfg.progress)
    prev_handler = None
    try:
        prev_handler = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: no SIGTERM handling
        pass
    _STOP["sigterm"] = False
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)

    losses, evals, last_saved, stopped = {}, {}, step if resume_from else -1, False
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    model.train()
    clock, t_start = Throughput(), time.perf_counter()
    try:
        while step < cfg.steps:
            if graph_step is not None:
                # the whole step (its optimizer update included) in one replay; a non-finite loss or gradient
                # norm makes the captured fused AdamW skip its update, so the check below still comes first
                micro = [batches.batch_docs(consumed + m * batches.global_batch)  # CPU: one copy into the graph
                         for m in range(cfg.grad_accum)]
                t_capture = time.perf_counter()
                mean_loss, grad_norm = graph_step(torch.stack([x for x, _, _ in micro]),
                                                  torch.stack([y for _, y, _ in micro]),
                                                  _stacked_seq_idx(micro) if docs else None,
                                                  torch.tensor(micro_weights(batches, consumed, cfg.grad_accum)))
                if not losses:  # the first step of this process captured the graph
                    torch.cuda.synchronize(env.device)
                    log(f"--cuda-graph: warm-up + capture + first replay took "
                        f"{time.perf_counter() - t_capture:.1f} s")
            else:
                if dims.pp > 1:
                    mean_loss = pipelined.pipelined_step(model, batches, consumed, cfg, env.device,
                                                         _autocast(cfg, env.device))
                else:
                    mean_loss = _eager_step(model, batches, consumed, cfg, env.device, ddp)
                grad_norm = _grad_norm(model, cfg.grad_clip)
            # One all-reduce per step: the mean loss, and the SIGTERM flag (> 0 on any rank stops every rank).
            red = torch.stack([mean_loss, torch.tensor(float(_STOP["sigterm"]), device=env.device)])
            if dist.is_initialized():
                red = red.to(_comm_device(red.device))
                dist.all_reduce(red)
                red[0] /= dist.get_world_size()
            lr = optimizer.param_groups[0]["lr"]  # a device tensor under --cuda-graph: read with the stats
            stats = [red[0], grad_norm.float().to(env.device), red[1]]
            loss_v, gnorm_v, stop_v, *lr_v = torch.stack(stats + ([lr.float()] if torch.is_tensor(lr) else [])
                                                         ).tolist()
            lr = lr_v[0] if lr_v else lr
            if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
                raise TrainingError(guard.non_finite_message(step + 1, loss_v, gnorm_v, cfg.out,
                                                             guard.last_checkpoint(cfg.out), cfg.lr))
            if graph_step is None:
                t_opt = time.perf_counter()
                optimizer.step()  # with --cpu-offload: the host update, synchronous (its time is logged)
                t_opt = time.perf_counter() - t_opt
            scheduler.step()  # under --cuda-graph: fills the lr tensor the next replay reads
            if graph_step is None:
                optimizer.zero_grad(set_to_none=True)
            step += 1
            consumed += cfg.grad_accum * batches.global_batch
            losses[step] = loss_v
            clock.add(tokens_per_step)
            stopped = stop_v > 0 and step < cfg.steps  # at the last step the normal end already saves

            if step % cfg.log_every == 0 or step == cfg.steps or step == 1:
                tps, _ = clock.read()
                mfu = tps * flops_per_token / (peak * env.world_size) if peak else None
                rec = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": gnorm_v, "tokens_per_s": tps,
                       "mfu": mfu, "mem_gib": round(peak_memory_gib(env.device), 3),
                       "host_gib": round(_peak_host_gib(), 3),
                       "tokens": consumed * cfg.seq_len, "elapsed_s": round(time.perf_counter() - t_start, 2)}
                if cfg.cpu_offload and graph_step is None:
                    rec["optimizer_s"] = round(t_opt, 3)
                rec.update(gpus.read())
                metrics.log(rec)
                mfu_s = f" mfu {mfu:.1%}" if mfu is not None else ""
                log(f"step {step}/{cfg.steps} loss {loss_v:.4f} lr {lr:.2e} grad_norm {gnorm_v:.3f} "
                    f"{tps:,.0f} tok/s{mfu_s} mem {rec['mem_gib']:.2f} GiB host {rec['host_gib']:.1f} GiB"
                    + (f" optimizer {rec['optimizer_s']:.1f} s" if "optimizer_s" in rec else ""))
            progress.update(step, f"loss {loss_v:.3f}")

            do_eval = val_batches is not None and ((cfg.eval_every and step % cfg.eval_every == 0)
                                                   or step == cfg.steps)
            if do_eval and not stopped:
                ev = pipelined.pipelined_evaluate(model, val_batches, cfg.eval_batches, cfg, env.device,
                                                  _autocast(cfg, env.device)) if dims.pp > 1 else \
                    evaluate(model, val_batches, cfg.eval_batches, cfg, env.device)
                evals[step] = ev
                metrics.log({"step": step, "eval_loss": ev})
                log(f"step {step}: eval_loss {ev:.4f}")
                clock.read()
            if stopped or (step == cfg.steps and cfg.save_final) or (cfg.save_every and step % cfg.save_every == 0):
                if last_saved != step:
                    unsafe = guard.unsafe_to_save(model, loss_v, config.vocab_size)  # never a diverged checkpoint
                    if unsafe:
                        raise TrainingError(guard.not_saved_message(step, unsafe, cfg.out,
                                                                    guard.last_checkpoint(cfg.out), cfg.lr))
                    root = ckpt.checkpoints_dir(cfg.out)
                    run_folder.agree(check_space, cfg.out, ckpt_bytes, f"checkpoint step-{step}")
                    with graph_step.plain_param_groups(scheduler) if graph_step else contextlib.nullcontext(), \
                            output_errors(root, f"checkpoint step-{step}", ckpt_bytes):
                        path = ckpt.save_checkpoint(cfg.out, step, model, optimizer, scheduler, consumed, cfg.keep,
                                                    model_config=config, tokenizer=tokenizer)
                    last_saved = step
                    log(f"saved checkpoint {path}")
                clock.read()
            if stopped:
                log(f"SIGTERM: stopped after step {step} with a checkpoint; resume with --resume")
                break
    finally:
        progress.close()
        progress = None
        metrics.close()
        if prev_handler is not None:
            signal.signal(signal.SIGTERM, prev_handler)

    result = {"losses": losses, "eval": evals, "step": step, "stopped": stopped, "log": log_lines}
    if not stopped and step >= cfg.steps and cfg.save_final:
        final = os.path.join(cfg.out, "final")
        plain = gather_for_save(model, config)
        if plain is not None:
            with output_errors(final, "the final model", 4 * n_params):
                plain.save_pretrained(final)
                tokenizer.save(final)
                if os.path.isfile(os.path.join(final, "tokenizer.json")):  # generate reads it: in the manifest too
                    update_manifest(final, ["tokenizer.json"])
            log(f"saved the final model to {final} (load it with MambaLMHeadModel.from_pretrained or "
                f"`mamba-parallel generate --checkpoint {final}`)")
            if cfg.sample_tokens:
                result["sample"] = sample_text(plain.to(env.device), tokenizer, cfg.sample_prompt,
                                               cfg.sample_tokens, env.device)
                log("---- sample ----\n" + result["sample"] + "\n----------------")
        _barrier()
    if env.is_main:  # loss.png beside metrics.jsonl (mamba-parallel plot RUN redraws it)
        from mamba_parallel.plots import plot_after_run

        log(plot_after_run(cfg.out))
    return result


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, device, temperature: float = 0.8,
                top_k: int = 40, seed: int = 0, top_p: float = 0.0) -> str:
    """Prompt + ``max_new_tokens`` sampled tokens, decoded."""
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt) or [tokenizer.eos_token_id or 0]], device=device)
    torch.manual_seed(seed)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature,
                         top_k=top_k, top_p=top_p, eos_token_id=tokenizer.eos_token_id)
    seq = out.sequences if hasattr(out, "sequences") else out
    return tokenizer.decode(seq[0].tolist())
