"""``--deterministic``: bitwise-repeatable training steps on the GPU, for the duration of a run.

- torch's deterministic algorithms (``torch.use_deterministic_algorithms``; cuDNN deterministic, no benchmark)
  and cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, cuBLAS's own requirement for repeatable
  GEMMs, set before its first use when the user has not set it);
- our kernels: none of them accumulates with atomics (their reductions run in a fixed order), but the SSD kernels
  autotune their launch configuration per process, and another tile is another summation order; here they take
  their first candidate instead (``ops.use_autotune(False)``).
The previous settings are restored when the run ends.
"""

from __future__ import annotations

import contextlib
import os

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"


def _fixed_kernel_configs():
    from mamba_parallel import ops

    return ops.use_autotune(False)


@contextlib.contextmanager
def deterministic_mode(on: bool):
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, os.environ.get(CUBLAS_ENV))
    if before[3] is None:
        os.environ[CUBLAS_ENV] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with _fixed_kernel_configs():
            yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
        if before[3] is None:
            os.environ.pop(CUBLAS_ENV, None)
