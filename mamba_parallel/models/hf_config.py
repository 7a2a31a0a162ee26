"""MambaConfig <-> the ``config.json`` of an HF transformers checkpoint, one architecture per module.

transformers is not imported: each architecture's field names and defaults (transformers 5.x) are written down
in its module (models/hf_mamba.py: MambaForCausalLM, FalconMambaForCausalLM, Mamba2ForCausalLM;
models/hf_bamba.py: BambaForCausalLM; models/hf_nemotron_h.py: NemotronHForCausalLM), so a field missing from a
config.json means what it means to transformers. Each architecture also names its tensors (``tensor_names``: our
state-dict name -> the file's names, several when transformers splits what we fuse, e.g. q / k / v).

HF stores the padded vocabulary as ``vocab_size`` (its embedding has that many rows), so a model read from HF gets
``pad_vocab_size_multiple=1`` and a model saved to HF writes ``padded_vocab_size``. Init-only rules are never
written as active: transformers re-applies ``rescale_prenorm_residual`` to ``out_proj`` AFTER loading the weights
(it would shrink a trained model's projections), so exports write it False.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from mamba_parallel.config import MambaConfig

_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
# Our Mamba2 gated norm (like mamba_ssm's) has a fixed eps; transformers' uses the model's norm eps.
GATED_NORM_EPS = 1e-5


class HFConfigError(ValueError):
    """A config.json transformers would read differently from us, or a model no transformers class can hold."""


@dataclass(frozen=True)
class HFArch:
    """One transformers causal-LM architecture.

    read_config(raw, source) -> MambaConfig; write_config(config) -> config.json dict (without dtype);
    cannot_express(config) -> reasons (empty when it can); tensor_names(config, ours) -> [(file name, rows)]:
    the file tensors that make our tensor ``ours``, concatenated along dim 0 (rows None for a single piece).
    ``base``: the base-model prefix of the canonical names; ``file_prefixes``: other spellings of it in files (a
    transformers version's base-model prefix; a backbone-only class's files have none);
    ``ignored``: file tensors that are not weights of the model (regular-expression prefixes);
    ``unties``: the class never ties its head to the embedding (a tied model of ours is written with its head).
    """

    model_type: str
    architecture: str
    read_config: Callable[[dict, str], MambaConfig]
    write_config: Callable[[MambaConfig], dict]
    cannot_express: Callable[[MambaConfig], list[str]]
    tensor_names: Callable[[MambaConfig, str], list[tuple[str, int | None]]]
    backbone_class: str | None = None
    base: str = "backbone."
    file_prefixes: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    unties: bool = False


ARCHS: dict[str, HFArch] = {}


def register(arch: HFArch) -> HFArch:
    ARCHS[arch.model_type] = arch
    return arch


def _archs() -> dict[str, HFArch]:
    # The architecture modules register themselves on import.
    from mamba_parallel.models import hf_bamba, hf_mamba, hf_nemotron_h  # noqa: F401

    return ARCHS


# ---- special floats ---------------------------------------------------------------------------------------------
def decode_special_floats(obj: Any) -> Any:
    """transformers >= 5 writes inf as ``{"__float__": "Infinity"}`` (older versions write a bare ``Infinity``)."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


# ---- dispatch ---------------------------------------------------------------------------------------------------
def hf_arch_of(raw: dict) -> HFArch | None:
    """The architecture a config.json describes (by model_type, else by its architectures list), or None."""
    archs = _archs()
    mt = raw.get("model_type")
    if mt in archs:
        return archs[mt]
    if mt is None:
        names = raw.get("architectures") or []
        for arch in archs.values():
            if arch.architecture in names or (arch.backbone_class and arch.backbone_class in names):
                return arch
    return None


def hf_model_type(raw: dict) -> str | None:
    arch = hf_arch_of(raw)
    return None if arch is None else arch.model_type


def supported_hf_types() -> str:
    return ", ".join(f"{a.model_type!r} ({a.architecture})" for a in _archs().values())


def config_from_hf(raw: dict, source: str = "config.json") -> MambaConfig:
    """The MambaConfig of an HF config.json (a parsed dict) of one of the supported architectures."""
    raw = decode_special_floats(raw)
    arch = hf_arch_of(raw)
    if arch is None:
        raise HFConfigError(f"{source}: model_type={raw.get('model_type')!r}, architectures="
                            f"{raw.get('architectures')!r} is not a supported transformers model; supported: "
                            f"{supported_hf_types()}")
    return arch.read_config(raw, source)


def common_incompatibilities(config: MambaConfig) -> list[str]:
    """What no transformers class here can hold, whatever the architecture."""
    why = []
    if not config.rms_norm:
        why.append("rms_norm=False (LayerNorm); transformers' Mamba models use RMSNorm")
    if config.layer == "Mamba2":
        m = config.mixer_cfg
        if not m["rmsnorm"]:
            why.append("ssm_cfg.rmsnorm=False; transformers' Mamba-2 layers always have the gated norm")
        if m["norm_before_gate"]:
            why.append("ssm_cfg.norm_before_gate=True; transformers' Mamba-2 layers gate before the norm")
        if config.norm_epsilon != GATED_NORM_EPS:
            why.append(f"norm_epsilon={config.norm_epsilon}: transformers uses it in the Mamba-2 gated norm too, "
                       f"where ours (as mamba_ssm's) uses {GATED_NORM_EPS}")
        if m["D_has_hdim"]:
            why.append("ssm_cfg.D_has_hdim=True; transformers' Mamba-2 layers have one D per head")
    return why


def hf_arch_for(config: MambaConfig) -> HFArch:
    """The transformers architecture that matches this model's structure (it may still be unable to hold it)."""
    archs = _archs()
    if config.layer == "Mamba1":
        return archs["falcon_mamba"] if config.mixer_cfg.get("bcdt_rms_norm") else archs["mamba"]
    if not config.attn_layer_idx and config.d_intermediate == 0:
        return archs["mamba2"]
    return archs["bamba"] if config.mlp_after_mixer else archs["nemotron_h"]


def hf_incompatibilities(config: MambaConfig) -> list[str]:
    """Why no transformers class holds this model ([] when one does)."""
    if config.layer == "Mamba3":
        return ["transformers has no Mamba-3 model (mamba_ssm's layout holds it)"]
    arch = hf_arch_for(config)
    return [f"{arch.architecture}: {w}" for w in common_incompatibilities(config) + arch.cannot_express(config)]


def hf_config_from(config: MambaConfig, dtype_name: str | None = None) -> dict:
    """The config.json dict of the transformers class that holds ``config`` (see :func:`hf_arch_for`).

    Raises HFConfigError naming every feature that class cannot express.
    """
    why = hf_incompatibilities(config)
    if why:
        raise HFConfigError("cannot save in format 'hf': " + "; ".join(why)
                            + ". Save with format='mamba_ssm' instead.")
    arch = hf_arch_for(config)
    out: dict[str, Any] = dict(architectures=[arch.architecture], model_type=arch.model_type)
    out.update(arch.write_config(config))
    out["rescale_prenorm_residual"] = False  # an init rule: transformers would re-apply it to loaded weights
    # The tokenizer is not part of MambaConfig: leave the special tokens unset rather than guess them.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        out.setdefault(key, None)
    if dtype_name is not None:
        out["dtype"] = out["torch_dtype"] = dtype_name  # 5.x reads dtype, 4.x torch_dtype
    # inf stays a float: json writes a bare Infinity, which transformers 4.x and 5.x both read (5.x's own
    # {"__float__": "Infinity"} tag is read back by decode_special_floats, but 4.x would take it for a dict)
    return out


# ---- helpers shared by the architecture modules -------------------------------------------------------------
def with_defaults(raw: dict, defaults: dict, renames: dict[str, str] | None = None) -> dict:
    """``defaults`` overridden by the fields of ``raw`` they name; ``renames`` maps legacy field names (older
    transformers versions) to the current ones."""
    c = dict(defaults)
    for old, new in (renames or {}).items():
        if old in raw and new not in raw:
            c[new] = raw[old]
    c.update({k: v for k, v in raw.items() if k in defaults})
    return c


def need_silu(value: str, field: str, source: str) -> None:
    if value not in ("silu", "swish"):
        raise HFConfigError(f"{source}: {field}={value!r} is not supported (the layers here use silu)")


def integer_expand(d_inner: int, d_model: int, source: str, what: str) -> float:
    """expand with int(expand * d_model) == d_inner (our mixers derive their width from it)."""
    expand = d_inner / d_model
    if d_inner % d_model == 0:
        expand = d_inner // d_model
    if int(expand * d_model) != d_inner:
        raise HFConfigError(f"{source}: {what} = {d_inner} is not expand * hidden_size for any expand the layers "
                            f"here can use (hidden_size = {d_model})")
    return expand


def build(source: str, **fields) -> MambaConfig:
    """MambaConfig(**fields), its ConfigError re-raised naming the config.json."""
    from mamba_parallel.config import ConfigError

    try:
        return MambaConfig(**fields)
    except ConfigError as e:
        raise HFConfigError(f"{source}: {e}") from e
