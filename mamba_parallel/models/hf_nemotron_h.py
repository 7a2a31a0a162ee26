"""transformers' NemotronHForCausalLM (model_type "nemotron_h") <-> MambaConfig: one kind per layer (Mamba-2 "M",
attention "*", MLP "-"; ``layers_block_type`` in 5.x, ``hybrid_override_pattern`` in older configs), a
squared-ReLU MLP (``mlp_layer_idx``, ``mlp_cfg.activation="relu2"``), attention without rotary or biases.

Every block is norm -> mixer -> residual add (in the model's dtype: our ``residual_in_fp32=False``); names are
``backbone.layers.{i}.norm`` / ``.mixer.*`` as ours, the attention's q / k / v / o_proj and the MLP's up / down_proj
mapped onto our fused in_proj and fc1 / fc2. transformers 5 loads the base model under "model." (files keep
"backbone."; both are read). Its Mamba-2 mixer clamps dt below at ``time_step_min`` (dt_limit = (time_step_min,
inf)), so that is our dt_limit. Its head is never tied to the embedding (whatever ``tie_word_embeddings`` says):
a tied model of ours is written with the head stored. Mixture-of-experts layers ("E") have no counterpart here
and are refused.
"""

from __future__ import annotations

import math
import re
from typing import Any

from mamba_parallel.config import MambaConfig
from mamba_parallel.models.hf_bamba import qkv_pieces
from mamba_parallel.models.hf_config import HFArch, HFConfigError, build, integer_expand, need_silu, register

# NemotronHConfig's defaults (transformers 5.x) for the fields we read.
HF_NEMOTRON_H_DEFAULTS: dict[str, Any] = dict(
    vocab_size=131072, hidden_size=4096, layers_block_type=None, tie_word_embeddings=False, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False,
    ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8,
    conv_kernel=4, expand=2, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4, use_conv_bias=True,
    chunk_size=128, use_bias=False, initializer_range=0.02, layer_norm_epsilon=1e-5, residual_in_fp32=False,
)
# Field names of older configs (what NemotronHConfig still renames on load).
LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
          "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_init_floor":
          "time_step_floor", "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}
KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(norm|mixer)\.(.+)$")
_TOP = {"backbone.embedding.weight": "backbone.embeddings.weight", "backbone.norm_f.weight": "backbone.norm_f.weight",
        "lm_head.weight": "lm_head.weight"}


def _layer_types(raw: dict, source: str) -> list[str]:
    types = raw.get("layers_block_type") or raw.get("layer_types")
    if types is None:
        pattern = raw.get("hybrid_override_pattern")
        if pattern is None:
            raise HFConfigError(f"{source}: a nemotron_h config needs layers_block_type (or "
                                f"hybrid_override_pattern)")
        bad = sorted(set(pattern) - set(KINDS))
        if bad:
            raise HFConfigError(f"{source}: hybrid_override_pattern has unknown layer kinds {bad}")
        types = [KINDS[ch] for ch in pattern]
    if "moe" in types:
        raise HFConfigError(f"{source}: layers {[i for i, t in enumerate(types) if t == 'moe']} are mixture-of-"
                            f"experts blocks, which the layers here do not implement")
    bad = sorted(set(types) - set(KINDS.values()))
    if bad:
        raise HFConfigError(f"{source}: layers_block_type has unknown kinds {bad}")
    return list(types)


def read_nemotron_h(raw: dict, source: str) -> MambaConfig:
    c = dict(HF_NEMOTRON_H_DEFAULTS)
    for old, new in LEGACY.items():
        if old in raw and new not in raw:
            c[new] = raw[old]
    c.update({k: v for k, v in raw.items() if k in HF_NEMOTRON_H_DEFAULTS})
    need_silu(c["mamba_hidden_act"], "mamba_hidden_act", source)
    if c["mlp_hidden_act"] != "relu2":
        raise HFConfigError(f"{source}: mlp_hidden_act={c['mlp_hidden_act']!r} is not supported (only relu2)")
    if float(c["layer_norm_epsilon"]) != 1e-5:
        raise HFConfigError(f"{source}: layer_norm_epsilon={c['layer_norm_epsilon']} is not supported: "
                            f"transformers uses it in the Mamba-2 gated norm too, ours (as mamba_ssm's) uses 1e-5")
    types = _layer_types(raw, source)
    d = c["hidden_size"]
    d_inner = c["mamba_num_heads"] * c["mamba_head_dim"]
    lo = float(c["time_step_min"])
    mlp_layers = [i for i, t in enumerate(types) if t == "mlp"]
    ffn = c["intermediate_size"] if mlp_layers else 0  # 0: without MLP blocks, no MLP at all
    return build(
        source, d_model=d, n_layer=len(types), vocab_size=c["vocab_size"], d_intermediate=ffn,
        pad_vocab_size_multiple=1, tie_embeddings=False, norm_epsilon=1e-5,
        residual_in_fp32=False, rms_norm=True, initializer_range=c["initializer_range"],
        ssm_cfg=dict(layer="Mamba2", d_state=c["ssm_state_size"], d_conv=c["conv_kernel"],
                     expand=integer_expand(d_inner, d, source, "mamba_num_heads * mamba_head_dim"),
                     headdim=c["mamba_head_dim"], ngroups=c["n_groups"], chunk_size=c["chunk_size"],
                     dt_min=lo, dt_max=max(lo, float(c["time_step_max"])), dt_init_floor=c["time_step_floor"],
                     dt_limit=(lo, math.inf), conv_bias=bool(c["use_conv_bias"]), bias=bool(c["use_bias"])),
        attn_layer_idx=[i for i, t in enumerate(types) if t == "full_attention"],
        attn_cfg=dict(num_heads=c["num_attention_heads"], num_heads_kv=c["num_key_value_heads"],
                      head_dim=c["head_dim"], rotary_emb_dim=0, qkv_proj_bias=False, out_proj_bias=False),
        mlp_layer_idx=mlp_layers,
        mlp_cfg=dict(activation="relu2", bias=bool(c["mlp_bias"]), multiple_of=1 if ffn % 128 else 128))


def cannot_express(config: MambaConfig) -> list[str]:
    why = []
    if config.layer != "Mamba2":
        why.append(f"ssm_cfg.layer={config.layer!r}: Nemotron-H's SSM layers are Mamba-2")
    if config.mlp_layer_idx and config.mlp_params["activation"] != "relu2":
        why.append(f"mlp_cfg.activation={config.mlp_params['activation']!r}: Nemotron-H's MLP is relu2")
    lo, hi = config.mixer_cfg["dt_limit"]
    if not (lo > 0 and math.isinf(hi)):
        why.append(f"ssm_cfg.dt_limit={config.mixer_cfg['dt_limit']}: Nemotron-H clamps dt to (time_step_min, "
                   f"inf) with time_step_min > 0")
    if config.attn_layer_idx:
        a = config.attn_params
        if a["rotary_emb_dim"]:
            why.append(f"attn_cfg.rotary_emb_dim={a['rotary_emb_dim']}: Nemotron-H's attention has no rotary")
        if a["qkv_proj_bias"] or a["out_proj_bias"]:
            why.append("attention biases: Nemotron-H's attention has none")
        if not a["causal"]:
            why.append("attn_cfg.causal=False")
    return why


def write_nemotron_h(config: MambaConfig) -> dict:
    m, a, mlp = config.mixer_cfg, config.attn_params, config.mlp_params
    types = {"attention": "full_attention", "mlp": "mlp"}
    layer_types = [types.get(config.layer_kind(i), "linear_attention") for i in range(config.n_layer)]
    from mamba_parallel.models.hf_bamba import ffn_width

    lo = float(m["dt_limit"][0])
    ffn = ffn_width(config) if config.mlp_layer_idx else HF_NEMOTRON_H_DEFAULTS["intermediate_size"]
    return dict(
        hidden_size=config.d_model, vocab_size=config.padded_vocab_size, tie_word_embeddings=False,
        layers_block_type=layer_types, num_hidden_layers=config.n_layer,
        hybrid_override_pattern="".join({v: k for k, v in KINDS.items()}[t] for t in layer_types),
        num_attention_heads=a["num_heads"], num_key_value_heads=a["num_heads_kv"], head_dim=a["head_dim"],
        attention_bias=False, intermediate_size=ffn, mlp_hidden_act="relu2", mlp_bias=bool(mlp["bias"]), ssm_state_size=m["d_state"],
        mamba_num_heads=config.nheads, mamba_head_dim=m["headdim"], mamba_hidden_act="silu", n_groups=m["ngroups"],
        # expand is an int field there, unused by its mixer (whose width is mamba_num_heads * mamba_head_dim)
        conv_kernel=m["d_conv"], expand=round(m["expand"]), time_step_min=lo, time_step_max=max(lo, m["dt_max"]),
        time_step_floor=m["dt_init_floor"], time_step_limit=[lo, math.inf], use_conv_bias=bool(m["conv_bias"]),
        chunk_size=m["chunk_size"], use_bias=bool(m["bias"]), mamba_proj_bias=bool(m["bias"]),
        layer_norm_epsilon=config.norm_epsilon, residual_in_fp32=False, initializer_range=config.initializer_range)


def tensor_names(config: MambaConfig, ours: str) -> list[tuple[str, int | None]]:
    if ours in _TOP:
        return [(_TOP[ours], None)]
    m = _LAYER.match(ours)
    if m is None:
        raise KeyError(ours)
    i, part, rest = int(m.group(1)), m.group(2), m.group(3)
    layer = f"backbone.layers.{i}."
    if part == "norm":
        return [(layer + "norm." + rest, None)]
    kind = config.layer_kind(i)
    name, _, what = rest.partition(".")
    if kind == "attention":
        if name == "in_proj":
            return qkv_pieces(config, layer + "mixer.", what)
        return [(layer + "mixer.o_proj." + what, None)]
    if kind == "mlp":
        return [(layer + "mixer." + {"fc1": "up_proj", "fc2": "down_proj"}[name] + "." + what, None)]
    return [(layer + "mixer." + rest, None)]


register(HFArch("nemotron_h", "NemotronHForCausalLM", read_nemotron_h, write_nemotron_h, cannot_express,
                tensor_names, backbone_class="NemotronHModel", file_prefixes=("model.",),
                ignored=(r"mtp\.", r".*\.inv_freq$"), unties=True))
