"""How a benchmark leaves once its results are out, also as a torchrun worker."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def exit_worker(code: int) -> NoReturn:
    """``sys.exit(code)``; in a torchrun worker ``os._exit(code)`` after flushing stdout / stderr instead.

    Interpreter teardown can abort a gloo rank ("terminate called without an active exception": a worker thread
    still joinable at exit), which fails a run whose results were already written; a worker skips it."""
    if dist.is_torchelastic_launched():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
