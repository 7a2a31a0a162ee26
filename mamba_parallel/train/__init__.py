"""`mamba-parallel train`: config and flags, data, tokenizers, the loop, optimizer, DCP checkpoints, monitoring.

See mamba_parallel/train/README.md. Entry points: ``train.config.resolve_config`` and ``train.trainer.train``.
"""
