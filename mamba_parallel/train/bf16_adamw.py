"""AdamW for weights stored in bf16 (``--param-dtype bf16``): moments and the update in fp32, the new weight
written back with stochastic rounding.

Weights and gradients in bf16 take 4 bytes per parameter instead of 8, AdamW's two fp32 moments 8: 12 bytes in
all instead of 16 (a 7B model: 84 GB instead of 112, what lets it train on one GPU with its states in host memory).
Rounding the fp32 result to the nearest bf16 would drop every update smaller than half a bf16 step (2^-9 relative):
stochastic rounding keeps them in expectation (Gupta et al., 2015; Zamirai et al., 2020), so the loss follows the
fp32 run's. State keys and shapes are torch AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``; DTensors under FSDP2),
so checkpoints load either way round.
"""

from __future__ import annotations

import math

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stochastic_round_(target: torch.Tensor, value: torch.Tensor) -> None:
    """target (bf16) <- value (fp32, same shape) rounded up or down at random, in proportion to the distance: add
    16 random low bits to the fp32 pattern, keep its high 16 bits (the bf16 value, rounded toward zero)."""
    bits = torch.randint_like(value, 0, 1 << 16, dtype=torch.int32)
    bits.add_(value.view(torch.int32)).bitwise_and_(-65536)
    target.copy_(bits.view(torch.float32))


class AdamWFp32State(torch.optim.AdamW):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction) with fp32 moments for bf16 (or fp32)
    weights; fp32 weights get torch AdamW's result up to rounding. Options amsgrad / maximize / capturable /
    differentiable / fused are not supported."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            lr = float(lr)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32,
                                                           memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                w, g = _local(p), _local(p.grad).float()
                m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                new = w.float()
                new.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
                new.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
                if w.dtype == torch.bfloat16:
                    stochastic_round_(w, new)
                else:
                    w.copy_(new)
        return loss
