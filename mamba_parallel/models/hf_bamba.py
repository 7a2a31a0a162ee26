"""transformers' BambaForCausalLM (model_type "bamba"): Mamba-2 layers, some replaced by attention (partial
rotary: the first half of each head), every layer followed by a SwiGLU MLP. <-> MambaConfig (``attn_layer_idx``,
``d_intermediate`` with mamba_ssm's MLP after every mixer).

Layer i in transformers: ``input_layernorm`` -> ``mamba`` or ``self_attn`` -> ``pre_ff_layernorm`` ->
``feed_forward`` (gate / up / down), the residual kept in the model's dtype (our ``residual_in_fp32=False``).
Our fused tensors map to theirs: attention ``in_proj`` = [q_proj | k_proj | v_proj], MLP ``fc1`` = [up_proj |
gate_proj] (our GatedMLP multiplies the first half by silu of the second). transformers 4.x hard-codes the rotary
base (10000) and fraction (0.5), so exports keep to those. Bamba's ``z_loss_coefficient`` is a training-loss
term, not part of the model: it is not reproduced by our loss.
"""

from __future__ import annotations

import math
import re
from typing import Any

from mamba_parallel.config import MambaConfig
from mamba_parallel.models.hf_config import (
    HFArch,
    HFConfigError,
    build,
    integer_expand,
    need_silu,
    register,
    with_defaults,
)

# BambaConfig's defaults (transformers 5.x) for the fields we read.
HF_BAMBA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-5,
    attn_layer_indices=None, mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256,
    mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
    time_step_limit=(0.0, math.inf), rope_parameters=None, rope_theta=10000.0, attention_bias=False,
    mlp_bias=False, head_dim=None,
)
ROTARY_FRACTION, ROTARY_BASE = 0.5, 10000.0
_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(norm|norm2|mixer|mlp)\.(.+)$")
_TOP = {"backbone.embedding.weight": "model.embed_tokens.weight", "backbone.norm_f.weight":
        "model.final_layernorm.weight", "lm_head.weight": "lm_head.weight"}


def _rope(c: dict, source: str) -> tuple[float, float]:
    """(base, fraction of head_dim rotated) the way transformers 5 resolves them for Bamba."""
    rope = dict(c["rope_parameters"] or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise HFConfigError(f"{source}: rope_parameters.rope_type={kind!r} is not supported (only 'default')")
    return float(rope.get("rope_theta", c["rope_theta"])), float(rope.get("partial_rotary_factor", ROTARY_FRACTION))


def read_bamba(raw: dict, source: str) -> MambaConfig:
    c = with_defaults(raw, HF_BAMBA_DEFAULTS)
    need_silu(c["hidden_act"], "hidden_act", source)
    if float(c["rms_norm_eps"]) != 1e-5:
        raise HFConfigError(f"{source}: rms_norm_eps={c['rms_norm_eps']} is not supported: transformers uses it "
                            f"in the Mamba-2 gated norm too, ours (as mamba_ssm's) uses 1e-5")
    d, heads = c["hidden_size"], c["mamba_n_heads"]
    d_inner = c["mamba_expand"] * d
    headdim = d_inner // heads if c["mamba_d_head"] == "auto" else c["mamba_d_head"]
    if headdim * heads != d_inner:
        raise HFConfigError(f"{source}: mamba_n_heads * mamba_d_head = {heads} * {headdim} must equal "
                            f"mamba_expand * hidden_size = {d_inner}")
    n_heads, n_kv = c["num_attention_heads"], c["num_key_value_heads"] or c["num_attention_heads"]
    head_dim = c["head_dim"] or d // n_heads
    base, fraction = _rope(c, source)
    rotary = int(head_dim * fraction)
    ffn = c["intermediate_size"]
    return build(
        source, d_model=d, n_layer=c["num_hidden_layers"], vocab_size=c["vocab_size"], d_intermediate=ffn,
        pad_vocab_size_multiple=1, tie_embeddings=bool(c["tie_word_embeddings"]), norm_epsilon=1e-5,
        residual_in_fp32=False, rms_norm=True, initializer_range=c["initializer_range"],
        ssm_cfg=dict(layer="Mamba2", d_state=c["mamba_d_state"], d_conv=c["mamba_d_conv"],
                     expand=integer_expand(d_inner, d, source, "mamba_expand * hidden_size"), headdim=headdim,
                     ngroups=c["mamba_n_groups"], chunk_size=c["mamba_chunk_size"],
                     dt_limit=tuple(float(x) for x in c["time_step_limit"]), conv_bias=bool(c["mamba_conv_bias"]),
                     bias=bool(c["mamba_proj_bias"])),
        attn_layer_idx=list(c["attn_layer_indices"] or []),
        attn_cfg=dict(num_heads=n_heads, num_heads_kv=n_kv, head_dim=head_dim, rotary_emb_dim=rotary,
                      rotary_emb_base=base, qkv_proj_bias=bool(c["attention_bias"]),
                      out_proj_bias=bool(c["attention_bias"])),
        mlp_cfg=dict(activation="swiglu", bias=bool(c["mlp_bias"]), multiple_of=1 if ffn % 128 else 128))


def cannot_express(config: MambaConfig) -> list[str]:
    why = []
    if config.layer != "Mamba2":
        why.append(f"ssm_cfg.layer={config.layer!r}: Bamba's SSM layers are Mamba-2")
    mlp = config.mlp_params
    if mlp["activation"] != "swiglu":
        why.append(f"mlp_cfg.activation={mlp['activation']!r}: Bamba's MLP is SwiGLU")
    e = config.mixer_cfg["expand"]
    if float(e) != int(e):
        why.append(f"expand={e} is not an integer (Bamba's mamba_expand is an int)")
    if config.attn_layer_idx:
        a = config.attn_params
        if a["qkv_proj_bias"] != a["out_proj_bias"]:
            why.append("attention biases differ between qkv and out projections (Bamba has one attention_bias)")
        if (a["rotary_emb_dim"] or 0) != int(a["head_dim"] * ROTARY_FRACTION):
            why.append(f"attn_cfg.rotary_emb_dim={a['rotary_emb_dim']}: Bamba rotates half of each head "
                       f"({int(a['head_dim'] * ROTARY_FRACTION)} of head_dim={a['head_dim']})")
        if float(a["rotary_emb_base"]) != ROTARY_BASE:
            why.append(f"attn_cfg.rotary_emb_base={a['rotary_emb_base']}: transformers 4.x's Bamba hard-codes "
                       f"{ROTARY_BASE:g}")
        if not a["causal"]:
            why.append("attn_cfg.causal=False")
    return why


def write_bamba(config: MambaConfig) -> dict:
    m, a, mlp = config.mixer_cfg, config.attn_params, config.mlp_params
    return dict(
        hidden_size=config.d_model, num_hidden_layers=config.n_layer, vocab_size=config.padded_vocab_size,
        tie_word_embeddings=config.tie_embeddings, intermediate_size=ffn_width(config), hidden_act="silu",
        rms_norm_eps=config.norm_epsilon, initializer_range=config.initializer_range,
        attn_layer_indices=list(config.attn_layer_idx), num_attention_heads=a["num_heads"],
        num_key_value_heads=a["num_heads_kv"], head_dim=a["head_dim"], attention_bias=bool(a["qkv_proj_bias"]),
        mlp_bias=bool(mlp["bias"]),
        rope_parameters=dict(rope_type="default", rope_theta=float(a["rotary_emb_base"]),
                             partial_rotary_factor=ROTARY_FRACTION),
        rope_theta=float(a["rotary_emb_base"]),
        mamba_n_heads=config.nheads, mamba_d_head=m["headdim"], mamba_n_groups=m["ngroups"],
        mamba_d_state=m["d_state"], mamba_d_conv=m["d_conv"], mamba_expand=int(m["expand"]),
        mamba_chunk_size=m["chunk_size"], mamba_conv_bias=bool(m["conv_bias"]), mamba_proj_bias=bool(m["bias"]),
        time_step_limit=[float(x) for x in m["dt_limit"]], z_loss_coefficient=0.0)


def qkv_pieces(config: MambaConfig, prefix: str, kind: str) -> list[tuple[str, int]]:
    """in_proj.{kind} of an attention layer = [q_proj | k_proj | v_proj].{kind} (rows per piece)."""
    a = config.attn_params
    q, kv = a["num_heads"] * a["head_dim"], a["num_heads_kv"] * a["head_dim"]
    return [(f"{prefix}q_proj.{kind}", q), (f"{prefix}k_proj.{kind}", kv), (f"{prefix}v_proj.{kind}", kv)]


def tensor_names(config: MambaConfig, ours: str) -> list[tuple[str, int | None]]:
    if ours in _TOP:
        return [(_TOP[ours], None)]
    m = _LAYER.match(ours)
    if m is None:
        raise KeyError(ours)
    i, part, rest = int(m.group(1)), m.group(2), m.group(3)
    layer = f"model.layers.{i}."
    if part == "norm":
        return [(f"{layer}input_layernorm.{rest}", None)]
    if part == "norm2":
        return [(f"{layer}pre_ff_layernorm.{rest}", None)]
    if part == "mlp":
        name, kind = rest.split(".")
        ffn = f"{layer}feed_forward."
        if name == "fc1":
            half = ffn_width(config)
            return [(f"{ffn}up_proj.{kind}", half), (f"{ffn}gate_proj.{kind}", half)]
        return [(f"{ffn}down_proj.{kind}", None)]
    if config.layer_kind(i) == "attention":
        name, kind = rest.split(".")
        if name == "in_proj":
            return qkv_pieces(config, f"{layer}self_attn.", kind)
        return [(f"{layer}self_attn.o_proj.{kind}", None)]
    return [(f"{layer}mamba.{rest}", None)]


def ffn_width(config: MambaConfig) -> int:
    """The MLP's hidden width as built (d_intermediate rounded up to mlp_cfg.multiple_of)."""
    mult = config.mlp_params["multiple_of"]
    return (config.d_intermediate + mult - 1) // mult * mult


register(HFArch("bamba", "BambaForCausalLM", read_bamba, write_bamba, cannot_express, tensor_names,
                backbone_class="BambaModel", base="model.", ignored=(r".*\.inv_freq$",)))
