"""``generate``: prefill the prompt into a fresh cache, then decode one token per step with the recurrent step."""

from __future__ import annotations

import torch

from mamba_parallel.inference.sampling import sample


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 0.0, eos_token_id: int | None = None, generator: torch.Generator | None = None,
             cache_dtype: torch.dtype | None = None, cuda_graph: bool = False) -> torch.Tensor:
    """input_ids (b, L) int64 -> (b, L + n) token ids, n <= max_new_tokens.

    Sampling: see inference/sampling.py (greedy when temperature == 0 or top_k == 1), over the real vocabulary
    only (the padding rows of the LM head are never drawn). A row that emits ``eos_token_id`` is finished: later
    positions of that row are filled with eos; the loop stops early once every row is finished (the only host
    sync of a decode step). ``cuda_graph``: replay a captured one-token step (inference/cuda_graph.py, CUDA only).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must be (batch, seqlen >= 1), got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    b, L = input_ids.shape
    if max_new_tokens == 0:
        return input_ids
    vocab = model.config.vocab_size
    if cuda_graph:
        from mamba_parallel.inference.cuda_graph import decode_runner

        run, cache = decode_runner(model, b, L + max_new_tokens, cache_dtype, cuda_graph=True)
    else:
        run, cache = model, model.allocate_inference_cache(b, L + max_new_tokens, dtype=cache_dtype)
    logits = run(input_ids, inference_params=cache, num_last_tokens=1)[:, -1, :vocab]
    cache.seqlen_offset = L

    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    new_tokens = []
    for step in range(max_new_tokens):
        token = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done = done | (token == eos_token_id)
        new_tokens.append(token)
        if step == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        logits = run(token[:, None], inference_params=cache)[:, -1, :vocab]
        cache.seqlen_offset += 1
    return torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
