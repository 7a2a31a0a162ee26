"""Causal depthwise conv1d and its one-token update in plain PyTorch (the specification; fp32 math).

Tap k of the width-w filter multiplies the input k - (w - 1) steps away, so weight[:, -1] sees the current token
(the layout of ``nn.Conv1d(groups=d, padding=w - 1)`` truncated to the first L outputs, as mamba_ssm uses it).
``final_state`` (the state a prompt leaves, optionally written into an inference cache) is shared with the Triton
path: a gather, no arithmetic.
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


def final_state_mask(seq_idx: torch.Tensor, L: int, w: int) -> torch.Tensor:
    """(b, w-1) bool: final-state slot j (input L-(w-1)+j) belongs to the last token's sequence."""
    pos = torch.arange(L - (w - 1), L, device=seq_idx.device).clamp_min(0)
    return seq_idx[:, pos] == seq_idx[:, -1:]


def final_state(x, initial_state, seq_idx, w: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The last w-1 inputs of [initial_state, x] (b, d, w-1) in x.dtype, zeroed outside the last sequence. ``out``
    (b, d, w-1), e.g. an inference cache, which may also be ``initial_state``: written in place (cast to its dtype)
    and returned; without seq_idx and with at least w-1 inputs that is one copy of x's tail."""
    b, d, L = x.shape
    if L >= w - 1:
        tail = x[:, :, L - (w - 1):]
    else:
        pre = initial_state if initial_state is not None else x.new_zeros((b, d, w - 1))
        tail = torch.cat([pre[:, :, L:].to(x.dtype), x], dim=-1)
    if seq_idx is not None:
        tail = tail * final_state_mask(seq_idx, L, w)[:, None, :].to(x.dtype)
    if out is not None:  # tail is x's view or a new tensor, never out itself: one copy
        return out.copy_(tail.to(x.dtype))
    # a fresh tensor: a custom op's output may not alias its input
    return tail.to(x.dtype).clone(memory_format=torch.contiguous_format)


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
