"""The batch of a training step: micro-batch size (``--batch-size N`` or ``auto``), micro-steps per optimizer step,
and the global batch they make (``--global-batch-size``), resolved once per run from the layout.

global batch = batch_size x dp ranks x micro-steps. ``--global-batch-size N`` fixes N and derives the micro-steps
(gradient accumulation; with ``--pp`` the pipeline's micro-batches), so the same run resumed on another number of
GPUs keeps its global batch: the trainer records the global batch of every run in its config.toml.
"""

from __future__ import annotations

from mamba_parallel.config import ConfigError


def resolve_micro_steps(cfg, dp: int, pp: int) -> int:
    """Micro-steps per optimizer step for ``cfg`` on ``dp`` data-parallel ranks and ``pp`` pipeline stages, set into
    ``cfg.grad_accum`` (and ``cfg.global_batch_size``); raises ConfigError naming the flags that disagree."""
    bs = cfg.batch_size
    per_micro = bs * dp
    wanted = cfg.microbatches or 0
    if cfg.global_batch_size:
        if cfg.global_batch_size % per_micro:
            raise ConfigError(f"--global-batch-size {cfg.global_batch_size} is not a multiple of --batch-size "
                              f"{bs} x {dp} data-parallel rank(s) = {per_micro}")
        n = cfg.global_batch_size // per_micro
        if wanted and wanted != n:
            raise ConfigError(f"--microbatches {wanted} disagrees with --global-batch-size {cfg.global_batch_size} "
                              f"= {n} micro-batches of {bs} x {dp} ranks")
    elif wanted:
        if cfg.grad_accum not in (1, wanted):
            raise ConfigError(f"--microbatches {wanted} and --grad-accum {cfg.grad_accum} disagree: give one")
        n = wanted
    else:
        n = max(cfg.grad_accum, pp) if pp > 1 else cfg.grad_accum
    if pp > 1 and n < pp:
        raise ConfigError(f"--pp {pp} needs at least {pp} micro-batches per step, got {n} (raise --microbatches "
                          f"or --global-batch-size)")
    cfg.grad_accum = n
    cfg.global_batch_size = n * per_micro
    return n
