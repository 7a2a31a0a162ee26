"""No silent flags: a train setting that cannot act in the chosen mode is an error (when the user would get a
different run than asked for) or a one-line warning (when it is merely unused).

A setting counts as given when it differs from its default (a TOML file or a flag can set it; both count).
"""

from __future__ import annotations

from dataclasses import fields

from mamba_parallel.config import ConfigError

FSDP_ONLY = ("fsdp_param_dtype", "reshard_after_forward", "fsdp_blocks_per_unit", "dp_replicate")
DDP_ONLY = ("ddp_bucket_mb", "ddp_bf16_grads")


def _flag(name: str, value=None) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + name.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def given(cfg) -> dict:
    """{field: value} of the settings that differ from their defaults."""
    out = {}
    for f in fields(cfg):
        if f.name == "model":
            continue
        v = getattr(cfg, f.name)
        if v != f.default:
            out[f.name] = v
    return out


def check(cfg, world_size: int, data_is_prepared: bool) -> list[str]:
    """ConfigError for a setting that would change nothing although it changes what the user expects; returns
    the one-line warnings of settings without effect here."""
    set_ = given(cfg)
    if cfg.parallel == "auto":
        manual = [_flag(k, set_[k]) for k in ("tp", "cp", "pp") if k in set_]
        if manual:
            raise ConfigError(f"{' '.join(manual)} with --parallel auto: auto chooses tp, cp and pp itself; drop "
                              f"{' and '.join(m.split()[0] for m in manual)} or use --parallel manual")
    if cfg.dp_mode == "ddp" and "dp_replicate" in set_:
        raise ConfigError(f"--dp-replicate {cfg.dp_replicate} with --dp-mode ddp: DDP replicates over every "
                          f"data-parallel rank already; --dp-replicate sets HSDP's replica count (--dp-mode fsdp)")
    warnings = []
    manual_dp = world_size // max(1, cfg.tp * cfg.cp * cfg.pp) if cfg.parallel == "manual" else world_size
    if world_size == 1 or manual_dp == 1:  # FSDP options still act on the one-rank group of --cpu-offload
        unused = [_flag(k, set_[k]) for k in DDP_ONLY + (() if cfg.cpu_offload else FSDP_ONLY) if k in set_]
        if unused:
            warnings.append(f"{', '.join(unused)}: no effect without data parallelism")
    elif cfg.dp_mode == "ddp":
        unused = [_flag(k, set_[k]) for k in FSDP_ONLY if k in set_]
        if unused:
            warnings.append(f"{', '.join(unused)}: FSDP options, no effect with --dp-mode ddp")
    else:
        unused = [_flag(k, set_[k]) for k in DDP_ONLY if k in set_]
        if unused:
            warnings.append(f"{', '.join(unused)}: DDP options, no effect with --dp-mode fsdp")
    if data_is_prepared and "val_fraction" in set_:
        warnings.append(f"--val-fraction {cfg.val_fraction}: no effect on a prepared token folder (--data "
                        f"{cfg.data}); its split was made when it was prepared")
    if data_is_prepared and cfg.allow_binary:
        warnings.append("--allow-binary: no effect on a prepared token folder")
    if cfg.sample_tokens == 0 and "sample_prompt" in set_:
        warnings.append("--sample-prompt: no effect with --sample-tokens 0")
    return warnings
