"""``--parallel auto``: pick the tensor- and context-parallel degrees from the GPU count, model size and memory.

The rule (data parallel is preferred: Mamba layers are small, and TP adds two collectives per layer):

1. Estimate the memory one GPU needs for a training step with FSDP2 over dp and TP+SP over tp:
   ``states = 16 bytes x params / world`` (fp32 weights, fp32 gradients, two AdamW moments, all sharded over every
   rank) plus ``activations = tokens x (24 x d_model x n_layer + 8 x vocab) bytes / (tp x cp)``, where tokens =
   micro_batch x seq_len per data-parallel rank (bf16 autocast, no activation checkpointing). The per-token
   constant is fitted to the 1-GPU peer figures in shared/ANCHORS.md (mamba2-2.7b: 97 GiB measured, 106 GiB
   estimated at batch 8 x 2048), so it errs on the safe side.
2. Candidates: tp in 1, 2, 4, 8 dividing the world size (TP stays inside one NVLink node) that the model
   accepts (``ParallelDims.validate_for_model``: heads, groups, vocab divisible); cp = 1 first.
3. Take the smallest tp whose estimate fits in ``headroom`` (85%) of the GPU's memory. If none fits, double cp
   (context parallel splits the sequence: activations / cp) while world / tp is divisible, with the largest
   valid tp. If still nothing fits, return the largest valid (tp, cp): the caller should lower the micro-batch
   or turn on activation checkpointing.
"""

from __future__ import annotations

import torch

from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims

BYTES_PER_PARAM = 16  # fp32 weight + fp32 grad + AdamW exp_avg + exp_avg_sq
ACT_BYTES_PER_TOKEN_LAYER_DMODEL = 24
LOGIT_BYTES_PER_TOKEN_VOCAB = 8
HEADROOM = 0.85


def count_params(config) -> int:
    """Parameters of the model described by ``config`` (built on the meta device: no memory)."""
    from mamba_parallel.models import MambaLMHeadModel

    model = MambaLMHeadModel(config, device="meta")
    return sum(p.numel() for p in model.parameters())


def estimate_memory(config, world_size: int, tp: int = 1, cp: int = 1, seq_len: int = 2048,
                    micro_batch: int = 8, n_params: int | None = None) -> int:
    """Bytes one GPU needs for a training step at this layout (the estimate of the module docstring)."""
    n_params = count_params(config) if n_params is None else n_params
    states = BYTES_PER_PARAM * n_params / world_size
    tokens = micro_batch * seq_len
    per_token = (ACT_BYTES_PER_TOKEN_LAYER_DMODEL * config.d_model * config.n_layer
                 + LOGIT_BYTES_PER_TOKEN_VOCAB * config.padded_vocab_size)
    return int(states + tokens * per_token / (tp * cp))


def _valid_tp(world_size: int, config) -> list[int]:
    out = []
    for tp in (1, 2, 4, 8):
        if world_size % tp:
            continue
        try:
            ParallelDims(dp_shard=-1, tp=tp, world_size=world_size).validate_for_model(config)
        except ParallelConfigError:
            continue
        out.append(tp)
    return out


def choose_parallel(world_size: int, config, gpu_mem_bytes: int, seq_len: int = 2048,
                    micro_batch: int = 8) -> tuple[int, int]:
    """-> (tp, cp) for ``world_size`` GPUs of ``gpu_mem_bytes`` each (dp = world_size / (tp * cp)).

    ``gpu_mem_bytes`` 0 or None (no GPU, memory unknown) gives (1, 1): data parallel only.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ParallelConfigError(f"choose_parallel: world_size must be an integer >= 1, got {world_size!r}")
    if not gpu_mem_bytes or gpu_mem_bytes <= 0:  # unknown (CPU ranks): plain data parallel
        return 1, 1
    n_params = count_params(config)
    budget = HEADROOM * gpu_mem_bytes
    tps = _valid_tp(world_size, config)

    def fits(tp: int, cp: int) -> bool:
        return estimate_memory(config, world_size, tp, cp, seq_len, micro_batch, n_params) <= budget

    for tp in tps:
        if fits(tp, 1):
            return tp, 1
    tp, cp = tps[-1], 1
    while (world_size // tp) % (2 * cp) == 0 and not fits(tp, cp):
        cp *= 2
    return tp, cp


def gpu_memory_bytes(device: torch.device | None = None) -> int:
    """Total memory of the current CUDA device (for ``choose_parallel``); raises without CUDA."""
    if not torch.cuda.is_available():
        raise ParallelConfigError("--parallel auto needs CUDA to read the GPU memory; pass --tp / --cp instead")
    return torch.cuda.get_device_properties(device or torch.cuda.current_device()).total_memory
