"""The three stages of a fused Mamba-2 decode step in plain PyTorch (the specification; fp32 math).

A Mamba-2 block's one-token step is: h = rmsnorm(residual) w_pre; zxbcdt = in_proj(h); xBC <- silu(conv update);
y = ssd state update; g = rmsnorm(y silu(z)) w_norm (per group); residual += out_proj(g). Two norms are folded
into the matmuls next to them, because a norm is a scale per row (per group): ``in_proj(rstd (r w_pre)) =
rstd in_proj(r w_pre)``. The stages round where the unfused step's tensors have the model's dtype (in_proj's
output, the conv state, y, out_proj's output); the two matmuls' inputs (the normed activations) stay fp32, where
the unfused step rounds them to the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_parallel.ops._common import process_dt


def norm_in_proj_conv(residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                      conv_state: torch.Tensor, conv_start: int) -> torch.Tensor:
    """residual (b, K) fp32 -> zxbcdt (b, N) in weight.dtype: in_proj(rmsnorm(residual) norm_weight) with columns
    [conv_start, conv_start + C) passed through the conv update + silu; conv_state (b, C, d_conv - 1) updated in
    place."""
    r = residual.float()
    h = r * torch.rsqrt(r.square().mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = h @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    y = y.to(weight.dtype)
    c = conv_state.shape[1]
    x = y[:, conv_start:conv_start + c]
    window = torch.cat([conv_state.float(), x.float()[..., None]], dim=-1)  # (b, C, d_conv)
    xc = (window * conv_weight.float()).sum(-1)
    if conv_bias is not None:
        xc = xc + conv_bias.float()
    conv_state.copy_(window[..., 1:].to(conv_state.dtype))
    out = y.clone()
    out[:, conv_start:conv_start + c] = F.silu(xc).to(y.dtype)
    return out


def state_update_gate(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor, dt_bias: torch.Tensor | None,
                      dt_limit: tuple[float, float], norm_weight: torch.Tensor,
                      ngroups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One Mamba-2 token (softplus dt) gated for the output norm: state (b, h, p, n) in place; x, z (b, h, p); dt
    (b, h); B, C (b, g, n) -> (gw (b, h p) fp32 = g norm_weight with g = y silu(z), y rounded to x.dtype;
    sumsq (b, ngroups, 1) fp32: the sum of g^2 over each norm group's channels)."""
    b, h, p = x.shape
    s = state.float()
    dtf = process_dt(dt, dt_bias, True, dt_limit, dtype=torch.float32)
    Bh = B.float().repeat_interleave(h // B.shape[1], dim=1)
    Ch = C.float().repeat_interleave(h // C.shape[1], dim=1)
    s = torch.exp(dtf * A.float())[..., None, None] * s + (dtf[..., None] * x.float()).unsqueeze(-1) * Bh.unsqueeze(2)
    state.copy_(s.to(state.dtype))
    y = (s * Ch.unsqueeze(2)).sum(-1)
    if D is not None:
        Df = D.float()
        y = y + (Df if Df.dim() == 2 else Df[:, None]) * x.float()
    g = y.to(x.dtype).float() * F.silu(z.float())
    g = g.reshape(b, h * p)
    return g * norm_weight.float(), g.square().view(b, ngroups, -1).sum(-1, keepdim=True)


def gated_out_proj_residual(gw: torch.Tensor, sumsq: torch.Tensor | None, eps: float, weight: torch.Tensor,
                            bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """gw (b, K), sumsq (b, G, P) fp32 (P partial sums per norm group of K / G channels; None: no norm) ->
    residual (b, N) fp32 += out_proj(gw rstd) rounded to weight.dtype, in place; returns residual."""
    b, k = gw.shape
    a = gw.float()
    if sumsq is not None:
        groups = sumsq.shape[1]
        rstd = torch.rsqrt(sumsq.float().sum(-1) / (k // groups) + eps)  # (b, G)
        a = a * rstd.repeat_interleave(k // groups, dim=1)
    y = a @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    residual += y.to(weight.dtype).float()
    return residual


def mamba1_x_proj_state_update(state: torch.Tensor, x: torch.Tensor, z: torch.Tensor, x_proj_weight: torch.Tensor,
                               dt_proj_weight: torch.Tensor, dt_bias: torch.Tensor | None, A: torch.Tensor,
                               D: torch.Tensor | None, bcdt_eps: float | None = None) -> torch.Tensor:
    """One Mamba-1 token after the conv: state (b, d, n) in place; x (conv'd), z (b, d) -> y (b, d) in x.dtype:
    x_dbl = x_proj(x) = [dt_low | B | C] (with ``bcdt_eps``: each piece divided by its root mean square, Falcon-
    Mamba's norms), dt = dt_proj(dt_low) (each rounded to x.dtype), softplus(dt + dt_bias), the state update,
    y = (state . C + D x) silu(z)."""
    n, r = state.shape[2], dt_proj_weight.shape[1]
    x_dbl = (x.float() @ x_proj_weight.float().t()).to(x.dtype)
    pieces = x_dbl.float().split([r, n, n], dim=-1)
    if bcdt_eps is not None:
        pieces = [(p * torch.rsqrt(p.square().mean(-1, keepdim=True) + bcdt_eps)).to(x.dtype).float() for p in pieces]
    dt_low, B, C = pieces
    dt = (dt_low @ dt_proj_weight.float().t()).to(x.dtype).float()
    dt = F.softplus(dt + (dt_bias.float() if dt_bias is not None else 0.0))
    xf = x.float()
    s = torch.exp(dt[..., None] * A.float()) * state.float() + (dt * xf)[..., None] * B[:, None, :]
    state.copy_(s.to(state.dtype))
    y = (s * C[:, None, :]).sum(-1)
    if D is not None:
        y = y + D.float() * xf
    return (y * F.silu(z.float())).to(x.dtype)


__all__ = ["norm_in_proj_conv", "state_update_gate", "gated_out_proj_residual", "mamba1_x_proj_state_update"]
