"""Long sequences: the longest one GPU trains (ours beside mamba_ssm), or one length with context parallelism.

Without ``--seq-len``: the side-by-side probe of long_context_probe.py (batch 1, doubling from ``--start`` until
the first out-of-memory; the peer as it ships, ours with its defaults or with ``--activation-checkpointing`` /
``--recompute ITEMS``, a table of its own):

    mamba-parallel bench long_context [--peer | --no-peer] [--preset mamba2-1.3b] [--start 16384] [--json PATH]
        [--activation-checkpointing] [--recompute conv,states]

With ``--seq-len``: one length, ours only, fp32 params + bf16 autocast, fwd + bwd + fused AdamW, batch 1, random
tokens, the model sharded by ``parallelize`` (cp ranks hold slices of the sequence; FSDP2 over them).

    # 2 GPUs, cp = 2, activation checkpointing: one length per run (an OOM exits 3 and torchrun stops both ranks)
    torchrun --nproc_per_node 2 -m mamba_parallel.bench.bench_long_context --preset mamba2-1.3b \\
        --seq-len 262144 --cp 2 --activation-checkpointing --json out.json
    # 1 GPU, no cp
    python -m mamba_parallel.bench.bench_long_context --preset mamba2-1.3b --seq-len 32768
    # parity of the cp model against one device (fp32 and bf16 autocast, every gradient), Triton kernels
    torchrun --nproc_per_node 2 -m mamba_parallel.bench.bench_long_context --parity --preset mamba2-130m \\
        --seq-len 8192 --cp 2

Prints one JSON record (rank 0) and appends it to ``--json`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from mamba_parallel.bench import peer as peer_mod
from mamba_parallel.bench.results import add_git_commit_flag, publish
from mamba_parallel.bench.worker_exit import exit_worker

OOM_EXIT = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mamba-parallel bench long_context", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="mamba2-1.3b", help="model preset (mamba_parallel/config.py)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (global, before cp slicing); without it: the side-by-side probe")
    peer_mod.add_peer_flags(p)
    p.add_argument("--start", type=int, default=16384, help="probe: first length (default 16384)")
    p.add_argument("--max-len", type=int, default=262144, help="probe: last length tried (default 262144)")
    p.add_argument("--cp", type=int, default=None, help="context parallel degree (default: the world size)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--recompute", default="", metavar="ITEMS",
                   help="probe: what our layers rebuild in the backward (conv, dt, gate, states; comma list)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="untimed training steps first")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--parity", action="store_true", help="compare the cp model with one device instead of timing")
    p.add_argument("--json", default=None,
                   help="append the JSON record to this file (probe: a .json file or a results folder)")
    add_git_commit_flag(p)
    return p


def _setup(args):
    from mamba_parallel.distributed.data_parallel import init_distributed
    from mamba_parallel.distributed.parallel_dims import ParallelDims

    env = init_distributed(args.device)
    cp = args.cp or env.world_size
    if args.seq_len % cp:
        raise SystemExit(f"--seq-len {args.seq_len} is not divisible by --cp {cp}")
    dims = ParallelDims(dp_shard=-1, cp=cp, world_size=env.world_size)
    if env.world_size > 1:
        dims.build_mesh(env.device.type)
    cp_rank = dims.submesh("cp").get_local_rank() if cp > 1 else 0
    return env, dims, cp, cp_rank


def _tokens(seq_len: int, vocab: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def _emit(record: dict, path: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


def _max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run_timing(args) -> dict:
    from mamba_parallel import get_preset
    from mamba_parallel.distributed.parallelize import parallelize
    from mamba_parallel.distributed.materialize import materialize
    from mamba_parallel.models import MambaLMHeadModel
    from mamba_parallel.train.optim import build_optimizer

    env, dims, cp, cp_rank = _setup(args)
    config = get_preset(args.preset)
    with torch.device("meta"):
        model = MambaLMHeadModel(config)
    model = parallelize(model, dims, activation_checkpointing=args.activation_checkpointing)
    materialize(model, config, env.device, seed=0)
    opt = build_optimizer(model, 1e-4, 0.1, fused=env.device.type == "cuda")
    ids, labels = _tokens(args.seq_len, config.vocab_size, env.device)
    n = args.seq_len // cp
    ids, labels = ids[:, cp_rank * n:(cp_rank + 1) * n], labels[:, cp_rank * n:(cp_rank + 1) * n]
    cuda = env.device.type == "cuda"
    autocast = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=cuda)

    def step():
        with autocast:
            loss = model(ids, targets=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    record = {"bench": "long_context", "preset": args.preset, "seq_len": args.seq_len, "batch": 1, "cp": cp,
              "world_size": env.world_size, "activation_checkpointing": args.activation_checkpointing,
              "device": torch.cuda.get_device_name(env.device) if cuda else "cpu"}
    try:
        for _ in range(args.warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(env.device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        loss = loss.item()
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
    except torch.OutOfMemoryError as e:
        record.update(oom=True, rank=env.rank, error=str(e).split("\n")[0])
        _emit(record, args.json if env.is_main else None)
        os._exit(OOM_EXIT)  # the other ranks wait in a collective: torchrun stops them when this one exits
    dt = _max_over_ranks(dt, env.device)
    peak = torch.cuda.max_memory_allocated(env.device) / 2**30 if cuda else None
    record.update(oom=False, loss=loss, step_s=round(dt, 4),
                  tokens_per_s=round(args.seq_len / dt, 1),  # the whole sequence, all GPUs together
                  tokens_per_s_per_gpu=round(args.seq_len / dt / env.world_size, 1),
                  peak_gib_per_gpu=round(_max_over_ranks(peak, env.device), 2) if cuda else None)
    return record if env.is_main else {}


def run_parity(args) -> dict:
    """Loss, logits and every gradient of the cp model vs the same weights on one device, fp32 and bf16 autocast.
    Pass: the cp error against the fp32 single-device result is at most 2x the single-device bf16 error (+1e-5)."""
    import copy

    from mamba_parallel import get_preset
    from mamba_parallel.distributed.context_parallel import apply_context_parallel
    from mamba_parallel.models import MambaLMHeadModel

    env, dims, cp, cp_rank = _setup(args)
    config = get_preset(args.preset)
    torch.manual_seed(0)
    ref = MambaLMHeadModel(config, device=env.device)
    model = apply_context_parallel(copy.deepcopy(ref), dims.submesh("cp")) if cp > 1 else copy.deepcopy(ref)
    ids, labels = _tokens(args.seq_len, config.vocab_size, env.device)
    n = args.seq_len // cp
    sl = slice(cp_rank * n, (cp_rank + 1) * n)
    seq = torch.zeros(1, args.seq_len, dtype=torch.int32, device=env.device)
    seq[:, args.seq_len // 3:] += 1
    seq[:, n:] += 1  # a boundary exactly at the first rank boundary, another inside a slice

    def run(m, dtype, x, y, s, reduce):
        m.zero_grad(set_to_none=True)
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = m(x, targets=y, seq_idx=s).loss
            logits = m(x, seq_idx=s).logits[0, :, :64].float()
        loss.backward()
        grads = {k: p.grad.float() for k, p in m.named_parameters()}
        if reduce:
            for g in grads.values():
                dist.all_reduce(g, group=dims.submesh("cp").get_group())
                g /= cp
        return loss.item(), logits.detach(), grads

    def err(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    base = run(ref, "fp32", ids, labels, seq, False)
    record = {"bench": "long_context_parity", "preset": args.preset, "seq_len": args.seq_len, "cp": cp}
    ok = True
    for dtype in ("fp32", "bf16"):
        single = run(ref, dtype, ids, labels, seq, False) if dtype == "bf16" else base
        par = run(model, dtype, ids[:, sl], labels[:, sl], seq[:, sl], cp > 1)
        e_single = max([abs(single[0] - base[0]) / abs(base[0]), err(single[1][sl], base[1][sl])] +
                       [err(single[2][k], base[2][k]) for k in base[2]])
        errs = {"loss": abs(par[0] - base[0]) / abs(base[0]), "logits": err(par[1], base[1][sl])}
        errs.update({k: err(par[2][k], base[2][k]) for k in base[2]})
        worst = max(errs, key=errs.get)
        passed = errs[worst] <= 2 * e_single + 1e-5 if dtype == "bf16" else errs[worst] <= 5e-3  # Triton may use tf32
        ok &= passed
        record[dtype] = {"max_rel_err": errs[worst], "worst": worst, "loss": errs["loss"], "logits": errs["logits"],
                         "single_device_bf16_err": e_single if dtype == "bf16" else None, "pass": passed}
    record["pass"] = ok
    return record if env.is_main else {}


def run_probe(args) -> int:
    from mamba_parallel.bench import long_context_probe
    from mamba_parallel.train.trainer import resolve_recompute

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recompute = resolve_recompute(args.recompute)  # unknown items: a ConfigError naming --recompute
    peer = peer_mod.resolve_peer(args.peer, args.peer_impl)
    result = long_context_probe.run(args.preset, peer, device, args.start, args.max_len,
                                    activation_checkpointing=args.activation_checkpointing, recompute=recompute)
    publish(result, device, peer, path=args.json, git_commit=args.git_commit)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.seq_len is None and not args.parity:
        return run_probe(args)
    if args.seq_len is None:
        raise SystemExit("bench long_context: --parity needs --seq-len")
    if args.recompute:
        raise SystemExit("bench long_context: --recompute is the probe's (without --seq-len)")
    record = run_parity(args) if args.parity else run_timing(args)
    if record:
        _emit(record, args.json)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if record.get("pass", True) else 1


if __name__ == "__main__":
    exit_worker(main())
