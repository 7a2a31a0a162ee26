"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus). No host syncs (CUDA-graph friendly)."""

from __future__ import annotations

import torch


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """logits (b, V) -> logits with everything below the k-th largest value of each row set to -inf."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits (b, V) -> logits keeping the smallest set of top tokens whose probability mass reaches top_p.

    A token is dropped when the mass of the tokens strictly more likely than it already reaches top_p; the most
    likely token is always kept. top_p <= 0 or >= 1 disables the filter.
    """
    if top_p <= 0.0 or top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (b, V) -> next tokens (b,) int64.

    Greedy (argmax) when temperature == 0 or top_k == 1; otherwise softmax(logits / temperature) restricted by
    top_k then top_p, drawn with the exponential-race trick (argmax of p / Exp(1) noise), which samples exactly
    from p without torch.multinomial's host sync.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    logits = top_p_filter(top_k_filter(logits, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)
