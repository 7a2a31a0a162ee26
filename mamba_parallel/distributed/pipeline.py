"""Pipeline parallelism on torch.distributed.pipelining: the layers split into stages, one schedule runs them.

The model is cut by layer into ``pp x stages_per_rank`` stages (balanced by parameter count, or a given split):
stage 0 also holds the embedding, the last stage the final norm, the LM head and the loss. Each pipeline rank
builds only its own stages (on the meta device, so it never holds the full model) as ``PipelineStageModel``
modules whose parameter names are those of the single-device model (``backbone.layers.37.mixer.in_proj.weight``),
so DCP checkpoints do not depend on the pp degree. A stage passes ``(hidden_states, residual)`` to the next one;
the targets (next tokens, already shifted) go to every stage as a keyword (only the last uses them), and the last
stage returns the micro-batch's mean loss, computed by the model's own loss (chunked, vocab-parallel under tensor
parallelism).

Schedules (``--pp-schedule``) are torch's: ``gpipe``, ``1f1b``, ``interleaved-1f1b`` (several stages per rank,
looped placement), ``interleaved-zb`` (zero bubble: the backward split into input and weight gradients) and
``zbv`` (zero bubble, two stages per rank in a V). Micro-batches (``--microbatches``) are the pipeline's gradient
accumulation; gradients are the mean over them, as one big batch gives.

Tied embeddings (``tie_embeddings``, every Mamba preset): the LM head on the last stage gets its own copy of the
embedding, initialised alike; after each backward the two gradients are summed between the first and the last
stage (``sync_tied_grads``), so both copies see the same gradient and AdamW keeps them equal. Checkpoints store the
one tensor under the single-device names (``backbone.embedding.weight`` and its ``lm_head.weight`` alias).

Composes with tensor and context parallelism (applied to the whole meta model before the split) and with FSDP2 /
DDP (applied to each stage, over the rank's data-parallel mesh): ``ParallelDims.pp`` is the outermost mesh dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.torch_version import TorchVersion

from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims

# name -> (torch.distributed.pipelining class name, stage placement, default stages per rank)
PP_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "1f1b": ("Schedule1F1B", "loop", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop", 2),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop", 2),
    "zbv": ("ScheduleZBVZeroBubble", "v", 2),
}


# The zero-bubble schedules split the backward into an input pass and a weight pass. torch 2.11's weight pass
# (pipelining/_backward.py, stage_backward_weight) feeds the sum of an autograd node's output gradients into the
# node's first output; torch 2.12 gives each output its own. A node with several outputs that all carry a
# gradient then yields a wrong weight gradient (the fused add + RMSNorm: the normed output and the residual), or a
# shape error where the outputs differ in shape.
ZERO_BUBBLE = ("interleaved-zb", "zbv")
ZERO_BUBBLE_MIN_TORCH = "2.12"


def schedule_class(name: str):
    """The torch schedule class of ``--pp-schedule name``; a clear error for an unknown one or an old torch."""
    if name not in PP_SCHEDULES:
        raise ParallelConfigError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {name!r}")
    if name in ZERO_BUBBLE and TorchVersion(torch.__version__) < ZERO_BUBBLE_MIN_TORCH:
        raise ParallelConfigError(f"--pp-schedule {name} needs torch >= {ZERO_BUBBLE_MIN_TORCH}, this is "
                                  f"{torch.__version__}: its zero-bubble weight pass adds up the gradients of an "
                                  "autograd node's outputs into the first one, which gives wrong weight gradients "
                                  "for the model's nodes with several outputs; use 1f1b or interleaved-1f1b")
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, PP_SCHEDULES[name][0], None)
    if cls is None:
        raise ParallelConfigError(f"--pp-schedule {name}: this torch ({torch.__version__}) has no "
                                  f"{PP_SCHEDULES[name][0]}")
    return cls


def stages_per_rank(schedule: str, requested: int = 0) -> int:
    """Stages each rank runs under ``schedule`` (``requested`` 0: the schedule's default)."""
    if schedule not in PP_SCHEDULES:
        raise ParallelConfigError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {schedule!r}")
    return requested or PP_SCHEDULES[schedule][2]


# ---- the plan: how many stages, which layers, which rank ---------------------------------------------------------
@dataclass
class PipelinePlan:
    """``pp`` ranks, ``schedule`` (a PP_SCHEDULES name), ``microbatches`` per step, ``stages_per_rank`` (0: the
    schedule's default), ``split``: layers per stage (None: balanced by parameter count)."""

    pp: int
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 0
    split: list[int] | None = None
    _ranges: list[range] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        schedule_class(self.schedule) if self.pp > 1 else None
        if self.schedule not in PP_SCHEDULES:
            raise ParallelConfigError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got "
                                      f"{self.schedule!r}")
        _, style, default = PP_SCHEDULES[self.schedule]
        if self.stages_per_rank == 0:
            self.stages_per_rank = default
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ParallelConfigError(f"--microbatches must be an integer >= 1, got {self.microbatches!r}")
        if default == 1 and self.stages_per_rank != 1:
            raise ParallelConfigError(f"--pp-schedule {self.schedule} runs one stage per rank, got "
                                      f"--pp-stages-per-rank {self.stages_per_rank} (use interleaved-1f1b)")
        if style == "v" and self.stages_per_rank != 2:
            raise ParallelConfigError(f"--pp-schedule zbv runs exactly two stages per rank, got "
                                      f"--pp-stages-per-rank {self.stages_per_rank}")
        if self.stages_per_rank < 1:
            raise ParallelConfigError(f"--pp-stages-per-rank must be >= 1, got {self.stages_per_rank}")
        if self.pp > 1 and self.microbatches < self.pp:
            raise ParallelConfigError(f"--microbatches {self.microbatches} < --pp {self.pp}: a pipeline needs at "
                                      f"least one micro-batch per stage in flight (more fill the bubble)")
        multi = self.stages_per_rank > 1
        if self.pp > 1 and multi:
            rounds = max(1, self.microbatches // self.pp)
            if self.microbatches % rounds:
                raise ParallelConfigError(f"--pp-schedule {self.schedule} needs --microbatches divisible by "
                                          f"max(1, microbatches // pp) = {rounds}, got {self.microbatches}")

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def style(self) -> str:
        return PP_SCHEDULES[self.schedule][1]

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs, in order (looped: r, r + pp, ...; V: r, 2 pp - 1 - r)."""
        if self.style == "v":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.stages_per_rank)]

    def rank_of_stage(self, stage: int) -> int:
        if self.style == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def ranges(self, config) -> list[range]:
        """The layers of each stage (validated against the model)."""
        if self._ranges is None:
            self._ranges = split_layers(config, self.n_stages, self.split)
        return self._ranges

    def describe(self, config) -> str:
        sizes = ",".join(str(len(r)) for r in self.ranges(config))
        return (f"pp {self.pp}: {self.schedule}, {self.n_stages} stages of {sizes} layers, "
                f"{self.microbatches} micro-batches")


def parse_split(text: str) -> list[int] | None:
    """``--pp-split``: "balanced" (None) or a comma list of layers per stage, e.g. "30,34"."""
    if text in ("", "balanced"):
        return None
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise ParallelConfigError(f"--pp-split must be 'balanced' or a comma list of layer counts, got "
                                  f"{text!r}") from None
    return out


def block_param_counts(config) -> tuple[list[int], int, int]:
    """(parameters of each block, of the embedding, of the LM head as a stage holds it) from a meta model."""
    from mamba_parallel.models import MambaLMHeadModel

    model = MambaLMHeadModel(config, device="meta")
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.backbone.layers]
    emb = model.backbone.embedding.weight.numel()
    head = model.lm_head.weight.numel() + sum(p.numel() for p in model.backbone.norm_f.parameters())
    return blocks, emb, head


def split_layers(config, n_stages: int, split: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage. ``split``: layers per stage; None: balanced by parameter count
    (the embedding counted on the first stage, the final norm + LM head, a copy when tied, on the last): the
    split that minimises the largest stage."""
    n = config.n_layer
    if n_stages > n:
        raise ParallelConfigError(f"{n_stages} pipeline stages need at least {n_stages} layers, the model has "
                                  f"n_layer={n}")
    if split is not None:
        if len(split) != n_stages or any(k < 1 for k in split) or sum(split) != n:
            raise ParallelConfigError(f"--pp-split {','.join(map(str, split))}: needs {n_stages} counts >= 1 "
                                      f"summing to n_layer={n}")
        sizes = split
    else:
        blocks, emb, head = block_param_counts(config)
        sizes = _balanced(blocks, n_stages, emb, head)
    out, start = [], 0
    for k in sizes:
        out.append(range(start, start + k))
        start += k
    return out


def _balanced(blocks: list[int], n_stages: int, first_extra: int, last_extra: int) -> list[int]:
    """Layer counts of the contiguous split minimising the largest stage (dynamic programme over cut points)."""
    n = len(blocks)
    prefix = [0]
    for b in blocks:
        prefix.append(prefix[-1] + b)

    def cost(s: int, i: int, j: int) -> int:  # stage s holds layers i .. j-1
        c = prefix[j] - prefix[i]
        return c + (first_extra if s == 0 else 0) + (last_extra if s == n_stages - 1 else 0)

    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(s - 1, i, j))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    sizes, j = [], n
    for s in range(n_stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


# ---- stage modules -----------------------------------------------------------------------------------------------
class StageLayers(nn.Module):
    """The blocks of one or more stages, named by their index in the whole model (``layers.37``), so parameter
    names stay the single-device ones. Behaves as a list of its blocks (iteration, ``len``, ``[i]`` by position)."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for i in sorted(blocks):
            self.add_module(str(i), blocks[i])

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, pos: int) -> nn.Module:
        return list(self._modules.values())[pos]

    def __setitem__(self, pos: int, module: nn.Module) -> None:
        self._modules[list(self._modules)[pos]] = module

    def indices(self) -> list[int]:
        return [int(k) for k in self._modules]


class StageBackbone(nn.Module):
    """``backbone`` of a stage: ``embedding`` (first stage), ``layers``, ``norm_f`` (last stage); None when absent."""

    def __init__(self, embedding: nn.Module | None, layers: StageLayers, norm_f: nn.Module | None,
                 residual_in_fp32: bool):
        super().__init__()
        self.embedding, self.layers, self.norm_f = embedding, layers, norm_f
        self.residual_in_fp32 = residual_in_fp32


class PipelineStageModel(nn.Module):
    """One pipeline stage of a ``MambaLMHeadModel`` (parameter names as in the single-device model).

    forward: first stage ``(input_ids (b, L), targets=...)``, later stages ``(hidden (b, L, d), residual (b, L, d),
    targets=...)`` -> ``(hidden, residual)``; the last stage -> the mean loss over ``targets`` (b, L) (0-d fp32;
    targets already shifted: targets[:, t] is the token after position t, -100 ignored),
    through the model's own loss (``model.lm_loss`` -> ``model.loss_fn``, which tensor / context parallelism replace).
    """

    def __init__(self, model: nn.Module, stage: int, n_stages: int, layers: range):
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        bb = model.backbone
        self.backbone = StageBackbone(bb.embedding if self.is_first else None,
                                      StageLayers({i: bb.layers[i] for i in layers}),
                                      bb.norm_f if self.is_last else None, bb.residual_in_fp32)
        self.lm_head = model.lm_head if self.is_last else None
        # Not a submodule (its other stages are not ours): the loss seam and the backbone's output hooks.
        self.__dict__["_model"] = model

    def forward(self, *args, targets: torch.Tensor | None = None):
        from mamba_parallel.layers.norm import add_norm

        bb = self.backbone
        if self.is_first:
            (input_ids,) = args
            hidden, residual = bb.embedding(input_ids), None
        else:
            hidden, residual = (_ContiguousGrad.apply(t) for t in args)
        for layer in bb.layers:
            hidden, residual = layer(hidden, residual)
        if not self.is_last:  # sent to the next stage: contiguous buffers
            return hidden.contiguous(), residual.contiguous()
        hidden, _ = add_norm(hidden, residual, bb.norm_f, bb.residual_in_fp32)
        model = self._model
        # What follows the backbone's forward in the whole model (tensor parallel gathers the sequence there).
        for hook in model.backbone._forward_hooks.values():
            out = hook(model.backbone, (), hidden)
            hidden = hidden if out is None else out
        if targets is None:
            raise ValueError("the last pipeline stage needs targets (b, L) to compute the loss")
        return model.lm_loss(hidden, targets)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: it is sent to the previous stage as is, and
    point-to-point sends need contiguous buffers (tensor / sequence parallel backward can give strided views)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class PipelineModel(nn.Module):
    """What one rank holds of a pipelined model: the union of its stages, under single-device names
    (``backbone.embedding`` on the first stage's rank, ``backbone.layers.<i>`` of its stages, ``backbone.norm_f``
    and ``lm_head`` on the last stage's). The optimizer, gradient clipping and checkpoints see this module; the
    schedule runs ``parts`` (the stages, wrapped by FSDP2 / DDP). Not callable: steps go through ``schedule``."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, pp_rank: int, tied_copy: bool):
        super().__init__()
        ranges = plan.ranges(model.config)
        self.config, self.plan, self.pp_rank = model.config, plan, pp_rank
        self.stage_ids = plan.stage_ids(pp_rank)
        parts = [PipelineStageModel(model, s, plan.n_stages, ranges[s]) for s in self.stage_ids]
        first = next((p for p in parts if p.is_first), None)
        last = next((p for p in parts if p.is_last), None)
        blocks = {i: blk for p in parts for i, blk in zip(p.backbone.layers.indices(), p.backbone.layers)}
        self.backbone = StageBackbone(first.backbone.embedding if first else None, StageLayers(blocks),
                                      last.backbone.norm_f if last else None, model.backbone.residual_in_fp32)
        self.lm_head = last.lm_head if last else None
        self.has_first, self.has_last = first is not None, last is not None
        # tie_embeddings with the head's own copy of the embedding (see the module docstring)
        self.tied_copy = tied_copy
        self.__dict__["parts"] = parts  # stage modules, possibly wrapped later: not submodules (no second names)
        self.__dict__["schedule"] = None
        self.__dict__["tie_group"] = None

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its schedule: use pipeline_step(model, inputs, targets)")


def untie_for_pipeline(model: nn.Module) -> bool:
    """Give a tied LM head its own copy of the embedding weight (meta model, before any parallelism), so the first
    and the last stage each own one; True when the model was tied."""
    if model.lm_head.weight is not model.backbone.embedding.weight:
        return False
    w = model.backbone.embedding.weight
    model.lm_head.weight = nn.Parameter(torch.empty_like(w), requires_grad=w.requires_grad)
    return True


def build_pipeline_model(model: nn.Module, plan: PipelinePlan, dims: ParallelDims, pp_rank: int,
                         tied_copy: bool) -> PipelineModel:
    """This rank's stages of ``model`` (a meta MambaLMHeadModel, tensor / context parallel already applied)."""
    dims.validate_for_model(model.config, plan.stages_per_rank)
    return PipelineModel(model, plan, pp_rank, tied_copy)


# ---- schedule and step ----------------------------------------------------------------------------------------------
def _identity_loss(output: torch.Tensor, target) -> torch.Tensor:
    """The last stage already returns the micro-batch's loss."""
    return output


class StageTimer:
    """Busy time of this rank's stages: the forward / backward chunks the schedule runs (CUDA events on a GPU, wall
    clock on CPU). ``bubble_fraction(step_s)`` = 1 - busy / step time: the share of the step the rank waited."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.cpu_s = 0.0

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        import time

        return time.perf_counter()

    def stop(self, begin) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append((begin, e))
        else:
            import time

            self.cpu_s += time.perf_counter() - begin

    def busy_s(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        return self.cpu_s

    def reset(self) -> None:
        self.events, self.cpu_s = [], 0.0

    def bubble_fraction(self, step_s: float) -> float:
        return max(0.0, 1.0 - self.busy_s() / step_s) if step_s > 0 else 0.0


def _timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage that adds each chunk's compute time to ``timer`` (for the bubble measurement)."""

        timer: StageTimer

        def _timed(self, fn, *args, **kwargs):
            t = self.timer.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.timer.stop(t)

        def forward_one_chunk(self, *args, **kwargs):
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args, **kwargs):
            return self._timed(super().backward_one_chunk, *args, **kwargs)

        def backward_weight_one_chunk(self, *args, **kwargs):
            return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    return TimedStage


def build_schedule(pm: PipelineModel, dims: ParallelDims, device: torch.device, timed: bool = False):
    """torch's PipelineStage for each of ``pm.parts`` (already wrapped) and the schedule over them; stored on
    ``pm``. Also makes the group that sums the tied embedding's gradients. ``timed``: stages record their busy
    time in ``pm.timer`` (a StageTimer), for the bubble fraction."""
    from torch.distributed.pipelining import PipelineStage

    plan = pm.plan
    group = dims.submesh("pp").get_group()
    cls = _timed_stage_class() if timed else PipelineStage
    stages = [cls(part, sid, plan.n_stages, device, group=group) for part, sid in zip(pm.parts, pm.stage_ids)]
    if timed:
        pm.__dict__["timer"] = StageTimer(device)
        for st in stages:
            st.timer = pm.timer
    cls = schedule_class(plan.schedule)
    if plan.stages_per_rank == 1:
        schedule = cls(stages[0], n_microbatches=plan.microbatches, loss_fn=_identity_loss)
    else:
        schedule = cls(stages, n_microbatches=plan.microbatches, loss_fn=_identity_loss)
    pm.__dict__["schedule"] = schedule
    pm.__dict__["stages"] = stages
    pm.__dict__["pp_group"] = group
    pm.__dict__["last_rank"] = dist.get_global_rank(group, plan.rank_of_stage(plan.n_stages - 1))
    if pm.tied_copy:
        pm.__dict__["tie_group"] = _tie_group(dims, plan)
    return schedule


def _tie_group(dims: ParallelDims, plan: PipelinePlan):
    """The process group of the two ranks holding stage 0 and the last stage in this rank's pipeline (None when
    it is the same rank, as under the V placement)."""
    first, last = plan.rank_of_stage(0), plan.rank_of_stage(plan.n_stages - 1)
    if first == last:
        return None
    if {first, last} == set(range(plan.pp)):  # pp = 2: the pipeline group itself
        return dims.submesh("pp").get_group()
    lines = dims.mesh.mesh.reshape(plan.pp, -1)
    groups = [[int(lines[first, j]), int(lines[last, j])] for j in range(lines.shape[1])]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


def pipeline_step(pm: PipelineModel, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward + backward of one step: ``inputs``, ``targets`` (microbatches x b, L) split into ``microbatches``;
    gradients are the mean over them (tied embedding gradients summed across its two copies). -> the mean loss
    (0-d fp32) on every rank of the pipeline."""
    schedule = pm.schedule
    losses: list[torch.Tensor] = []
    args = (inputs,) if pm.has_first else ()
    schedule.step(*args, target=targets if pm.has_last else None, losses=losses, targets=targets,
                  return_outputs=False)
    sync_tied_grads(pm)
    if pm.has_last:
        loss = torch.stack([x.detach().float() for x in losses]).mean()
    else:
        loss = torch.zeros((), device=inputs.device, dtype=torch.float32)
    dist.broadcast(loss, src=pm.last_rank, group=pm.pp_group)
    return loss


@torch.no_grad()
def pipeline_eval_loss(pm: PipelineModel, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward only over ``microbatches`` micro-batches: the mean loss (0-d fp32) on every rank of the pipeline."""
    losses: list[torch.Tensor] = []
    args = (inputs,) if pm.has_first else ()
    pm.schedule.eval(*args, target=targets if pm.has_last else None, losses=losses, targets=targets,
                     return_outputs=False)
    if pm.has_last:
        loss = torch.stack([x.detach().float() for x in losses]).mean()
    else:
        loss = torch.zeros((), device=inputs.device, dtype=torch.float32)
    dist.broadcast(loss, src=pm.last_rank, group=pm.pp_group)
    return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def sync_tied_grads(pm: PipelineModel) -> None:
    """Sum the gradients of the embedding (stage 0) and of the head's copy of it (last stage): both then hold the
    gradient of the tied weight of the single-device model."""
    if not pm.tied_copy:
        return
    mine = []
    if pm.has_first:
        mine.append(_tied_param(pm.backbone.embedding))
    if pm.has_last:
        mine.append(_tied_param(pm.lm_head))
    if not mine:
        return
    grads = [p.grad for p in mine]
    if any(g is None for g in grads):
        raise RuntimeError("pipeline: the tied embedding has no gradient after the backward pass")
    if len(grads) == 2:  # both stages on this rank (V placement)
        total = _local(grads[0]) + _local(grads[1])
        _local(grads[0]).copy_(total)
        _local(grads[1]).copy_(total)
        return
    dist.all_reduce(_local(grads[0]), group=pm.tie_group)


def _tied_param(module: nn.Module) -> torch.Tensor:
    """The (only) weight parameter of the embedding / LM head module, whatever parametrisation holds it."""
    params = [p for p in module.parameters()]
    if len(params) != 1:
        raise RuntimeError(f"pipeline: expected one weight in {type(module).__name__}, found {len(params)}")
    return params[0]


def tied_duplicates(pm: PipelineModel) -> set[int]:
    """ids of parameters that repeat another one's value (the head's copy of a tied embedding): counted once by
    the gradient norm."""
    if pm.tied_copy and pm.has_last:
        return {id(_tied_param(pm.lm_head))}
    return set()


# ---- checkpoints --------------------------------------------------------------------------------------------------
EMB, HEAD = "backbone.embedding.weight", "lm_head.weight"


def stage_model_state_dict(pm: PipelineModel) -> dict:
    """``model_state_dict`` of this rank's stages with the tied weight under both single-device names."""
    from mamba_parallel.distributed.state_dict import model_state_dict

    sd = model_state_dict(pm)
    if pm.tied_copy:
        if EMB in sd:
            sd.setdefault(HEAD, sd[EMB])
        elif HEAD in sd:
            sd[EMB] = sd[HEAD]
    return sd


def _head_to_emb(key: str) -> str:
    kind, rest = key.split(".", 1)
    return f"{kind}.{EMB}.{rest[len(HEAD) + 1:]}" if rest.startswith(HEAD + ".") else key


def stage_optim_state_dict(pm: PipelineModel, optimizer) -> dict:
    """``optim_state_dict`` of this rank's stages; the head's copy of a tied embedding keeps its state under the
    embedding's name, as the single-device model writes it."""
    from mamba_parallel.distributed.state_dict import optim_state_dict

    osd = optim_state_dict(pm, optimizer)
    if not pm.tied_copy:
        return osd
    return {_head_to_emb(k): v for k, v in osd.items()}


def load_stage_optim_state_dict(pm: PipelineModel, optimizer, state: dict) -> None:
    from mamba_parallel.distributed.state_dict import load_optim_state_dict

    if pm.tied_copy and pm.has_last and not pm.has_first:
        emb = f".{EMB}."
        state = {**state, **{k.replace(emb, f".{HEAD}."): v for k, v in state.items() if emb in k}}
    load_optim_state_dict(pm, optimizer, state)


def gather_full_state(pm: PipelineModel, dims: ParallelDims) -> dict | None:
    """The single-device state dict (full CPU tensors) on global rank 0, None elsewhere; collective over the world
    (every stage gathers its own shards; the pipeline line of rank 0 sends them to rank 0 tensor by tensor)."""
    from mamba_parallel.distributed.state_dict import full_model_state_dict

    mine = full_model_state_dict(pm, cpu_offload=True)
    if pm.tied_copy:
        v = mine.get(EMB, mine.get(HEAD))
        if v is not None:
            mine[EMB] = mine[HEAD] = v
    coords = dims.coords(dist.get_rank())
    if any(v for k, v in coords.items() if k != "pp"):
        return None  # another pipeline line: the same tensors as rank 0's line
    group = pm.pp_group
    me = dist.get_group_rank(group, dist.get_rank())
    device = pm.stages[0].device
    out = dict(mine) if me == 0 else None
    for src in range(1, dims.pp):
        keys = [sorted((k, tuple(v.shape), v.dtype) for k, v in mine.items())] if me == src else [None]
        dist.broadcast_object_list(keys, group_src=src, group=group)
        for k, shape, dtype in keys[0]:
            if me == src:
                dist.send(mine[k].to(device), group_dst=0, group=group)
            elif me == 0:
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, group_src=src, group=group)
                out.setdefault(k, buf.cpu())
    return out
