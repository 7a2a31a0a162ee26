"""``generate``: prefill the prompt(s) into a fresh cache, then decode one token per step with the recurrent step.

Ragged requests (a list of prompts of different lengths) share one batched cache: the prompts are ordered by
length so that each group of equal length owns a contiguous block of cache rows, each group is prefilled on its
own into a row-slice view of the cache (the mixers write their final conv / SSM states in place), then every row
decodes together. A Mamba layer's one-token step never reads the position, so rows at different positions can
step in one batch; an attention layer's KV cache has a single position for the whole batch, hence ragged prompts
need a pure Mamba / Mamba2 model.
"""

from __future__ import annotations

import torch

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.inference.sampling import sample


def _row_view(cache: InferenceParams, start: int, stop: int) -> InferenceParams:
    """A cache over rows [start, stop) of ``cache``: same state storage, its own (zero) offset."""
    views = {k: tuple(t[start:stop] for t in v) if isinstance(v, tuple) else v[start:stop]
             for k, v in cache.key_value_memory_dict.items()}
    return InferenceParams(max_seqlen=cache.max_seqlen, max_batch_size=stop - start, key_value_memory_dict=views)


def _check_prompts(prompts) -> list[torch.Tensor]:
    """A list / tuple of 1-D integer tensors (each non-empty, one device) -> the same prompts as int64."""
    if len(prompts) == 0:
        raise ValueError("generate: the list of prompts is empty")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0 or p.is_floating_point():
            desc = f"shape {tuple(p.shape)} dtype {p.dtype}" if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"generate: prompts[{i}] must be a non-empty 1-D integer tensor, got {desc}")
        if p.device != prompts[0].device:
            raise ValueError(f"generate: prompts[{i}] is on {p.device}, prompts[0] on {prompts[0].device}")
        out.append(p.long())
    return out


def _refuse_attention(model) -> None:
    attn = list(getattr(model.config, "attn_layer_idx", None) or [])
    if attn:
        raise ValueError(f"generate: prompts of different lengths need a pure Mamba / Mamba2 model; layers {attn} "
                         f"(config.attn_layer_idx) are attention, whose KV cache has one position for the whole "
                         f"batch. Pad the prompts to one length or generate them one at a time.")


def _decode(run, cache: InferenceParams, logits: torch.Tensor, max_new_tokens: int, vocab: int, temperature: float,
            top_k: int, top_p: float, eos_token_id: int | None, generator) -> torch.Tensor:
    """logits (b, vocab) of the prompts' last positions -> new tokens (b, n), n <= max_new_tokens.

    Advances ``cache.seqlen_offset`` by one per decoded token. Finished rows (eos emitted) are padded with eos; the
    loop stops once every row is finished (the only host sync of a step)."""
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    new_tokens = []
    for step in range(max_new_tokens):
        token = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done = done | (token == eos_token_id)
        new_tokens.append(token)
        if step == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        logits = run(token[:, None], inference_params=cache).logits[:, -1, :vocab]
        cache.seqlen_offset += 1
    return torch.stack(new_tokens, dim=1)


def _runner(model, batch: int, max_seqlen: int, cache_dtype, cuda_graph: bool):
    if cuda_graph:
        from mamba_parallel.inference.cuda_graph import decode_runner

        return decode_runner(model, batch, max_seqlen, cache_dtype, cuda_graph=True)
    return model, model.allocate_inference_cache(batch, max_seqlen, dtype=cache_dtype)


def _generate_ragged(model, prompts: list[torch.Tensor], max_new_tokens: int, cache_dtype, cuda_graph: bool,
                     **sampling) -> list[torch.Tensor]:
    """prompts: list of (L_i,) -> list of (L_i + n_i,): each row cut after its first eos (no padding)."""
    prompts = _check_prompts(prompts)
    if max_new_tokens == 0:
        return prompts
    lengths = [p.numel() for p in prompts]
    if len(set(lengths)) > 1:
        _refuse_attention(model)
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])  # stable: equal lengths keep the input order
    b, longest, vocab = len(prompts), max(lengths), model.config.vocab_size
    run, cache = _runner(model, b, longest + max_new_tokens, cache_dtype, cuda_graph)
    # One prefill per distinct length, into its block of rows; ``model`` directly (a graphed runner only replays).
    last_logits, start = [], 0
    while start < b:
        stop = start
        while stop < b and lengths[order[stop]] == lengths[order[start]]:
            stop += 1
        group = torch.stack([prompts[i] for i in order[start:stop]])
        view = _row_view(cache, start, stop) if (start, stop) != (0, b) else cache
        last_logits.append(model(group, inference_params=view, num_last_tokens=1).logits[:, -1, :vocab])
        start = stop
    # Mamba steps only test offset > 0; the longest prompt bounds every row's position (cache capacity checks).
    cache.seqlen_offset = longest
    new = _decode(run, cache, torch.cat(last_logits), max_new_tokens, vocab, **sampling).cpu()

    eos = sampling["eos_token_id"]
    out: list[torch.Tensor | None] = [None] * b
    for row, i in enumerate(order):
        tokens = new[row]
        if eos is not None:
            hits = (tokens == eos).nonzero()
            if len(hits):
                tokens = tokens[: int(hits[0]) + 1]
        out[i] = torch.cat([prompts[i], tokens.to(prompts[i].device)])
    return out


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor | list[torch.Tensor], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 0.0, eos_token_id: int | None = None,
             generator: torch.Generator | None = None, cache_dtype: torch.dtype | None = None,
             cuda_graph: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """input_ids (b, L) int64 -> (b, L + n) token ids, n <= max_new_tokens; or a list of 1-D prompts (L_i,) of any
    lengths -> a list of 1-D (L_i + n_i,) in input order (ragged requests, pure Mamba / Mamba2 models when the
    lengths differ).

    Sampling: see inference/sampling.py (greedy when temperature == 0 or top_k == 1), over the real vocabulary
    only (the padding rows of the LM head are never drawn). A row that emits ``eos_token_id`` is finished: in the
    (b, L + n) result its later positions are filled with eos, in the list result it ends at its eos; the loop
    stops early once every row is finished (the only host sync of a decode step). ``cuda_graph``: replay a
    captured one-token step (inference/cuda_graph.py, CUDA only).
    """
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                    generator=generator)
    if isinstance(input_ids, (list, tuple)):
        return _generate_ragged(model, list(input_ids), max_new_tokens, cache_dtype, cuda_graph, **sampling)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"generate: input_ids must be (batch, seqlen >= 1) or a list of 1-D prompts, got shape "
                         f"{tuple(input_ids.shape)}")
    b, L = input_ids.shape
    if max_new_tokens == 0:
        return input_ids
    vocab = model.config.vocab_size
    run, cache = _runner(model, b, L + max_new_tokens, cache_dtype, cuda_graph)
    logits = run(input_ids, inference_params=cache, num_last_tokens=1).logits[:, -1, :vocab]
    cache.seqlen_offset = L
    new = _decode(run, cache, logits, max_new_tokens, vocab, **sampling)
    return torch.cat([input_ids, new], dim=1)
