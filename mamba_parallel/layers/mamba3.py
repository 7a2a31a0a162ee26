"""``Mamba3``: the Mamba-3 mixer (Lahoti et al. 2026), single device, mamba_ssm's parameter names.

Data flow for hidden (b, L, d_model):
  in_proj -> [z | x | B | C | dt | A | trap | angles] with z, x (d_inner), B, C (R·g·n, rank-major), dt, A, trap
  (nheads each), angles (a rotated pairs, shared by the heads);
  dt = softplus(dt + dt_bias); A = -max(softplus(A), A_floor) (a decay rate per token and head, no A_log);
  trap = sigmoid(trap) (the trapezoid's weight on the current token); angles = pi tanh(angles) (rotation speed);
  B, C -> RMSNorm over n (B_norm, C_norm), then + B_bias / C_bias per head;
  y = Mamba-3 scan (ops/mamba3) with D and the gate silu(z) (or, with is_outproj_norm, a gated RMSNorm after it)
  -> out_proj -> (b, L, d_model). No short convolution: the trapezoid and the biases take its place.
MIMO (is_mimo): B and C carry R = mimo_rank inputs / outputs per head; x, z and the output go through the
per-head, per-rank scales mimo_x, mimo_z, mimo_o (the state size stays (p, n)).
Local sizes come from the attributes ``d_inner, nheads, ngroups`` (tensor parallelism rewrites them); the scan
goes through ``seq_ops`` (the parallel seam: context parallelism installs its own, distributed/cp_mamba3.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mamba_parallel.layers import init
from mamba_parallel.layers.norm import RMSNorm, RMSNormGated
from mamba_parallel.layers.seq_ops import SequenceOps
from mamba_parallel.ops.mamba3 import (Mamba3Discretization, Mamba3State, discretize, mamba3_chunk_scan,
                                       mamba3_state_update)


def _per_head(angles: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """angles (..., a), shared by the heads -> an expanded (..., h, a) view (dt: (..., h))."""
    return angles.unsqueeze(-2).expand(*dt.shape, angles.shape[-1])


def rope_angle_count(d_state: int, rope_fraction: float) -> int:
    """Rotated coordinate pairs of the state: half of the rotated coordinates, floor(d_state * rope_fraction)
    rounded down to an even number (mamba_ssm's rule)."""
    rotated = int(d_state * rope_fraction)
    return (rotated - rotated % 2) // 2


class Mamba3Ops(SequenceOps):
    """Mamba3's single-device sequence op (the parallel seam, layers/seq_ops.py): the Mamba-3 scan; the layer has
    no conv."""

    def scan(self, x, dt, A, B, C, trap, angles, chunk_size, **kwargs):
        """``ops.mamba3.mamba3_chunk_scan`` (same arguments): x (b, L, h, p) ... -> y (b, L, h, p)
        [, final Mamba3State]."""
        return mamba3_chunk_scan(x, dt, A, B, C, trap, angles, chunk_size, **kwargs)


class Mamba3(nn.Module):
    def __init__(self, d_model: int, d_state: int = 128, expand: float = 2, headdim: int = 64, ngroups: int = 1,
                 rope_fraction: float = 0.5, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, A_floor: float = 1e-4, is_outproj_norm: bool = False,
                 is_mimo: bool = False, mimo_rank: int = 4, chunk_size: int = 64, layer_idx: int | None = None,
                 device=None, dtype=None):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.d_model, self.d_state = d_model, d_state
        self.d_inner = int(expand * d_model)
        if self.d_inner % headdim:
            raise ValueError(f"Mamba3: d_inner = {self.d_inner} is not divisible by headdim = {headdim}")
        self.headdim = headdim
        self.nheads = self.d_inner // headdim
        if self.nheads % ngroups:
            raise ValueError(f"Mamba3: nheads = {self.nheads} is not divisible by ngroups = {ngroups}")
        if rope_fraction not in (0.5, 1.0):
            raise ValueError(f"Mamba3: rope_fraction must be 0.5 or 1.0, got {rope_fraction}")
        self.ngroups = ngroups
        self.num_rope_angles = rope_angle_count(d_state, rope_fraction)
        if self.num_rope_angles < 1:
            raise ValueError(f"Mamba3: d_state = {d_state} x rope_fraction = {rope_fraction} rotates no pair")
        self.is_mimo = is_mimo
        self.mimo_rank = mimo_rank if is_mimo else 1
        # the peer's kernels pair (2i, 2i+1) in SISO and (i, i + n/2) in MIMO; trained weights expect the same
        self.rope = "halved" if is_mimo else "interleaved"
        self.is_outproj_norm = is_outproj_norm
        self.chunk_size = chunk_size
        self.dt_min, self.dt_max, self.dt_init_floor, self.A_floor = dt_min, dt_max, dt_init_floor, A_floor
        self.layer_idx = layer_idx
        self.seq_ops = Mamba3Ops()  # the scan: what context parallelism replaces

        R, h, n = self.mimo_rank, self.nheads, d_state
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner + 2 * R * ngroups * n + 3 * h + self.num_rope_angles,
                                 bias=False, **fk)
        self.dt_bias = nn.Parameter(torch.empty(h, **fk))
        self.B_bias = nn.Parameter(torch.empty(h, R, n, **fk))
        self.C_bias = nn.Parameter(torch.empty(h, R, n, **fk))
        self.B_norm = RMSNorm(n, eps=1e-5, **fk)
        self.C_norm = RMSNorm(n, eps=1e-5, **fk)
        if is_mimo:
            self.mimo_x = nn.Parameter(torch.empty(h, R, headdim, **fk))
            self.mimo_z = nn.Parameter(torch.empty(h, R, headdim, **fk))
            self.mimo_o = nn.Parameter(torch.empty(h, R, headdim, **fk))
        self.D = nn.Parameter(torch.empty(h, **fk))
        if is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, group_size=headdim, norm_before_gate=True, **fk)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False, **fk)
        if not init.is_meta(device):
            self.reset_parameters()
        init.mark_no_weight_decay(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba_ssm's init: softplus(dt_bias) log-uniform in [dt_min, dt_max]; B / C biases 1, D 1; MIMO scales
        mimo_x = mimo_o = 1 / R, mimo_z = 1; projections as PyTorch's default; norm weights 1. The model's
        ``init_weights`` then re-scales out_proj (see models/lm.py)."""
        init.linear_zero_bias_(self.in_proj)
        init.dt_bias_(self.dt_bias, self.dt_min, self.dt_max, self.dt_init_floor)
        init.constant_(self.B_bias, 1.0)
        init.constant_(self.C_bias, 1.0)
        self.B_norm.reset_parameters()
        self.C_norm.reset_parameters()
        if self.is_mimo:
            init.constant_(self.mimo_x, 1.0 / self.mimo_rank)
            init.constant_(self.mimo_z, 1.0)
            init.constant_(self.mimo_o, 1.0 / self.mimo_rank)
        init.constant_(self.D, 1.0)
        if self.is_outproj_norm:
            self.norm.reset_parameters()
        init.linear_zero_bias_(self.out_proj)
        init.mark_no_weight_decay(self)

    # ---- the scan ------------------------------------------------------------------------------------------------
    def _scan(self, x, dt, A, B, C, trap, angles, z=None, seq_idx=None, cu_seqlens=None, **state_kwargs):
        """x, z (b, L, h, p), dt / A / trap (b, L, h), B / C (b, L, [R,] g, n) normed, angles (b, L, h, a)
        -> y (b, L, h, p) (or (b, L, R, h, p): MIMO with is_outproj_norm). ``state_kwargs`` (inference):
        ``initial_states``, ``return_final_states``."""
        gate = not self.is_outproj_norm
        mimo = dict(mimo_x=self.mimo_x, mimo_z=self.mimo_z if gate else None,
                    mimo_o=self.mimo_o if gate else None) if self.is_mimo else {}
        # packed input may come with both seq_idx and cu_seqlens (the model derives one from the other): the op
        # takes one, cu_seqlens (b == 1) when given
        return self.seq_ops.scan(x, dt, A, B, C, trap, angles, self.chunk_size, D=self.D, z=z,
                                 B_bias=self._bias(self.B_bias), C_bias=self._bias(self.C_bias), rope=self.rope,
                                 seq_idx=None if cu_seqlens is not None else seq_idx, cu_seqlens=cu_seqlens,
                                 **mimo, **state_kwargs)

    # ---- pieces shared by forward and step ----------------------------------------------------------------------
    def _bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias if self.is_mimo else bias[:, 0]  # SISO: (h, n)

    def _split(self, zxbc: torch.Tensor):
        """(..., in_proj features) -> z, x (..., h, p); B, C (..., [R,] g, n); dt, A, trap (..., h); angles (..., a)."""
        d, h, g, n, R = self.d_inner, self.nheads, self.ngroups, self.d_state, self.mimo_rank
        sizes = [d, d, R * g * n, R * g * n, h, h, h, self.num_rope_angles]
        if zxbc.shape[-1] != sum(sizes):
            raise ValueError(f"Mamba3: in_proj gives {zxbc.shape[-1]} features, expected 2 d_inner + 2 R g n + "
                             f"3 nheads + rope angles = {sum(sizes)} (d_inner={d}, R={R}, ngroups={g}, "
                             f"d_state={n}, nheads={h}, angles={self.num_rope_angles})")
        z, x, B, C, dt, A, trap, angles = zxbc.split(sizes, dim=-1)
        heads = lambda t: t.unflatten(-1, (h, self.headdim))  # noqa: E731
        groups = lambda t: t.unflatten(-1, (R, g, n) if self.is_mimo else (g, n))  # noqa: E731
        return heads(z), heads(x), groups(B), groups(C), dt, A, trap, angles

    def _discretize(self, dt, A, trap, angles):
        """Raw projections -> dt > 0, A <= -A_floor, trap in (0, 1) (all fp32), angles (..., h, a) in rad / dt."""
        dt, A, trap, angles = discretize(dt, A, trap, angles, self._discretization())
        return dt, A, trap, _per_head(angles, dt)

    def _discretization(self) -> Mamba3Discretization:
        return Mamba3Discretization(self.dt_bias, self.A_floor)

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """is_outproj_norm: y (..., h, p) or (..., R, h, p) -> gated RMSNorm (per head) [-> mimo_o fold]."""
        if not self.is_mimo:
            return self.norm(y.flatten(-2), z.flatten(-2)).unflatten(-1, (self.nheads, self.headdim))
        zr = z.float().unsqueeze(-3) * self.mimo_z.float().transpose(0, 1)
        yr = self.norm(y.float().flatten(-2), zr.flatten(-2)).unflatten(-1, (self.nheads, self.headdim))
        return (yr * self.mimo_o.float().transpose(0, 1)).sum(-3).to(z.dtype)

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, inference_params=None, seq_idx: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (b, L, d_model) -> (b, L, d_model).

        seq_idx (b, L) int32 / cu_seqlens (nseq + 1,) int32 (b == 1): packed sequences, no state crosses a
        boundary. With ``inference_params`` this layer's cache (a Mamba3State) is read (when
        ``seqlen_offset > 0``) and written back.
        """
        b, L, _ = hidden_states.shape
        cache = None
        if inference_params is not None:
            cache = inference_params.states(self.layer_idx)
            if inference_params.seqlen_offset > 0 and L == 1:
                return self.step(hidden_states, cache)
            if cu_seqlens is not None:
                raise ValueError("Mamba3: cu_seqlens (packed sequences) cannot fill an inference cache; prefill "
                                 "one sequence per batch row instead")
        z, x, B, C, dt, A, trap, angles = self._split(self.in_proj(hidden_states))
        dt, A, trap, angles = self._discretize(dt, A, trap, angles)
        B, C = self.B_norm(B), self.C_norm(C)
        state_kwargs = {}
        if cache is not None:
            resume = inference_params.seqlen_offset > 0  # chunked prefill continues from the cached states
            init_states = Mamba3State(*(t[:b] for t in cache)) if resume else None
            state_kwargs.update(initial_states=init_states, return_final_states=True)
        y = self._scan(x, dt, A, B, C, trap, angles, z=None if self.is_outproj_norm else z, seq_idx=seq_idx,
                       cu_seqlens=cu_seqlens, **state_kwargs)
        if cache is not None:
            y, final = y
            for slot, value in zip(cache, final):
                slot[:b].copy_(value)
        if self.is_outproj_norm:
            y = self._output(y, z)
        return self.out_proj(y.flatten(-2).to(hidden_states.dtype))

    def step(self, hidden_states: torch.Tensor, cache: Mamba3State) -> torch.Tensor:
        """One decode token: hidden_states (b, 1, d_model) -> (b, 1, d_model); the cache advanced in place."""
        b = hidden_states.shape[0]
        z, x, B, C, dt, A, trap, angles = self._split(self.in_proj(hidden_states[:, 0]))
        gate = not self.is_outproj_norm
        mimo = dict(mimo_x=self.mimo_x, mimo_z=self.mimo_z if gate else None,
                    mimo_o=self.mimo_o if gate else None) if self.is_mimo else {}
        # the raw projections: the step discretizes them itself (in its kernel on a GPU: no launches for it)
        y = mamba3_state_update(Mamba3State(*(t[:b] for t in cache)), x, dt, A, self.B_norm(B), self.C_norm(C),
                                trap, _per_head(angles, dt), D=self.D,
                                z=z if gate else None, B_bias=self._bias(self.B_bias),
                                C_bias=self._bias(self.C_bias), rope=self.rope, discretize=self._discretization(),
                                **mimo)
        if self.is_outproj_norm:
            y = self._output(y, z)
        return self.out_proj(y.flatten(-2).to(hidden_states.dtype))[:, None]

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype=None, device=None,
                                 state_dtype=None) -> Mamba3State:
        """-> Mamba3State: angle (batch, h, a), ssm (batch, h, p, n), k (batch, [R,] h, n) fp32 (fp64 for an fp64
        model; ssm in ``state_dtype`` when given); v (batch, h, p) in ``dtype`` (the last token's x, which the next
        token's trapezoid half-step reads)."""
        w = self.in_proj.weight
        device, dtype = device or w.device, dtype or w.dtype
        f32 = dict(device=device, dtype=torch.promote_types(torch.float32, dtype))  # fp64 only for fp64 models
        h, p, n, R = self.nheads, self.headdim, self.d_state, self.mimo_rank
        k_shape = (batch_size, R, h, n) if self.is_mimo else (batch_size, h, n)
        return Mamba3State(torch.zeros(batch_size, h, self.num_rope_angles, **f32),
                           torch.zeros(batch_size, h, p, n, **(f32 if state_dtype is None else
                                                               dict(device=device, dtype=state_dtype))),
                           torch.zeros(*k_shape, **f32),
                           torch.zeros(batch_size, h, p, device=device, dtype=dtype))
