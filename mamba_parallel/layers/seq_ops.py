"""The parallel seam: a mixer's operations along the sequence, as one object the mixer owns (``mixer.seq_ops``).

A mixer never calls its conv / scan / attention op directly: it calls ``self.seq_ops``, which its constructor
builds as the single-device strategy of its class (``Mamba1Ops``, ``Mamba2Ops``, ``AttentionOps``, each beside its
mixer). Parallelism replaces that one attribute from outside and nothing else in the layer:

- context parallel (distributed/context_parallel.py) installs strategies whose conv takes the previous rank's
  halo, whose scan folds in the state of the earlier ranks, whose attention sees every rank's keys / values;
- tensor parallel (distributed/tp_plan.py) installs, for Mamba, one whose ``channel_sum`` adds x_proj's partial
  products over the ranks holding the other d_inner channels.

The layer never asks who built its strategy; it reads two capabilities of it:

- ``local``: no op communicates (the single-device strategy), so the layer may run them as its own fused kernels
  instead (Mamba's fused training path, layers/mamba1.py);
- ``local_conv``: the conv reads only this device's tokens, so the backward may run it again (recompute "conv").

Adding a mixer: subclass ``SequenceOps`` beside it with its own ops (same signatures as the ops they call), build
it in the constructor, call only it in ``forward``; its context-parallel strategy subclasses that one in
distributed/ and joins ``CP_STRATEGIES`` there.
"""

from __future__ import annotations

import torch

from mamba_parallel import ops


class SequenceOps:
    """Single-device sequence operations shared by the mixers (the causal depthwise conv)."""

    local = True
    local_conv = True

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str | None = None, seq_idx: torch.Tensor | None = None,
             initial_state: torch.Tensor | None = None, return_final_state: bool = False):
        """``ops.causal_conv1d``: x (b, d, L) any strides, weight (d, w) -> (b, d, L) [, final_state (b, d, w-1)]."""
        return ops.causal_conv1d(x, weight, bias, activation=activation, initial_state=initial_state,
                                 seq_idx=seq_idx, return_final_state=return_final_state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
