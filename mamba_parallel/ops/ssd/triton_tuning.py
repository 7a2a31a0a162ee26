"""Launch configurations of the SSD kernels (the candidates; ops/tuning.py picks among them).

No SSD kernel reads what it writes, so re-running a launch while autotuning is safe, with one exception: the
forward state pass may write the final states over the initial states it reads (an inference cache continued
and updated in place, ``final_states_out``), so its tuner puts that buffer back after each trial run.
"""

from __future__ import annotations

from mamba_parallel.ops.tuning import Tuner, block_pow2, dot_precision  # noqa: F401  (the SSD kernels' imports)
from mamba_parallel.ops.tuning import config as _c

# name -> (GPU candidates, interpreter config, autotune key[, GPU candidates for fp32 operands])
_CONFIGS = {
    # BLOCK_K = 128: a 128-token chunk in one step (the autotuner's pick at d_state 64 and 128 on an H100: the
    # forward 1.61 -> 1.58 ms at b8 L4096 h64, 2.63 -> 2.56 at b4 L16384 h64, 0.81 -> 0.77 at b8 L4096 h32 n64)
    "state_fwd": ([_c(4, 3, BLOCK_P=64, BLOCK_N=64, BLOCK_K=64), _c(4, 3, BLOCK_P=64, BLOCK_N=32, BLOCK_K=64),
                   _c(8, 3, BLOCK_P=64, BLOCK_N=128, BLOCK_K=64), _c(4, 4, BLOCK_P=64, BLOCK_N=32, BLOCK_K=32),
                   _c(4, 2, BLOCK_P=64, BLOCK_N=64, BLOCK_K=128)],
                  _c(BLOCK_P=16, BLOCK_N=16, BLOCK_K=16), ["P", "N", "HPG", "CHUNK"],
                  [_c(4, 2, BLOCK_P=64, BLOCK_N=32, BLOCK_K=32), _c(4, 3, BLOCK_P=32, BLOCK_N=32, BLOCK_K=32)]),
    # chunk_states: the forward's states for few (row, head) pairs (triton_states_wide)
    "chunk_states": ([_c(4, 3, BLOCK_P=64, BLOCK_N=64, BLOCK_K=64), _c(4, 3, BLOCK_P=64, BLOCK_N=128, BLOCK_K=32),
                      _c(8, 3, BLOCK_P=64, BLOCK_N=128, BLOCK_K=64), _c(4, 4, BLOCK_P=32, BLOCK_N=128, BLOCK_K=64)],
                     _c(BLOCK_P=16, BLOCK_N=16, BLOCK_K=16), ["P", "N", "HPG", "CHUNK"],
                     [_c(4, 2, BLOCK_P=64, BLOCK_N=32, BLOCK_K=32), _c(4, 3, BLOCK_P=32, BLOCK_N=32, BLOCK_K=32)]),
    # state_bwd: one (BLOCK_P, BLOCK_N) tile for all candidates (its dA_cs partial buffer is laid out by tile)
    "state_bwd": ([_c(4, 3, BLOCK_P=64, BLOCK_N=32, BLOCK_K=64), _c(4, 2, BLOCK_P=64, BLOCK_N=32, BLOCK_K=32),
                   _c(8, 3, BLOCK_P=64, BLOCK_N=32, BLOCK_K=64)],
                  _c(BLOCK_P=16, BLOCK_N=16, BLOCK_K=16), ["P", "N", "HPG", "CHUNK"],
                  [_c(4, 2, BLOCK_P=64, BLOCK_N=32, BLOCK_K=32), _c(8, 2, BLOCK_P=64, BLOCK_N=32, BLOCK_K=32)]),
    # scan_fwd: HEADS=2 candidates share each C.B tile between two heads of a group (two accumulators)
    "scan_fwd": ([_c(4, 2, BLOCK_M=64, BLOCK_P=64, BLOCK_K=64, HEADS=1),
                  _c(4, 3, BLOCK_M=64, BLOCK_P=64, BLOCK_K=32, HEADS=1),
                  _c(8, 2, BLOCK_M=128, BLOCK_P=64, BLOCK_K=64, HEADS=1),
                  _c(4, 2, BLOCK_M=64, BLOCK_P=32, BLOCK_K=64, HEADS=1),
                  _c(8, 2, BLOCK_M=64, BLOCK_P=64, BLOCK_K=64, HEADS=2),
                  _c(4, 2, BLOCK_M=64, BLOCK_P=32, BLOCK_K=64, HEADS=2)],
                 _c(BLOCK_M=16, BLOCK_P=16, BLOCK_K=16, HEADS=2), ["P", "N", "HPG", "CHUNK"]),
    # dx: one BLOCK_M for all candidates (its dD partial buffer is laid out by row block)
    "dx": ([_c(4, 2, BLOCK_M=64, BLOCK_K=64), _c(4, 3, BLOCK_M=64, BLOCK_K=32), _c(8, 3, BLOCK_M=64, BLOCK_K=64)],
           _c(BLOCK_M=16, BLOCK_K=16), ["P", "N", "HPG", "CHUNK"]),
    # dbc_intra: one BLOCK_M for all candidates (partial buffers are laid out by tile)
    "dbc_intra": ([_c(4, 2, BLOCK_M=64), _c(8, 2, BLOCK_M=64), _c(4, 3, BLOCK_M=64)],
                  _c(BLOCK_M=16), ["P", "N", "HPG", "HS", "CHUNK"]),
    "dbc_state": ([_c(4, 2, BLOCK_M=64), _c(8, 2, BLOCK_M=64), _c(8, 2, BLOCK_M=128), _c(4, 3, BLOCK_M=32)],
                  _c(BLOCK_M=16), ["P", "N", "HPG", "HS", "REVERSE", "CHUNK"]),
}


tuned = Tuner(_CONFIGS, restore={"state_fwd": ["final_ptr"]})
