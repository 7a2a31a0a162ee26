"""Materialise a model built on the meta device and parallelised there, holding only this rank's shards.

``init_sharded_weights(model, config, device, seed)`` gives every local shard the values the single-device model
gets from ``MambaLMHeadModel.init_weights`` under ``torch.manual_seed(seed)`` on ``device``, without ever building
the whole model: it replays init_weights' order (each block's ``reset_parameters`` in module order, the final
norm, then the embedding and an untied head) one block at a time on a single-device twin of that block, and each
rank keeps its own slice of it (``load_model_state_dict(..., strict=False)``: FSDP2 shards, tensor-parallel
segments, pipeline stages — a block another stage owns is drawn and dropped, so the random stream stays in step).
Peak memory: one full block (or the embedding) beside the shards. No collective: every rank draws the same values.

``load_sharded_checkpoint(model, checkpoint)`` fills the same kind of model from a checkpoint folder
(``models.formats.open_checkpoint``) the same way, but finer: tensor by tensor, each rank reads off the file only
the box of every tensor it holds (its rows / columns of a sharded segment, all of a replicated one). Peak memory:
one rank-sized slice of one tensor beside the shards; the whole model is never in host memory.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mamba_parallel.distributed.state_dict import _clean, _views, canonical_name, load_model_state_dict

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover
    DTensor = ()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {_clean(k): b for k, b in model.named_buffers()}


@torch.no_grad()
def _load(model: nn.Module, buffers: dict, prefix: str, part: nn.Module) -> None:
    state = {prefix + k: v for k, v in part.state_dict(keep_vars=True).items()}
    load_model_state_dict(model, {k: v.detach() for k, v in state.items()}, strict=False)
    for k, b in part.named_buffers():  # non-persistent buffers too (rotary tables), never sharded
        if prefix + k in buffers:
            buffers[prefix + k].copy_(b)


@torch.no_grad()
def load_single_device_model(model: nn.Module, single: nn.Module) -> None:
    """Fill ``model`` (materialised with ``to_empty``, any layout) with the values of ``single``, the same model on
    one device: every rank keeps its own slices of the parameters; the buffers (rotary tables), never sharded,
    are copied whole. Both must hold the same parameters and buffers."""
    own, theirs = _buffers(model), dict(single.named_buffers())
    if set(own) != set(theirs):  # one the sharded model has and the other not would stay unset
        raise RuntimeError(f"load_single_device_model: the buffers differ: {sorted(set(own) ^ set(theirs))}")
    load_model_state_dict(model, {k: v.detach() for k, v in single.state_dict(keep_vars=True).items()})
    for k, b in theirs.items():
        own[k].copy_(b)


def _local_box(t: torch.Tensor, view, idx: int | None) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the tensor this rank writes, the box of the canonical single-device tensor it holds). ``view``/``idx``: the
    ShardView and segment index of a tensor-parallel parameter (None for any other tensor)."""
    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
    else:
        shape, offset, local = tuple(t.shape), (0,) * t.dim(), t
    offset = list(offset)
    if idx is not None:  # a segment of a fused parameter starts where the ones before it end
        offset[view.dim] += sum(view.sizes[:idx])
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_sharded_checkpoint(model: nn.Module, checkpoint, progress: bool | None = False) -> None:
    """Fill ``model`` (materialised with ``to_empty``, any layout: tensor-parallel segments, DTensor shards, plain
    tensors) from ``checkpoint`` (``models.formats.open_checkpoint``), reading off the file only the part of each
    tensor this rank holds, one tensor at a time, in the model's dtypes. The checkpoint is checked first against
    the single-device model of its config (``Checkpoint.plan``: missing, unexpected, mis-shaped tensors are one
    error naming the file, the tensors and both shapes); a model tensor the checkpoint cannot fill is an error,
    never left as ``to_empty``'s garbage."""
    from mamba_parallel.models.formats import CheckpointError
    from mamba_parallel.models.lm import MambaLMHeadModel
    from mamba_parallel.models.tensor_layout import EMBEDDING, LM_HEAD
    from mamba_parallel.progress import progress_bar

    twin = MambaLMHeadModel(checkpoint.config, device="meta")  # the single-device names and shapes, no memory
    expected = {n: tuple(t.shape) for n, t in twin.state_dict(keep_vars=True).items()}
    transient = sorted(n for n, _ in twin.named_buffers() if n not in expected)
    if transient:  # not in a checkpoint: nothing would set them here
        raise CheckpointError(f"{checkpoint.path}: the model has buffers no checkpoint stores, which a sharded "
                              f"load cannot fill: {transient}")
    del twin
    checkpoint.plan(expected)
    views = _views(model)
    tensors = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())]
    with progress_bar(f"loading {checkpoint.folder.name}", total=len(tensors), enabled=progress) as advance:
        for fqn, t in tensors:
            advance()
            canon, idx = canonical_name(_clean(fqn))
            if canon not in expected:
                raise CheckpointError(f"{checkpoint.path}: the model holds {canon!r} ({fqn}), which the "
                                      f"single-device model of this config does not")
            # a head tied to the embedding is stored once (or not at all): read the embedding's rows
            source = EMBEDDING if (canon == LM_HEAD and checkpoint.tied) else canon
            local, index = _local_box(t, views.get(canon), idx)
            tied_check = source == EMBEDDING and checkpoint.tied
            # the tie is checked on the file's values, on the host: read them uncast, the cast is then copy_'s
            cast = None if tied_check or not local.is_floating_point() else local.dtype
            value = checkpoint.read(source, torch.device("cpu") if tied_check else local.device, cast, index)
            if value.shape != local.shape:
                box = ", ".join(f"{sl.start}:{sl.stop}" for sl in index)
                raise CheckpointError(f"{checkpoint.path}: {canon}[{box}] read as {tuple(value.shape)}, but this "
                                      f"rank holds {tuple(local.shape)} of it")
            if tied_check:
                checkpoint.check_tied_head(index, value)
            local.copy_(value)
            del value


@torch.no_grad()
def init_sharded_weights(model: nn.Module, config, device: torch.device | str, seed: int,
                         draw_device: torch.device | str | None = None) -> None:
    """Fill ``model`` (materialised with ``to_empty`` on ``device``, any layout) with the single-device initial
    values. ``draw_device``: where the random values are drawn, when not ``device`` (a host-resident model drawn
    on the GPU: torch's CPU generator is serial, minutes for a 7B model; the values are then those of the model
    initialised on that GPU), each block moved to ``device`` before its slices are kept."""
    from mamba_parallel.layers import init
    from mamba_parallel.layers.block import create_block
    from mamba_parallel.layers.norm import make_norm
    from mamba_parallel.models.lm import INIT_MODULE_TYPES, rescale_residual_writers

    device = torch.device(device)
    draw = torch.device(draw_device) if draw_device is not None else device
    torch.manual_seed(seed)
    buffers = _buffers(model)
    for i in range(config.n_layer):
        block = create_block(config, i, device="meta")
        block.to_empty(device=draw)
        for m in block.modules():
            if isinstance(m, INIT_MODULE_TYPES):
                m.reset_parameters()
        if config.rescale_prenorm_residual:
            rescale_residual_writers(block, config)
        _load(model, buffers, f"backbone.layers.{i}.", block.to(device))
        del block
    norm_f = make_norm(config.d_model, config.rms_norm, config.norm_epsilon, device="meta")
    norm_f.to_empty(device=draw)
    norm_f.reset_parameters()
    _load(model, buffers, "backbone.norm_f.", norm_f.to(device))
    emb = torch.empty(config.padded_vocab_size, config.d_model, device=draw)
    init.normal_(emb, config.initializer_range)
    emb = emb.to(device)
    state = {"backbone.embedding.weight": emb}
    if config.tie_embeddings:
        state["lm_head.weight"] = emb
    load_model_state_dict(model, state, strict=False)
    del emb, state
    if not config.tie_embeddings:
        head = torch.empty(config.padded_vocab_size, config.d_model, device=draw)
        init.linear_default_(head)
        load_model_state_dict(model, {"lm_head.weight": head.to(device)}, strict=False)


def tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) pairs that hold one Parameter together (a tied LM head), grouped."""
    by_id: dict[int, list] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            entry = (mod, name)
            if entry not in by_id.setdefault(id(p), []):
                by_id[id(p)].append(entry)
    return [g for g in by_id.values() if len(g) > 1]


def retie_after_to_empty(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """``to_empty`` gives each module its own new Parameter: tie the groups ``tied_groups`` found before it again."""
    for group in groups:
        first = getattr(*group[0])
        for mod, name in group[1:]:
            if getattr(mod, name) is not first:
                setattr(mod, name, first)


def materialize(model: nn.Module, config, device: torch.device | str, seed: int,
                buffer_device: torch.device | str | None = None,
                draw_device: torch.device | str | None = None) -> None:
    """``to_empty`` on ``device`` (each rank allocates only its shards; parameters shared before, as a tied LM
    head, are shared after), then ``init_sharded_weights`` (values drawn on ``draw_device`` when given).
    ``buffer_device``: where buffers (rotary tables) go afterwards, when the parameters stay on the host (CPU
    offload: FSDP2 moves parameters, not buffers)."""
    groups = tied_groups(model)
    model.to_empty(device=device)
    retie_after_to_empty(groups)
    init_sharded_weights(model, config, device, seed, draw_device=draw_device)
    if buffer_device is not None:
        for mod in model.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = buf.to(buffer_device)
