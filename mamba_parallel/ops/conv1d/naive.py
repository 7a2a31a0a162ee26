"""Causal depthwise conv1d and its one-token update in plain PyTorch (the specification; fp32 math).

Tap k of the width-w filter multiplies the input k - (w - 1) steps away, so weight[:, -1] sees the current token
(the layout of ``nn.Conv1d(groups=d, padding=w - 1)`` truncated to the first L outputs, as mamba_ssm uses it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_parallel.ops._common import compute_dtype, fp32_math


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


@fp32_math
def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, seq_idx=None,
                  return_final_state=False):
    """x (b, d, L), weight (d, w), bias (d,), initial_state (b, d, w-1), seq_idx (b, L) -> y (b, d, L)
    [, final_state (b, d, w-1) in x.dtype].

    A sum of w shifted copies of x (no unfold: memory stays O(b d L)). With seq_idx, a tap only reads inputs of
    the output's own sequence; the initial state belongs to the sequence of the first token, and the final state
    keeps only inputs of the last token's sequence (zeros elsewhere), ready for decoding that sequence.
    """
    b, d, L = x.shape
    w = weight.shape[1]
    ct = compute_dtype(x, weight, bias, initial_state)
    xf = x.to(ct)
    pre = (initial_state.to(ct) if initial_state is not None else xf.new_zeros(b, d, w - 1))
    xpad = torch.cat([pre, xf], dim=-1)  # (b, d, L + w - 1); position j is token j - (w - 1)
    seq_pad = None
    if seq_idx is not None:
        seq_pad = torch.cat([seq_idx[:, :1].expand(b, w - 1), seq_idx], dim=-1)
    wf = weight.to(ct)
    y = xf.new_zeros(b, d, L) if bias is None else bias.to(ct)[None, :, None].expand(b, d, L)
    for k in range(w):
        tap = xpad[:, :, k:k + L]
        if seq_pad is not None:
            tap = tap * (seq_pad[:, k:k + L] == seq_idx).unsqueeze(1).to(ct)
        y = y + wf[:, k, None] * tap
    y = _activate(y, activation).to(x.dtype)
    if not return_final_state:
        return y
    final = xpad[:, :, L:]  # the last w - 1 inputs (including initial-state entries when L < w - 1)
    if seq_pad is not None:
        final = final * (seq_pad[:, L:] == seq_idx[:, -1:]).unsqueeze(1).to(ct)
    return y, final.to(x.dtype)


@fp32_math
def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, state_indices=None):
    """x (b, d) one token, conv_state (B, d, w-1) updated in place (rows state_indices (b,) or all) -> y (b, d).

    The state holds the previous w-1 inputs, oldest first; it is shifted left by one and x appended.
    """
    ct = compute_dtype(x, weight, bias, conv_state)
    rows = None if state_indices is None else state_indices.long()
    old = conv_state if rows is None else conv_state[rows]
    window = torch.cat([old.to(ct), x.to(ct).unsqueeze(-1)], dim=-1)  # (b, d, w)
    y = (window * weight.to(ct)).sum(-1)
    if bias is not None:
        y = y + bias.to(ct)
    new = window[:, :, 1:].to(conv_state.dtype)
    if rows is None:
        conv_state.copy_(new)
    else:
        conv_state[rows] = new
    return _activate(y, activation).to(x.dtype)
