"""Launch configurations shared by the autotuned kernels (SSD, Mamba-3): a few candidates on the GPU, one small
config in the CPU interpreter (small blocks there also exercise the multi-block loops on tiny test shapes).
Inside ``ops.use_autotune(False)`` the first GPU candidate runs untuned: fast compiles for tests, and one fixed
summation order for ``--deterministic``.
"""

from __future__ import annotations

import torch
import triton

from mamba_parallel.ops.backend import autotune_enabled, interpret_mode


def config(num_warps: int = 4, num_stages: int = 2, **blocks) -> triton.Config:
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


class Tuner:
    """``tuner(kernel, name)``: the kernel wrapped in its autotuner, from ``table[name]`` = (GPU candidates,
    interpreter config, autotune key); one wrapper per (kernel, name, interpreter, autotune) kept."""

    def __init__(self, table: dict):
        self.table = table
        self._cache: dict = {}

    def __call__(self, kernel, name: str):
        autotune = autotune_enabled()
        key = (id(kernel), name, interpret_mode(), autotune)
        fn = self._cache.get(key)
        if fn is None:
            gpu, interp, keys = self.table[name]
            configs = [interp] if interpret_mode() else (gpu if autotune else gpu[:1])
            fn = triton.autotune(configs=configs, key=keys)(kernel)
            self._cache[key] = fn
        return fn


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision dots (Triton would use tf32 otherwise); half types use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_pow2(n: int, least: int = 16) -> int:
    """A power-of-two block covering ``n`` whole (tl.dot needs every block dim >= 16)."""
    return max(least, triton.next_power_of_2(n))
