"""Language models. ``MambaLMHeadModel`` (models/lm.py); checkpoint formats live in models/formats.py."""

from mamba_parallel.models.lm import MambaLMHeadModel, MixerModel

__all__ = ["MambaLMHeadModel", "MixerModel"]
