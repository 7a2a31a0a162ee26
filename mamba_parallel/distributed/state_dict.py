"""Layout-independent state dicts for DCP checkpoints: the same keys and global shapes at every parallel layout.

The trainer saves and loads only through the four functions below, so a checkpoint written at one (dp, tp, cp)
layout loads at another (tp2 -> tp1, dp2 x tp2 -> dp4, ...). Loading follows DCP's template pattern:
``sd = model_state_dict(model); dcp.load(sd, ...); load_model_state_dict(model, sd)`` (same for the optimizer).

- Data parallelism alone: torch's ``get_*_state_dict`` already gives global keys and shapes (FSDP2 parameters are
  DTensors whose global shape is the unsharded one).
- Tensor parallelism (``tp_plan``) stores parameters as DTensors behind ``ShardView`` parametrizations, named
  ``<module>.parametrizations.<name>.original<i>``. Here they get their single-device name back. A parameter of
  one segment stays a (sharded) DTensor of its global shape. A fused parameter of several segments (Mamba-2
  in_proj [z | x | B | C | dt], conv1d, attention [q | k | v], MLP fc1, Mamba-1 in_proj) is gathered to its full
  canonical tensor (a few such tensors per layer) and split back into the segments' local shards on load.
- A tied LM head keeps its alias key ``lm_head.weight`` (as torch writes it for the single-device model).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover
    DTensor = ()

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
_OPTS_PARTIAL = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
_PARAM_RE = re.compile(r"^(?P<prefix>.*?)parametrizations\.(?P<name>[^.]+)\.original(?P<idx>\d*)$")


# ---- name mapping -----------------------------------------------------------------------------------------------
def canonical_name(fqn: str) -> tuple[str, int | None]:
    """``a.parametrizations.weight.original2`` -> (``a.weight``, 2); any other name -> (name, None)."""
    m = _PARAM_RE.match(fqn)
    if m is None:
        return fqn, None
    return m["prefix"] + m["name"], int(m["idx"] or 0)


def _views(model: torch.nn.Module) -> dict[str, object]:
    """Canonical parameter name -> its ShardView (wrapper prefixes of AC / compile stripped)."""
    from mamba_parallel.distributed.tp_modules import ShardView

    out = {}
    for mod_name, mod in model.named_modules():
        plist = getattr(mod, "parametrizations", None)
        if plist is None:
            continue
        for name, pl in plist.items():
            views = [v for v in pl if isinstance(v, ShardView)]
            if views:
                out[_clean(f"{mod_name}.{name}" if mod_name else name)] = views[0]
    return out


def _clean(fqn: str) -> str:
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        fqn = fqn.replace(wrapper, "")
    return fqn


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _like(full: Tensor, template: Tensor) -> Tensor:
    """``full`` (global) laid out as ``template``: a DTensor with this rank's chunk, or a plain copy."""
    if not isinstance(template, DTensor):
        return full.to(template.dtype)
    shape, offset = compute_local_shape_and_global_offset(full.shape, template.device_mesh, template.placements)
    local = full
    for d, (n, o) in enumerate(zip(shape, offset)):
        local = local.narrow(d, o, n)
    local = local.to(device=template.to_local().device, dtype=template.dtype).contiguous()
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


def _fuse(entries: dict[int, Tensor], dim: int) -> Tensor:
    return torch.cat([_full(entries[i]) for i in sorted(entries)], dim)


def canonical_tensors(named: dict[str, Tensor], model: torch.nn.Module) -> dict[str, Tensor]:
    """Map tensors keyed by the model's parameter names (e.g. parameters or their gradients) to canonical names;
    fused segments become one full tensor, single-segment DTensors stay as they are."""
    views = _views(model)
    groups: dict[str, dict[int, Tensor]] = {}
    out = {}
    for k, v in named.items():
        canon, idx = canonical_name(_clean(k))
        if idx is None:
            out[canon] = v
        else:
            groups.setdefault(canon, {})[idx] = v
    for canon, entries in groups.items():
        out[canon] = entries[0] if len(entries) == 1 else _fuse(entries, views[canon].dim)
    return out


def _split_into(canon_value: Tensor, view, idx: int, template: Tensor) -> Tensor:
    piece = _full(canon_value).split(view.sizes, view.dim)[idx]
    return _like(piece, template)


# ---- model ------------------------------------------------------------------------------------------------------
def model_state_dict(model: torch.nn.Module) -> dict:
    """The model's state for DCP: single-device keys and global shapes (sharded tensors stay sharded)."""
    sd = canonical_tensors(get_model_state_dict(model, options=_OPTS), model)
    head = getattr(getattr(model, "module", model), "lm_head", None)  # (a DDP wrapper holds the model as .module)
    if getattr(head, "tied", False) and "lm_head.weight" not in sd:  # TPTiedLMHead: no parameter of its own
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]
    return sd


def load_model_state_dict(model: torch.nn.Module, state: dict, strict: bool = True) -> None:
    """Load a state from ``model_state_dict`` (of any layout, filled by ``dcp.load``) into ``model``.

    Values may also be full plain tensors (e.g. a single-device ``state_dict()`` present on every rank): each rank
    then keeps its own shard. ``strict=False``: entries of the model missing from ``state`` keep their values
    (a model filled part by part).
    """
    views = _views(model)
    out = {}
    for k, template in get_model_state_dict(model, options=_OPTS).items():
        canon, idx = canonical_name(_clean(k))
        if canon not in state:
            if not strict:
                continue
            raise KeyError(f"load_model_state_dict: the state has no entry {canon!r} (for parameter {k!r})")
        if idx is not None and len(views[canon].sizes) > 1:
            out[k] = _split_into(state[canon], views[canon], idx, template)
        else:
            out[k] = _match(state[canon], template)
    set_model_state_dict(model, out, options=_OPTS if strict else _OPTS_PARTIAL)


def full_model_state_dict(model: torch.nn.Module, cpu_offload: bool = True) -> dict:
    """Single-device keys and FULL plain tensors (on CPU with ``cpu_offload``), on every rank; collective.

    What a plain ``MambaLMHeadModel.load_state_dict`` or ``save_pretrained`` needs, from any layout.
    """
    out = {}
    for k, v in model_state_dict(model).items():
        v = _full(v).detach()
        out[k] = v.cpu() if cpu_offload else v
    return out


def _match(value: Tensor, template: Tensor) -> Tensor:
    """``value`` in the layout of ``template`` (as is when it already is)."""
    if isinstance(template, DTensor):
        if isinstance(value, DTensor) and value.placements == template.placements and \
                value.device_mesh == template.device_mesh:
            return value
        return _like(_full(value), template)
    return _full(value)


# ---- optimizer --------------------------------------------------------------------------------------------------
def _split_key(key: str) -> tuple[str, str, str]:
    """``state.<fqn>.exp_avg`` -> ("state", fqn, "exp_avg"); same for ``param_groups.<fqn>.lr``."""
    kind, rest = key.split(".", 1)
    fqn, leaf = rest.rsplit(".", 1)
    return kind, fqn, leaf


def optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state for DCP, flattened (``state.<fqn>.exp_avg`` ...) with single-device names."""
    osd = get_optimizer_state_dict(model, optimizer, options=_OPTS)
    views = _views(model)
    out, groups = {}, {}
    for key, v in osd.items():
        kind, fqn, leaf = _split_key(key)
        canon, idx = canonical_name(_clean(fqn))
        ckey = f"{kind}.{canon}.{leaf}"
        if idx is None:
            out[ckey] = v
        else:
            groups.setdefault(ckey, {})[idx] = v
    for ckey, entries in groups.items():
        first = entries[min(entries)]
        canon = _split_key(ckey)[1]
        fused = len(entries) > 1 and isinstance(first, Tensor) and first.dim() > 0
        out[ckey] = _fuse(entries, views[canon].dim) if fused else first
    return out


def load_optim_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a state from ``optim_state_dict`` (of any layout, filled by ``dcp.load``) into ``optimizer``."""
    views = _views(model)
    current = get_optimizer_state_dict(model, optimizer, options=_OPTS)
    out = {}
    for key, template in current.items():
        kind, fqn, leaf = _split_key(key)
        canon, idx = canonical_name(_clean(fqn))
        ckey = f"{kind}.{canon}.{leaf}"
        if ckey not in state:
            raise KeyError(f"load_optim_state_dict: the state has no entry {ckey!r} (for {key!r})")
        value = state[ckey]
        if not isinstance(template, Tensor) or template.dim() == 0:
            out[key] = value
        elif idx is not None and len(views[canon].sizes) > 1:
            out[key] = _split_into(value, views[canon], idx, template)
        else:
            out[key] = _match(value, template)
    set_optimizer_state_dict(model, optimizer, out, options=_OPTS)
