"""``--parallel auto``: pick the layout (tp, cp, then pp and CPU offload) from the GPU count, model size and memory.

The rule (data parallel is preferred: Mamba layers are small, and TP adds two collectives per layer):

1. Estimate the memory one GPU needs for a training step with FSDP2 over dp and TP+SP over tp:
   ``states = 16 bytes x params / world`` (fp32 weights, fp32 gradients, two AdamW moments, all sharded over every
   rank) plus ``activations = tokens x (24 x d_model x n_layer + 8 x vocab) bytes / (tp x cp)``, where tokens =
   micro_batch x seq_len per data-parallel rank (bf16 autocast, no activation checkpointing). The per-token
   constant is fitted to mamba_ssm's measured one-GPU peak (mamba2-2.7b at batch 8 x 2048: 97 GiB measured,
   106 GiB estimated), so it errs on the safe side.
2. Candidates: tp in 1, 2, 4, 8 dividing the world size (TP stays inside one NVLink node) that the model
   accepts (``ParallelDims.validate_for_model``: heads, groups, vocab divisible); cp = 1 first.
3. Take the smallest tp whose estimate fits in ``headroom`` (85%) of the GPU's memory. If none fits, double cp
   (context parallel splits the sequence: activations / cp) while world / tp is divisible, with the largest
   valid tp. If still nothing fits, return the largest valid (tp, cp): the caller should lower the micro-batch
   or turn on activation checkpointing.

``plan_layout`` (what ``train --parallel auto`` uses) goes on where that rule stops: when no (tp, cp) plan fits
it tries pipeline parallel (pp = 2, 4, 8 dividing the world, the smallest that fits), then FSDP2 CPU offload (the
states in host memory, which must hold them), and refuses with the table of what it tried when nothing fits. The
memory model it applies is written down in docs/memory-model.md; ``estimate_memory`` with its defaults is the
formula above.
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


# Activation checkpointing keeps each block's input (hidden in the compute dtype + fp32 residual) per token and
# layer, and rebuilds one block at a time in the backward.
AC_BYTES_PER_TOKEN_LAYER_DMODEL = 8
BF16_STATE_BYTES_PER_PARAM = 12  # bf16 weight + bf16 grad + two fp32 AdamW moments (--param-dtype bf16)


def estimate_memory(config, world_size: int, tp: int = 1, cp: int = 1, seq_len: int = 2048,
                    micro_batch: int = 8, n_params: int | None = None, *, pp: int = 1, microbatches: int = 1,
                    activation_checkpointing: bool = False, cpu_offload: bool = False,
                    param_dtype: str = "fp32", breakdown: bool = False):
    """Bytes one GPU needs for a training step at this layout (docs/memory-model.md). With the defaults: the
    estimate of the module docstring. ``breakdown=True`` -> a dict of the terms (and ``host``: the bytes each rank
    keeps in host memory under ``cpu_offload``)."""
    n_params = count_params(config) if n_params is None else n_params
    per_param = BF16_STATE_BYTES_PER_PARAM if param_dtype == "bf16" else BYTES_PER_PARAM
    states = per_param * n_params / world_size
    gathered = 0.0
    if cpu_offload or pp > 1:
        # FSDP2 units in flight on the GPU: the unit computing and the one prefetched, plus the root (embedding,
        # head) kept gathered; in the compute dtype (bf16 weights: 2 bytes, else 4), split over tp.
        block = (n_params - 2 * config.padded_vocab_size * config.d_model) / config.n_layer
        width = 2 if param_dtype == "bf16" else 4
        gathered = (2 * block + config.padded_vocab_size * config.d_model) * width / tp
    host = states if cpu_offload else 0.0
    tokens = micro_batch * seq_len / (tp * cp)
    layers = config.n_layer / pp
    in_flight = min(pp, microbatches) if pp > 1 else 1  # 1F1B: stage 0 holds pp micro-batches' activations
    if activation_checkpointing:
        act = tokens * config.d_model * (AC_BYTES_PER_TOKEN_LAYER_DMODEL * layers * in_flight
                                         + ACT_BYTES_PER_TOKEN_LAYER_DMODEL)
    else:
        act = tokens * config.d_model * ACT_BYTES_PER_TOKEN_LAYER_DMODEL * layers * in_flight
    logits = tokens * LOGIT_BYTES_PER_TOKEN_VOCAB * config.padded_vocab_size
    gpu = (0.0 if cpu_offload else states) + gathered + act + logits
    if breakdown:
        return {"states": 0.0 if cpu_offload else states, "gathered": gathered, "activations": act,
                "logits": logits, "total": gpu, "host": host}
    return int(gpu)


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


# ---- the whole plan: dp / tp / cp, then pp, then offload ---------------------------------------------------------
class LayoutPlan:
    """A layout ``plan_layout`` chose: degrees, offload, the estimate and why (``reason``, printed by train)."""

    def __init__(self, tp: int, cp: int, pp: int, cpu_offload: bool, estimate: int, reason: str):
        self.tp, self.cp, self.pp, self.cpu_offload = tp, cp, pp, cpu_offload
        self.estimate, self.reason = estimate, reason

    def __repr__(self) -> str:
        return (f"LayoutPlan(tp={self.tp}, cp={self.cp}, pp={self.pp}, cpu_offload={self.cpu_offload}, "
                f"estimate={self.estimate / 2**30:.1f} GiB)")


def host_memory_bytes() -> int:
    """Physical memory of this machine (0 when unknown)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def plan_layout(world_size: int, config, gpu_mem_bytes: int, seq_len: int = 2048, micro_batch: int = 8, *,
                activation_checkpointing: bool = False, param_dtype: str = "fp32", microbatches: int = 0,
                host_mem_bytes: int | None = None, local_world_size: int | None = None) -> LayoutPlan:
    """The layout of ``--parallel auto``: the first that fits in ``HEADROOM`` of the GPU, in this order:
    ``choose_parallel``'s (tp, cp); pipeline parallel (pp = 2, 4, 8 dividing the world, tp / cp as found); CPU
    offload (dp only; the host must hold ``local_world_size`` ranks' states in ``HEADROOM`` of its memory).
    Raises ParallelConfigError with what each candidate needs when none fits."""
    if not gpu_mem_bytes or gpu_mem_bytes <= 0:
        return LayoutPlan(1, 1, 1, False, 0, "GPU memory unknown (CPU ranks): data parallel only")
    n = count_params(config)
    budget = HEADROOM * gpu_mem_bytes
    host = host_memory_bytes() if host_mem_bytes is None else host_mem_bytes
    local = local_world_size or min(world_size, 8)
    common = dict(seq_len=seq_len, micro_batch=micro_batch, n_params=n,
                  activation_checkpointing=activation_checkpointing, param_dtype=param_dtype)
    tried = []

    def est(tp=1, cp=1, pp=1, off=False):
        mb = microbatches or max(pp, 1)
        return estimate_memory(config, world_size, tp, cp, pp=pp, microbatches=mb, cpu_offload=off,
                               breakdown=True, **common)

    def gib(x: float) -> str:
        return f"{x / 2**30:.1f} GiB"

    tp, cp = choose_parallel(world_size, config, gpu_mem_bytes, seq_len=seq_len, micro_batch=micro_batch)
    e = est(tp, cp)
    tried.append((f"tp={tp} cp={cp}", e))
    if e["total"] <= budget:
        return LayoutPlan(tp, cp, 1, False, int(e["total"]),
                          f"tp={tp} cp={cp} (dp={world_size // (tp * cp)}): {gib(e['total'])} per GPU fits "
                          f"{HEADROOM:.0%} of {gib(gpu_mem_bytes)}")
    for pp in (2, 4, 8):
        if world_size % pp or pp > config.n_layer:
            continue
        tq, cq = choose_parallel(world_size // pp, config, gpu_mem_bytes, seq_len=seq_len, micro_batch=micro_batch)
        e = est(tq, cq, pp)
        tried.append((f"tp={tq} cp={cq} pp={pp}", e))
        if e["total"] <= budget:
            return LayoutPlan(tq, cq, pp, False, int(e["total"]),
                              f"tp={tp} cp={cp} alone needs {gib(tried[0][1]['total'])} per GPU; pp={pp} splits the "
                              f"layers: {gib(e['total'])} fits {HEADROOM:.0%} of {gib(gpu_mem_bytes)}")
    e = est(off=True)
    tried.append(("cpu offload", e))
    host_need = e["host"] * local
    if e["total"] <= budget and (not host or host_need <= HEADROOM * host):
        return LayoutPlan(1, 1, 1, True, int(e["total"]),
                          f"no tp / cp / pp layout fits; FSDP2 CPU offload keeps {gib(host_need)} of states in host "
                          f"memory ({gib(host)}) and needs {gib(e['total'])} per GPU")
    lines = [f"  {name}: {gib(x['total'])} per GPU" + (f", {gib(x['host'] * local)} host" if x["host"] else "")
             for name, x in tried]
    raise ParallelConfigError(
        f"--parallel auto: no layout fits {world_size} GPU(s) of {gib(gpu_mem_bytes)} (budget {HEADROOM:.0%}) at "
        f"micro-batch {micro_batch} x {seq_len} tokens:\n" + "\n".join(lines) +
        "\nlower --batch-size or --seq-len, add --activation-checkpointing or --param-dtype bf16, or use more GPUs")
