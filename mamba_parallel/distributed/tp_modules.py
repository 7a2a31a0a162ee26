"""What a tensor-parallel ``MambaLMHeadModel`` is made of beyond the building blocks of tensor_parallel.py (built by
``tp_plan.apply_tensor_parallel``).

``ShardView`` keeps a parameter as DTensor segment(s) on the tp mesh and shows the model code its local tensor.
``TPMamba1Ops`` is Mamba's sequence-ops strategy with x_proj's channel sum over tp; ``TPGatedRMSNorm`` Mamba-2's
gated norm over channels split across ranks; ``TPLMHead`` / ``TPTiedLMHead`` the vocab-parallel head and
``VocabParallelLoss`` its loss (``model.loss_fn``). Activations are (batch, seqlen, features); sequence
parallelism shards dim 1.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mamba_parallel.distributed import collectives as coll
from mamba_parallel.distributed.tensor_parallel import local_tensor, vocab_parallel_linear_cross_entropy
from mamba_parallel.layers.mamba1 import Mamba1Ops
from mamba_parallel.layers.norm import RMSNormGated

SEQ_DIM = 1  # activations are (batch, seqlen, features)


# ---- parameters as DTensors behind a local view ----------------------------------------------------------------
class ShardView(nn.Module):
    """Parametrization: stores a parameter as DTensor segment(s) on the tp mesh, shows the model its local tensor.

    ``segments``: (size along ``dim``, placement, grad_sum) per segment of the canonical (single-device) tensor.
    ``grad_sum`` marks a replicated segment used by rank-local computations: its gradient is summed over tp.
    """

    def __init__(self, mesh: DeviceMesh, dim: int, segments: list[tuple[int, Placement, bool]]):
        super().__init__()
        self.mesh, self.dim = mesh, dim
        self.sizes = [s for s, _, _ in segments]
        self.placements = [p for _, p, _ in segments]
        self.grad_sum = [g for _, _, g in segments]
        self.group = mesh.get_group()

    def forward(self, *parts: Tensor) -> Tensor:
        local = []
        for p, g in zip(parts, self.grad_sum):
            t = local_tensor(p)
            local.append(coll.copy_to_group(t, self.group) if g else t)
        return local[0] if len(local) == 1 else torch.cat(local, self.dim)

    def right_inverse(self, full: Tensor):
        if full.shape[self.dim] != sum(self.sizes):
            raise ValueError(f"ShardView: tensor of shape {tuple(full.shape)} does not split into segments "
                             f"{self.sizes} along dim {self.dim}")
        pieces = full.detach().split(self.sizes, self.dim)
        if full.is_meta:  # meta build: shards of the right local shape, materialised later by to_empty
            return tuple(_meta_dtensor(piece.shape, piece.dtype, self.mesh, pl) for piece, pl in
                         zip(pieces, self.placements))
        return tuple(distribute_tensor(piece.contiguous(), self.mesh, [pl])
                     for piece, pl in zip(pieces, self.placements))


def _meta_dtensor(shape, dtype, mesh: DeviceMesh, placement: Placement) -> DTensor:
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, [placement])
    local = torch.empty(local_shape, dtype=dtype, device="meta")
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


# ---- what the building blocks (tensor_parallel.py) do not cover ---------------------------------------------------
class TPMamba1Ops(Mamba1Ops):
    """Mamba's sequence ops when its d_inner channels are split over tp (the parallel seam, layers/seq_ops.py):
    conv and scan stay local; x_proj's partial products are summed over tp in forward AND backward (each rank then
    uses the sum for its own channels: dt_proj, and B / C in its scan)."""

    local = False  # the channel sum communicates: the fused training path (which bypasses it) must not run

    def __init__(self, group):
        self.group = group

    def channel_sum(self, t: Tensor) -> Tensor:
        return coll.all_reduce_both(t, self.group)

    def __repr__(self) -> str:
        return "TPMamba1Ops()"


class TPGatedRMSNorm(nn.Module):
    """Mamba-2's gated norm over ALL d_inner channels (ngroups = 1) when the channels are split over tp ranks:
    the sum of squares is all-reduced. x, z (..., d_local) -> (..., d_local) in x.dtype."""

    def __init__(self, norm: RMSNormGated, group, dim_global: int):
        super().__init__()
        self.weight = norm.weight
        self.eps, self.norm_before_gate = norm.eps, norm.norm_before_gate
        self.group, self.dim_global = group, dim_global

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        return TPGatedRMSNormFunc.apply(x, z, self.weight, self.eps, self.norm_before_gate, self.group,
                                        self.dim_global)


class TPGatedRMSNormFunc(torch.autograd.Function):
    """The cross-rank gated RMSNorm with a hand-written backward: saves x, z (input dtype) and the per-token rstd
    only, like the fused single-device kernel (autograd through fp32 temporaries would keep several fp32 copies
    of (b, L, d_local) per layer). Math in fp32 (fp64 for fp64 inputs).

    With g = x * silu(z) (gate first) or g = x (norm first), r = rsqrt(sum_all(g^2) / D + eps), n = g * r * w:
    dn/dg = r * w * dy - g * r^3 / D * sum_all(dy * w * g), the sum over every channel of every tp rank.
    """

    @staticmethod
    def forward(ctx, x, z, weight, eps, norm_before_gate, group, dim_global):
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        g = x.to(ct)
        if z is not None and not norm_before_gate:
            g = g * F.silu(z.to(ct))
        sumsq = coll.all_reduce_raw(g.square().sum(-1, keepdim=True), group)[0]
        rstd = torch.rsqrt(sumsq / dim_global + eps)
        y = g * rstd * weight.to(ct)
        if z is not None and norm_before_gate:
            y = y * F.silu(z.to(ct))
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.norm_before_gate, ctx.group, ctx.dim_global = norm_before_gate, group, dim_global
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        ct = rstd.dtype
        dy, xf, w = dy.to(ct), x.to(ct), weight.to(ct)
        sig = None if z is None else torch.sigmoid(z.to(ct))
        silu = None if z is None else z.to(ct) * sig
        gate_first = z is not None and not ctx.norm_before_gate
        g = xf * silu if gate_first else xf
        dn = dy * silu if (z is not None and ctx.norm_before_gate) else dy  # gradient wrt g * r * w
        dw = (dn * g * rstd).reshape(-1, g.shape[-1]).sum(0)
        dot = coll.all_reduce_raw((dn * w * g).sum(-1, keepdim=True), ctx.group)[0]
        dg = rstd * w * dn - g * rstd.pow(3) / ctx.dim_global * dot
        dz = None
        if z is not None:
            dsilu = sig * (1 + z.to(ct) * (1 - sig))
            if gate_first:
                dz = dg * xf * dsilu
                dg = dg * silu
            else:
                dz = dy * (g * rstd * w) * dsilu
            dz = dz.to(z.dtype)
        return dg.to(x.dtype), dz, dw.to(weight.dtype), None, None, None, None


class TPLMHead(nn.Module):
    """Vocab-parallel LM head: hidden (b, L, d) -> logits (b, L, V) gathered over the vocabulary.

    ``weight``: this rank's (V / tp, d) rows (a DTensor parameter behind a ShardView).
    """

    tied = False

    def __init__(self, lm_head: nn.Linear, group):
        super().__init__()
        self.group = group
        if lm_head is not None:
            self.weight = lm_head.weight

    def forward(self, hidden: Tensor) -> Tensor:
        return coll.gather_from_group(F.linear(hidden, self.weight), self.group, -1)


class TPTiedLMHead(TPLMHead):
    """The LM head tied to the vocab-parallel embedding: ``weight`` is the embedding's local shard (no parameter
    of its own, so no duplicate state-dict entry; state_dict.py writes the ``lm_head.weight`` alias)."""

    tied = True

    def __init__(self, embedding: nn.Module, group):
        super().__init__(None, group)
        self._embedding = [embedding]  # a list: not a submodule

    @property
    def weight(self) -> Tensor:
        return self._embedding[0].weight

    @weight.setter
    def weight(self, value: Tensor) -> None:
        """``model.tie_weights()`` assigns the embedding's weight: this head reads it itself, so nothing to do."""
        if value is not None and value.shape != self._embedding[0].weight.shape:
            raise ValueError(f"TPTiedLMHead: cannot tie to a weight of shape {tuple(value.shape)}, the embedding's "
                             f"shard is {tuple(self._embedding[0].weight.shape)}")


class VocabParallelLoss:
    """``model.loss_fn`` under tensor parallelism: hidden (N, d) full on every rank, weight (V / tp, d) this rank's
    vocabulary rows, targets (N,) already shifted -> CE over targets != -100 (mean / sum / none); the logits stay
    sharded (vocab_parallel_linear_cross_entropy)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, hidden: Tensor, weight: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        return vocab_parallel_linear_cross_entropy(hidden, weight, targets, self.group, reduction=reduction)
