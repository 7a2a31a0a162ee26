"""``Mamba``: the Mamba-1 selective-SSM mixer (Gu & Dao 2023), single device, mamba_ssm's parameter names.

Data flow for hidden (b, L, d_model):
  in_proj -> [x | z] (b, L, 2 d_inner); x -> causal depthwise conv + silu -> x_proj -> [dt_low | B | C];
  dt = dt_proj.weight @ dt_low; y = selective_scan(x, softplus(dt + dt_proj.bias), A = -exp(A_log), B, C, D)
  -> y * silu(z) -> out_proj -> (b, L, d_model). As in mamba_ssm, the Δ bias is added in fp32 inside the scan
  (under bf16 autocast a bf16 linear output would round Δ before the softplus), so dt_proj's weight and bias are
  read directly.
Layouts (layers/mamba1_layout.py): x and z stay channels-last views of in_proj's output; the conv's output is
made token-major once for x_proj and the scan; the gate writes out_proj's (b, L, d_inner) input. In backward the
gate writes dz straight into in_proj's output gradient and the conv's dx is copied into its other half: nothing
is concatenated or transposed by torch. ``recompute`` (a subset of conv, dt, gate; layers/recompute.py,
docs/memory.md) rebuilds the conv output (its token-major copy), the scan's delta and out_proj's input in the
backward instead of keeping them. Training on the Triton path with ``use_fused_path`` (the default), nothing
replaced and no ``gate`` recompute runs the middle (conv .. gate) as one autograd node with the same kernels
(layers/mamba1_fused.py): fewer launches and less host work per layer.
Local sizes come from the attributes ``d_inner``, ``d_state``, ``dt_rank`` (tensor parallelism rewrites them); the
conv, the scan and x_proj's channel sum go through ``seq_ops`` (the parallel seam, layers/seq_ops.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mamba_parallel import ops
from mamba_parallel.layers import init
from mamba_parallel.layers.decode_constants import derived, neg_exp_fp32
from mamba_parallel.layers.mamba1_fused import FUSED_RECOMPUTE, fused_ok, mamba1_inner
from mamba_parallel.layers.mamba1_layout import gate_to_token_last, split_xz, token_major
from mamba_parallel.layers.packing import resolve_seq_idx
from mamba_parallel.layers.recompute import NOTHING, RecomputeInBackward, recompute_plan, recompute_set, run_saving
from mamba_parallel.layers.seq_ops import SequenceOps


def _token_major_linear(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """weight (out, in), x (b, in, L) any strides -> weight @ x (+ bias) as a contiguous (b, out, L).

    The token-major counterpart of F.linear: one batched matmul over a stride-0 expanded weight (no copy of the
    weight; autograd sums its gradient over b), so neither x nor the result needs a transposing copy.
    """
    y = torch.bmm(weight.unsqueeze(0).expand(x.shape[0], -1, -1), x)
    return y if bias is None else y + bias.to(y.dtype)[:, None]  # in the product's dtype, as F.linear under autocast


class Mamba1Ops(SequenceOps):
    """Mamba's single-device sequence ops (the parallel seam, layers/seq_ops.py): the conv, the selective scan,
    and the sum of x_proj's output over channel shards (the identity here)."""

    def scan(self, u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None,
             return_last_state=False, seq_idx=None):
        """``ops.selective_scan``: u / delta / z (b, d, L), A (d, n), B / C (b, n, L) -> y (b, d, L)
        [, last_state (b, d, n) fp32]."""
        return ops.selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                                  initial_state=initial_state, return_last_state=return_last_state,
                                  seq_idx=seq_idx)

    def channel_sum(self, t: torch.Tensor) -> torch.Tensor:
        """x_proj's output (b, r + 2n, L) from this device's d_inner channels -> the sum over all channels."""
        return t


class Mamba(nn.Module):
    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: float = 2, dt_rank="auto",
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random", dt_scale: float = 1.0,
                 dt_init_floor: float = 1e-4, conv_bias: bool = True, bias: bool = False, layer_idx: int | None = None,
                 device=None, dtype=None, *, recompute=(), use_fused_path: bool = True):
        super().__init__()
        if dt_init not in ("random", "constant"):
            raise ValueError(f"Mamba: dt_init must be 'random' or 'constant', got {dt_init!r}")
        fk = dict(device=device, dtype=dtype)
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.dt_min, self.dt_max, self.dt_init, self.dt_scale = dt_min, dt_max, dt_init, dt_scale
        self.dt_init_floor = dt_init_floor
        self.layer_idx = layer_idx
        self.recompute = recompute_set(recompute)  # conv, dt, gate: rebuilt in the backward, not kept
        # training on the Triton path: the middle as one autograd node (layers/mamba1_fused.py); False: the
        # modular forward below, op by op
        self.use_fused_path = bool(use_fused_path)
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
        init.linear_default_(self.in_proj.weight, None)
        if self.in_proj.bias is not None:
            init.constant_(self.in_proj.bias, 0.0)
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
    def forward(self, hidden_states: torch.Tensor, inference_params=None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (b, L, d_model) -> (b, L, d_model).

        seq_idx (b, L) int32 resets conv and scan state where it changes (packed sequences); ``cu_seqlens``
        (nseq + 1,) with b == 1 is turned into seq_idx when that is missing. With ``inference_params``
        the conv / SSM states of this layer are read (when ``seqlen_offset > 0``) and written back.
        """
        b, L, _ = hidden_states.shape
        seq_idx = resolve_seq_idx(seq_idx, cu_seqlens, L)
        conv_state = ssm_state = None
        if inference_params is not None:
            conv_state, ssm_state = inference_params.states(self.layer_idx)
            if inference_params.seqlen_offset > 0 and L == 1:
                return self.step(hidden_states, conv_state, ssm_state)
        d_inner, n, r = self.d_inner, self.d_state, self.dt_rank
        xz = self.in_proj(hidden_states)
        if xz.shape[-1] != 2 * d_inner:
            raise ValueError(f"Mamba: in_proj gives {xz.shape[-1]} features, expected 2 * d_inner = {2 * d_inner}")
        if conv_state is None and self.use_fused_path and self.seq_ops.local and fused_ok(self, xz):
            plan = recompute_plan(self)
            if plan <= FUSED_RECOMPUTE:  # one autograd node (layers/mamba1_fused.py); it always rebuilds dt
                return self.out_proj(mamba1_inner(self, xz, seq_idx, recompute_conv="conv" in plan))
        x, z, xz_grad = split_xz(xz, d_inner)  # channels-last (b, d_inner, L) views of xz

        conv_kwargs, scan_kwargs = {}, {}
        if conv_state is not None:
            resume = inference_params.seqlen_offset > 0  # chunked prefill continues from the cached states
            conv_kwargs = dict(initial_state=conv_state[:b] if resume else None, return_final_state=True)
            scan_kwargs = dict(initial_state=ssm_state[:b] if resume else None, return_last_state=True)
        conv_in = x
        x = self._conv(x, seq_idx, **conv_kwargs)  # reads the strided view; may keep its layout
        if conv_state is not None:
            x, final_conv = x
            conv_state[:b].copy_(final_conv)
        x = token_major(x)  # unit token stride for x_proj and the scan, which stream along L
        # recompute (training or a plain forward: no inference states to fill): what the backward rebuilds
        # instead of keeping; empty: no context at all
        plan = recompute_plan(self, self.seq_ops.local_conv) if conv_state is None else NOTHING
        rebuilt = None
        if "conv" in plan:
            conv_in = conv_in.detach()  # a view of in_proj's output, which the conv keeps for its backward anyway
            rebuilt = RecomputeInBackward()
            rebuilt.add(x, lambda: token_major(self._conv(conv_in, seq_idx)))
        x_dbl = run_saving(rebuilt, self._x_proj_token_major, x)  # (b, r + 2n, L); x_proj keeps x
        dt_low, B, C = x_dbl.split([r, n, n], dim=1)
        dt = _token_major_linear(self.dt_proj.weight, dt_low)  # (b, d_inner, L); bias added in the scan
        if "dt" in plan:
            w, low = self.dt_proj.weight.detach(), dt_low.detach()  # x_dbl is kept for the backward anyway
            if rebuilt is None:
                rebuilt = RecomputeInBackward()
            rebuilt.add(dt, lambda: _token_major_linear(w, low))
        A = -torch.exp(self.A_log.float())
        # the scan keeps x and dt for the backward
        y = run_saving(rebuilt, self.seq_ops.scan, x, dt, A, B, C, D=self.D.float(),
                       delta_bias=self.dt_proj.bias.float(), delta_softplus=True, seq_idx=seq_idx, **scan_kwargs)
        if ssm_state is not None:
            y, last_state = y
            ssm_state[:b].copy_(last_state)
        # the gate outside the scan: it reads z in place and writes out_proj's input (b, L, d_inner) contiguous
        gated = gate_to_token_last(y, z, xz_grad)
        if "gate" not in plan:
            return self.out_proj(gated)
        y_in, z_in = y.detach(), z.detach()  # the gate keeps both for its backward anyway
        rebuilt = RecomputeInBackward()
        rebuilt.add(gated, lambda: gate_to_token_last(y_in, z_in))
        with rebuilt:  # out_proj keeps its input for the weight gradient
            return self.out_proj(gated)

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
        dt, B, C = self.x_proj(x).split([r, n, n], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight)
        A = derived(self, "A_log", neg_exp_fp32)
        # D and the dt bias go in their own dtype: the step computes in fp32 either way (no per-token casts)
        y = ops.selective_state_update(ssm_state[:b], x, dt, A, B, C, D=self.D, z=z, dt_bias=self.dt_proj.bias,
                                       dt_softplus=True)
        return self.out_proj(y)[:, None]

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, device=None):
        """-> (conv_state (batch, d_inner, d_conv - 1) in ``dtype``, ssm_state (batch, d_inner, d_state) fp32)."""
        w = self.conv1d.weight
        device = device or w.device
        conv_state = torch.zeros(batch_size, self.d_inner, w.shape[-1] - 1, device=device, dtype=dtype or w.dtype)
        ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=torch.float32)
        return conv_state, ssm_state
