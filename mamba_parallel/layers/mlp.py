"""Feed-forward layers of hybrid stacks: ``GatedMLP`` (SwiGLU, mamba_ssm's, after each mixer when d_intermediate
> 0) and ``MLP`` (Nemotron-H's squared-ReLU feed-forward, also a block of its own)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mamba_parallel.layers import init


class _FeedForward(nn.Module):
    """fc1 -> activation -> fc2; the hidden width is ``hidden_features`` rounded up to a multiple of ``multiple_of``
    (128, as mamba_ssm), so a mamba_ssm checkpoint with any d_intermediate loads with the same shapes."""

    fc1_parts = 1  # fc1's output = this many hidden-wide parts

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 bias: bool = False, multiple_of: int = 128, device=None, dtype=None):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        out_features = out_features or in_features
        hidden = (hidden_features + multiple_of - 1) // multiple_of * multiple_of
        self.hidden_features = hidden
        self.fc1 = nn.Linear(in_features, self.fc1_parts * hidden, bias=bias, **fk)
        self.fc2 = nn.Linear(hidden, out_features, bias=bias, **fk)
        if not init.is_meta(device):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for lin in (self.fc1, self.fc2):
            init.linear_zero_bias_(lin)


class GatedMLP(_FeedForward):
    """y = fc2(value * silu(gate)) with fc1 -> [value | gate] (mamba_ssm's layout and names)."""

    fc1_parts = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features). The split uses fc1's output width (local under TP)."""
        value, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(value * F.silu(gate))


class MLP(_FeedForward):
    """y = fc2(relu(fc1(x))^2) (squared ReLU, Nemotron-H's feed-forward; "up_proj" / "down_proj" in transformers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features)."""
        return self.fc2(F.relu(self.fc1(x)).square())


def create_mlp(d_model: int, d_intermediate: int, activation: str = "swiglu", bias: bool = False,
               multiple_of: int = 128, device=None, dtype=None) -> nn.Module:
    """The feed-forward of ``mlp_cfg``: GatedMLP for "swiglu", MLP for "relu2"."""
    cls = {"swiglu": GatedMLP, "relu2": MLP}.get(activation)
    if cls is None:
        raise ValueError(f"create_mlp: activation must be 'swiglu' or 'relu2', got {activation!r}")
    return cls(d_model, d_intermediate, d_model, bias=bias, multiple_of=multiple_of, device=device, dtype=dtype)
