"""``Mamba2``: the Mamba-2 SSD mixer (Dao & Gu 2024), single device, mamba_ssm's parameter names.

Data flow for hidden (b, L, d_model):
  in_proj -> [z | xBC | dt] with xBC = [x (d_inner) | B (g·n) | C (g·n)], dt (nheads);
  xBC -> causal depthwise conv + silu; y = SSD scan(x as (h, p) heads, dt, A = -exp(A_log), B, C, D) with
  dt = clamp(softplus(dt + dt_bias), dt_limit); y = norm(y, z) (gated RMSNorm, group size d_inner / ngroups)
  -> out_proj -> (b, L, d_model).
Local sizes come from the attributes ``d_inner, nheads, headdim, ngroups, d_state`` (tensor parallelism rewrites
them); the conv and the scan go through ``seq_ops`` (the parallel seam, layers/seq_ops.py); packed sequences are
handled through ``seq_idx`` / ``cu_seqlens`` in both the conv and the scan.
Both splits (zxbcdt -> z / xBC / dt, conv output -> x / B / C) go through ``ops.grad_arena``: the conv, scan
and norm kernels write their input gradients into one buffer per split, so the backward concatenates nothing.
Training on the Triton path, the gated norm and out_proj run as one node (``ops.gated_rms_norm_linear``,
layers/out_proj.py): out_proj's input is not kept, the norm's backward kernel writes it again for out_proj's weight
gradient, as mamba_ssm's fused path does.
``recompute`` (a subset of conv, gate, states; layers/recompute.py, docs/memory.md) rebuilds the conv output
(from in_proj's output, kept anyway), out_proj's input where that node does not apply (from the norm's inputs,
kept anyway) and the SSD chunk states in the backward instead of keeping them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mamba_parallel import ops
from mamba_parallel.layers import init
from mamba_parallel.layers.decode_constants import derived, fp32, neg_exp_fp32
from mamba_parallel.layers.packing import resolve_seq_idx
from mamba_parallel.layers.norm import RMSNormGated
from mamba_parallel.layers.out_proj import fusable_linear, no_hooks
from mamba_parallel.layers.recompute import NOTHING, RecomputeInBackward, recompute_plan, recompute_set, run_saving
from mamba_parallel.layers.seq_ops import SequenceOps
from mamba_parallel.ops.backend import triton_available, use_triton
from mamba_parallel.ops.conv1d.naive import final_state as conv_final_state
from mamba_parallel.ops.grad_arena import split_with_grad_arena, tag_view


def _tagged(piece: torch.Tensor, view):
    """view(piece), carrying piece's gradient-arena slot through the same view (ops/grad_arena.py)."""
    return tag_view(view(piece), piece, view)


class Mamba2Ops(SequenceOps):
    """Mamba2's single-device sequence ops (the parallel seam, layers/seq_ops.py): the conv and the SSD scan."""

    def scan(self, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), initial_states=None, seq_idx=None, cu_seqlens=None,
             return_final_states=False, recompute_states=False, final_states_out=None):
        """``ops.ssd_chunk_scan``: x (b, L, h, p), dt (b, L, h), A (h,), B / C (b, L, g, n) -> y (b, L, h, p)
        [, final_states (b, h, p, n) fp32]; ``final_states_out``: where the final states are written (the
        single-device scan's own argument: the layer passes it only where ``local``)."""
        return ops.ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                  dt_limit=dt_limit, initial_states=initial_states, seq_idx=seq_idx,
                                  cu_seqlens=cu_seqlens, return_final_states=return_final_states,
                                  recompute_states=recompute_states, final_states_out=final_states_out)


class Mamba2(nn.Module):
    def __init__(self, d_model: int, d_state: int = 128, d_conv: int = 4, expand: float = 2, headdim: int = 64,
                 ngroups: int = 1, chunk_size: int = 256, A_init_range=(1, 16), dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4, dt_limit=(0.0, float("inf")),
                 conv_bias: bool = True, bias: bool = False, rmsnorm: bool = True, norm_before_gate: bool = False,
                 D_has_hdim: bool = False, layer_idx: int | None = None, device=None, dtype=None, *,
                 recompute=()):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = int(expand * d_model)
        if self.d_inner % headdim:
            raise ValueError(f"Mamba2: d_inner = {self.d_inner} is not divisible by headdim = {headdim}")
        self.headdim = headdim
        self.nheads = self.d_inner // headdim
        if self.nheads % ngroups:
            raise ValueError(f"Mamba2: nheads = {self.nheads} is not divisible by ngroups = {ngroups}")
        self.ngroups = ngroups
        self.chunk_size = chunk_size
        self.A_init_range = tuple(A_init_range)
        self.dt_min, self.dt_max, self.dt_init_floor = dt_min, dt_max, dt_init_floor
        self.dt_limit = tuple(float(v) for v in dt_limit)
        self.rmsnorm, self.D_has_hdim = rmsnorm, D_has_hdim
        self.layer_idx = layer_idx
        self.recompute = recompute_set(recompute)  # conv, gate, states: rebuilt in the backward, not kept
        self.seq_ops = Mamba2Ops()  # conv and scan: what context parallelism replaces

        conv_dim = self.d_inner + 2 * ngroups * d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * ngroups * d_state + self.nheads, bias=bias, **fk)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=conv_bias,
                                **fk)
        self.dt_bias = nn.Parameter(torch.empty(self.nheads, **fk))
        self.A_log = nn.Parameter(torch.empty(self.nheads, **fk))
        self.D = nn.Parameter(torch.empty(self.d_inner if D_has_hdim else self.nheads, **fk))
        if rmsnorm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, group_size=self.d_inner // ngroups,
                                     norm_before_gate=norm_before_gate, **fk)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **fk)
        if not init.is_meta(device):
            self.reset_parameters()
        init.mark_no_weight_decay(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper's init: A = -U(A_init_range) per head, D = 1, softplus(dt_bias) log-uniform in
        [dt_min, dt_max]; projections and conv as PyTorch's default, norm weight 1. The model's ``init_weights``
        then re-scales out_proj (see models/lm.py)."""
        init.linear_zero_bias_(self.in_proj)
        init.linear_default_(self.conv1d.weight, self.conv1d.bias)
        init.dt_bias_(self.dt_bias, self.dt_min, self.dt_max, self.dt_init_floor)
        lo, hi = self.A_init_range
        A = torch.empty(self.A_log.shape, device=self.A_log.device).uniform_(lo, hi)
        init.assign_(self.A_log, torch.log(A))
        init.constant_(self.D, 1.0)
        if self.rmsnorm:
            self.norm.reset_parameters()
        init.linear_zero_bias_(self.out_proj)
        init.mark_no_weight_decay(self)

    # ---- forward ------------------------------------------------------------------------------------------------
    def _split_in_proj(self, zxbcdt: torch.Tensor):
        """(..., 2 d_inner + 2 g n + h) -> z (..., d_inner), xBC (..., d_inner + 2 g n), dt (..., h)."""
        d_inner, gn, h = self.d_inner, self.ngroups * self.d_state, self.nheads
        if zxbcdt.shape[-1] != 2 * d_inner + 2 * gn + h:
            raise ValueError(f"Mamba2: in_proj gives {zxbcdt.shape[-1]} features, expected 2 * d_inner + "
                             f"2 * ngroups * d_state + nheads = {2 * d_inner + 2 * gn + h} (d_inner={d_inner}, "
                             f"ngroups={self.ngroups}, d_state={self.d_state}, nheads={h})")
        # The ops consuming the pieces write their gradients into one buffer: no concatenation in the backward
        return split_with_grad_arena(zxbcdt, [d_inner, d_inner + 2 * gn, h], dim=-1)

    def _D(self) -> torch.Tensor:
        D = derived(self, "D", fp32)
        return D.view(self.nheads, self.headdim) if self.D_has_hdim else D

    def forward(self, hidden_states: torch.Tensor | None, inference_params=None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                in_proj_out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (b, L, d_model) -> (b, L, d_model). ``in_proj_out``: in_proj(hidden_states) computed by the
        caller instead (the block's norm + in_proj node, a training forward without a cache; hidden_states None).

        seq_idx (b, L) int32 / cu_seqlens (nseq + 1,) int32 (b == 1): packed sequences, no state crosses a
        boundary. With ``inference_params`` the conv / SSM states of this layer are read (when
        ``seqlen_offset > 0``) and written back.
        """
        if in_proj_out is not None and inference_params is not None:
            raise ValueError("Mamba2: in_proj_out is for a training forward; with inference_params pass hidden_states")
        b, L = (hidden_states if in_proj_out is None else in_proj_out).shape[:2]
        seq_idx = resolve_seq_idx(seq_idx, cu_seqlens, L)
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = inference_params.states(self.layer_idx)
            if inference_params.seqlen_offset > 0 and L == 1:
                return self.step(hidden_states, conv_state, ssm_state)
            if cu_seqlens is not None:
                raise ValueError("Mamba2: cu_seqlens (packed sequences) cannot fill an inference cache; prefill "
                                 "one sequence per batch row instead")
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        z, xBC, dt = self._split_in_proj(self.in_proj(hidden_states) if in_proj_out is None else in_proj_out)

        conv_kwargs, scan_kwargs = {}, {}
        into = False  # whether the conv's and the scan's final states go straight into the cache
        if conv_state is not None:
            resume = inference_params.seqlen_offset > 0  # chunked prefill continues from the cached states
            conv_init, ssm_init = (conv_state[:b], ssm_state[:b]) if resume else (None, None)
            # a prompt without autograd on the single-device ops: the scan writes its final states into the
            # cache (no fp32 buffer, no copy), the conv's is one copy of its input's tail (no buffer, no second
            # copy); other strategies (context parallel: the whole sequence's states) return them for a copy
            into = self.seq_ops.local and not (torch.is_grad_enabled() and xBC.requires_grad)
            conv_kwargs = dict(initial_state=conv_init, return_final_state=not into)
            scan_kwargs = dict(initial_states=ssm_init, return_final_states=not into)
            if into:
                scan_kwargs["final_states_out"] = ssm_state[:b]
        conv_in = _tagged(xBC, lambda t: t.transpose(1, 2))
        xBC = self._conv(conv_in, seq_idx, **conv_kwargs)
        if into:  # after the conv has read the state it continues from
            conv_final_state(conv_in, conv_init, seq_idx, self.d_conv, out=conv_state[:b])
        elif conv_state is not None:
            xBC, final_conv = xBC
            conv_state[:b].copy_(final_conv)
        # what the backward rebuilds instead of keeping (empty: no context at all)
        plan = recompute_plan(self, self.seq_ops.local_conv) if conv_state is None else NOTHING
        rebuilt = None
        if "conv" in plan:
            conv_in = conv_in.detach()  # views of in_proj's output, which the conv keeps for its backward anyway
            rebuilt = RecomputeInBackward()
            rebuilt.add(xBC, lambda: self._conv(conv_in, seq_idx))
        x, B, C = split_with_grad_arena(xBC.transpose(1, 2), [self.d_inner, g * n, g * n], dim=-1)

        A = derived(self, "A_log", neg_exp_fp32)
        heads, groups = (lambda t: t.unflatten(-1, (h, p))), (lambda t: t.unflatten(-1, (g, n)))
        # the scan keeps x, B, C (views of the conv output)
        # packed input may come with both seq_idx and cu_seqlens (the model derives one from the other): the op takes
        # one, cu_seqlens (b == 1) when given
        y = run_saving(rebuilt, self.seq_ops.scan, _tagged(x, heads), dt, A, _tagged(B, groups), _tagged(C, groups),
                       self.chunk_size, D=self._D(), z=None if self.rmsnorm else _tagged(z, heads),
                       dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit,
                       seq_idx=None if cu_seqlens is not None else seq_idx, cu_seqlens=cu_seqlens,
                       recompute_states="states" in self.recompute, **scan_kwargs)
        if ssm_state is not None and not into:
            y, final_ssm = y
            ssm_state[:b].copy_(final_ssm)
        y = y.flatten(-2)
        if not self.rmsnorm:
            return self.out_proj(y)
        if self._norm_out_proj_fused(y):  # one node: out_proj's input is not kept ("gate" has nothing to rebuild)
            norm, out_proj = self.norm, self.out_proj
            return ops.gated_rms_norm_linear(y, z, norm.weight, out_proj.weight, out_proj.bias, norm.eps,
                                             norm.group_size, norm.norm_before_gate)
        if "gate" not in plan:
            return self.out_proj(self.norm(y, z))
        y_in, z_in = y.detach(), z.detach()  # the norm keeps both for its backward anyway
        y = self.norm(y, z)
        rebuilt = RecomputeInBackward()
        rebuilt.add(y, lambda: self.norm(y_in, z_in))
        with rebuilt:  # out_proj keeps its input for the weight gradient
            return self.out_proj(y)

    def _norm_out_proj_fused(self, y: torch.Tensor) -> bool:
        """Whether the gated norm and out_proj run as one node: training (autograd on) on the Triton path, with the
        single-device norm and a plain out_proj (layers/out_proj.py); tensor parallelism replaces both."""
        return (torch.is_grad_enabled() and type(self.norm) is RMSNormGated and no_hooks(self.norm)
                and fusable_linear(self.out_proj) and triton_available()
                and use_triton(y, op="Mamba2 gated norm + out_proj"))

    def _conv(self, xBC: torch.Tensor, seq_idx: torch.Tensor | None, **state_kwargs):
        """xBC (b, conv_dim, L) -> silu(causal depthwise conv(xBC)) (b, conv_dim, L); no mixing across seq_idx."""
        return self.seq_ops.conv(xBC, self.conv1d.weight[:, 0, :], self.conv1d.bias, activation="silu",
                                 seq_idx=seq_idx, **state_kwargs)

    def step(self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
        """One decode token: hidden_states (b, 1, d_model) -> (b, 1, d_model); states updated in place."""
        b = hidden_states.shape[0]
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        z, xBC, dt = self._split_in_proj(self.in_proj(hidden_states[:, 0]))
        xBC = ops.causal_conv1d_update(xBC, conv_state[:b], self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                       activation="silu")
        x, B, C = xBC.split([self.d_inner, g * n, g * n], dim=-1)
        A = derived(self, "A_log", neg_exp_fp32)
        y = ops.ssd_state_update(ssm_state[:b], x.unflatten(-1, (h, p)), dt, A, B.unflatten(-1, (g, n)),
                                 C.unflatten(-1, (g, n)), D=self.D.view(h, p) if self.D_has_hdim else self.D,
                                 z=None if self.rmsnorm else z.unflatten(-1, (h, p)), dt_bias=self.dt_bias,
                                 dt_softplus=True, dt_limit=self.dt_limit)
        y = y.flatten(-2)
        if self.rmsnorm:
            y = self.norm(y, z)
        return self.out_proj(y)[:, None]

    def fused_step_ok(self) -> bool:
        """Whether ``fused_step`` computes what ``step`` does for this layer: the gated norm after the gate, plain
        single-device projections and conv (not sharded by tensor parallelism, no hooks)."""
        return (self.rmsnorm and not self.norm.norm_before_gate and self.seq_ops.local
                and fusable_linear(self.in_proj) and fusable_linear(self.out_proj)
                and type(self.conv1d) is nn.Conv1d and no_hooks(self.conv1d))

    def fused_step(self, residual: torch.Tensor, pre_norm: nn.Module, conv_state: torch.Tensor,
                   ssm_state: torch.Tensor) -> None:
        """One decode token of this block in three kernels (ops.decode_step): residual (b, d_model) fp32, the
        block's input, gets the block's output added in place; ``pre_norm`` is the block's RMSNorm. The same
        step as ``step`` behind the block's add + norm (the two norms folded into the projections next to
        them; where ``fused_step_ok``)."""
        b = residual.shape[0]
        h, p, g, n = self.nheads, self.headdim, self.ngroups, self.d_state
        zxbcdt = ops.decode_step.norm_in_proj_conv(residual, pre_norm.weight, pre_norm.eps, self.in_proj.weight,
                                                   self.in_proj.bias, self.conv1d.weight[:, 0, :], self.conv1d.bias,
                                                   conv_state[:b], self.d_inner)
        z, x, B, C, dt = zxbcdt.split([self.d_inner, self.d_inner, g * n, g * n, h], dim=-1)
        A = derived(self, "A_log", neg_exp_fp32)
        gw, sumsq = ops.decode_step.state_update_gate(
            ssm_state[:b], x.view(b, h, p), dt, A, B.view(b, g, n), C.view(b, g, n), self._D(), z.view(b, h, p),
            self.dt_bias, self.dt_limit, self.norm.weight, self.d_inner // self.norm.group_size)
        ops.decode_step.gated_out_proj_residual(gw, sumsq, self.norm.eps, self.out_proj.weight, self.out_proj.bias,
                                                residual)

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, device=None,
                                 state_dtype=None):
        """-> (conv_state (batch, conv_dim, d_conv - 1) in ``dtype``, ssm_state (batch, h, p, n) in ``state_dtype``,
        fp32 by default)."""
        w = self.conv1d.weight
        device = device or w.device
        conv_state = torch.zeros(batch_size, w.shape[0], w.shape[-1] - 1, device=device, dtype=dtype or w.dtype)
        ssm_state = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device,
                                dtype=state_dtype or torch.float32)
        return conv_state, ssm_state
