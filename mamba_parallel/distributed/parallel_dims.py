"""ParallelDims: the parallel degrees of a run, checked against the world size and the model, and its meshes.

World ranks are laid out as a 5-D grid, outer to inner: ``pp x dp_replicate x dp_shard x cp x tp`` (tp innermost, so
tensor-parallel peers are neighbouring ranks — the same node, the fastest links; pipeline stages outermost, as their
point-to-point activations are the lightest traffic).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelConfigError(ValueError):
    """Parallel degrees that do not fit the world size or the model; the message names the degree."""


@dataclass
class ParallelDims:
    """Degrees of pipeline, data (replicate = DDP-like, shard = FSDP), context and tensor parallelism.

    ``dp_shard = -1`` takes whatever the other degrees leave: ``world_size / (pp * dp_replicate * cp * tp)``.
    ``pp`` (keyword, after ``world_size`` for the positional order of the older four degrees) splits the layers
    into pipeline stages (distributed/pipeline.py).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    world_size: int = 1
    pp: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "cp", "tp", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParallelConfigError(f"{name} must be an integer >= 1, got {v!r}")
        rest = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % rest:
                raise ParallelConfigError(
                    f"world size {self.world_size} is not divisible by pp*dp_replicate*cp*tp = "
                    f"{self.pp}*{self.dp_replicate}*{self.cp}*{self.tp} = {rest}")
            self.dp_shard = self.world_size // rest
        if not isinstance(self.dp_shard, int) or self.dp_shard < 1:
            raise ParallelConfigError(f"dp_shard must be -1 or an integer >= 1, got {self.dp_shard!r}")
        if rest * self.dp_shard != self.world_size:
            raise ParallelConfigError(
                f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.cp}*"
                f"{self.tp} = {rest * self.dp_shard} != world size {self.world_size}")

    # ---- degrees ------------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    def describe(self) -> str:
        pp = f"pp {self.pp} x " if self.pp > 1 else ""
        return (f"world {self.world_size} = {pp}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"cp {self.cp} x tp {self.tp}")

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each mesh dim (the grid of MESH_DIMS, tp innermost), without a mesh."""
        sizes = dict(zip(MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)))
        out = {}
        for name in reversed(MESH_DIMS):
            out[name] = rank % sizes[name]
            rank //= sizes[name]
        return {name: out[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of ``rank`` (over dp_replicate x dp_shard): which slice of the batch it reads."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    # ---- model checks -------------------------------------------------------------------------------------------
    def validate_for_model(self, config, stages_per_rank: int = 1) -> None:
        """Raise ParallelConfigError when tp does not divide what tensor parallelism splits in this model, or the
        model has fewer layers than pipeline stages (``pp * stages_per_rank``)."""
        stages = self.pp * stages_per_rank
        if stages > config.n_layer:
            per = f" ({self.pp} ranks x {stages_per_rank} stages each)" if stages_per_rank > 1 else ""
            raise ParallelConfigError(f"pp={self.pp} needs at least {stages} layers for its {stages} pipeline "
                                      f"stages{per}, the model has n_layer={config.n_layer}")
        tp = self.tp
        if tp == 1:
            return

        def need(n: int, what: str) -> None:
            if n % tp:
                raise ParallelConfigError(f"tp={tp} does not divide {what}={n}")

        need(config.padded_vocab_size, "padded vocab_size")
        if config.layer in ("Mamba2", "Mamba3"):
            need(config.nheads, "nheads")
            g = config.mixer_cfg["ngroups"]
            if g % tp and g != 1:  # ngroups=1 is replicated on every tp rank
                raise ParallelConfigError(f"tp={tp} does not divide ngroups={g} (ngroups must be 1 or a "
                                          f"multiple of tp)")
        else:
            need(config.d_inner, "d_inner")
        if config.d_intermediate:
            need(config.d_intermediate, "d_intermediate")
        if config.attn_layer_idx:
            a = config.attn_params
            need(a["num_heads"], "attn num_heads")
            need(a["num_heads_kv"], "attn num_heads_kv")

    # ---- meshes -------------------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The world DeviceMesh with dims named ``pp, dp_replicate, dp_shard, cp, tp`` (process group must exist)."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs torch.distributed initialised (run under torchrun)")
        if dist.get_world_size() != self.world_size:
            raise ParallelConfigError(
                f"ParallelDims.world_size={self.world_size} but the process group has {dist.get_world_size()} "
                f"ranks")
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        self._mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        return self._mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self.build_mesh()
        return self._mesh

    def submesh(self, *names: str) -> DeviceMesh:
        """A sub-mesh over the named dims, e.g. ``submesh("tp")`` or ``submesh("dp_replicate", "dp_shard")``.

        Several names are flattened into one dim (named by joining them with "_") where the caller needs a
        1-D group, e.g. FSDP's shard group over ``("dp_shard", "cp")``.
        """
        for n in names:
            if n not in MESH_DIMS:
                raise ParallelConfigError(f"unknown mesh dim {n!r}; known: {MESH_DIMS}")
        if len(names) == 1:
            return self.mesh[names[0]]
        flat = "_".join(names)
        try:
            return self.mesh[flat]
        except (KeyError, RuntimeError, ValueError):
            return self.mesh[names]._flatten(flat)

    def group(self, name: str):
        """The process group of one mesh dim (``"tp"``, ``"cp"``, ...)."""
        return self.submesh(name).get_group()


def dims_from_world(tp: int = 1, cp: int = 1, dp_replicate: int = 1, world_size: int | None = None,
                    pp: int = 1) -> ParallelDims:
    """ParallelDims for the current process group (or ``world_size``), dp_shard filling the rest."""
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=-1, cp=cp, tp=tp, world_size=world_size, pp=pp)
