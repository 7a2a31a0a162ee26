"""The one-token decode step with the block's pre-norm folded into the mixer's first linear.

At batch 1 a decode step is bound by reading the weights once and by the number of kernels per layer, not by
arithmetic. A Block whose mixer has ``step_with_norm`` hands it the un-normed hidden state and the residual when
``can_fuse_step`` allows; the mixer then runs its step in fewer kernels (Mamba-2: three per layer, docs/API.md):
the residual add + RMSNorm + in_proj + conv update in one (``ops.add_rms_norm_linear``), the state update, the
gated norm + out_proj in one. Same numerics as the unfused step up to the order of fp32 sums.

Only the single-device layer qualifies: plain ``nn.Linear`` projections and norms without hooks, the local
sequence ops, the Triton path, a few rows; anything else (tensor parallel, a hooked module, autograd, a large
batch: cuBLAS GEMMs) takes the mixer's ``step``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mamba_parallel.layers.norm import RMSNorm
from mamba_parallel.layers.out_proj import fusable_linear, no_hooks
from mamba_parallel.ops.backend import triton_available, use_triton

from mamba_parallel.ops.step_linear.rows import STEP_ROWS  # larger batches run the unfused step (cuBLAS GEMMs)


def can_fuse_step(hidden: torch.Tensor, norm: nn.Module, mixer: nn.Module, inference_params) -> bool:
    """Whether this one-token call of ``mixer`` (hidden (b, 1, d)) may run ``mixer.step_with_norm``."""
    if inference_params is None or inference_params.seqlen_offset == 0 or hidden.shape[1] != 1:
        return False
    if torch.is_grad_enabled() or not 1 <= hidden.shape[0] <= STEP_ROWS or not hasattr(mixer, "step_with_norm"):
        return False
    if type(norm) is not RMSNorm or not no_hooks(norm) or norm.weight.dtype != hidden.dtype:
        return False
    if not (mixer.seq_ops.local and no_hooks(mixer) and all(fusable_linear(m) for m in mixer.step_linears())):
        return False
    if any(m.weight.dtype != hidden.dtype for m in mixer.step_linears()):
        return False
    return triton_available() and use_triton(hidden, op="fused decode step")
