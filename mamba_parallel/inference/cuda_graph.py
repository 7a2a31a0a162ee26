"""CUDA-graph decode: capture a model's one-token step once per batch size, then replay it for every new token.

A decode step of a Mamba model is ~10 small kernels per layer; at batch 1 launching them costs more than running
them. Captured into a CUDA graph, the whole step is one launch. The graph reads its input token from a static
buffer and updates the recurrent states of a static cache in place, so every generation with that batch size
reuses the same buffers: ``new_cache()`` zeroes them, prefill runs eagerly into them, then each call with one
token replays the graph.

Only Mamba / Mamba2 layers: an attention layer writes its KV cache at ``seqlen_offset``, a Python int that a
graph would freeze at its capture value.

Use through ``decode_runner`` (what ``generate`` calls):

    run, cache = decode_runner(model, batch, max_seqlen, dtype, cuda_graph=True)
    logits = run(prompt, inference_params=cache, num_last_tokens=1).logits  # eager prefill, static cache
    cache.seqlen_offset = prompt.shape[1]
    logits = run(token[:, None], inference_params=cache).logits             # graph replay
"""

from __future__ import annotations

import torch

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.models.outputs import CausalLMOutput

# model attribute holding {(batch_size, dtype, state_dtype): GraphedDecoder}: a graph is captured once per batch size
_ATTR = "_mp_graphed_decoders"


def _param_state(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """Storage and version of every parameter: a captured step also holds constants derived from them
    (layers/decode_constants.py), so an in-place update (a training step between generations) recaptures."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _attention_layers(model: torch.nn.Module) -> list[int]:
    return list(getattr(model.config, "attn_layer_idx", []) or [])


class GraphedDecoder:
    """One captured decode step of ``model`` for ``batch_size`` rows (cache dtype ``dtype``, recurrent states in
    ``state_dtype``, fp32 when None).

    Attributes: ``cache`` (the static InferenceParams the graph reads and writes), ``input_ids`` (b, 1) int64 and
    ``logits`` (b, 1, padded_vocab) static buffers, ``graph`` (torch.cuda.CUDAGraph).
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None,
                 n_warmup: int = 2, pool=None, state_dtype: torch.dtype | None = None):
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDA-graph decode needs the model on a CUDA device, it is on {device}")
        attn = _attention_layers(model)
        if attn:
            raise ValueError(f"CUDA-graph decode supports Mamba / Mamba2 layers only; layers {attn} "
                             f"(config.attn_layer_idx) are attention, whose KV-cache position cannot be captured")
        if batch_size < 1 or max_seqlen < 2:
            raise ValueError(f"GraphedDecoder: need batch_size >= 1 and max_seqlen >= 2, got {batch_size}, "
                             f"{max_seqlen}")
        self.model, self.batch_size, self.max_seqlen, self.dtype = model, batch_size, max_seqlen, dtype
        self.state_dtype = state_dtype
        self.param_state = _param_state(model)
        with torch.inference_mode():
            self.cache = model.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, state_dtype=state_dtype)
            self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
            self.cache.seqlen_offset = 1  # > 0: the mixers take their one-token step path while capturing
            # Warm-up on a side stream (Triton autotuning and cuBLAS workspaces happen here, not in the capture).
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(n_warmup):
                    model(self.input_ids, inference_params=self.cache)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.logits = model(self.input_ids, inference_params=self.cache).logits
            self.new_cache()

    def new_cache(self) -> InferenceParams:
        """Zero the static states and rewind the offset: the cache of a fresh sequence (same buffers)."""
        with torch.inference_mode():
            self.cache.reset(self.max_seqlen, self.batch_size)
        return self.cache

    def matches(self, model: torch.nn.Module, max_seqlen: int) -> bool:
        """True when this graph still serves ``model`` (same parameter storage and versions) for ``max_seqlen``
        positions."""
        return model is self.model and max_seqlen <= self.max_seqlen and _param_state(model) == self.param_state

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, inference_params: InferenceParams | None = None,
                 num_last_tokens: int = 0) -> CausalLMOutput:
        """input_ids (b, L) -> CausalLMOutput with logits (b, L or num_last_tokens, padded_vocab), like
        ``model(...)``.

        One token (L == 1) after prefill replays the graph and returns the STATIC logits buffer (overwritten by
        the next replay: use it before the next call). Anything else (the prompt) runs the model eagerly.
        """
        if inference_params is not self.cache:
            raise ValueError("GraphedDecoder: inference_params must be this decoder's own cache (decoder.cache / "
                             "decoder.new_cache()); its buffers are the ones the graph reads and writes")
        if input_ids.shape[0] != self.batch_size:
            raise ValueError(f"GraphedDecoder: captured for batch {self.batch_size}, got input_ids of shape "
                             f"{tuple(input_ids.shape)}")
        if input_ids.shape[1] == 1 and self.cache.seqlen_offset > 0:
            if self.cache.seqlen_offset >= self.max_seqlen:
                raise ValueError(f"GraphedDecoder: cache holds {self.max_seqlen} positions, decoding position "
                                 f"{self.cache.seqlen_offset}")
            self.input_ids.copy_(input_ids)
            self.graph.replay()
            return CausalLMOutput(logits=self.logits)
        return self.model(input_ids, inference_params=self.cache, num_last_tokens=num_last_tokens)


def make_graphed_decoder(model: torch.nn.Module, batch_size: int, max_seqlen: int,
                         dtype: torch.dtype | None = None, state_dtype: torch.dtype | None = None) -> GraphedDecoder:
    """The graphed decoder of ``model`` for ``batch_size`` rows: captured on first use, then kept on the model and
    reused (re-captured when the parameters moved, e.g. after ``model.to(...)``, or ``max_seqlen`` grew).
    Graphs of different batch sizes share one memory pool."""
    graphs = model.__dict__.setdefault(_ATTR, {})
    key = (batch_size, dtype, state_dtype)
    dec = graphs.get(key)
    if dec is not None and dec.matches(model, max_seqlen):
        return dec
    graphs.pop(key, None)
    pool = next(iter(graphs.values())).graph.pool() if graphs else None
    dec = GraphedDecoder(model, batch_size, max(max_seqlen, dec.max_seqlen if dec else 0), dtype, pool=pool,
                         state_dtype=state_dtype)
    graphs[key] = dec
    return dec


def release_graphs(model: torch.nn.Module) -> None:
    """Drop every graph and static cache kept on ``model`` (frees their GPU memory)."""
    model.__dict__.pop(_ATTR, None)


def decode_runner(model: torch.nn.Module, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None,
                  cuda_graph: bool = False, state_dtype: torch.dtype | None = None):
    """-> (run, cache): ``run(input_ids, inference_params=cache, num_last_tokens=...)`` computes logits like
    ``model(...)``; with ``cuda_graph`` its one-token calls replay a captured graph and ``cache`` is the graph's
    static cache, zeroed. Without, ``run`` is the model and ``cache`` a fresh ``allocate_inference_cache``."""
    if not cuda_graph:
        return model, model.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, state_dtype=state_dtype)
    dec = make_graphed_decoder(model, batch_size, max_seqlen, dtype, state_dtype)
    return dec, dec.new_cache()
