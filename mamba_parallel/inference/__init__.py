"""Inference: the per-layer cache, token sampling, and the prefill + decode loop."""

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.inference.generate import generate
from mamba_parallel.inference.sampling import sample, top_k_filter, top_p_filter

__all__ = ["InferenceParams", "generate", "sample", "top_k_filter", "top_p_filter"]
