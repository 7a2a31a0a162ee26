"""``generate``: prefill the prompt(s) into a fresh cache, then decode one token per step with the recurrent step.

Arguments are transformers' and mamba_ssm's (inference/generate_options.py): greedy by default, ``max_new_tokens``
or ``max_length``, ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p`` / ``min_p`` / ``repetition_penalty``,
``eos_token_id`` (one or several), ``streamer`` (``put`` / ``end``, as transformers' TextStreamer; for every row
of a batch: inference/token_stream.py), ``cg`` /
``cuda_graph``, ``return_dict_in_generate`` with ``output_scores`` / ``output_logits``.

Ragged requests (a list of prompts of different lengths, or a left-padded batch with its ``attention_mask``) share
one batched cache: the prompts are ordered by length so that each group of equal length owns a contiguous block of
cache rows, each group is prefilled on its own into a row-slice view of the cache (the mixers write their final
conv / SSM states in place), then every row decodes together. A Mamba layer's one-token step never reads the
position, so rows at different positions can step in one batch; an attention layer's KV cache has a single
position for the whole batch, hence ragged prompts need a pure Mamba / Mamba2 model.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.inference.generate_options import GenerateOptions, resolve
from mamba_parallel.inference.sampling import draw, repetition_penalty_, warp


@dataclass
class GenerateOutput:
    """``return_dict_in_generate=True``: sequences as without it; scores / logits: one (b, vocab) fp32 tensor per
    step (the processed scores a token was chosen from / the raw logits), in input order, when asked for."""

    sequences: torch.Tensor | list[torch.Tensor]
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None


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


def _runner(model, batch: int, max_seqlen: int, opts: GenerateOptions):
    if opts.cuda_graph:
        from mamba_parallel.inference.cuda_graph import decode_runner

        return decode_runner(model, batch, max_seqlen, opts.cache_dtype, cuda_graph=True,
                             state_dtype=opts.state_dtype)
    # only when asked: a duck-typed model's allocate_inference_cache need not take it
    states = {} if opts.state_dtype is None else {"state_dtype": opts.state_dtype}
    return model, model.allocate_inference_cache(batch, max_seqlen, dtype=opts.cache_dtype, **states)


class _Decoder:
    """The per-step token choice: repetition penalty and eos suppression (min length), then greedy or a draw from
    the warped distribution; finished rows get ``pad``; records scores / logits when asked."""

    def __init__(self, opts: GenerateOptions, prompts: list[torch.Tensor], vocab: int, device):
        self.opts, self.vocab, b = opts, vocab, len(prompts)
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.eos = torch.tensor(opts.eos, dtype=torch.long, device=device) if opts.eos else None
        # what fills finished rows: pad_token_id, else the first eos id, else 0 (rows ended by a stop string)
        self.pad = opts.pad if opts.pad is not None else (opts.eos[0] if opts.eos else 0)
        self.seen = None
        if opts.repetition_penalty != 1.0:
            self.seen = torch.zeros(b, vocab, dtype=torch.bool, device=device)
            for row, p in enumerate(prompts):
                self.seen[row, p[p < vocab]] = True
        lengths = [p.numel() for p in prompts]
        self.min_new = torch.tensor([opts.min_new_for(n) for n in lengths], device=device)
        self.any_min = bool(self.eos is not None and int(self.min_new.max()) > 0)
        if self.any_min:
            self.eos_columns = torch.zeros(1, vocab, dtype=torch.bool, device=device)
            self.eos_columns[0, self.eos[self.eos < vocab]] = True
        self.scores: list[torch.Tensor] = []
        self.raw: list[torch.Tensor] = []
        # stop strings: each row's new tokens on the host, decoded after every step (a host sync per step)
        self.stop_text = [[] for _ in range(b)] if opts.stop_strings else None
        self.stopped = torch.zeros(b, dtype=torch.bool)

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """logits (b, vocab) of the current positions -> next tokens (b,)."""
        o = self.opts
        if o.output_logits:
            self.raw.append(logits.float().clone())  # a graphed step's logits live in a static buffer
        if not (o.do_sample or o.output_scores or self.seen is not None or self.any_min):
            return self._finish(logits.argmax(dim=-1))  # greedy on the logits as they are: no fp32 copy per step
        scores = logits.float()
        if self.seen is not None:
            scores = repetition_penalty_(scores, self.seen, o.repetition_penalty)
        if self.any_min:  # rows still under their minimum length cannot end
            early = (step < self.min_new)[:, None]
            scores = scores.masked_fill(early & self.eos_columns, float("-inf"))
        if o.do_sample:
            scores = warp(scores, o.temperature, o.top_k, o.top_p, o.min_p)
            token = draw(scores, o.generator)
        else:
            token = scores.argmax(dim=-1)
        if o.output_scores:  # a copy when nothing changed the logits (a graphed step's are a static buffer)
            self.scores.append(scores.clone() if scores.data_ptr() == logits.data_ptr() else scores)
        return self._finish(token)

    def _finish(self, token: torch.Tensor) -> torch.Tensor:
        """Padding for finished rows, the finished / stop-string bookkeeping, the repetition record."""
        finished_before = self.done
        if self.eos is not None or self.stop_text is not None:
            token = token.masked_fill(finished_before, self.pad)
        if self.eos is not None:
            self.done = self.done | torch.isin(token, self.eos)
        if self.stop_text is not None:
            self._check_stop_strings(token, finished_before)
        if self.seen is not None:
            self.seen.scatter_(1, token[:, None], True)
        return token

    def _check_stop_strings(self, token: torch.Tensor, finished_before: torch.Tensor) -> None:
        """A row whose generated text now contains a stop string is finished (its later tokens are padding)."""
        before = finished_before.cpu()
        for row, t in enumerate(token.tolist()):
            if before[row]:
                continue
            self.stop_text[row].append(t)
            text = self.opts.tokenizer.decode(self.stop_text[row])
            if any(s in text for s in self.opts.stop_strings):
                self.stopped[row] = True
        self.done = self.done | self.stopped.to(self.done.device)

    def all_done(self) -> bool:
        return (self.eos is not None or self.stop_text is not None) and bool(self.done.all())


def _decode(run, cache: InferenceParams, logits: torch.Tensor, n_steps: int, vocab: int, decoder: _Decoder,
            emit) -> torch.Tensor:
    """logits (b, vocab) of the prompts' last positions -> new tokens (b, n), n <= n_steps.

    Advances ``cache.seqlen_offset`` by one per decoded token; ``emit(token)`` sees each step's tokens. The loop
    stops once every row is finished (the only host sync of a step without a streamer)."""
    new_tokens = []
    for step in range(n_steps):
        token = decoder(logits, step)
        new_tokens.append(token)
        emit(token)
        if step == n_steps - 1 or decoder.all_done():
            break
        logits = run(token[:, None], inference_params=cache).logits[:, -1, :vocab]
        cache.seqlen_offset += 1
    if not new_tokens:
        return logits.new_zeros(logits.shape[0], 0, dtype=torch.long)
    return torch.stack(new_tokens, dim=1)


def _vocab(model, opts: GenerateOptions) -> int:
    vocab = model.config.vocab_size
    return min(vocab, opts.vocab_size) if opts.vocab_size else vocab


def _generate_ragged(model, prompts: list[torch.Tensor], opts: GenerateOptions):
    """prompts: list of (L_i,) -> (list of (L_i + n_i,), decoder): each row cut after its first eos (no padding)
    and at its own length limit."""
    prompts = _check_prompts(prompts)
    lengths = [p.numel() for p in prompts]
    caps = [opts.new_tokens_for(n) for n in lengths]
    n_steps = max(caps)
    if opts.streamer is not None and len(prompts) > 1 and not _batched(opts):
        raise ValueError("generate: a streamer follows one sequence; pass one prompt (or a (1, L) tensor), or "
                         "stream every row with inference.TokenStream / stream_generate")
    vocab = _vocab(model, opts)
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])  # stable: equal lengths keep the input order
    sorted_prompts = [prompts[i] for i in order]
    decoder = _Decoder(opts, sorted_prompts, vocab, prompts[0].device)  # rows in the sorted order
    if n_steps == 0:
        return prompts, decoder
    if len(set(lengths)) > 1:
        _refuse_attention(model)
    b, longest = len(prompts), max(lengths)
    run, cache = _runner(model, b, longest + n_steps, opts)
    # One prefill per distinct length, into its block of rows; ``model`` directly (a graphed runner only replays).
    last_logits, start = [], 0
    while start < b:
        stop = start
        while stop < b and lengths[order[stop]] == lengths[order[start]]:
            stop += 1
        group = torch.stack(sorted_prompts[start:stop])
        view = _row_view(cache, start, stop) if (start, stop) != (0, b) else cache
        last_logits.append(model(group, inference_params=view, num_last_tokens=1).logits[:, -1, :vocab])
        start = stop
    # Mamba steps only test offset > 0; the longest prompt bounds every row's position (cache capacity checks).
    cache.seqlen_offset = longest
    emit = _streamer_emit(opts, order, [caps[i] for i in order], decoder.pad)
    if opts.streamer is not None and not _batched(opts):
        opts.streamer.put(prompts[0][None].cpu())
    new = _decode(run, cache, torch.cat(last_logits), n_steps, vocab, decoder, emit).cpu()
    _unsort_records(decoder, order)

    out: list[torch.Tensor | None] = [None] * b
    for row, i in enumerate(order):
        tokens = new[row][: caps[i]]
        if decoder.stop_text is not None and decoder.stopped[row]:
            tokens = tokens[: len(decoder.stop_text[row])]  # up to the token that completed the stop string
        if opts.eos:
            hits = torch.isin(tokens, torch.tensor(opts.eos)).nonzero()
            if len(hits):
                tokens = tokens[: int(hits[0]) + 1]
        out[i] = torch.cat([prompts[i], tokens.to(prompts[i].device)])
    return out, decoder


def _inverse(order: list[int]) -> torch.Tensor:
    """The decode rows' input indices -> the decode row of every input (indexing a decode-order tensor with it
    gives input order)."""
    return torch.argsort(torch.tensor(order))


def _unsort_records(decoder: _Decoder, order: list[int]) -> None:
    """Scores / logits recorded in the sorted row order -> input order."""
    inverse = _inverse(order)
    for records in (decoder.scores, decoder.raw):
        for k, t in enumerate(records):
            records[k] = t[inverse.to(t.device)]


def _batched(opts: GenerateOptions) -> bool:
    """A streamer that takes every row of each step (TokenStream), not one sequence with its prompt first."""
    return bool(getattr(opts.streamer, "batched", False))


def _streamer_emit(opts: GenerateOptions, order: list[int] | None = None, caps: list[int] | None = None,
                   pad: int = 0):
    """Each step's tokens -> the streamer. A batched one gets them in input order (``order``: the decode rows'
    input indices), rows past their own limit (``caps``, in decode order) as ``pad``."""
    if opts.streamer is None:
        return lambda token: None
    if not _batched(opts):
        return lambda token: opts.streamer.put(token.cpu())
    inverse = None if order is None else _inverse(order)
    limits = None if caps is None else torch.tensor(caps)
    step = [0]

    def emit(token):
        t = token.cpu()
        if limits is not None:
            t = t.masked_fill(limits <= step[0], pad)
        opts.streamer.put(t if inverse is None else t[inverse])
        step[0] += 1
    return emit


def _left_padded_to_prompts(input_ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """A left-padded batch (b, L) and its attention_mask -> the unpadded prompts; right padding is refused."""
    if mask.shape != input_ids.shape:
        raise ValueError(f"generate: attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(mask.shape)}")
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    starts = input_ids.shape[1] - lengths
    positions = torch.arange(input_ids.shape[1], device=mask.device)[None]
    if not torch.equal(mask, positions >= starts[:, None]) or bool((lengths == 0).any()):
        raise ValueError("generate: attention_mask must describe left padding (zeros, then ones, at least one one "
                         "per row); right-padded rows would decode after their padding")
    return [row[s:] for row, s in zip(input_ids, starts.tolist())]


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor | list[torch.Tensor], *args, **kwargs):
    """input_ids (b, L) int64 -> (b, L + n) token ids; or a list of 1-D prompts (L_i,) of any lengths -> a list of
    1-D (L_i + n_i,) in input order (ragged requests, pure Mamba / Mamba2 models when the lengths differ); with
    ``return_dict_in_generate=True`` a GenerateOutput holding them. Every option is a keyword (see the module
    docstring and inference/generate_options.py).

    A row that emits an eos id is finished: in the (b, L + n) result its later positions hold ``pad_token_id``
    (eos when unset), in the list result it ends at its eos; the loop stops once every row is finished. A (b, L)
    batch with an ``attention_mask`` that has zeros is read as left-padded prompts (decoded as a ragged batch)
    and returned in the same left-padded layout.
    """
    if args:
        raise TypeError("generate(): pass the length by keyword, max_new_tokens=N or max_length=N (mamba_ssm's "
                        "second positional argument is max_length, transformers' is generation_config)")
    opts = resolve(model, kwargs)
    t0 = time.perf_counter()
    if isinstance(input_ids, (list, tuple)):
        sequences, decoder = _generate_ragged(model, list(input_ids), opts)
    else:
        sequences, decoder = _generate_batch(model, input_ids, opts)
    if opts.streamer is not None:
        opts.streamer.end()
    if opts.enable_timing:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(f"Prompt processing + decoding time: {(time.perf_counter() - t0) * 1000:.0f}ms", file=sys.stderr)
    if not opts.return_dict:
        return sequences
    return GenerateOutput(sequences, tuple(decoder.scores) if opts.output_scores else None,
                          tuple(decoder.raw) if opts.output_logits else None)


def _generate_batch(model, input_ids: torch.Tensor, opts: GenerateOptions):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"generate: input_ids must be (batch, seqlen >= 1) or a list of 1-D prompts, got {shape}")
    mask = opts.attention_mask
    if mask is not None and not bool(mask.bool().all()):
        return _generate_left_padded(model, input_ids, mask, opts)
    b, L = input_ids.shape
    vocab = _vocab(model, opts)
    prompts = list(input_ids)
    decoder = _Decoder(opts, prompts, vocab, input_ids.device)
    n = opts.new_tokens_for(L)
    if opts.streamer is not None and not _batched(opts):
        if b != 1:
            raise ValueError(f"generate: a streamer follows one sequence; input_ids has {b} rows (stream every "
                             "row with inference.TokenStream / stream_generate)")
        opts.streamer.put(input_ids.cpu())
    if n == 0:
        return input_ids, decoder
    run, cache = _runner(model, b, L + n, opts)
    logits = run(input_ids, inference_params=cache, num_last_tokens=1).logits[:, -1, :vocab]
    cache.seqlen_offset = L
    new = _decode(run, cache, logits, n, vocab, decoder, _streamer_emit(opts))
    return torch.cat([input_ids, new], dim=1), decoder


def _generate_left_padded(model, input_ids: torch.Tensor, mask: torch.Tensor, opts: GenerateOptions):
    """A left-padded batch -> the same layout, each row's new tokens after its prompt, finished rows padded."""
    prompts = _left_padded_to_prompts(input_ids, mask)
    b, L = input_ids.shape
    opts.max_new_tokens, opts.max_length = opts.new_tokens_for(L), None  # one limit for every padded row
    rows, decoder = _generate_ragged(model, prompts, opts)
    n = max(r.numel() - p.numel() for r, p in zip(rows, prompts))
    pad = decoder.pad if decoder.pad is not None else 0
    out = torch.full((b, L + n), pad, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :L] = input_ids
    for i, (r, p) in enumerate(zip(rows, prompts)):
        out[i, L:L + r.numel() - p.numel()] = r[p.numel():]
    return out, decoder
