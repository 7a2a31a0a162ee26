"""AdamW with the usual no-decay groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

NO_DECAY_NAMES = ("A_log", "D", "dt_bias")


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases (ndim < 2), the SSM's A_log / D / dt_bias, and params flagged ``_no_weight_decay``."""
    from mamba_parallel.distributed.state_dict import canonical_name

    # Tensor parallel renames parameters (``a.parametrizations.A_log.original0``): judge by the canonical name.
    leaf = canonical_name(name)[0].rsplit(".", 1)[-1]
    return param.ndim < 2 or leaf in NO_DECAY_NAMES or getattr(param, "_no_weight_decay", False)


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95),
                    fused: bool | None = None, param_dtype: str = "fp32") -> torch.optim.AdamW:
    """AdamW over two groups (decay / no decay); fused on CUDA unless ``fused`` says otherwise.
    ``param_dtype="bf16"``: weights stored in bf16, AdamW's moments in fp32 (train/bf16_adamw.py).

    Sharded params (FSDP2 DTensors) have their global ndim, so the grouping is the same at every layout.
    """
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (no_decay if no_weight_decay(name, p) else decay).append(p)
    if fused is None:
        fused = any(p.is_cuda for p in decay + no_decay)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if param_dtype == "bf16":
        from mamba_parallel.train.bf16_adamw import AdamWFp32State

        return AdamWFp32State([g for g in groups if g["params"]], lr=lr, betas=betas)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, fused=fused or None)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): linear warmup, then cosine to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int,
                    min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, total, min_ratio))


def restart_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                     lr: float) -> None:
    """After loading a checkpoint: the current run's peak lr and schedule (its --steps / --warmup) at the loaded
    step, so a resumed run with the same settings continues exactly and a changed --lr / --steps takes effect."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, lam in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = lr * lam(scheduler.last_epoch)
        group["initial_lr"] = lr
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
