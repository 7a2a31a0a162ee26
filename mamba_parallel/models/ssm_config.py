"""MambaConfig <-> the config.json of mamba_ssm (``mamba_ssm.models.config_mamba.MambaConfig``).

Our field names are mamba_ssm's, so this is mostly identity. Reading tolerates what real mamba_ssm configs
contain: older files without the newer fields (mamba-130m has only d_model, n_layer, vocab_size, ``ssm_cfg: {}``,
rms_norm, residual_in_fp32, fused_add_norm, pad_vocab_size_multiple), and run-time-only mixer arguments.
Writing emits mamba_ssm's twelve fields, plus ``norm_epsilon`` only when it is not mamba_ssm's hard-coded 1e-5 (then
mamba_ssm's own loader fails loudly instead of building a different model). The init-only fields
(``initializer_range``, ``rescale_prenorm_residual``) are not written: they do not change a loaded model.
"""

from __future__ import annotations

import json

from mamba_parallel.config import ConfigError, MambaConfig

# mamba_ssm's MambaConfig fields, in its order.
SSM_FIELDS = ("d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
              "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings")
# Fields of ours that change the model's function but that mamba_ssm hard-codes (to their default values).
EXTRA_FIELDS = ("norm_epsilon", "mlp_layer_idx", "mlp_cfg")

# Mixer arguments that only steer how mamba_ssm runs or initialises (no effect on a loaded model's function).
_RUNTIME_SSM_KEYS = {"use_fast_path", "use_mem_eff_path", "layer_idx", "process_group", "sequence_parallel",
                     "device", "dtype", "conv_init"}
_MAMBA3_IGNORED_KEYS = ("dropout", "n_layer")
# Arguments we accept only at the value that matches what we compute.
_FIXED_SSM_KEYS = {"activation": ("silu", "swish"), "learnable_init_states": (False,)}
_FIXED_ATTN_KEYS = {"mlp_dim": (0,), "softmax_scale": (None,), "rotary_emb_interleaved": (False,)}


class SsmConfigError(ValueError):
    """A mamba_ssm config.json that we cannot build the same model from; the message names the field."""


def config_from_mamba_ssm(raw: dict, source: str = "config.json") -> MambaConfig:
    """The MambaConfig of a mamba_ssm config.json (a parsed dict)."""
    d = dict(raw)
    ssm = dict(d.get("ssm_cfg") or {})
    for key in _RUNTIME_SSM_KEYS:
        ssm.pop(key, None)
    if ssm.get("layer") == "Mamba3":  # arguments mamba_ssm's Mamba3 accepts and ignores
        for key in _MAMBA3_IGNORED_KEYS:
            ssm.pop(key, None)
    for key, ok in _FIXED_SSM_KEYS.items():
        if key in ssm:
            value = ssm.pop(key)
            if value not in ok:
                raise SsmConfigError(f"{source}: ssm_cfg.{key}={value!r} is not supported (only {list(ok)})")
    if ssm.get("d_ssm") is not None:
        d_inner = int(ssm.get("expand", 2) * d["d_model"]) if "d_model" in d else None
        if ssm["d_ssm"] != d_inner:
            raise SsmConfigError(f"{source}: ssm_cfg.d_ssm={ssm['d_ssm']} != expand * d_model = {d_inner} is not "
                                 "supported (the SSM must span the whole mixer width)")
    ssm.pop("d_ssm", None)
    d["ssm_cfg"] = ssm
    attn = dict(d.get("attn_cfg") or {})
    for key, ok in _FIXED_ATTN_KEYS.items():
        if key in attn:
            value = attn.pop(key)
            if value not in ok:
                raise SsmConfigError(f"{source}: attn_cfg.{key}={value!r} is not supported (only {list(ok)})")
    d["attn_cfg"] = attn
    try:
        return MambaConfig.from_dict(d)
    except (ConfigError, TypeError) as e:
        raise SsmConfigError(f"{source}: {e}") from e


def mamba_ssm_config_json(config: MambaConfig) -> str:
    """config.json text for mamba_ssm's loader (see the module docstring for the extra fields)."""
    ours = json.loads(config.to_json())  # to_json already encodes an infinite dt_limit as mamba_ssm does
    defaults = MambaConfig(d_model=config.d_model, n_layer=config.n_layer, vocab_size=config.vocab_size)
    out = {k: ours[k] for k in SSM_FIELDS}
    out.update({k: ours[k] for k in EXTRA_FIELDS if getattr(config, k) != getattr(defaults, k)})
    return json.dumps(out, indent=2)
