"""out_proj inside the autograd node of the op before it, so its input is never kept for the backward.

out_proj's input gradient needs only its weight; its weight gradient needs its input, which the op before it
(Mamba-2's gated norm, Mamba-1's gate) can write again in its own backward, where it computes it anyway: one node
for both keeps what that op's backward reads plus out_proj's weight (``ops.gated_rms_norm_linear``, Mamba's fused
training node). The layers read out_proj's parameters directly there, so only a plain ``nn.Linear`` without hooks
qualifies; anything else (tensor parallelism's RowParallelLinear, a parametrized or hooked module) keeps the
module call, and with it the ``gate`` recompute option.
"""

from __future__ import annotations

import torch.nn as nn


def no_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has no forward (pre-)hooks of its own, which a direct read of its parameters would skip."""
    return not (module._forward_hooks or module._forward_pre_hooks)


def fusable_linear(linear: nn.Module) -> bool:
    """Whether a fused node may compute ``linear`` from its ``weight`` / ``bias``: a plain nn.Linear, no hooks."""
    return type(linear) is nn.Linear and no_hooks(linear)
