"""Inference: the per-layer cache, token sampling, and the prefill + decode loop."""

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.inference.generate import GenerateOutput, generate
from mamba_parallel.inference.generation_config import GenerationConfig
from mamba_parallel.inference.sampling import min_p_filter, sample, top_k_filter, top_p_filter
from mamba_parallel.inference.token_stream import TokenStream, stream_generate

__all__ = ["GenerateOutput", "GenerationConfig", "InferenceParams", "TokenStream", "generate", "min_p_filter",
           "sample", "stream_generate", "top_k_filter", "top_p_filter"]
