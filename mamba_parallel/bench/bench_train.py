"""One training step of a preset: tokens/s and peak memory, median over timed steps after warm-up, as JSON.

With the peer (``--peer``; the default when mamba_ssm imports and the run is the default one-GPU step): mamba_ssm's
model beside ours on the same initial weights and batch, in this process (train_side_by_side.py; no gradient
clipping on either side). Under torchrun with ``--peer``: the peer wrapped in DDP beside ours in FSDP2 and DDP on
every rank (bench_train_dp.py). Otherwise ours alone, as below.

Synthetic tokens; fp32 master weights + bf16 autocast; fused AdamW on CUDA; the same model building and
parallelize() path as `mamba-parallel train`. Works under torchrun (dp / tp / cp from the flags):

    mamba-parallel bench train --preset mamba2-370m
    torchrun --nproc_per_node 2 -m mamba_parallel.cli bench train --preset mamba2-370m --profile

``--cuda-graph`` captures the whole step (forward, backward, clipping, AdamW) in one CUDA graph and times its replays
(one GPU or --tp; with ``--peer``: our step graphed beside the peer's eager one, the case named so);
``--grad-clip 0`` leaves out the gradient norm ("fwd + bwd + fused AdamW").
``--profile`` adds the host time to issue each phase (forward, backward, clip, optimizer; when it nears the step
time the step is CPU-bound), each phase's time with a device sync around it, and the all-reduce bus bandwidth
(NVLink-class links give hundreds of GB/s; a host-memory path tens, too slow to hide fp32 gradients).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from mamba_parallel.bench.peer import add_peer_flags, resolve_peer
from mamba_parallel.bench.results import add_git_commit_flag, publish
from mamba_parallel.bench.worker_exit import exit_worker
from mamba_parallel.train.config import DEFAULT_RECOMPUTE


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def dp_options(a: argparse.Namespace) -> dict:
    """The data-parallel speed flags as ``parallelize`` keyword arguments (build_parallel_model's ``options``)."""
    return {"param_dtype": torch.bfloat16 if a.fsdp_param_dtype == "bf16" else None,
            "reshard_after_forward": not a.no_reshard_after_forward,
            "ddp_bucket_cap_mb": a.ddp_bucket_mb, "ddp_bf16_grads": a.ddp_bf16_grads,
            "fsdp_blocks_per_unit": a.fsdp_blocks_per_unit}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mamba-parallel bench train", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mamba2-130m", help="model preset (default: mamba2-130m)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: 2048)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank (default: 8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="autocast dtype (default: bf16)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dp-mode", choices=["fsdp", "ddp"], default="fsdp", help="data parallel mode (default: fsdp)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    p.add_argument("--cp", type=int, default=1, help="context parallel degree")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute block activations")
    p.add_argument("--recompute", default=DEFAULT_RECOMPUTE, metavar="ITEMS",
                   help="comma list of conv, dt, gate, states: activations each layer rebuilds in the backward "
                        "instead of keeping them (as `train --recompute`; docs/memory.md); none keeps everything. "
                        f"Default: {DEFAULT_RECOMPUTE}, as train's")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the whole step in one CUDA graph and replay it (one GPU or --tp only)")
    p.add_argument("--grad-clip", type=_non_negative_float, default=1.0, metavar="F",
                   help="clip the global gradient norm to F; 0 = no norm and no clipping, i.e. fwd + bwd + fused "
                        "AdamW (default: 1.0; the side-by-side run with the peer never clips)")
    p.add_argument("--fsdp-param-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="FSDP2 compute/all-gather dtype (MixedPrecisionPolicy.param_dtype; fp32 master shards and "
                        "fp32 gradient reduction either way; default: fp32)")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="FSDP2: keep blocks gathered from forward to backward (one all-gather per step, not two)")
    p.add_argument("--fsdp-blocks-per-unit", type=_positive_int, default=1, metavar="K",
                   help="FSDP2: shard K consecutive blocks as one unit (one all-gather / reduce-scatter and one set "
                        "of hooks per K blocks; same checkpoint names; default: 1)")
    p.add_argument("--ddp-bucket-mb", type=float, default=None, help="DDP bucket size in MB (default: torch's 25)")
    p.add_argument("--ddp-bf16-grads", action="store_true", help="DDP: all-reduce gradients in bf16")
    p.add_argument("--profile", action="store_true",
                   help="add a per-phase breakdown (forward, backward, clip, optimizer, other) in ms: host time to "
                        "issue each phase in the timed steps, and device-synchronised time in extra steps")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the result to FILE (side by side: a .json file or a results folder)")
    add_git_commit_flag(p)
    add_peer_flags(p)
    return p


def _side_by_side_peer(a: argparse.Namespace):
    """The peer adapter when this run compares with it (flags permitting), else None. Under torchrun only an
    explicit ``--peer`` compares (the data-parallel side by side, bench_train_dp.py); otherwise ours runs alone, as
    the scaling table's runs do. ``--recompute`` applies to our side only (mamba_ssm's layers rebuild what their
    fused kernels choose): a one-process run compares the two at the memory each keeps. ``--cuda-graph`` applies
    to our step only (captured whole; the peer has no such mode), one GPU."""
    launched = dist.is_torchelastic_launched()
    other = [flag for flag, on in (("--tp", a.tp > 1), ("--cp", a.cp > 1),
                                   ("--cuda-graph under torchrun", a.cuda_graph and launched),
                                   ("--profile", a.profile), ("--compile", a.compile),
                                   ("--recompute under torchrun", a.recompute != DEFAULT_RECOMPUTE and launched),
                                   ("--activation-checkpointing", a.activation_checkpointing),
                                   ("--dtype fp32", a.dtype != "bf16")) if on]
    if other:
        if a.peer:
            raise SystemExit(f"bench train: --peer compares the bf16 step without {', '.join(other)}: drop it "
                             "(or pass --no-peer)")
        return None
    if not a.peer and (launched or a.recompute != DEFAULT_RECOMPUTE or a.cuda_graph):  # asked for, not assumed
        return None
    return resolve_peer(a.peer, a.peer_impl)


def _run_side_by_side(a: argparse.Namespace, peer) -> int:
    from mamba_parallel.bench import bench_train_dp, train_side_by_side
    from mamba_parallel.train.trainer import resolve_recompute

    if dist.is_torchelastic_launched():  # torchrun: the peer in DDP beside ours (FSDP2 and DDP) on every rank
        return bench_train_dp.run_launched([a.preset], a.peer, a.peer_impl, a.device, a.seq_len, a.batch_size,
                                           a.warmup_steps, a.steps, bench_train_dp.DP_MODES, a.json,
                                           git_commit=a.git_commit)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.cuda_graph:
        from mamba_parallel.train.cuda_graph import check_graph_layout
        check_graph_layout(device, dp=1, cp=1)
    result = train_side_by_side.run([a.preset], peer, device, a.seq_len, a.batch_size, a.warmup_steps, a.steps,
                                    recompute=resolve_recompute(a.recompute), cuda_graph=a.cuda_graph)
    publish(result, device, peer, path=a.json, git_commit=a.git_commit)
    return 0


def _allreduce_busbw(device: torch.device, sync, mib: int = 256, reps: int = 5) -> float:
    """NCCL-tests style bus bandwidth (GB/s) of an fp32 all-reduce over the world: says whether the link is
    NVLink-class (hundreds of GB/s) or a host-memory path (tens), i.e. whether gradients can hide behind compute."""
    mib = mib if device.type == "cuda" else 8
    buf = torch.ones(mib * 2**20 // 4, device=device)
    n = dist.get_world_size()
    dist.all_reduce(buf)
    sync()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 * 2 * (n - 1) / n / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    from mamba_parallel.train.config import resolve_config
    from mamba_parallel.train.trainer import resolve_recompute

    a = build_parser().parse_args(argv)
    peer = _side_by_side_peer(a)
    if peer is not None:
        return _run_side_by_side(a, peer)
    cfg = resolve_config(preset=a.preset, seq_len=a.seq_len, batch_size=a.batch_size, dtype=a.dtype,
                         device=a.device, dp_mode=a.dp_mode, tp=a.tp, cp=a.cp, recompute=a.recompute,
                         activation_checkpointing=a.activation_checkpointing, compile=a.compile, out="unused")
    return _run(a, cfg, resolve_recompute(cfg.recompute, cfg.compile))


def _run(a: argparse.Namespace, cfg, recompute: str) -> int:
    """The benchmark of ``main`` with its flags resolved; ``recompute``: the items in effect (for the JSON)."""
    from mamba_parallel.distributed.data_parallel import init_distributed
    from mamba_parallel.train.cuda_graph import GraphedTrainStep, check_graph_layout
    from mamba_parallel.train.flops import peak_flops, train_flops_per_token
    from mamba_parallel.train.optim import build_optimizer
    from mamba_parallel.train.trainer import _autocast, _grad_norm, _model_class, build_parallel_model, \
        choose_dims

    env = init_distributed(cfg.device)
    config = cfg.model_config()
    dims = choose_dims(cfg, config, env, print)
    if a.cuda_graph:
        check_graph_layout(env.device, dims.dp, dims.cp, a.dp_mode)
    if env.world_size > 1:
        dims.build_mesh(env.device.type)
    model, _ = build_parallel_model(config, cfg, env, dims, resuming=False, options=dp_options(a))
    optimizer = build_optimizer(model, 1e-4, 0.1, fused=env.device.type == "cuda")
    with torch.device("meta"):
        flops_per_token = train_flops_per_token(_model_class()(config), config, cfg.seq_len)

    # Ranks of one tp / cp group share a batch (its cp slice); data-parallel groups differ.
    dp_rank = env.rank // (dims.cp * dims.tp)
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    tokens = torch.randint(0, config.vocab_size, (a.batch_size, a.seq_len + 1), generator=gen)
    n = a.seq_len // dims.cp
    c = (env.rank // dims.tp) % dims.cp
    inputs = tokens[:, c * n:(c + 1) * n].to(env.device)
    labels = tokens[:, 1 + c * n:1 + (c + 1) * n].to(env.device)

    def sync():
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)

    phases = ("forward", "backward", "clip", "optimizer")
    graphed = None
    if a.cuda_graph:  # captured at the first call (its own warm-up steps first, then undone)
        phases = ("replay",)
        graphed = GraphedTrainStep(model, optimizer, grad_clip=a.grad_clip or None,
                                   autocast_dtype=torch.bfloat16 if a.dtype == "bf16" else None)

    def one_step(marks: list, synced: bool) -> torch.Tensor:
        """One training step; appends perf_counter() after each phase (after a device sync when ``synced``)."""
        def mark():
            if synced:
                sync()
            marks.append(time.perf_counter())
        if graphed is not None:
            loss, _ = graphed(inputs, labels)
            mark()
            return loss
        with _autocast(cfg, env.device):
            loss = model(inputs, targets=labels).loss
        mark()
        loss.backward()
        mark()
        if a.grad_clip > 0:
            _grad_norm(model, a.grad_clip)
        mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark()
        return loss

    times, host = [], {k: [] for k in phases}
    for i in range(a.warmup_steps + a.steps):
        # a graph allocates only while being captured (first call): its peak is measured there
        if i == (0 if graphed is not None else a.warmup_steps) and env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        sync()
        t0 = time.perf_counter()
        marks = [t0]
        loss = one_step(marks, synced=False)
        sync()
        if i >= a.warmup_steps:
            times.append(time.perf_counter() - t0)
            for k, t_a, t_b in zip(phases, marks, marks[1:]):
                host[k].append(t_b - t_a)
    profile = None
    if a.profile:
        # Synchronised phases: what each phase costs on its own (loses the overlap the real step has).
        synced = {k: [] for k in phases}
        for _ in range(a.steps):
            sync()
            marks = [time.perf_counter()]
            one_step(marks, synced=True)
            for k, t_a, t_b in zip(phases, marks, marks[1:]):
                synced[k].append(t_b - t_a)
        med = {k: statistics.median(v) * 1e3 for k, v in host.items()}
        sync_med = {k: statistics.median(v) * 1e3 for k, v in synced.items()}
        profile = {"host_issue_ms": {k: round(v, 2) for k, v in med.items()},
                   "host_issue_total_ms": round(sum(med.values()), 2),
                   "synced_ms": {k: round(v, 2) for k, v in sync_med.items()},
                   # vs step_ms_median: how much the real step gains from overlapping its phases
                   "synced_total_ms": round(sum(sync_med.values()), 2)}
        if dist.is_initialized():
            profile["allreduce_busbw_gbps"] = round(_allreduce_busbw(env.device, sync), 1)

    step_s = statistics.median(times)
    peak = torch.tensor(torch.cuda.max_memory_allocated(env.device) / 2**30 if env.device.type == "cuda" else 0.0,
                        device=env.device)
    if dist.is_initialized():
        t = torch.tensor(step_s, device=env.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        step_s = t.item()
    global_tokens = a.batch_size * dims.dp * a.seq_len
    tps = global_tokens / step_s
    pf = peak_flops(env.device, a.dtype)
    result = {
        "bench": "train", "preset": a.preset, "device": torch.cuda.get_device_name(env.device)
        if env.device.type == "cuda" else "cpu", "world_size": env.world_size, "dp": dims.dp, "tp": dims.tp,
        "cp": dims.cp, "dp_mode": a.dp_mode, "dtype": a.dtype, "seq_len": a.seq_len, "batch_per_dp_rank": a.batch_size,
        "activation_checkpointing": a.activation_checkpointing, "recompute": recompute, "compile": a.compile,
        "cuda_graph": a.cuda_graph,
        "grad_clip": a.grad_clip,
        "fsdp_param_dtype": a.fsdp_param_dtype, "reshard_after_forward": not a.no_reshard_after_forward,
        "ddp_bucket_mb": a.ddp_bucket_mb, "ddp_bf16_grads": a.ddp_bf16_grads,
        "fsdp_blocks_per_unit": a.fsdp_blocks_per_unit,
        "step_ms_median": round(step_s * 1e3, 2), "tokens_per_s": round(tps, 1),
        "tokens_per_s_per_gpu": round(tps / env.world_size, 1), "peak_mem_gib": round(peak.item(), 2),
        "mfu": round(tps * flops_per_token / (pf * env.world_size), 4) if pf else None,
        "final_loss": round(loss.item(), 4), "timed_steps": a.steps,
    }
    if profile is not None:
        result["profile"] = profile
    if env.is_main:
        text = json.dumps(result)
        print(text)
        if a.json:
            with open(a.json, "w") as fh:
                fh.write(text + "\n")
    if dist.is_initialized():
        dist.barrier()  # every rank is past its last collective: what is left is teardown
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_worker(main())
