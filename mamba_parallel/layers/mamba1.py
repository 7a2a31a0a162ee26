"""``Mamba``: the Mamba-1 selective-SSM mixer (Gu & Dao 2023), single device, mamba_ssm's parameter names.

Data flow for hidden (b, L, d_model):
  in_proj -> [x | z] (b, L, 2 d_inner); x -> causal depthwise conv + silu -> x_proj -> [dt_low | B | C];
  dt = dt_proj.weight @ dt_low; y = selective_scan(x, softplus(dt + dt_proj.bias), A = -exp(A_log), B, C, D)
  -> y * silu(z) -> out_proj -> (b, L, d_model). As in mamba_ssm, the Δ bias is added in fp32 inside the scan
  (under bf16 autocast a bf16 linear output would round Δ before the softplus), so dt_proj's weight and bias are
  read directly.

``forward`` is the reference: one op per step, the conv, the scan and x_proj's channel sum through ``seq_ops``
(the parallel seam, layers/seq_ops.py). Layouts: x and z stay channels-last views of in_proj's output (split with
a gradient arena, ops/grad_arena.py); the conv's output is made token-major once for x_proj and the scan
(``ops.token_major``); the gate writes out_proj's (b, L, d_inner) input (``ops.silu_gate``). In backward the conv
and the gate write dx and dz straight into in_proj's output gradient: torch concatenates and transposes nothing.
``recompute`` (a subset of conv, dt, gate, states; layers/recompute.py, docs/memory.md) rebuilds the conv output
(its token-major copy), the scan's delta and out_proj's input in the backward instead of keeping them; ``states``
keeps one selective-scan checkpoint per SCAN_CHECKPOINT_EVERY chunks (the scan's backward rebuilds the others).
The scan's per-chunk checkpoints are bf16 under bf16 inputs, fp32 otherwise (``scan_checkpoint_dtype`` overrides).

``bcdt_rms_norm`` (Falcon-Mamba): x_proj's three outputs dt_low (dt_rank), B and C (d_state) each pass through a
weightless RMS norm (eps ``bcdt_rms_eps``, computed in fp32) before dt_proj and the scan, in the reference, the
decode step and the fused node alike.

The fused training path (``use_fused_path``, the default; bottom of this file): training on the Triton path with
the local ``seq_ops`` runs the middle (conv .. gate, and out_proj when it is a plain nn.Linear: layers/out_proj.py)
as ONE autograd node with a hand-written backward and the same kernels. With out_proj inside, its input y * silu(z)
is not kept: the gate's backward kernel writes it again for out_proj's weight gradient (so ``gate`` recompute has
nothing to do there); otherwise a ``gate`` recompute keeps the reference forward. Why the node: a small Mamba-1
model's eager step is bound by the host (mamba-130m on an H200: ~1,800 launches and ~100 ms of CPU per step
against ~93 ms of GPU work), and the reference builds about ten autograd nodes per layer; the node saves ~500
launches per mamba-130m step and keeps less (delta is rebuilt in the backward, as mamba_ssm's fused path does).
A prompt's pass into the inference cache (no autograd) runs the node's forward as ``_prefill``, which also reads
and writes the cached conv and SSM states.

Local sizes come from the attributes ``d_inner``, ``d_state``, ``dt_rank`` (tensor parallelism rewrites them).
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._C import _len_torch_dispatch_stack
from torch.autograd.function import once_differentiable

from mamba_parallel import ops
from mamba_parallel.layers import init
from mamba_parallel.layers.decode_constants import derived, fp32, neg_exp_fp32, neg_exp_fp32_state_major
from mamba_parallel.layers.out_proj import fusable_linear, no_hooks
from mamba_parallel.layers.packing import resolve_seq_idx
from mamba_parallel.layers.recompute import (NOTHING, SCAN_CHECKPOINT_EVERY, RecomputeInBackward, recompute_plan,
                                             recompute_set, run_saving)
from mamba_parallel.layers.seq_ops import SequenceOps
from mamba_parallel.ops._common import linear_dtype, linear_in
from mamba_parallel.ops.backend import triton_available, use_triton
from mamba_parallel.ops.conv1d.naive import final_state as conv_final_state
from mamba_parallel.ops.grad_arena import split_with_grad_arena, tag_view
from mamba_parallel.ops.selective_scan import launch as scan_launch


def _channels_last(piece: torch.Tensor) -> torch.Tensor:
    """A (b, L, d) piece of in_proj's output -> its (b, d, L) view, carrying the piece's gradient-arena slot."""
    return tag_view(piece.transpose(1, 2), piece, lambda g: g.transpose(1, 2))


def _expand(w: torch.Tensor, b: int) -> torch.Tensor:
    return w.unsqueeze(0).expand(b, -1, -1)


def _token_major_linear(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """weight (out, in), x (b, in, L) any strides -> weight @ x (+ bias) as a contiguous (b, out, L).

    The token-major counterpart of F.linear: one batched matmul over a stride-0 expanded weight (no copy of the
    weight; autograd sums its gradient over b), so neither x nor the result needs a transposing copy.
    """
    y = torch.bmm(_expand(weight, x.shape[0]), x)
    return y if bias is None else y + bias.to(y.dtype)[:, None]  # in the product's dtype, as F.linear under autocast


def bcdt_rms_norm(x_dbl: torch.Tensor, r: int, n: int, eps: float, dim: int) -> torch.Tensor:
    """x_dbl (..., r + 2n, ...) along ``dim`` = [dt_low | B | C] -> each piece divided by its root mean square
    (+ eps), computed in fp32, returned in x_dbl's dtype (Falcon-Mamba's weightless norms)."""
    pieces = x_dbl.float().split([r, n, n], dim=dim)
    return torch.cat([p * torch.rsqrt(p.square().mean(dim, keepdim=True) + eps) for p in pieces],
                     dim=dim).to(x_dbl.dtype)


def _bcdt_norm_fwd(x_dbl: torch.Tensor, r: int, n: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused node's forward of the norms: x_dbl (b, r + 2n, L) -> (normed, same dtype; rstd (b, 3, L) fp32)."""
    pieces = x_dbl.float().split([r, n, n], dim=1)
    rstd = torch.cat([torch.rsqrt(p.square().mean(1, keepdim=True) + eps) for p in pieces], dim=1)
    normed = torch.cat([p * rstd[:, i:i + 1] for i, p in enumerate(pieces)], dim=1).to(x_dbl.dtype)
    return normed, rstd


def _bcdt_norm_bwd(grad: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """d(normed) (b, r + 2n, L) -> d(x_dbl), in place: per piece, rstd * (g - y * mean(g * y)) with y = normed."""
    for i, (g, y) in enumerate(zip(grad.split([r, n, n], dim=1), normed.split([r, n, n], dim=1))):
        g32, y32 = g.float(), y.float()
        g.copy_(rstd[:, i:i + 1] * (g32 - y32 * (g32 * y32).mean(1, keepdim=True)))
    return grad


class Mamba1Ops(SequenceOps):
    """Mamba's single-device sequence ops (the parallel seam, layers/seq_ops.py): the conv, the selective scan,
    and the sum of x_proj's output over channel shards (the identity here)."""

    def scan(self, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
             return_last_state=False, seq_idx=None, checkpoint_every=1, checkpoint_dtype=None):
        """``ops.selective_scan``: u / delta / z (b, d, L), A (d, n), B / C (b, n, L) -> y (b, d, L)
        [, last_state (b, d, n) fp32]; one state checkpoint kept per ``checkpoint_every`` chunks, in
        ``checkpoint_dtype`` (None: the op's default)."""
        return ops.selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                                  initial_state=initial_state, return_last_state=return_last_state,
                                  seq_idx=seq_idx, checkpoint_every=checkpoint_every,
                                  checkpoint_dtype=checkpoint_dtype)

    def channel_sum(self, t: torch.Tensor) -> torch.Tensor:
        """x_proj's output (b, r + 2n, L) from this device's d_inner channels -> the sum over all channels."""
        return t


class Mamba(nn.Module):
    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: float = 2, dt_rank="auto",
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random", dt_scale: float = 1.0,
                 dt_init_floor: float = 1e-4, conv_bias: bool = True, bias: bool = False,
                 bcdt_rms_norm: bool = False, bcdt_rms_eps: float = 1e-6, layer_idx: int | None = None,
                 device=None, dtype=None, *, recompute=(), use_fused_path: bool = True,
                 scan_checkpoint_dtype: torch.dtype | None = None):
        super().__init__()
        if dt_init not in ("random", "constant"):
            raise ValueError(f"Mamba: dt_init must be 'random' or 'constant', got {dt_init!r}")
        fk = dict(device=device, dtype=dtype)
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.dt_min, self.dt_max, self.dt_init, self.dt_scale = dt_min, dt_max, dt_init, dt_scale
        self.dt_init_floor = dt_init_floor
        # Falcon-Mamba's weightless RMS norms on dt_low, B and C (None: off)
        self.bcdt_rms_eps = float(bcdt_rms_eps) if bcdt_rms_norm else None
        self.layer_idx = layer_idx
        self.recompute = recompute_set(recompute)  # conv, dt, gate, states: rebuilt in the backward, not kept
        # training on the Triton path: the middle as one autograd node (``_Mamba1Inner`` below); False: the
        # reference forward, op by op (e.g. to compare, or to run the sub-modules' forward hooks)
        self.use_fused_path = bool(use_fused_path)
        # the selective scan's per-chunk state checkpoints: fp32 or bf16; None: the op's default (bf16 under bf16
        # inputs: ops.selective_scan's checkpoint_dtype)
        if scan_checkpoint_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"Mamba: scan_checkpoint_dtype must be torch.float32, torch.bfloat16 or None, got "
                             f"{scan_checkpoint_dtype!r}")
        self.scan_checkpoint_dtype = scan_checkpoint_dtype
        self.seq_ops = Mamba1Ops()  # conv, scan, channel_sum: what context / tensor parallelism replace

        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias, **fk)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1,
                                bias=conv_bias, **fk)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **fk)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **fk)
        self.A_log = nn.Parameter(torch.empty(self.d_inner, d_state, **fk))
        self.D = nn.Parameter(torch.empty(self.d_inner, **fk))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **fk)
        if not init.is_meta(device):
            self.reset_parameters()
        init.mark_no_weight_decay(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper's init: A = -[1..N] per channel (S4D-real), D = 1, softplus(dt bias) log-uniform in
        [dt_min, dt_max], dt_proj weight ±dt_rank^-0.5·dt_scale; projections and conv as PyTorch's default.
        The model's ``init_weights`` then re-scales out_proj (see models/lm.py)."""
        init.linear_zero_bias_(self.in_proj)
        init.linear_default_(self.conv1d.weight, self.conv1d.bias)
        init.linear_default_(self.x_proj.weight)
        std = self.dt_rank ** -0.5 * self.dt_scale
        if self.dt_init == "constant":
            init.constant_(self.dt_proj.weight, std)
        else:
            init.uniform_(self.dt_proj.weight, -std, std)
        init.dt_bias_(self.dt_proj.bias, self.dt_min, self.dt_max, self.dt_init_floor)
        n = self.A_log.shape[1]
        A = torch.arange(1, n + 1, dtype=torch.float32, device=self.A_log.device).expand(self.A_log.shape[0], n)
        init.assign_(self.A_log, torch.log(A))
        init.constant_(self.D, 1.0)
        init.linear_zero_bias_(self.out_proj)
        init.mark_no_weight_decay(self)

    def _x_proj_token_major(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, d_inner, L) -> x_proj(x) as (b, r + 2n, L), applied token-major (no copy of x, which the scan also
        keeps for backward), summed over the ranks holding the other channels (``seq_ops.channel_sum``)."""
        return self.seq_ops.channel_sum(_token_major_linear(self.x_proj.weight, x, self.x_proj.bias))

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor | None, inference_params=None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                in_proj_out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (b, L, d_model) -> (b, L, d_model). ``in_proj_out``: in_proj(hidden_states) computed by the
        caller instead (the block's norm + in_proj node, a training forward without a cache; hidden_states None).

        seq_idx (b, L) int32 resets conv and scan state where it changes (packed sequences); ``cu_seqlens``
        (nseq + 1,) with b == 1 is turned into seq_idx when that is missing. With ``inference_params``
        the conv / SSM states of this layer are read (when ``seqlen_offset > 0``) and written back.
        """
        if in_proj_out is not None and inference_params is not None:
            raise ValueError("Mamba: in_proj_out is for a training forward; with inference_params pass hidden_states")
        b, L = (hidden_states if in_proj_out is None else in_proj_out).shape[:2]
        seq_idx = resolve_seq_idx(seq_idx, cu_seqlens, L)
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = inference_params.states(self.layer_idx)
            if inference_params.seqlen_offset > 0 and L == 1:
                return self.step(hidden_states, conv_state, ssm_state)
        d_inner, n, r = self.d_inner, self.d_state, self.dt_rank
        xz = self.in_proj(hidden_states) if in_proj_out is None else in_proj_out
        if xz.shape[-1] != 2 * d_inner:
            raise ValueError(f"Mamba: in_proj gives {xz.shape[-1]} features, expected 2 * d_inner = {2 * d_inner}")
        if conv_state is not None and self.use_fused_path and self.seq_ops.local and prefill_ok(xz):
            resume = inference_params.seqlen_offset > 0  # chunked prefill continues from the cached states
            return _prefill(self, xz, seq_idx, conv_state[:b], ssm_state[:b], resume)
        if conv_state is None and self.use_fused_path and self.seq_ops.local and fused_ok(xz):
            plan = recompute_plan(self)
            every = self._scan_checkpoint_every()
            ckpt_dtype = self.scan_checkpoint_dtype
            if ckpt_dtype is None:
                ckpt_dtype = _kernels()[1].default_checkpoint_dtype(xz, every)
            if fusable_linear(self.out_proj):  # out_proj in the node: its input is not kept ("gate": nothing left)
                return _fused_middle(self, xz, seq_idx, recompute_conv="conv" in plan, out_proj=self.out_proj,
                                     checkpoint_every=every, checkpoint_dtype=ckpt_dtype)
            if plan <= _FUSED_RECOMPUTE:  # one autograd node (below); it always rebuilds dt
                return self.out_proj(_fused_middle(self, xz, seq_idx, recompute_conv="conv" in plan,
                                                   checkpoint_every=every, checkpoint_dtype=ckpt_dtype))
        # channels-last (b, d_inner, L) views of xz, whose gradient the conv and the gate write in place
        x, z = (_channels_last(t) for t in split_with_grad_arena(xz, [d_inner, d_inner], dim=-1))

        conv_kwargs, scan_kwargs = {}, {}
        if conv_state is not None:
            resume = inference_params.seqlen_offset > 0  # chunked prefill continues from the cached states
            conv_kwargs = dict(initial_state=conv_state[:b] if resume else None, return_final_state=True)
            scan_kwargs = dict(initial_state=ssm_state[:b] if resume else None, return_last_state=True)
        elif type(self.seq_ops).scan is Mamba1Ops.scan:
            # (context parallelism's own scan takes neither: one checkpoint per chunk, in the op's default dtype)
            scan_kwargs = dict(checkpoint_every=self._scan_checkpoint_every(),
                               checkpoint_dtype=self.scan_checkpoint_dtype)
        conv_in = x
        x = self._conv(x, seq_idx, **conv_kwargs)  # reads the strided view; may keep its layout
        if conv_state is not None:
            x, final_conv = x
            conv_state[:b].copy_(final_conv)
        x = ops.token_major(x)  # unit token stride for x_proj and the scan, which stream along L
        # recompute (training or a plain forward: no inference states to fill): what the backward rebuilds
        # instead of keeping; empty: no context at all
        plan = recompute_plan(self, self.seq_ops.local_conv) if conv_state is None else NOTHING
        rebuilt = None
        if "conv" in plan:
            conv_in = conv_in.detach()  # a view of in_proj's output, which the conv keeps for its backward anyway
            rebuilt = RecomputeInBackward()
            rebuilt.add(x, lambda: ops.token_major(self._conv(conv_in, seq_idx)))
        x_dbl = run_saving(rebuilt, self._x_proj_token_major, x)  # (b, r + 2n, L); x_proj keeps x
        if self.bcdt_rms_eps is not None:
            x_dbl = bcdt_rms_norm(x_dbl, r, n, self.bcdt_rms_eps, dim=1)
        dt_low, B, C = x_dbl.split([r, n, n], dim=1)
        dt = _token_major_linear(self.dt_proj.weight, dt_low)  # (b, d_inner, L); bias added in the scan
        if "dt" in plan:
            w, low = self.dt_proj.weight.detach(), dt_low.detach()  # x_dbl is kept for the backward anyway
            if rebuilt is None:
                rebuilt = RecomputeInBackward()
            rebuilt.add(dt, lambda: _token_major_linear(w, low))
        A = derived(self, "A_log", neg_exp_fp32)
        # the scan keeps x and dt for the backward
        y = run_saving(rebuilt, self.seq_ops.scan, x, dt, A, B, C, D=derived(self, "D", fp32),
                       delta_bias=derived(self.dt_proj, "bias", fp32), delta_softplus=True, seq_idx=seq_idx,
                       **scan_kwargs)
        if ssm_state is not None:
            y, last_state = y
            ssm_state[:b].copy_(last_state)
        # the gate outside the scan: it reads z in place and writes out_proj's input (b, L, d_inner)
        gated = ops.silu_gate(y, z)
        if "gate" not in plan:
            return self.out_proj(gated)
        y_in, z_in = y.detach(), z.detach()  # the gate keeps both for its backward anyway
        rebuilt = RecomputeInBackward()
        rebuilt.add(gated, lambda: ops.silu_gate(y_in, z_in))
        with rebuilt:  # out_proj keeps its input for the weight gradient
            return self.out_proj(gated)

    def _scan_checkpoint_every(self) -> int:
        """Chunks of the selective scan per kept state checkpoint: SCAN_CHECKPOINT_EVERY with recompute "states"
        (a scan argument: compiled too), else 1."""
        if "states" not in self.recompute:
            return 1
        if self.scan_checkpoint_dtype == torch.bfloat16:
            raise ValueError("Mamba: recompute 'states' keeps one fp32 scan checkpoint per "
                             f"{SCAN_CHECKPOINT_EVERY} chunks; scan_checkpoint_dtype=torch.bfloat16 needs one per "
                             "chunk: drop one of the two")
        return SCAN_CHECKPOINT_EVERY

    def _conv(self, x: torch.Tensor, seq_idx: torch.Tensor | None, **state_kwargs):
        """x (b, d_inner, L) any strides -> silu(causal depthwise conv(x)) (b, d_inner, L), any layout."""
        return self.seq_ops.conv(x, self.conv1d.weight[:, 0, :], self.conv1d.bias, activation="silu",
                                 seq_idx=seq_idx, **state_kwargs)

    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
        """One decode token: hidden_states (b, 1, d_model) -> (b, 1, d_model); states updated in place."""
        b = hidden_states.shape[0]
        d_inner, n, r = self.d_inner, self.d_state, self.dt_rank
        x, z = self.in_proj(hidden_states[:, 0]).split([d_inner, d_inner], dim=-1)  # (b, d_inner)
        x = ops.causal_conv1d_update(x, conv_state[:b], self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                     activation="silu")
        x_dbl = self.seq_ops.channel_sum(self.x_proj(x))
        if self.bcdt_rms_eps is not None:
            x_dbl = bcdt_rms_norm(x_dbl, r, n, self.bcdt_rms_eps, dim=-1)
        dt, B, C = x_dbl.split([r, n, n], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)
        A = derived(self, "A_log", neg_exp_fp32)
        # D and the dt bias go in their own dtype: the step computes in fp32 either way (no per-token casts)
        y = ops.selective_state_update(ssm_state[:b], x, dt, A, B, C, D=self.D, z=z, dt_bias=self.dt_proj.bias,
                                       dt_softplus=True)
        return self.out_proj(y)[:, None]

    def fused_step_ok(self) -> bool:
        """Whether ``fused_step`` computes what ``step`` does for this layer: plain single-device projections and
        conv (not sharded by tensor parallelism, no hooks)."""
        return (self.seq_ops.local
                and all(fusable_linear(m) for m in (self.in_proj, self.x_proj, self.dt_proj, self.out_proj))
                and self.x_proj.bias is None and type(self.conv1d) is nn.Conv1d and no_hooks(self.conv1d))

    def fused_step(self, residual: torch.Tensor, pre_norm: nn.Module, conv_state: torch.Tensor,
                   ssm_state: torch.Tensor) -> None:
        """One decode token of this block in four kernels (ops.decode_step): residual (b, d_model) fp32, the
        block's input, gets the block's output added in place; ``pre_norm`` is the block's RMSNorm. The same step
        as ``step`` behind the block's add + norm (where ``fused_step_ok``)."""
        b = residual.shape[0]
        xz = ops.decode_step.norm_in_proj_conv(residual, pre_norm.weight, pre_norm.eps, self.in_proj.weight,
                                               self.in_proj.bias, self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                               conv_state[:b], 0)
        x, z = xz.split([self.d_inner, self.d_inner], dim=-1)
        y = ops.decode_step.mamba1_x_proj_state_update(ssm_state[:b], x, z, self.x_proj.weight, self.dt_proj.weight,
                                                       self.dt_proj.bias, derived(self, "A_log", neg_exp_fp32),
                                                       self.D, self.bcdt_rms_eps)
        ops.decode_step.gated_out_proj_residual(y, None, 0.0, self.out_proj.weight, self.out_proj.bias, residual)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, device=None,
                                 state_dtype=None):
        """-> (conv_state (batch, d_inner, d_conv - 1) in ``dtype``, ssm_state (batch, d_inner, d_state) in
        ``state_dtype``, fp32 by default)."""
        w = self.conv1d.weight
        device = device or w.device
        conv_state = torch.zeros(batch_size, self.d_inner, w.shape[-1] - 1, device=device, dtype=dtype or w.dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device,
                                dtype=state_dtype or torch.float32)
        return conv_state, ssm_state


# ---- the fused training path --------------------------------------------------------------------------------------
# One autograd.Function runs the reference's kernels with a hand-written backward:
# - forward: the conv writes its output token-major directly (no layout copy), B and C become fp32 in one copy
#   (kept for the backward: the scan would otherwise convert them again there), A = -exp(A_log) is built
#   state-major once (the kernels' layout); delta (d_inner values per token) is not kept: the backward runs its
#   small matmul again, and with recompute "conv" the conv too; with "states" the scan keeps one checkpoint per
#   SCAN_CHECKPOINT_EVERY chunks; y * silu(z) (out_proj's input) comes from the scan itself on one row per
#   channel, from a gate kernel after it on two (launch.GATED_FORWARD_PATHS), and y is not kept: the scan's
#   backward rebuilds it from the states it recomputes anyway and runs the gate's backward itself;
# - out_proj (optional): its input, the gate's output, lives only inside the forward; the backward forms its input
#   gradient first (d_gated = dout @ W), the scan's backward also writes the gate's output again, and out_proj's
#   weight gradient follows (dout^T @ gated: nn.Linear's GEMMs); its weight is kept as given (an fp32 parameter is
#   cast again in the backward, as the forward casts it);
# - backward: one buffer receives x_proj's output gradient (ddt_low from the dt matmul, dB / dC straight from the
#   scan's finishing kernel), x's two gradients meet in one matmul (du + W^T dx_dbl, accumulated in place into
#   the channels-last du the scan wrote, the layout the conv's backward reads beside x), the
#   scan's finishing kernel returns d(A_log) directly, and the conv writes dx into the x half of in_proj's output
#   gradient, whose z half the scan's backward fills.
# Same numerics as the reference on the Triton path: the same kernels in the same dtypes (weights cast to the
# activations' dtype, as autocast does; the weight gradients of the two token-major matmuls are summed over the
# batch in fp32 instead of in the activation dtype; the gate multiplies the scan's fp32 y, where the reference
# gates y rounded to the activations' dtype). The node reads the sub-modules' weights directly: their
# forward hooks do not run.

# recompute items the node without out_proj handles (dt always); "gate" there: the reference forward
_FUSED_RECOMPUTE = frozenset({"conv", "dt", "states"})
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kernels_apply(xz: torch.Tensor, op: str) -> bool:
    """Nothing compiling, no dispatch mode watching ops (op logs, FLOP counters), a plain tensor of the kernels'
    dtypes, the Triton path."""
    if torch.compiler.is_compiling() or _len_torch_dispatch_stack() > 0 or type(xz) is not torch.Tensor:
        return False
    return xz.dtype in _KERNEL_DTYPES and triton_available() and use_triton(xz, op=op)


def fused_ok(xz: torch.Tensor) -> bool:
    """Whether the fused node may run now for in_proj's output ``xz``: training with autograd on the kernels."""
    return torch.is_grad_enabled() and xz.requires_grad and _kernels_apply(xz, "Mamba fused path")


def prefill_ok(xz: torch.Tensor) -> bool:
    """Whether a prefill into the inference cache may run as ``_prefill``: no autograd, on the kernels."""
    return not (torch.is_grad_enabled() and xz.requires_grad) and _kernels_apply(xz, "Mamba prefill")


@functools.cache
def _kernels():
    """The Triton modules (imported on first use: only where Triton runs)."""
    return tuple(importlib.import_module(f"mamba_parallel.ops.{m}.triton_impl")
                 for m in ("conv1d", "selective_scan", "layout"))


def _xz_views(xz: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj's output (b, L, 2d) -> x, z as channels-last (b, d, L) views."""
    return xz[..., :d].transpose(1, 2), xz[..., d:].transpose(1, 2)


def _delta(wdt: torch.Tensor, x_dbl: torch.Tensor, r: int) -> torch.Tensor:
    """dt_proj's output (b, d, L) from x_proj's (b, r + 2n, L); its bias is added in fp32 inside the scan."""
    return torch.bmm(_expand(wdt, x_dbl.shape[0]), x_dbl[:, :r])


def _conv_token_major(conv, x, w2, conv_b, seq_idx, initial_state=None):
    """silu(conv(x)) written token-major (x_proj and the scan stream along L): no layout copy."""
    xc = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    return conv.conv1d_into(xc, x, w2, conv_b, initial_state, seq_idx, True)


def _project(xc: torch.Tensor, wx: torch.Tensor, wdt: torch.Tensor, r: int, n: int, bcdt_eps: float | None):
    """The conv's token-major output xc (b, d, L) -> x_proj's output x_dbl (b, r + 2n, L) (normed with
    ``bcdt_eps``: Falcon-Mamba), the norms' rstd (b, 3, L) or None, dt (b, d, L), B and C (b, 1, n, L) fp32."""
    x_dbl = torch.bmm(_expand(wx, xc.shape[0]), xc)
    rstd = None
    if bcdt_eps is not None:
        x_dbl, rstd = _bcdt_norm_fwd(x_dbl, r, n, bcdt_eps)
    dt = _delta(wdt, x_dbl, r)
    bc = x_dbl[:, r:].float()  # (b, 2n, L) fp32 once, for both passes
    return x_dbl, rstd, dt, bc[:, :n].unsqueeze(1), bc[:, n:].unsqueeze(1)


class _Mamba1Inner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xz, conv_w, conv_b, xproj_w, dt_w, dt_b, A_log, D, out_w, out_b, seq_idx, d_inner: int, r: int,
                n: int, recompute_conv: bool, bcdt_eps: float | None, out_dtype: torch.dtype | None,
                checkpoint_every: int, checkpoint_dtype: torch.dtype):
        conv, scan, layout = _kernels()
        b = xz.shape[0]
        d, cdt = d_inner, xz.dtype
        x, z = _xz_views(xz, d)
        xc = _conv_token_major(conv, x, conv_w[:, 0, :], conv_b, seq_idx)
        wx, wdt = xproj_w.to(cdt), dt_w.to(cdt)  # what autocast would cast (no-op without it)
        # with Falcon-Mamba's norms the node keeps the normed x_dbl and their rstd
        x_dbl, rstd, dt, B4, C4 = _project(xc, wx, wdt, r, n, bcdt_eps)
        # (d, n) view of a state-major (n, d) tensor: the kernels' layout, so the scan makes no transposed copy
        A = torch.exp(A_log.t(), out=A_log.new_empty(A_log.shape[::-1], dtype=torch.float32)).neg_().t()
        D32, dtb32 = D.float(), dt_b.float()
        sid = seq_idx.to(torch.int32) if seq_idx is not None else None
        path = scan.scan_path(xc, dt, None, A, B4)
        # y * silu(z) as out_proj's (b, L, d) input; y itself is not kept (the backward rebuilds it from the
        # checkpoints). One row per channel: the scan writes it; two rows: a gate kernel after the scan is faster
        if scan_launch.gates_in_forward(path):
            out = xz.new_empty((b, xz.shape[1], d))
            ckpt = scan.gated_forward(xc, dt, A, B4, C4, D32, z, dtb32, sid, path, out.transpose(1, 2),
                                      checkpoint_every=checkpoint_every, checkpoint_dtype=checkpoint_dtype)
        else:
            y, _, ckpt = scan.scan_forward(xc, dt, A, B4, C4, D32, None, dtb32, None, sid, True, False, b, True,
                                           path, checkpoint_every=checkpoint_every,
                                           checkpoint_dtype=checkpoint_dtype)
            out = layout._gate_fwd(y, z)
            del y
        if out_w is not None:  # out_proj as nn.Linear computes it (out_dtype: autocast's); its input is not kept
            out = linear_in(out, out_w, out_b, out_dtype)
        # dt is rebuilt in the backward (one small matmul), xc too with recompute_conv (one conv), y and the gate's
        # output inside the scan's backward
        ctx.save_for_backward(xz, conv_w, conv_b, wx, wdt, None if recompute_conv else xc, x_dbl, B4, C4, A, D32,
                              dtb32, sid, ckpt, seq_idx, rstd, out_w)
        ctx.meta = (d, r, n, path, D.dtype, dt_b.dtype, A_log.dtype, out_dtype,
                    out_b.dtype if out_b is not None else None, checkpoint_every)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        conv, scan, layout = _kernels()
        xz, conv_w, conv_b, wx, wdt, xc, x_dbl, B4, C4, A, D32, dtb32, sid, ckpt, seq_idx, rstd, out_w = \
            ctx.saved_tensors
        d, r, n, path, d_dtype, dtb_dtype, alog_dtype, out_dtype, outb_dtype, checkpoint_every = ctx.meta
        need = ctx.needs_input_grad
        b = xz.shape[0]
        x, z = _xz_views(xz, d)
        dxz = torch.empty_like(xz)  # in_proj's output gradient: the scan fills the z half, the conv the x half
        dout_w = dout_b = gated = None
        if out_w is None:
            dgated = dout
        else:  # through out_proj first; the scan's backward writes its input again for the weight gradient
            dres = dout.reshape(-1, dout.shape[-1])
            dgated = dres.mm(out_w.to(out_dtype)).to(xz.dtype).view(b, -1, d)
            gated = torch.empty_like(dgated) if need[8] else None
            if need[9]:
                dout_b = dres.sum(0).to(outb_dtype)
        if xc is None:
            xc = _conv_token_major(conv, x, conv_w[:, 0, :], conv_b, seq_idx)
        dt = _delta(wdt, x_dbl, r)  # the forward's values (the same matmul)
        dx_dbl = torch.empty_like(x_dbl)  # x_proj's output gradient: [ddt_low | dB | dC]
        # y's gradient dgated * silu(z) token-major, as the scan streams it; the rest of the gate inside the
        # scan's backward, from the y it rebuilds: dz into in_proj's output gradient, y * silu(z) into gated
        dgated = dgated.transpose(1, 2)
        dy = layout._gate_into(dgated, z, xz.new_empty(z.shape))
        # x's gradient channels-last (b, L, d), as the conv's backward reads it beside x, in rows of channels
        dxc = xz.new_empty((b, xz.shape[1], d))
        _, ddt, dA_log, _, _, dD, _, ddtb, _ = scan.scan_backward(
            xc, dt, A, B4, C4, D32, z, dtb32, None, sid, ckpt, dy, None, True, False, path,
            dB_out=dx_dbl[:, r:r + n].unsqueeze(1), dC_out=dx_dbl[:, r + n:].unsqueeze(1), dA_scale=A,
            checkpoint_every=checkpoint_every, dz_out=dxz[..., d:].transpose(1, 2),
            gated_out=gated.transpose(1, 2) if gated is not None else None, dgated=dgated,
            du_out=dxc.transpose(1, 2))
        del dy, dgated, dt  # activation-sized: free them before the next ones are made (the largest models' peak)
        if gated is not None:
            dout_w = dres.t().mm(gated.view(-1, d).to(out_dtype)).to(out_w.dtype)
        del gated
        torch.bmm(_expand(wdt.t(), b), ddt, out=dx_dbl[:, :r])
        dwdt = torch.bmm(ddt, x_dbl[:, :r].transpose(1, 2)).sum(0, dtype=torch.float32)  # (d, r)
        if rstd is not None:  # through the norms: the gradient of x_proj's raw output
            _bcdt_norm_bwd(dx_dbl, x_dbl, rstd, r, n)
        dwx = torch.bmm(dx_dbl, xc.transpose(1, 2)).sum(0, dtype=torch.float32)  # (r + 2n, d)
        del ddt
        dxc.baddbmm_(dx_dbl.transpose(1, 2), _expand(wx, b))  # x's two gradients: the scan's and x_proj's
        _, dw2, dcb, _ = conv.conv1d_backward(x, conv_w[:, 0, :], conv_b, None, seq_idx, dxc.transpose(1, 2), None,
                                              True, dxz[..., :d].transpose(1, 2))
        grads = (dxz, dw2.view_as(conv_w), dcb if conv_b is not None else None, dwx, dwdt, ddtb.to(dtb_dtype),
                 dA_log.to(alog_dtype), dD.to(d_dtype), dout_w, dout_b)
        return (*(g if need[i] else None for i, g in enumerate(grads)), None, None, None, None, None, None, None,
                None, None)


def _fused_middle(layer: Mamba, xz: torch.Tensor, seq_idx: torch.Tensor | None, recompute_conv: bool = False,
                  out_proj: nn.Linear | None = None, checkpoint_every: int = 1,
                  checkpoint_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """xz (b, L, 2 d_inner) in_proj's output -> y * silu(z) (b, L, d_inner) contiguous (out_proj's input), the
    middle of ``layer`` as one autograd node; with ``out_proj`` (a plain nn.Linear) -> out_proj(y * silu(z))
    (b, L, d_model), out_proj in the node too. ``recompute_conv``: rebuild the conv output in the backward instead
    of keeping it. ``checkpoint_every``, ``checkpoint_dtype``: the scan's chunks per kept state checkpoint and
    their dtype. Call only where ``fused_ok`` allows and ``layer.seq_ops`` are local."""
    conv1d, dt_proj = layer.conv1d, layer.dt_proj
    out_w = out_b = out_dtype = None
    if out_proj is not None:
        out_w, out_b = out_proj.weight, out_proj.bias
        out_dtype = linear_dtype(xz, out_w)  # the gate's output has xz's dtype
    return _Mamba1Inner.apply(xz, conv1d.weight, conv1d.bias, layer.x_proj.weight, dt_proj.weight, dt_proj.bias,
                              layer.A_log, layer.D, out_w, out_b, seq_idx, layer.d_inner, layer.dt_rank,
                              layer.d_state, recompute_conv, layer.bcdt_rms_eps, out_dtype, checkpoint_every,
                              checkpoint_dtype)


@torch.no_grad()
def _prefill(layer: Mamba, xz: torch.Tensor, seq_idx: torch.Tensor | None, conv_state: torch.Tensor,
             ssm_state: torch.Tensor, resume: bool) -> torch.Tensor:
    """A prompt's pass through ``layer`` into the inference cache: the fused node's forward without autograd or
    anything kept, reading (``resume``: chunked prefill) and writing conv_state (b, d_inner, d_conv - 1) and
    ssm_state (b, d_inner, d_state) in place; xz (b, L, 2 d_inner) -> (b, L, d_model). The same kernels and
    dtypes as the op-by-op forward with less host work between them: a batch-1 prefill is bound by the host
    (mamba-2.8b, 256 tokens, H100: ~8 ms of kernels in ~60 ms; 58.6 -> 47.4 ms through this path)."""
    conv, scan, _ = _kernels()
    d, r, n, cdt = layer.d_inner, layer.dt_rank, layer.d_state, xz.dtype
    x, z = _xz_views(xz, d)
    conv1d = layer.conv1d
    conv_init = conv_state if resume else None
    xc = _conv_token_major(conv, x, conv1d.weight[:, 0, :], conv1d.bias, seq_idx, conv_init)
    conv_final_state(x, conv_init, seq_idx, conv1d.weight.shape[-1], out=conv_state)  # after the conv read it
    _, _, dt, B4, C4 = _project(xc, layer.x_proj.weight.to(cdt), layer.dt_proj.weight.to(cdt), r, n,
                                layer.bcdt_rms_eps)
    # the constants the decode steps that follow use too, cached per parameter version
    A = derived(layer, "A_log", neg_exp_fp32_state_major)
    D, dtb = derived(layer, "D", fp32), derived(layer.dt_proj, "bias", fp32)
    sid = seq_idx.to(torch.int32) if seq_idx is not None else None
    gated = xz.new_empty((xz.shape[0], xz.shape[1], d))  # y * silu(z) from the scan: out_proj's input
    scan.scan_into(scan.forward_launch(xc, dt, A, B4), xc, dt, A, B4, C4, D, dtb, ssm_state if resume else None, sid,
                   ssm_state, z=z, y_out=gated.transpose(1, 2))
    return layer.out_proj(gated)
