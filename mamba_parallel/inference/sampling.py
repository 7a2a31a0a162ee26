"""Next-token choice: greedy, temperature, top-k, top-p (nucleus), min-p, repetition penalty. No host syncs
(CUDA-graph friendly). Filters follow transformers' logits warpers (applied in its order: penalty, temperature,
top-k, top-p, min-p)."""

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


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits (b, V) -> logits with every token less likely than min_p x the likeliest token's probability set to
    -inf (min_p <= 0 disables the filter)."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def repetition_penalty_(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits (b, V), seen (b, V) bool: tokens already in the row (prompt or generated) -> logits where each seen
    token's logit is divided by ``penalty`` when positive and multiplied by it when negative (CTRL's rule, as
    transformers and mamba_ssm apply it). penalty == 1 changes nothing."""
    if penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def warp(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
         min_p: float = 0.0) -> torch.Tensor:
    """logits (b, V) -> fp32 logits / temperature restricted by top_k, top_p and min_p (what is sampled from)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
    logits = logits.float() / temperature
    return min_p_filter(top_p_filter(top_k_filter(logits, top_k), top_p), min_p)


def draw(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (b, V) -> one token per row drawn from softmax(logits), by the exponential race (argmax of p / Exp(1)
    noise), which samples exactly from p without torch.multinomial's host sync."""
    probs = torch.softmax(logits.float(), dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 0.0,
           generator: torch.Generator | None = None, min_p: float = 0.0) -> torch.Tensor:
    """logits (b, V) -> next tokens (b,) int64.

    Greedy (argmax) when temperature == 0 or top_k == 1; otherwise a draw from softmax(logits / temperature)
    restricted by top_k, top_p and min_p (see :func:`warp`, :func:`draw`).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1)
    return draw(warp(logits, temperature, top_k, top_p, min_p), generator)
