"""mamba-parallel: Mamba-1 / Mamba-2 language models from one CPU to many GPUs."""

__version__ = "0.1.0"

from mamba_parallel.config import MambaConfig, get_preset, PRESETS  # noqa: E402


def __getattr__(name):  # lazy: importing the package must not pull in every submodule
    if name == "MambaLMHeadModel":
        from mamba_parallel.models import MambaLMHeadModel
        return MambaLMHeadModel
    raise AttributeError(name)


__all__ = ["MambaConfig", "MambaLMHeadModel", "get_preset", "PRESETS", "__version__"]
