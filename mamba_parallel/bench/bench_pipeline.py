"""Pipeline-parallel step benchmark: tokens/s, peak memory and the MEASURED bubble fraction of a schedule.

    torchrun --nproc_per_node 2 -m mamba_parallel.bench.bench_pipeline --preset mamba2-2.7b --pp 2 \\
        --schedule 1f1b --microbatches 8 --batch-size 2 --seq-len 2048 --dtype bf16 [--json out.json]

Synthetic tokens, the trainer's own build (meta device, stages, FSDP2 / replicas per stage) and step
(``train/pipelined.py``), fp32 master weights; AdamW steps included. Bubble fraction per rank = 1 - (time its
stages spend in forward / backward chunks, CUDA events) / step time: the share of the step it waits on its
neighbours; printed as the mean and the max over ranks, beside the schedule's textbook value: (p - 1) / (m + p - 1)
for GPipe / 1F1B with p ranks and m micro-batches, (p - 1) / (v m + p - 1) for interleaved 1F1B with v stages per
rank, 0 for the zero-bubble schedules (their ideal, with forward / backward / weight-gradient chunks of equal cost).
``--pp 1`` times the same global batch as plain gradient accumulation on the same GPUs. Prints one JSON line (rank
0) and writes it to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from mamba_parallel.bench.worker_exit import exit_worker


def textbook_bubble(schedule: str, p: int, m: int, stages_per_rank: int = 1) -> float:
    """The share of a step a rank idles under ``schedule`` in theory (p ranks, m micro-batches)."""
    if p < 2:
        return 0.0
    if schedule in ("interleaved-zb", "zbv"):
        return 0.0
    v = stages_per_rank if schedule == "interleaved-1f1b" else 1
    return (p - 1) / (v * m + p - 1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m mamba_parallel.bench.bench_pipeline",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mamba2-370m")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp-mode", choices=["fsdp", "ddp"], default="fsdp")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--json", default=None, help="also write the result here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from mamba_parallel.train import pipelined
    from mamba_parallel.train.batching import resolve_micro_steps
    from mamba_parallel.train.config import resolve_config
    from mamba_parallel.train.optim import build_optimizer
    from mamba_parallel.train.trainer import _autocast, _grad_norm, build_parallel_model, choose_dims, dp_options
    from mamba_parallel.distributed.data_parallel import init_distributed
    from mamba_parallel.distributed.pipeline import stages_per_rank

    cfg = resolve_config(preset=args.preset, pp=args.pp, pp_schedule=args.schedule, microbatches=args.microbatches,
                         batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype, tp=args.tp,
                         dp_mode=args.dp_mode, activation_checkpointing=args.activation_checkpointing,
                         cpu_offload=args.cpu_offload, param_dtype=args.param_dtype, device=args.device,
                         progress=False)
    env = init_distributed(cfg.device, single_rank_group=True)
    config = cfg.model_config()
    dims = choose_dims(cfg, config, env, lambda s: None)
    dims.build_mesh(env.device.type)
    resolve_micro_steps(cfg, dims.dp, dims.pp)
    if dims.pp > 1:
        model = pipelined.build_pipelined_model(config, cfg, env, dims, dp_options(cfg), timed=True)
    else:
        model, _ = build_parallel_model(config, cfg, env, dims, resuming=True)
    opt = build_optimizer(model, 1e-4, 0.1, fused=env.device.type == "cuda" and not cfg.cpu_offload,
                          param_dtype=cfg.param_dtype)
    n, b, L = cfg.grad_accum, cfg.batch_size, cfg.seq_len // dims.cp
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (n * b, L + 1), generator=g).to(env.device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)

    def step() -> float:
        if dims.pp > 1:
            with _autocast(cfg, env.device):
                loss = pipelined.pipeline_step(model, inputs, targets)
        else:
            loss = torch.zeros((), device=env.device)
            for m in range(n):
                with _autocast(cfg, env.device):
                    out = model(inputs[m * b:(m + 1) * b], targets=targets[m * b:(m + 1) * b]).loss
                (out / n).backward()
                loss += out.detach() / n
        _grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    sync()
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    timer = getattr(model, "timer", None)
    if timer is not None:
        timer.reset()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    bubble = timer.bubble_fraction(step_s * args.steps) if timer is not None else 0.0
    mem = torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else 0.0
    stats = torch.tensor([bubble, mem, float(loss)], dtype=torch.float64, device=env.device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    bubbles = [float(x[0]) for x in gathered]
    p, m = dims.pp, n
    cfg_stages = stages_per_rank(cfg.pp_schedule, cfg.pp_stages_per_rank) if p > 1 else 1
    result = {"preset": args.preset, "world": world, "pp": p, "tp": dims.tp, "dp": dims.dp,
              "schedule": args.schedule if p > 1 else "accumulation", "microbatches": m, "batch_size": b,
              "seq_len": cfg.seq_len, "dtype": cfg.dtype, "activation_checkpointing": cfg.activation_checkpointing,
              "step_s": round(step_s, 4), "tokens_per_s": round(n * b * dims.dp * cfg.seq_len / step_s, 1),
              "peak_mem_gib": round(max(float(x[1]) for x in gathered), 2),
              "bubble_fraction_mean": round(sum(bubbles) / len(bubbles), 4) if p > 1 else None,
              "bubble_fraction_max": round(max(bubbles), 4) if p > 1 else None,
              "bubble_fraction_theory": round(textbook_bubble(args.schedule, p, m, cfg_stages), 4) if p > 1
              else None,
              "loss": round(float(gathered[-1][2]), 4), "device": str(env.device),
              "gpu": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    if env.is_main:
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
    dist.barrier()
    return 0


if __name__ == "__main__":
    exit_worker(main())
