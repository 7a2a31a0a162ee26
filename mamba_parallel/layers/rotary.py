"""Rotary position embedding (GPT-NeoX / flash-attn non-interleaved layout) on the first ``rotary_dim`` dims."""

from __future__ import annotations

import torch


def rotary_cos_sin(position_ids: torch.Tensor, rotary_dim: int, base: float = 10000.0,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids (b, L) int -> cos, sin (b, L, rotary_dim / 2) in ``dtype`` (angles computed in fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=position_ids.device,
                                            dtype=torch.float32) / rotary_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, L, heads, head_dim), cos/sin (b, L, r/2) -> x with its first r dims rotated (halves layout).

    [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos] for x1 = x[..., :r/2], x2 = x[..., r/2:r]; the rest unchanged.
    """
    half = cos.shape[-1]
    cos, sin = cos[:, :, None].to(torch.float32), sin[:, :, None].to(torch.float32)
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)
