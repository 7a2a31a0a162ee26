"""Single-device layers (no distributed code): mixers, MLP, norms, the residual block."""

from mamba_parallel.layers.attention import MHA
from mamba_parallel.layers.block import Block, create_block, create_mixer
from mamba_parallel.layers.mamba1 import Mamba
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.mamba3 import Mamba3
from mamba_parallel.layers.mlp import MLP, GatedMLP
from mamba_parallel.layers.norm import RMSNorm, RMSNormGated

__all__ = ["Block", "GatedMLP", "MHA", "MLP", "Mamba", "Mamba2", "Mamba3", "RMSNorm", "RMSNormGated",
           "create_block", "create_mixer"]
