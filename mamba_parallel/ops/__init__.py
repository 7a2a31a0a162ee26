"""Every op as ONE public function (shape docstring, input checks, backend dispatch); see docs/API.md.

Each op folder holds ``naive.py`` (pure PyTorch: the specification and the CPU route) and, where written, a
``triton_impl.py`` kernel with the same signature, picked per call by the backend (``use_backend``,
ops/backend.py). Switches for a block of code: ``use_backend("naive" | "triton" | "auto")``,
``use_eager_fastpath(False)`` (every op through its torch.library custom op), ``use_autotune(False)`` (the SSD's
first launch candidate, no tuning).
"""

from mamba_parallel.ops.backend import use_autotune, use_backend
from mamba_parallel.ops import decode_step
from mamba_parallel.ops.conv1d import causal_conv1d, causal_conv1d_update
from mamba_parallel.ops.cross_entropy import linear_cross_entropy
from mamba_parallel.ops.eager_fastpath import use_eager_fastpath
from mamba_parallel.ops.layout import silu_gate, token_major
from mamba_parallel.ops.norm import (add_rms_norm, add_rms_norm_linear, gated_rms_norm, gated_rms_norm_linear,
                                     rms_norm)
from mamba_parallel.ops.selective_scan import selective_scan
from mamba_parallel.ops.selective_scan.naive import selective_scan_sequential
from mamba_parallel.ops.ssd import ssd_chunk_scan
from mamba_parallel.ops.ssd.naive import ssd_sequential
from mamba_parallel.ops.state_update import selective_state_update, ssd_state_update

__all__ = [
    "selective_scan", "ssd_chunk_scan", "causal_conv1d", "causal_conv1d_update", "rms_norm", "add_rms_norm",
    "add_rms_norm_linear", "gated_rms_norm", "gated_rms_norm_linear", "selective_state_update", "ssd_state_update",
    "linear_cross_entropy",
    "ssd_sequential", "selective_scan_sequential", "token_major", "silu_gate", "use_backend", "use_eager_fastpath",
    "use_autotune", "decode_step",
]

# Resolve the kernel modules now, while not compiling: the lookup (importlib) is not traceable by torch.compile,
# so a first op call inside a compiled region would otherwise break the graph.
from mamba_parallel.ops._common import kernel_module as _kernel_module  # noqa: E402
from mamba_parallel.ops.backend import triton_available as _triton_available  # noqa: E402

if _triton_available():
    for _pkg in ("conv1d", "cross_entropy", "decode_step", "layout", "norm", "selective_scan", "ssd",
                 "state_update"):
        _kernel_module(f"{__name__}.{_pkg}")
