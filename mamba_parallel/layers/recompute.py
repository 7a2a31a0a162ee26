"""Recompute: activations a layer rebuilds in the backward instead of keeping them.

Why: our Mamba-2 layer kept ~74.8 KB/token/layer for the backward against mamba_ssm's ~46.8 (docs/memory.md).
Listing ``conv``, ``dt``, ``gate`` (and ``states``, inside the Triton SSD op and Mamba's selective scan) trades one
more cheap kernel per layer in the backward for that memory. ``gate`` acts only where out_proj does not run inside
the node of the op before it (layers/out_proj.py), which keeps no out_proj input at all. The choice is a layer
attribute (``Mamba(recompute=...)``; ``apply_recompute(model, items)``; ``train --recompute``) read in the forward:
the backward rebuilds exactly what that forward did not keep.

How: ``RecomputeInBackward`` is a ``saved_tensors_hooks`` context: tensors saved inside it that are views of a
registered target are packed as (offset, shape, strides); the first unpack in the backward runs the target's
producer again (no grad, the forward's autocast state) and rebuilds every view from it, dropped after the last.
To hand the other saved tensors on to the hooks active outside (activation checkpointing's), it reads them with
the private ``torch._C._autograd._top_saved_tensors_default_hooks(ignore_is_tracing)`` (torch >= 2.8; the same in
2.11 and 2.13); without it, a context with targets refuses to open rather than hide tensors from checkpointing.
With nothing to recompute, layers create no context (``run_saving`` with ``None`` is a plain call).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import torch

# Mamba's "states": the selective scan keeps one fp32 state checkpoint per this many of its chunks (of 16
# tokens on a GPU) instead of one per chunk (ops.selective_scan's checkpoint_every)
SCAN_CHECKPOINT_EVERY = 8

# What a layer may rebuild in the backward instead of keeping (the names ``--recompute`` takes).
RECOMPUTE_ITEMS = {
    "conv": "the conv output (Mamba, Mamba2): one more depthwise conv",
    "dt": "Mamba's dt_proj output (the scan's delta): one more (d_inner x dt_rank) matmul",
    "gate": "out_proj's input (Mamba: y * silu(z); Mamba2: the gated norm's output) where the norm / gate + "
            "out_proj node does not apply (layers/out_proj.py; elsewhere nothing is kept): one more gate / norm pass",
    "states": "Mamba2's dt / decay and chunk states (Triton SSD op): one more state pass (ops/ssd/triton_impl.py); "
              f"Mamba's selective-scan checkpoints: one kept per {SCAN_CHECKPOINT_EVERY} chunks (128 tokens on a "
              "GPU), the states in between rebuilt by one more forward scan in the backward",
}
NOTHING: frozenset[str] = frozenset()

# The saved-tensor hooks active when a RecomputeInBackward context opens (see the module docstring).
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def parse_items(raw: str) -> tuple[frozenset[str], list[str]]:
    """A comma list ('conv, gate'; 'none' for no item) -> (its names, those not in RECOMPUTE_ITEMS, sorted): the
    ``--recompute`` flags' parser."""
    if raw.strip() == "none":
        return NOTHING, []
    items = frozenset(v.strip() for v in raw.split(",") if v.strip())
    return items, sorted(items - RECOMPUTE_ITEMS.keys())


def recompute_set(items: str | Iterable[str] | None) -> frozenset[str]:
    """items (a comma list or names from RECOMPUTE_ITEMS; None / empty: nothing) -> their frozenset.
    An unknown name raises ValueError naming it and the valid ones."""
    if items is None:
        return NOTHING
    names, unknown = parse_items(items) if isinstance(items, str) else (frozenset(items), None)
    unknown = sorted(names - RECOMPUTE_ITEMS.keys()) if unknown is None else unknown
    if unknown:
        raise ValueError(f"recompute: unknown {', '.join(map(str, unknown))}; expected names from "
                         f"{', '.join(RECOMPUTE_ITEMS)}")
    return names


def apply_recompute(model: torch.nn.Module, items: str | Iterable[str] | None) -> torch.nn.Module:
    """Set what every layer of ``model`` that can recompute (those with a ``recompute`` attribute: Mamba, Mamba2)
    rebuilds in the backward: ``items`` from RECOMPUTE_ITEMS (a comma list or names; None / empty: nothing).
    Each layer acts on the items it has. Returns the model. Before or after ``parallelize``, before a forward."""
    chosen = recompute_set(items)
    for module in model.modules():
        if isinstance(getattr(module, "recompute", None), frozenset):
            module.recompute = chosen
    return model


def recompute_plan(module: torch.nn.Module, conv_local: bool = True) -> frozenset[str]:
    """What ``module`` (a training forward: no inference cache) rebuilds in this backward: its ``recompute``
    items when autograd records and nothing compiles (the hooks are eager-only), less "conv" when the conv
    communicates (``conv_local`` False: context parallelism's halo exchange)."""
    items = module.recompute
    if not items or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return NOTHING
    return items if conv_local else items - {"conv"}


def run_saving(rebuilt: "RecomputeInBackward | None", fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), inside ``rebuilt``'s context when there is one (None: a plain call)."""
    if rebuilt is None:
        return fn(*args, **kwargs)
    with rebuilt:
        return fn(*args, **kwargs)


class _Outer(NamedTuple):
    unpack: Callable
    packed: object


class _Recipe(NamedTuple):
    target: int
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


class _Target:
    """One recomputable tensor: where it lives, how to rebuild it, and its saved views (counted per backward)."""

    def __init__(self, out: torch.Tensor, recompute: Callable[[], torch.Tensor]):
        self.ptr = out.untyped_storage().data_ptr()
        self.dtype, self.device = out.dtype, out.device
        self.shape, self.stride, self.offset = out.shape, out.stride(), out.storage_offset()
        self.recompute = recompute
        self.base: torch.Tensor | None = None
        self.packed = self.unpacked = 0

    def matches(self, t: torch.Tensor) -> bool:
        return (t.numel() > 0 and t.untyped_storage().data_ptr() == self.ptr and t.dtype == self.dtype
                and t.device == self.device)


class RecomputeInBackward:
    """A ``saved_tensors_hooks`` context: tensors saved for backward inside it that are views of a target ``out``
    (see ``add``) are kept as (offset, shape, strides) and rebuilt from its ``recompute()`` in the backward.

    ``recompute`` runs without grad under the forward's autocast state, once per backward at the first unpack, and
    must return ``out``'s values with its shape and strides; it should hold only detached tensors (one with a
    grad_fn would make a reference cycle with the graph). The rebuilt tensor is dropped when the last view saved
    from it is unpacked, so each layer holds it only during its own backward. Without targets the context does
    nothing. It may be entered several times (targets added in between): a target is rebuilt once either way.
    Other saved tensors go to the hooks active outside (e.g. activation checkpointing's), if any.
    """

    def __init__(self):
        self._targets: list[_Target] = []
        self._autocast = None
        self._hooks = []

    def add(self, out: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> None:
        dev = out.device.type
        if self._autocast is None:
            self._autocast = (dev, torch.get_autocast_dtype(dev), torch.is_autocast_enabled(dev))
        self._targets.append(_Target(out, recompute))

    def __enter__(self) -> "RecomputeInBackward":
        hooks = None
        if self._targets:
            if _top_hooks is None:
                raise RuntimeError(f"recompute: torch {torch.__version__} lacks "
                                   "torch._C._autograd._top_saved_tensors_default_hooks, so the rebuilt tensors' "
                                   "context would hide other saved tensors from activation checkpointing's hooks; "
                                   "recompute nothing (apply_recompute(model, None)) or use torch >= 2.8")
            outer = _top_hooks(False)
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, outer), self._unpack)
            hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, *exc) -> None:
        hooks = self._hooks.pop()
        if hooks is not None:
            hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor, outer):
        for i, target in enumerate(self._targets):
            if target.matches(t):
                target.packed += 1
                return _Recipe(i, t.storage_offset(), t.shape, t.stride())
        if outer is not None:
            pack, unpack = outer
            return _Outer(unpack, pack(t))
        return t

    def _unpack(self, packed):
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        if not isinstance(packed, _Recipe):
            return packed
        target = self._targets[packed.target]
        base = target.base
        if base is None:
            dev, dtype, enabled = self._autocast
            with torch.no_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                base = target.recompute()
            if base.shape != target.shape or base.stride() != target.stride or base.dtype != target.dtype:
                raise RuntimeError(f"RecomputeInBackward: recompute() gave {tuple(base.shape)} strides "
                                   f"{base.stride()} {base.dtype}, the forward kept {tuple(target.shape)} strides "
                                   f"{target.stride} {target.dtype}")
            target.base = base
        target.unpacked += 1
        if target.unpacked % target.packed == 0:  # every saved view unpacked: this backward is done with it
            target.base = None
        offset = packed.offset - target.offset + base.storage_offset()
        return base.as_strided(packed.shape, packed.stride, offset)
