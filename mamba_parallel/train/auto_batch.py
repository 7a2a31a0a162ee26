"""``--batch-size auto``: the largest micro-batch that fits, measured on a GPU, from the memory model elsewhere.

On a GPU (one stage per rank, no pipeline): a throwaway copy of the model at the run's layout runs forward +
backward at micro-batch 1 and 2; the difference of the peaks is one sequence's activations, the rest is fixed;
the optimizer's two moments (not yet allocated) are added from the local parameter count; the largest batch whose
prediction fits ``HEADROOM`` of the GPU is then run once to confirm (halved until it does). Every rank measures,
the smallest answer wins. With ``--pp`` (a schedule fixes its micro-batch shape at the first step) and on CPU:
the memory model of ``--parallel auto`` (distributed/auto.py) against the GPU's (or the host's) memory, at most
``CPU_CAP`` sequences on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mamba_parallel.config import ConfigError
from mamba_parallel.distributed.auto import HEADROOM, count_params, estimate_memory, host_memory_bytes

MAX_BATCH = 1024
CPU_CAP = 64


def _from_memory_model(cfg, config, dims, mem: int, cap: int) -> int:
    n = count_params(config)
    best = 0
    for b in range(1, cap + 1):
        e = estimate_memory(config, dims.world_size, dims.tp, dims.cp, cfg.seq_len, b, n, pp=dims.pp,
                            microbatches=max(cfg.microbatches, cfg.grad_accum, dims.pp),
                            activation_checkpointing=cfg.activation_checkpointing, cpu_offload=cfg.cpu_offload,
                            param_dtype=cfg.param_dtype)
        if e > HEADROOM * mem:
            break
        best = b
    return best


def _agree(b: int, device) -> int:
    if dist.is_initialized():
        t = torch.tensor([b], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        b = int(t.item())
    return b


def _probe(cfg, config, env, dims) -> int:
    from mamba_parallel.train.trainer import _autocast, build_parallel_model

    dev = env.device
    model, _ = build_parallel_model(config, cfg, env, dims, resuming=True)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    moments = 0 if cfg.cpu_offload else 8 * local
    budget = HEADROOM * torch.cuda.get_device_properties(dev).total_memory
    L = cfg.seq_len // dims.cp
    vocab = config.vocab_size

    def peak(b: int) -> int | None:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        ids = torch.randint(0, vocab, (b, L), device=dev)
        try:
            with _autocast(cfg, dev):
                loss = model(ids, targets=ids).loss
            loss.backward()
            torch.cuda.synchronize(dev)
            return torch.cuda.max_memory_allocated(dev) + moments
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            model.zero_grad(set_to_none=True)

    def fits(p) -> bool:  # on every rank (each decision is the same everywhere: the probes are collective)
        return bool(_agree(int(p is not None and p <= budget), dev))

    p1 = peak(1)
    best = 1 if fits(p1) else 0
    p2 = peak(2) if best else None
    if best and fits(p2):
        per_seq = max(p2 - p1, 1)
        guess = _agree(min(MAX_BATCH, int(1 + (budget - p1) // per_seq)), dev)
        while guess > 2 and not fits(peak(guess)):
            guess = max(2, guess * 3 // 4)
        best = max(2, guess)
    del model
    torch.cuda.empty_cache()
    return best


def resolve_auto_batch(cfg, config, env, dims, log) -> int:
    """The micro-batch of ``--batch-size auto`` (>= 1; ConfigError when not even one sequence fits)."""
    if env.device.type == "cuda" and dims.pp == 1:
        b, how = _probe(cfg, config, env, dims), "measured"
    else:
        if env.device.type == "cuda":
            mem, cap = torch.cuda.get_device_properties(env.device).total_memory, MAX_BATCH
        else:
            mem, cap = host_memory_bytes(), CPU_CAP
        b, how = _from_memory_model(cfg, config, dims, mem, cap), "memory model"
    b = _agree(b, env.device)
    if b < 1:
        raise ConfigError(f"--batch-size auto: not even one sequence of --seq-len {cfg.seq_len} fits "
                          f"({how}); lower --seq-len, add --activation-checkpointing / --cpu-offload / --pp")
    log(f"--batch-size auto: {b} sequences per micro-batch ({how}"
        f"{', capped on CPU' if env.device.type == 'cpu' and b == CPU_CAP else ''})")
    return b
