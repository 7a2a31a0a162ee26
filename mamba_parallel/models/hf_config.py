"""MambaConfig <-> HF transformers' ``MambaConfig`` / ``Mamba2Config`` (the ``config.json`` of an HF folder).

transformers is not imported: its field names and defaults (transformers 5.x, ``configuration_mamba.py`` and
``configuration_mamba2.py``) are written down here, so a field missing from a config.json means what it means to
transformers. HF stores the padded vocabulary as ``vocab_size`` (its embedding has that many rows), so a model read
from HF gets ``pad_vocab_size_multiple=1`` and a model saved to HF writes ``padded_vocab_size``.
"""

from __future__ import annotations

import math
from typing import Any

from mamba_parallel.config import MAMBA1_DEFAULTS, MAMBA2_DEFAULTS, ConfigError, MambaConfig

# model_type -> the causal-LM class transformers builds for it.
HF_ARCHITECTURES = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}
# Backbone-only classes whose weights carry no "backbone." prefix and no lm_head.
HF_BACKBONES = {"mamba": "MambaModel", "mamba2": "Mamba2Model"}

# transformers' defaults for the fields we read (what a field missing from config.json means there).
HF_COMMON_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, num_hidden_layers=32, vocab_size=50280, layer_norm_epsilon=1e-5, expand=2, conv_kernel=4,
    use_bias=False, use_conv_bias=True, hidden_act="silu", initializer_range=0.1, residual_in_fp32=True,
    time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, rescale_prenorm_residual=False,
)
HF_MAMBA1_DEFAULTS: dict[str, Any] = dict(
    HF_COMMON_DEFAULTS, state_size=16, time_step_rank="auto", time_step_scale=1.0, time_step_init_scheme="random",
    tie_word_embeddings=True,
)
HF_MAMBA2_DEFAULTS: dict[str, Any] = dict(
    HF_COMMON_DEFAULTS, hidden_size=4096, num_hidden_layers=64, vocab_size=32768, state_size=128, num_heads=128,
    head_dim=64, n_groups=8, chunk_size=256, time_step_limit=(0.0, math.inf), tie_word_embeddings=False,
)

# Our Mamba2 gated norm (like mamba_ssm's) has a fixed eps; HF's uses layer_norm_epsilon.
_GATED_NORM_EPS = 1e-5
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


class HFConfigError(ValueError):
    """A config.json transformers' Mamba classes would read differently from us, or a model HF cannot express."""


def decode_special_floats(obj: Any) -> Any:
    """transformers >= 5 writes inf as ``{"__float__": "Infinity"}`` (older versions write a bare ``Infinity``)."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def encode_special_floats(obj: Any) -> Any:
    """The inverse of :func:`decode_special_floats`, as transformers 5 writes it (strict JSON, no bare Infinity)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: encode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_special_floats(v) for v in obj]
    return obj


def hf_model_type(raw: dict) -> str | None:
    """"mamba" / "mamba2" when config.json describes one of transformers' Mamba models, else None."""
    mt = raw.get("model_type")
    if mt in HF_ARCHITECTURES:
        return mt
    if mt is None:
        archs = raw.get("architectures") or []
        for model_type in HF_ARCHITECTURES:
            if HF_ARCHITECTURES[model_type] in archs or HF_BACKBONES[model_type] in archs:
                return model_type
    return None


def config_from_hf(raw: dict, source: str = "config.json") -> MambaConfig:
    """The MambaConfig of an HF ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` config.json (a parsed dict)."""
    raw = decode_special_floats(raw)
    model_type = hf_model_type(raw)
    if model_type is None:
        raise HFConfigError(f"{source}: model_type={raw.get('model_type')!r}, architectures="
                            f"{raw.get('architectures')!r} is not one of transformers' Mamba models "
                            f"(model_type 'mamba' or 'mamba2')")
    c = dict(HF_MAMBA2_DEFAULTS if model_type == "mamba2" else HF_MAMBA1_DEFAULTS)
    c.update({k: v for k, v in raw.items() if k in c})
    if c["hidden_act"] not in ("silu", "swish"):
        raise HFConfigError(f"{source}: hidden_act={c['hidden_act']!r} is not supported (Mamba mixers use silu)")
    common = dict(
        d_model=c["hidden_size"], n_layer=c["num_hidden_layers"], vocab_size=c["vocab_size"],
        pad_vocab_size_multiple=1, tie_embeddings=bool(c["tie_word_embeddings"]),
        norm_epsilon=float(c["layer_norm_epsilon"]), residual_in_fp32=bool(c["residual_in_fp32"]),
        rescale_prenorm_residual=bool(c["rescale_prenorm_residual"]), initializer_range=c["initializer_range"],
        rms_norm=True, fused_add_norm=True,
    )
    ssm = dict(d_state=c["state_size"], d_conv=c["conv_kernel"], expand=c["expand"], dt_min=c["time_step_min"],
               dt_max=c["time_step_max"], dt_init_floor=c["time_step_floor"], conv_bias=bool(c["use_conv_bias"]),
               bias=bool(c["use_bias"]))
    if model_type == "mamba":
        ssm.update(layer="Mamba1", dt_rank=c["time_step_rank"], dt_scale=c["time_step_scale"],
                   dt_init=c["time_step_init_scheme"])
    else:
        d_inner = int(c["expand"] * c["hidden_size"])
        if c["num_heads"] * c["head_dim"] != d_inner:
            raise HFConfigError(f"{source}: num_heads * head_dim = {c['num_heads']} * {c['head_dim']} must equal "
                                f"expand * hidden_size = {d_inner}")
        if float(c["layer_norm_epsilon"]) != _GATED_NORM_EPS:
            raise HFConfigError(f"{source}: layer_norm_epsilon={c['layer_norm_epsilon']} is not supported for "
                                f"mamba2: HF uses it in the gated norm too, ours (as mamba_ssm's) uses "
                                f"{_GATED_NORM_EPS}")
        ssm.update(layer="Mamba2", headdim=c["head_dim"], ngroups=c["n_groups"], chunk_size=c["chunk_size"],
                   dt_limit=tuple(float(x) for x in c["time_step_limit"]),
                   # HF's Mamba2 always gates before its grouped norm and has one D per head.
                   rmsnorm=True, norm_before_gate=False, D_has_hdim=False)
    try:
        return MambaConfig(**common, ssm_cfg=ssm)
    except ConfigError as e:
        raise HFConfigError(f"{source}: {e}") from e


def hf_incompatibilities(config: MambaConfig) -> list[str]:
    """Why transformers' Mamba / Mamba2 classes cannot hold this model ([] when they can)."""
    why = []
    if config.attn_layer_idx:
        why.append(f"attention layers at attn_layer_idx={config.attn_layer_idx} (HF Mamba models have none)")
    if config.d_intermediate > 0:
        why.append(f"an MLP after every mixer (d_intermediate={config.d_intermediate}; HF Mamba models have none)")
    if not config.rms_norm:
        why.append("rms_norm=False (LayerNorm); HF Mamba models use RMSNorm")
    m = config.mixer_cfg
    if float(m["expand"]) != int(m["expand"]):
        why.append(f"expand={m['expand']} is not an integer (HF's config field is an int)")
    if config.layer == "Mamba2":
        if not m["rmsnorm"]:
            why.append("ssm_cfg.rmsnorm=False; HF Mamba2 always has the gated norm")
        if m["norm_before_gate"]:
            why.append("ssm_cfg.norm_before_gate=True; HF Mamba2 always applies the gate before the norm")
        if config.norm_epsilon != _GATED_NORM_EPS:
            why.append(f"norm_epsilon={config.norm_epsilon}: HF Mamba2 uses it in the gated norm too, where ours "
                       f"(as mamba_ssm's) uses {_GATED_NORM_EPS}")
        if m["D_has_hdim"]:
            why.append("ssm_cfg.D_has_hdim=True; HF Mamba2 has one D per head")
    return why


def hf_config_from(config: MambaConfig, dtype_name: str | None = None) -> dict:
    """The config.json dict of transformers' MambaForCausalLM / Mamba2ForCausalLM for ``config``.

    Raises HFConfigError naming every feature transformers cannot express (hybrid layers, MLPs, ...).
    """
    why = hf_incompatibilities(config)
    if why:
        raise HFConfigError("cannot save in format 'hf': " + "; ".join(why)
                            + ". Save with format='mamba_ssm' instead.")
    m = config.mixer_cfg
    model_type = "mamba2" if config.layer == "Mamba2" else "mamba"
    out: dict[str, Any] = dict(
        architectures=[HF_ARCHITECTURES[model_type]], model_type=model_type,
        hidden_size=config.d_model, num_hidden_layers=config.n_layer, vocab_size=config.padded_vocab_size,
        state_size=m["d_state"], conv_kernel=m["d_conv"], expand=int(m["expand"]),
        use_bias=bool(m["bias"]), use_conv_bias=bool(m["conv_bias"]), hidden_act="silu",
        layer_norm_epsilon=config.norm_epsilon, residual_in_fp32=config.residual_in_fp32,
        rescale_prenorm_residual=config.rescale_prenorm_residual, initializer_range=config.initializer_range,
        time_step_min=m["dt_min"], time_step_max=m["dt_max"], time_step_floor=m["dt_init_floor"],
        tie_word_embeddings=config.tie_embeddings,
        # The tokenizer is not part of MambaConfig: leave the special tokens unset rather than guess them.
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if model_type == "mamba":
        out.update(intermediate_size=config.d_inner, time_step_rank=config.dt_rank, time_step_scale=m["dt_scale"],
                   time_step_init_scheme=m["dt_init"])
    else:
        out.update(num_heads=config.nheads, head_dim=m["headdim"], n_groups=m["ngroups"],
                   chunk_size=m["chunk_size"], time_step_limit=[float(x) for x in m["dt_limit"]],
                   time_step_rank=config.dt_rank)
    if dtype_name is not None:
        out["dtype"] = dtype_name
    return encode_special_floats(out)
