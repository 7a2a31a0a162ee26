"""Launch configurations of the SSD kernels: a few autotuned candidates on the GPU, one small config in the
CPU interpreter (small blocks there also exercise the multi-block loops on tiny test shapes).
Inside ``ops.use_autotune(False)`` the first GPU candidate runs without tuning (fast compiles: the GPU tests).

No SSD kernel reads what it writes, so re-running a launch while autotuning is safe.
"""

from __future__ import annotations

import torch
import triton

from mamba_parallel.ops.backend import autotune_enabled, interpret_mode


def _c(num_warps=4, num_stages=2, **blocks):
    return triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)


# name -> (GPU candidates, interpreter config, autotune key)
_CONFIGS = {
    "outer": ([_c(4, 3, BLOCK_P=64, BLOCK_N=64, BLOCK_K=64), _c(4, 3, BLOCK_P=64, BLOCK_N=128, BLOCK_K=32),
               _c(8, 3, BLOCK_P=64, BLOCK_N=128, BLOCK_K=64), _c(4, 4, BLOCK_P=32, BLOCK_N=128, BLOCK_K=64)],
              _c(BLOCK_P=16, BLOCK_N=16, BLOCK_K=16), ["P", "N", "HPG", "MODE", "CHUNK"]),
    "scan_fwd": ([_c(4, 2, BLOCK_M=64, BLOCK_P=64, BLOCK_K=64), _c(4, 3, BLOCK_M=64, BLOCK_P=64, BLOCK_K=32),
                  _c(8, 2, BLOCK_M=128, BLOCK_P=64, BLOCK_K=64), _c(4, 2, BLOCK_M=64, BLOCK_P=32, BLOCK_K=64)],
                 _c(BLOCK_M=16, BLOCK_P=16, BLOCK_K=16), ["P", "N", "HPG", "CHUNK"]),
    # dx: one BLOCK_M for all candidates (its dD partial buffer is laid out by row block)
    "dx": ([_c(4, 2, BLOCK_M=64, BLOCK_K=64), _c(4, 3, BLOCK_M=64, BLOCK_K=32), _c(8, 3, BLOCK_M=64, BLOCK_K=64)],
           _c(BLOCK_M=16, BLOCK_K=16), ["P", "N", "HPG", "CHUNK"]),
    # dbc_intra: one BLOCK_M for all candidates (partial buffers are laid out by tile)
    "dbc_intra": ([_c(4, 2, BLOCK_M=64), _c(8, 2, BLOCK_M=64), _c(4, 3, BLOCK_M=64)],
                  _c(BLOCK_M=16), ["P", "N", "HPG", "HS", "CHUNK"]),
    "dbc_state": ([_c(4, 2, BLOCK_M=64), _c(8, 2, BLOCK_M=64), _c(8, 2, BLOCK_M=128), _c(4, 3, BLOCK_M=32)],
                  _c(BLOCK_M=16), ["P", "N", "HPG", "HS", "REVERSE", "CHUNK"]),
}


def tuned(kernel, name: str):
    """The kernel wrapped in its autotuner (GPU) or bound to the interpreter config (CPU)."""
    autotune = autotune_enabled()
    key = (id(kernel), name, interpret_mode(), autotune)
    fn = _CACHE.get(key)
    if fn is None:
        gpu, interp, keys = _CONFIGS[name]
        configs = [interp] if interpret_mode() else (gpu if autotune else gpu[:1])
        fn = triton.autotune(configs=configs, key=keys)(kernel)
        _CACHE[key] = fn
    return fn


_CACHE: dict = {}


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get full-precision dots (Triton would use tf32 otherwise); half types use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_pow2(n: int, least: int = 16) -> int:
    """A block covering ``n`` whole (tl.dot needs every block dim >= 16)."""
    return max(least, triton.next_power_of_2(n))
