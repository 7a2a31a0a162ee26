"""The arguments of ``generate``: transformers' and mamba_ssm's names, resolved once against the model's
generation defaults (inference/generation_config.py), checked, with one clear error for anything unknown.

Greedy unless sampling is asked for: ``do_sample=True`` (transformers' switch), or, when ``do_sample`` is not given,
a ``top_k`` other than 1 (mamba_ssm samples exactly then: its top_k defaults to 1, greedy). ``temperature=0`` is
greedy too. Length: ``max_new_tokens``, or ``max_length`` counting the prompt (transformers and mamba_ssm).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mamba_parallel.inference.generation_config import GenerationConfig

# transformers' defaults for sampling options nobody set (its GenerationConfig._get_default_generation_params).
SAMPLING_DEFAULTS = dict(temperature=1.0, top_k=50, top_p=1.0, min_p=0.0, repetition_penalty=1.0)

KNOWN = {
    # length
    "max_length", "max_new_tokens", "min_length", "min_new_tokens",
    # decoding (transformers / mamba_ssm)
    "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "eos_token_id", "pad_token_id",
    "bos_token_id", "generator", "vocab_size", "generation_config",
    # stop strings (transformers' names: the tokenizer decodes what each row generated)
    "stop_strings", "tokenizer",
    # output
    "streamer", "return_dict_in_generate", "output_scores", "output_logits", "enable_timing",
    # running
    "cuda_graph", "cg", "cache_dtype", "state_dtype", "attention_mask", "use_cache", "num_beams", "num_return_sequences",
}
# Known names whose other values are not implemented: say so instead of silently ignoring them.
_ONLY = {"use_cache": (True, None), "num_beams": (1, None), "num_return_sequences": (1, None)}


@dataclass
class GenerateOptions:
    """Everything the decode loop needs, resolved. eos: ids that finish a row; pad: what fills finished rows."""

    max_new_tokens: int | None
    max_length: int | None
    min_new_tokens: int
    min_length: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    eos: list[int]
    pad: int | None
    vocab_size: int | None
    generator: torch.Generator | None = None
    streamer: object = None
    return_dict: bool = False
    output_scores: bool = False
    output_logits: bool = False
    enable_timing: bool = False
    cuda_graph: bool = False
    cache_dtype: torch.dtype | None = None
    state_dtype: torch.dtype | None = None
    attention_mask: torch.Tensor | None = None
    stop_strings: list[str] = field(default_factory=list)
    tokenizer: object = None

    def new_tokens_for(self, prompt_len: int) -> int:
        """How many tokens a prompt of ``prompt_len`` may gain (max_new_tokens wins over max_length)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(0, self.max_length - prompt_len)

    def min_new_for(self, prompt_len: int) -> int:
        return max(self.min_new_tokens, self.min_length - prompt_len)


STATE_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def state_dtype_of(value) -> torch.dtype | None:
    """``state_dtype`` as given (None, a torch dtype or one of STATE_DTYPES' names) -> a torch dtype or None."""
    if value is None or value in STATE_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower() in STATE_DTYPES:
        return STATE_DTYPES[value.lower()]
    raise ValueError(f"generate(): state_dtype must be torch.float32, torch.bfloat16 or torch.float16 (or "
                     f"'fp32' / 'bf16' / 'fp16'), got {value!r}")


def resolve(model, kwargs: dict) -> GenerateOptions:
    """kwargs of generate() (without input_ids) -> GenerateOptions; TypeError / ValueError naming the argument."""
    unknown = sorted(set(kwargs) - KNOWN)
    if unknown:
        raise TypeError(f"generate() got unknown argument(s) {unknown}; known: {', '.join(sorted(KNOWN))}")
    for name, ok in _ONLY.items():
        if name in kwargs and kwargs[name] not in ok:
            raise ValueError(f"generate(): {name}={kwargs[name]!r} is not supported (only {ok[0]!r})")
    if "cg" in kwargs and "cuda_graph" in kwargs and bool(kwargs["cg"]) != bool(kwargs["cuda_graph"]):
        raise ValueError("generate(): cg and cuda_graph are the same option; they disagree")
    given = GenerationConfig.from_any(kwargs.get("generation_config"))
    model_cfg = GenerationConfig.from_any(getattr(model, "generation_config", None))

    def pick(name, default=None):
        for source in (kwargs.get(name), getattr(given, name, None), getattr(model_cfg, name, None)):
            if source is not None:
                return source
        return default

    max_new, max_len = kwargs.get("max_new_tokens"), kwargs.get("max_length")
    if max_new is None and max_len is None:  # neither passed here: the first config that sets one
        for cfg in (given, model_cfg):
            if cfg.max_new_tokens is not None or cfg.max_length is not None:
                max_new, max_len = cfg.max_new_tokens, cfg.max_length
                break
    if max_new is None and max_len is None:
        raise ValueError("generate(): say how long to generate: max_new_tokens=N (new tokens) or max_length=N "
                         "(prompt + new tokens)")
    for name, v in (("max_new_tokens", max_new), ("max_length", max_len)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"generate(): {name} must be an integer >= 0, got {v!r}")

    top_k_given = pick("top_k")
    do_sample = pick("do_sample")
    if do_sample is None:
        do_sample = top_k_given is not None and int(top_k_given) != 1
    temperature = float(pick("temperature", SAMPLING_DEFAULTS["temperature"]))
    if temperature < 0:
        raise ValueError(f"generate(): temperature must be >= 0, got {temperature}")
    top_k = int(top_k_given if top_k_given is not None else SAMPLING_DEFAULTS["top_k"])
    if temperature == 0 or top_k == 1:
        do_sample = False
    top_p = float(pick("top_p", SAMPLING_DEFAULTS["top_p"]))
    min_p = float(pick("min_p", SAMPLING_DEFAULTS["min_p"]))
    penalty = float(pick("repetition_penalty", SAMPLING_DEFAULTS["repetition_penalty"]))
    if top_k < 0 or not 0.0 <= top_p <= 1.0 or not 0.0 <= min_p <= 1.0 or penalty <= 0:
        raise ValueError(f"generate(): need top_k >= 0, 0 <= top_p <= 1, 0 <= min_p <= 1, repetition_penalty > 0; "
                         f"got top_k={top_k}, top_p={top_p}, min_p={min_p}, repetition_penalty={penalty}")
    eos = pick("eos_token_id")
    eos_ids = GenerationConfig(eos_token_id=eos).eos_ids()
    pad = pick("pad_token_id")
    vocab = kwargs.get("vocab_size")
    stops = kwargs.get("stop_strings") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    if stops and getattr(kwargs.get("tokenizer"), "decode", None) is None:
        raise ValueError("generate(): stop_strings need tokenizer= (an object with decode(ids) -> str)")
    cg = bool(kwargs.get("cuda_graph", False) or kwargs.get("cg", False))
    return GenerateOptions(
        max_new_tokens=max_new, max_length=max_len, min_new_tokens=int(pick("min_new_tokens", 0)),
        min_length=int(pick("min_length", 0)), do_sample=bool(do_sample), temperature=temperature,
        top_k=top_k if do_sample else 0, top_p=top_p, min_p=min_p, repetition_penalty=penalty, eos=eos_ids,
        pad=None if pad is None else int(pad), vocab_size=None if vocab is None else int(vocab),
        generator=kwargs.get("generator"), streamer=kwargs.get("streamer"),
        return_dict=bool(kwargs.get("return_dict_in_generate", False)),
        output_scores=bool(kwargs.get("output_scores", False)), output_logits=bool(kwargs.get("output_logits", False)),
        enable_timing=bool(kwargs.get("enable_timing", False)), cuda_graph=cg, cache_dtype=kwargs.get("cache_dtype"),
        state_dtype=state_dtype_of(kwargs.get("state_dtype")),
        attention_mask=kwargs.get("attention_mask"), stop_strings=stops, tokenizer=kwargs.get("tokenizer"))
