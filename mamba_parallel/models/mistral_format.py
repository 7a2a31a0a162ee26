"""Mistral's layout of Mamba-Codestral (mistral-inference): ``params.json`` + ``consolidated.safetensors``.

params.json holds ``dim``, ``n_layers``, ``vocab_size``, ``n_groups``, ``rms_norm``, ``residual_in_fp32``,
``fused_add_norm``, ``pad_vocab_size_multiple``, ``tie_embeddings`` (and ``model_type: "mamba"``); mistral-inference
builds mamba_ssm's MambaLMHeadModel from them with a Mamba-2 mixer at mamba_ssm's defaults but ``ngroups``, under a
wrapper attribute ``model``: the tensors are mamba_ssm's names prefixed "model." (read without the prefix too),
every one stored (its loader is strict), the tied head included.
"""

from __future__ import annotations

from mamba_parallel.config import MAMBA2_DEFAULTS, ConfigError, MambaConfig
from mamba_parallel.models.tensor_layout import TensorLayout

PARAMS = "params.json"
WEIGHTS = "consolidated.safetensors"
LAYOUT = TensorLayout(lambda ours: [("model." + ours, None)], base="model.", alternatives=("",),
                      stores_tied_head=True, describe="mistral")
_DEFAULTS = dict(rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=1,
                 tie_embeddings=False, n_groups=1)


class MistralConfigError(ValueError):
    """A params.json we cannot read, or a model mistral-inference's layout cannot hold."""


def config_from_params(raw: dict, source: str = PARAMS) -> MambaConfig:
    missing = [k for k in ("dim", "n_layers", "vocab_size") if k not in raw]
    if missing:
        raise MistralConfigError(f"{source}: missing {missing} (a Mamba params.json has dim, n_layers, vocab_size)")
    if raw.get("model_type", "mamba") != "mamba":
        raise MistralConfigError(f"{source}: model_type={raw['model_type']!r}; only Mistral's Mamba layout "
                                 f"('mamba') is read here")
    c = {**_DEFAULTS, **raw}
    try:
        return MambaConfig(d_model=c["dim"], n_layer=c["n_layers"], vocab_size=c["vocab_size"],
                           ssm_cfg={"layer": "Mamba2", "ngroups": c["n_groups"]}, rms_norm=bool(c["rms_norm"]),
                           residual_in_fp32=bool(c["residual_in_fp32"]), fused_add_norm=bool(c["fused_add_norm"]),
                           pad_vocab_size_multiple=c["pad_vocab_size_multiple"],
                           tie_embeddings=bool(c["tie_embeddings"]))
    except ConfigError as e:
        raise MistralConfigError(f"{source}: {e}") from e


def cannot_express(config: MambaConfig) -> list[str]:
    why = []
    if config.layer != "Mamba2":
        why.append(f"ssm_cfg.layer={config.layer!r} (the layout builds Mamba-2 layers)")
    if config.attn_layer_idx or config.d_intermediate:
        why.append("attention or MLP layers (the layout has Mamba-2 layers only)")
    if config.layer == "Mamba2":
        m = config.mixer_cfg
        other = sorted(k for k, v in m.items() if k != "ngroups" and MAMBA2_DEFAULTS.get(k) != v)
        if other:
            why.append(f"ssm_cfg {other} differ from mamba_ssm's defaults (the layout stores only n_groups)")
    if config.norm_epsilon != 1e-5:
        why.append(f"norm_epsilon={config.norm_epsilon} (mamba_ssm hard-codes 1e-5)")
    return why


def params_from_config(config: MambaConfig) -> dict:
    why = cannot_express(config)
    if why:
        raise MistralConfigError("cannot save in format 'mistral': " + "; ".join(why))
    return dict(dim=config.d_model, n_layers=config.n_layer, vocab_size=config.vocab_size,
                n_groups=config.mixer_cfg["ngroups"], rms_norm=config.rms_norm,
                residual_in_fp32=config.residual_in_fp32, fused_add_norm=config.fused_add_norm,
                pad_vocab_size_multiple=config.pad_vocab_size_multiple, tie_embeddings=config.tie_embeddings,
                model_type="mamba")
