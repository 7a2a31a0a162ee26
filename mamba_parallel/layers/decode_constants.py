"""Parameter-derived constants of the inference forward and decode step, computed once per parameter version.

At batch 1 a decode step is a handful of tiny kernels per layer, and a prefill is bound by the host's launches, so
deriving ``-exp(A_log)`` in fp32 at every call (a cast, an exp and a negation: three launches per layer) is a
visible share of either. The value only changes when the parameter does: it is cached on the module, keyed by the
parameter's storage and version counter (every in-place update, e.g. an optimizer step, bumps it). Not cached when
autograd must reach the parameter, nor inside torch.compile (the graph computes it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


def derived(module: nn.Module, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(module.<name>), recomputed only when that parameter's storage or version changed; each function of a
    parameter has its own slot (e.g. A in the decode step's layout and in the scan's)."""
    p = getattr(module, name)
    if ((torch.is_grad_enabled() and p.requires_grad) or type(p) not in (torch.Tensor, nn.Parameter)
            or torch.compiler.is_compiling()):
        return fn(p)  # gradients must flow / a tensor subclass's version need not track the data it shows
    key = (p.data_ptr(), p._version, p.dtype, p.device, fn)  # fn too: two functions may share a __name__
    slot = f"_decode_{name}_{fn.__name__}"
    hit = module.__dict__.get(slot)
    if hit is None or hit[0] != key:
        hit = (key, fn(p.detach()))
        module.__dict__[slot] = hit  # a plain attribute: not a buffer, not in the state dict
    return hit[1]


def neg_exp_fp32(t: torch.Tensor) -> torch.Tensor:
    """A = -exp(A_log) in fp32."""
    return -torch.exp(t.float())


def neg_exp_fp32_state_major(t: torch.Tensor) -> torch.Tensor:
    """-exp(A_log) in fp32, (d, n) as a view of a state-major (n, d) tensor: the selective scan's layout (it would
    make a transposed copy of a (d, n) one at every call)."""
    return neg_exp_fp32(t).t().contiguous().t()


def fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float()
