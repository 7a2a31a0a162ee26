"""Whole-step CUDA graphs for training (``--cuda-graph``): forward + backward of every micro-batch, the gradient
norm / clipping and the fused AdamW update, captured once and replayed every step.

Small models are host-bound on a fast GPU (thousands of kernel launches per step take longer to issue than to
run); one ``graph.replay()`` issues them all. torch's whole-network capture recipe
(https://pytorch.org/docs/stable/notes/cuda.html#whole-network-capture), with:

- static input / label buffers (grad_accum, b, L): a step's micro-batches are copied in, then the graph replays;
- warm-up steps on a side stream before the capture (Triton JIT and autotuning, cuBLAS workspaces, NCCL
  communicators, the optimizer's lazy state), then the parameters and optimizer state are put back as they were,
  so the first replay is the run's first step;
- gradients set to None before the capture: the first micro-batch's backward allocates them in the graph's pool
  and later ones accumulate into them; every replay overwrites them, nothing needs zeroing between steps;
- each param group's ``lr`` becomes a 0-d fp32 tensor on the device, read by the fused kernel at replay time: the
  lr schedule fills it in place between replays (an lr set as a float, e.g. by ``restart_schedule`` or a loaded
  state dict, is copied into the tensor before the next replay);
- fused AdamW's ``found_inf`` is computed in the graph from the loss and gradient norm: a non-finite step leaves
  parameters and optimizer state untouched (as the eager trainer's check before ``optimizer.step()``).

Layouts: one GPU, or tensor parallel (NCCL collectives are captured). Not data parallel (FSDP2 / DDP hooks) nor
context parallel; batches must have a fixed shape (no packed / varlen batches).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from mamba_parallel.config import ConfigError

FLAG = "--cuda-graph"


def check_graph_layout(device: torch.device, dp: int, cp: int, dp_mode: str = "fsdp") -> None:
    """Raise ConfigError (naming ``--cuda-graph`` and the conflicting option) unless the run is one CUDA device or
    tensor parallel: data parallel (``dp`` ranks, FSDP2 / DDP) and context parallel (``cp``) are refused."""
    if device.type != "cuda":
        raise ConfigError(f"{FLAG} needs a CUDA device; this run is on {device.type} (drop {FLAG} or use "
                          f"--device cuda)")
    if cp > 1:
        raise ConfigError(f"{FLAG} does not support context parallelism (--cp {cp}): use --cp 1 or drop {FLAG}")
    if dp > 1:
        raise ConfigError(f"{FLAG} supports one GPU or tensor parallelism only; this run is data parallel over "
                          f"{dp} ranks (--dp-mode {dp_mode}): set --tp to the number of processes, or drop {FLAG}")


def _check_model(model: torch.nn.Module) -> None:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(f"{FLAG}: the model is wrapped in DDP (--dp-mode ddp with several ranks), which is not "
                          f"supported; run on one GPU or with --tp")
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ConfigError(f"{FLAG}: the model is sharded with FSDP2 (--dp-mode fsdp with several ranks or --cp), "
                          f"which is not supported; run on one GPU or with --tp")


def install_tensor_lrs(optimizer: torch.optim.Optimizer, device: torch.device,
                       lrs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Give every param group a 0-d fp32 ``lr`` tensor on ``device`` (reused from ``lrs`` when given) holding the
    group's current lr, which may have been set as a float since. Returns the tensors, in group order."""
    out = []
    for i, group in enumerate(optimizer.param_groups):
        t = lrs[i] if lrs is not None else torch.zeros((), dtype=torch.float32, device=device)
        cur = group["lr"]
        if cur is not t:
            # a float (or another tensor) was put there since: copy its value in, keep the graph's tensor
            t.fill_(cur.item() if torch.is_tensor(cur) else float(cur))
            group["lr"] = t
        out.append(t)
    return out


class OptimizerSnapshot:
    """Copies of the parameters and of the optimizer's tensor state, to undo warm-up steps in place (tensors keep
    their storage: a captured graph may already point at them). State created after the snapshot is zeroed, which
    is AdamW's fresh state (exp_avg, exp_avg_sq, step = 0)."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        # host copies: a device copy of every parameter and moment would cost up to 3x the weights' memory at the
        # moment the warm-up's activations peak (mamba2-2.7b: 32 GB)
        with torch.no_grad():
            self.params = [(p, p.detach().to("cpu", copy=True)) for p in params]
            self.state = {id(p): {k: v.detach().to("cpu", copy=True) for k, v in st.items() if torch.is_tensor(v)}
                          for p, st in optimizer.state.items()}

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in self.params:
            p.copy_(saved)
        for p, st in self.optimizer.state.items():
            saved = self.state.get(id(p), {})
            for k, v in st.items():
                if not torch.is_tensor(v):
                    continue
                if k in saved:
                    v.copy_(saved[k])
                else:
                    v.zero_()


class GraphedTrainStep:
    """One training step of ``model`` + ``optimizer`` as a CUDA graph, captured at the first call.

    ``step(inputs, labels, seq_idx=None) -> (loss, grad_norm)``: inputs / labels (grad_accum, b, L) int64 (or
    (b, L) when grad_accum == 1; labels already shifted) on any device; seq_idx the same shape, int32, the documents
    of packed rows (given at the capture: then at every step); weights (grad_accum,) fp32, each micro-batch's
    weight in the loss (default 1 / grad_accum; the trainer weighs by targets, see ``trainer.micro_weights``); loss = mean over micro-batches of
    ``model(inputs[i], targets=labels[i]).loss`` (0-d fp32), grad_norm = the global gradient norm before clipping (0-d fp32; None when ``grad_clip`` is None). Both
    are the graph's static outputs: read them before the next call.

    ``grad_clip``: clip the global norm to this (0: compute the norm, do not clip; None: no norm at all, the
    benchmarks' "fwd + bwd + AdamW"). ``autocast_dtype``: e.g. torch.bfloat16 for bf16 autocast around each
    forward (None: no autocast). ``grad_norm_fn(model, max_norm) -> 0-d tensor`` must be free of host syncs
    (default: the trainer's ``_grad_norm``). ``warmup``: eager steps run before the capture (then undone).
    The optimizer must be fused (or capturable) Adam / AdamW; its ``lr`` entries become device tensors.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, grad_accum: int = 1,
                 grad_clip: float | None = 1.0, autocast_dtype: torch.dtype | None = None, warmup: int = 3,
                 grad_norm_fn: Callable | None = None):
        if grad_accum < 1:
            raise ValueError(f"GraphedTrainStep: grad_accum must be >= 1, got {grad_accum}")
        if warmup < 1:
            raise ValueError(f"GraphedTrainStep: warmup must be >= 1 (lazy state must exist before capture), "
                             f"got {warmup}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("GraphedTrainStep: the model has no trainable parameters")
        device = params[0].device
        check_graph_layout(device, dp=1, cp=1)
        _check_model(model)
        if not all(g.get("fused") or g.get("capturable") for g in optimizer.param_groups):
            raise ConfigError(f"{FLAG}: the optimizer must be fused or capturable (fused AdamW on CUDA), got "
                              f"{type(optimizer).__name__} with fused=False and capturable=False")
        if grad_norm_fn is None:
            from mamba_parallel.train.trainer import _grad_norm as grad_norm_fn
        self.model, self.optimizer, self.device = model, optimizer, device
        self.grad_accum, self.grad_clip, self.warmup = grad_accum, grad_clip, warmup
        self.autocast_dtype, self.grad_norm_fn = autocast_dtype, grad_norm_fn
        self._params = params
        self._was_capturable = [bool(g.get("capturable")) for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["capturable"] = True
        self.lrs = install_tensor_lrs(optimizer, device)
        # fused Adam(W) skips its update (and step count) when found_inf == 1
        self._fused = all(g.get("fused") for g in optimizer.param_groups)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device) if self._fused else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs = self._labels = self._seq_idx = self._weights = None
        self._outputs: tuple[torch.Tensor, torch.Tensor | None] | None = None

    # ---- the captured body ---------------------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # no cast cache: cached casts made outside the capture would be stale inside the graph
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _body(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        total = None
        for i in range(self.grad_accum):
            with self._autocast():
                seq_idx = self._seq_idx[i] if self._seq_idx is not None else None
                loss = self.model(self._inputs[i], targets=self._labels[i], seq_idx=seq_idx).loss
            (loss * self._weights[i]).backward()
            part = loss.detach().float() * self._weights[i]
            total = part if total is None else total + part
        loss = total
        norm = None
        if self.grad_clip is not None:
            norm = self.grad_norm_fn(self.model, self.grad_clip).float()
        if self._found_inf is not None:
            ok = torch.isfinite(loss) if norm is None else torch.isfinite(loss) & torch.isfinite(norm)
            self._found_inf.copy_(~ok)
            self.optimizer.found_inf = self._found_inf
        try:
            self.optimizer.step()
        finally:
            if self._found_inf is not None:
                del self.optimizer.found_inf  # only the captured step reads it; eager steps stay unaffected
        return loss, norm

    # ---- capture ------------------------------------------------------------------------------------------------
    def _as_micro(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if t.dim() == 2 and self.grad_accum == 1:
            t = t.unsqueeze(0)
        if t.dim() != 3 or t.shape[0] != self.grad_accum:
            raise ValueError(f"GraphedTrainStep: {name} must be (grad_accum={self.grad_accum}, batch, seqlen)"
                             f"{' or (batch, seqlen)' if self.grad_accum == 1 else ''}, got shape {tuple(t.shape)}")
        return t

    def _capture(self, inputs: torch.Tensor, labels: torch.Tensor, seq_idx: torch.Tensor | None,
                 weights: torch.Tensor) -> None:
        self._weights = weights.to(self.device, dtype=torch.float32, copy=True)
        self._inputs = inputs.to(self.device, copy=True)
        self._labels = labels.to(self.device, copy=True)
        self._seq_idx = seq_idx.to(self.device, dtype=torch.int32, copy=True) if seq_idx is not None else None
        snapshot = OptimizerSnapshot(self._params, self.optimizer)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with warnings.catch_warnings():
            # "capturable=True ... step() is running without CUDA graph capture": expected during warm-up
            warnings.filterwarnings("ignore", message=".*capturable=True.*")
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._body()
                self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        snapshot.restore()  # the warm-up steps never happened (storage unchanged)
        del snapshot
        # the warm-up's activations sit freed in the side stream's cache; the capture allocates from its own pool
        # and cannot free cached blocks mid-capture, so hand them back first (else the activations are held twice)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        # Same stream as the warm-up: per-stream lazy state (cuBLAS workspaces) is already there. With a process
        # group, "thread_local": the NCCL watchdog thread may still query events of the warm-up's collectives, which
        # the default "global" mode turns into a failed capture.
        mode = "thread_local" if torch.distributed.is_available() and torch.distributed.is_initialized() else "global"
        try:
            with torch.cuda.graph(graph, stream=side, capture_error_mode=mode):
                self._outputs = self._body()
        except RuntimeError as e:  # e.g. a host sync (.item(), a CPU copy) on the training path
            raise RuntimeError(f"{FLAG}: capturing the training step failed (an operation not allowed in a CUDA "
                               f"graph, such as a host synchronisation); run without {FLAG}. Cause: {e}") from e
        self.graph = graph

    # ---- replay -------------------------------------------------------------------------------------------------
    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor, seq_idx: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        inputs, labels = self._as_micro(inputs, "inputs"), self._as_micro(labels, "labels")
        seq_idx = self._as_micro(seq_idx, "seq_idx") if seq_idx is not None else None
        for name, t in (("labels", labels), ("seq_idx", seq_idx)):
            if t is not None and t.shape != inputs.shape:
                raise ValueError(f"GraphedTrainStep: {name} {tuple(t.shape)} must have the shape of inputs "
                                 f"{tuple(inputs.shape)}")
        if weights is None:
            weights = torch.full((self.grad_accum,), 1.0 / self.grad_accum)
        if tuple(weights.shape) != (self.grad_accum,):
            raise ValueError(f"GraphedTrainStep: weights must be (grad_accum={self.grad_accum},), got "
                             f"{tuple(weights.shape)}")
        if self.graph is not None and (seq_idx is None) != (self._seq_idx is None):
            raise ValueError("GraphedTrainStep: seq_idx must be given at every step or at none (as at the capture)")
        self.lrs = install_tensor_lrs(self.optimizer, self.device, self.lrs)
        if self.graph is None:
            self._capture(inputs, labels, seq_idx, weights)
        elif inputs.shape != self._inputs.shape:
            raise ValueError(f"{FLAG}: every step must have the captured batch shape {tuple(self._inputs.shape)} "
                             f"(grad_accum, batch, seqlen), got {tuple(inputs.shape)}; packed / variable-length "
                             f"batches cannot be replayed")
        else:
            self._inputs.copy_(inputs, non_blocking=True)
            self._labels.copy_(labels, non_blocking=True)
            if seq_idx is not None:
                self._seq_idx.copy_(seq_idx, non_blocking=True)
            self._weights.copy_(weights, non_blocking=True)
        self.graph.replay()
        return self._outputs

    replay = __call__

    @contextlib.contextmanager
    def plain_param_groups(self, scheduler=None):
        """Inside: each group's ``lr`` is a float and ``capturable`` what it was before (for checkpoints: JSON /
        DCP and a later eager run see the usual values); the scheduler's last lrs are floats too. The next call
        puts the lr tensors back (their values follow any change made meanwhile)."""
        groups = self.optimizer.param_groups
        for g, was in zip(groups, self._was_capturable):
            if torch.is_tensor(g["lr"]):
                g["lr"] = g["lr"].item()
            g["capturable"] = was
        if scheduler is not None:
            scheduler._last_lr = [v.item() if torch.is_tensor(v) else v for v in scheduler._last_lr]
        try:
            yield
        finally:
            for g in groups:
                g["capturable"] = True
            self.lrs = install_tensor_lrs(self.optimizer, self.device, self.lrs)
