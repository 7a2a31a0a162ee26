"""transformers' MambaForCausalLM, FalconMambaForCausalLM and Mamba2ForCausalLM (model_type "mamba",
"falcon_mamba", "mamba2") <-> MambaConfig. Falcon-Mamba is Mamba-1 with weightless RMS norms on dt_low, B and C
(``ssm_cfg.bcdt_rms_norm``, eps ``mixer_rms_eps``); its norms hold no weights in a file.

Tensor names equal ours (mamba_ssm's) but for the embedding: ``backbone.embeddings.weight``; a tied
``lm_head.weight`` is not stored. The backbone-only classes (MambaModel / Mamba2Model) store no "backbone." prefix.
"""

from __future__ import annotations

import math
from typing import Any

from mamba_parallel.config import MambaConfig
from mamba_parallel.models.hf_config import (
    HFArch,
    HFConfigError,
    build,
    need_silu,
    register,
    with_defaults,
)

EMBEDDING, HF_EMBEDDING = "backbone.embedding.weight", "backbone.embeddings.weight"

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
HF_FALCON_MAMBA_DEFAULTS: dict[str, Any] = dict(HF_MAMBA1_DEFAULTS, mixer_rms_eps=1e-6)
HF_MAMBA2_DEFAULTS: dict[str, Any] = dict(
    HF_COMMON_DEFAULTS, hidden_size=4096, num_hidden_layers=64, vocab_size=32768, state_size=128, num_heads=128,
    head_dim=64, n_groups=8, chunk_size=256, time_step_limit=(0.0, math.inf), tie_word_embeddings=False,
)


def mamba_tensor_names(config: MambaConfig, ours: str) -> list[tuple[str, int | None]]:
    return [(HF_EMBEDDING if ours == EMBEDDING else ours, None)]


def _common(c: dict) -> dict:
    return dict(d_model=c["hidden_size"], n_layer=c["num_hidden_layers"], vocab_size=c["vocab_size"],
                pad_vocab_size_multiple=1, tie_embeddings=bool(c["tie_word_embeddings"]),
                norm_epsilon=float(c["layer_norm_epsilon"]), residual_in_fp32=bool(c["residual_in_fp32"]),
                rescale_prenorm_residual=bool(c["rescale_prenorm_residual"]),
                initializer_range=c["initializer_range"], rms_norm=True, fused_add_norm=True)


def _ssm_common(c: dict) -> dict:
    return dict(d_state=c["state_size"], d_conv=c["conv_kernel"], expand=c["expand"], dt_min=c["time_step_min"],
                dt_max=c["time_step_max"], dt_init_floor=c["time_step_floor"], conv_bias=bool(c["use_conv_bias"]),
                bias=bool(c["use_bias"]))


def read_mamba1(raw: dict, source: str, falcon: bool = False) -> MambaConfig:
    c = with_defaults(raw, HF_FALCON_MAMBA_DEFAULTS if falcon else HF_MAMBA1_DEFAULTS)
    need_silu(c["hidden_act"], "hidden_act", source)
    ssm = dict(_ssm_common(c), layer="Mamba1", dt_rank=c["time_step_rank"], dt_scale=c["time_step_scale"],
               dt_init=c["time_step_init_scheme"])
    if falcon:
        ssm.update(bcdt_rms_norm=True, bcdt_rms_eps=float(c["mixer_rms_eps"]))
    return build(source, **_common(c), ssm_cfg=ssm)


def read_mamba2(raw: dict, source: str) -> MambaConfig:
    c = with_defaults(raw, HF_MAMBA2_DEFAULTS)
    need_silu(c["hidden_act"], "hidden_act", source)
    d_inner = int(c["expand"] * c["hidden_size"])
    if c["num_heads"] * c["head_dim"] != d_inner:
        raise HFConfigError(f"{source}: num_heads * head_dim = {c['num_heads']} * {c['head_dim']} must equal "
                            f"expand * hidden_size = {d_inner}")
    if float(c["layer_norm_epsilon"]) != 1e-5:
        raise HFConfigError(f"{source}: layer_norm_epsilon={c['layer_norm_epsilon']} is not supported for "
                            f"mamba2: transformers uses it in the gated norm too, ours (as mamba_ssm's) uses 1e-5")
    ssm = dict(_ssm_common(c), layer="Mamba2", headdim=c["head_dim"], ngroups=c["n_groups"],
               chunk_size=c["chunk_size"], dt_limit=tuple(float(x) for x in c["time_step_limit"]),
               # transformers' Mamba2 always gates before its grouped norm and has one D per head.
               rmsnorm=True, norm_before_gate=False, D_has_hdim=False)
    return build(source, **_common(c), ssm_cfg=ssm)


def integer_expand_reason(config: MambaConfig) -> list[str]:
    e = config.mixer_cfg["expand"]
    return [] if float(e) == int(e) else [f"expand={e} is not an integer (transformers' config field is an int)"]


def pure_stack_reasons(config: MambaConfig) -> list[str]:
    why = []
    if config.attn_layer_idx:
        why.append(f"attention layers at attn_layer_idx={config.attn_layer_idx} (this class has none)")
    if config.d_intermediate > 0:
        why.append(f"MLPs (d_intermediate={config.d_intermediate}; this class has none)")
    return why


def write_common(config: MambaConfig) -> dict:
    m = config.mixer_cfg
    return dict(hidden_size=config.d_model, num_hidden_layers=config.n_layer, vocab_size=config.padded_vocab_size,
                state_size=m["d_state"], conv_kernel=m["d_conv"], expand=int(m["expand"]),
                use_bias=bool(m["bias"]), use_conv_bias=bool(m["conv_bias"]), hidden_act="silu",
                layer_norm_epsilon=config.norm_epsilon, residual_in_fp32=config.residual_in_fp32,
                initializer_range=config.initializer_range, time_step_min=m["dt_min"], time_step_max=m["dt_max"],
                time_step_floor=m["dt_init_floor"], tie_word_embeddings=config.tie_embeddings)


def write_mamba1(config: MambaConfig) -> dict:
    m = config.mixer_cfg
    out = dict(write_common(config), intermediate_size=config.d_inner, time_step_rank=config.dt_rank,
               time_step_scale=m["dt_scale"], time_step_init_scheme=m["dt_init"])
    if m["bcdt_rms_norm"]:
        out["mixer_rms_eps"] = float(m["bcdt_rms_eps"])
    return out


def write_mamba2(config: MambaConfig) -> dict:
    m = config.mixer_cfg
    return dict(write_common(config), num_heads=config.nheads, head_dim=m["headdim"], n_groups=m["ngroups"],
                chunk_size=m["chunk_size"], time_step_limit=[float(x) for x in m["dt_limit"]],
                time_step_rank=config.dt_rank)


register(HFArch("mamba", "MambaForCausalLM", read_mamba1, write_mamba1,
                lambda c: pure_stack_reasons(c) + integer_expand_reason(c), mamba_tensor_names,
                backbone_class="MambaModel"))
register(HFArch("falcon_mamba", "FalconMambaForCausalLM", lambda raw, src: read_mamba1(raw, src, falcon=True),
                write_mamba1, lambda c: pure_stack_reasons(c) + integer_expand_reason(c), mamba_tensor_names,
                backbone_class="FalconMambaModel", ignored=(r".*\.(b|c|dt)_layernorm\.weight$",)))
register(HFArch("mamba2", "Mamba2ForCausalLM", read_mamba2, write_mamba2,
                lambda c: pure_stack_reasons(c) + integer_expand_reason(c), mamba_tensor_names,
                backbone_class="Mamba2Model"))
