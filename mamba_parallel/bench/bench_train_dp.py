"""One data-parallel training step on every GPU of a host: mamba_ssm's model in torch DDP beside ours (FSDP2, our
default, and DDP), same initial weights, same batch on each rank, in one torchrun launch.

    torchrun --standalone --nproc_per_node 2 -m mamba_parallel.bench.bench_train_dp \\
        --presets mamba2-1.3b mamba2-370m --seq-len 2048 --batch-size 8 --json benchmarks/results

The train side by side (train_side_by_side.py) on N ranks. The peer as its users run it on several GPUs: its
``MambaLMHeadModel`` wrapped in ``DistributedDataParallel`` with torch's defaults, ``F.cross_entropy`` on its logits.
Ours as our users run it: ``parallelize(model, dims, dp_mode=...)`` with the trainer's defaults, its fused loss.
Every side: fp32 parameters, bf16 autocast, fused AdamW, no clipping, ``--batch-size`` sequences per rank (each
rank its own batch, the same on every side). Rank 0 writes the peer's freshly initialised weights with its
``save_pretrained``; every rank reads them with our ``from_pretrained`` (one host: the folder is local), so all
sides start equal; the step-1 losses (mean over ranks) are checked to agree. Timing: CUDA events per step, the
median after warm-up per rank, the slowest rank's median; tokens/s counts every rank's tokens; peak memory is the
largest rank's. Without torchrun it is the one-process side by side (``bench train --peer``) over ``--presets``.
Writes ``<json>/<date>-<device>/train_dp.json`` (after each preset: a killed run keeps its finished presets).
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
import torch.distributed as dist

from mamba_parallel.bench import train_side_by_side as sbs
from mamba_parallel.bench.peer import add_peer_flags, load_ours, resolve_peer, save_peer_weights
from mamba_parallel.bench.results import add_git_commit_flag, error_text, publish, say, write_result
from mamba_parallel.bench.worker_exit import exit_worker
from mamba_parallel.config import PRESETS
from mamba_parallel.layers.recompute import apply_recompute
from mamba_parallel.train.config import DEFAULT_RECOMPUTE

DP_MODES = ("fsdp", "ddp")
MODE_NAMES = {"fsdp": "FSDP2", "ddp": "DDP"}
TIMEOUT_S = 300  # a rank stuck in a collective (its peer failed) ends the run instead of the device call's budget


def rank_batch(vocab_size: int, batch: int, seq_len: int, seed: int, rank: int, device):
    """(input_ids, targets) (batch, seq_len) of one rank; rank 0's batch is the one-process run's."""
    gen = torch.Generator().manual_seed(seed + 1 + 1000 * rank)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def across_ranks(device):
    """``combine`` for ``train_side_by_side._side``: a side failed if it failed on any rank; else the slowest rank's
    median step, the largest rank's peak memory and the losses averaged over ranks (the global batch's loss)."""
    world = dist.get_world_size()

    def combine(figures, error):
        failed = torch.tensor([0.0 if figures is not None else 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            return None, error or "failed on another rank"
        peak = figures["peak_gib"]
        worst = torch.tensor([figures["step_ms"], -1.0 if peak is None else peak], dtype=torch.float64,
                             device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        losses = torch.tensor(figures["losses"], dtype=torch.float64, device=device)
        dist.all_reduce(losses)
        losses = (losses / world).tolist()
        return {"step1_loss": losses[0], "losses": losses, "step_ms": worst[0].item(),
                "peak_gib": None if peak is None else worst[1].item()}, None
    return combine


def _hand_over(peer, model, rank: int) -> str:
    """Rank 0 writes the peer model's weights; -> the folder, on every rank (raises on every rank if it failed)."""
    box = [None]
    if rank == 0:
        try:
            box[0] = save_peer_weights(peer, model)
        except Exception as e:  # said on every rank, not only here (the others wait for the folder)
            box[0] = f"error: {error_text(e)}"
    dist.broadcast_object_list(box, src=0)
    if box[0].startswith("error: "):
        raise RuntimeError(f"rank 0 could not write the peer's weights ({box[0][7:]})")
    if not os.path.isdir(box[0]):
        raise RuntimeError(f"the peer's weights folder {box[0]} (written by rank 0) is not visible on rank {rank}: "
                           "run every rank on one host (torchrun --standalone)")
    return box[0]


def our_data_parallel(model: torch.nn.Module, mode: str, device) -> torch.nn.Module:
    """Ours over every rank: FSDP2 (``fsdp``: one shard group of all ranks) or DDP (``ddp``), the trainer's
    defaults for everything else."""
    from mamba_parallel.distributed.parallel_dims import ParallelDims
    from mamba_parallel.distributed.parallelize import parallelize

    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=world, dp_shard=1, world_size=world) if mode == "ddp" else \
        ParallelDims(dp_shard=-1, world_size=world)
    dims.build_mesh(torch.device(device).type)
    return parallelize(model, dims, dp_mode=mode)


def run_preset(preset: str, peer, device, seq_len: int = 2048, batch: int = 8, warmup: int = 2, steps: int = 5,
               seed: int = 0, modes=DP_MODES, loss_rtol: float = sbs.LOSS_RTOL, log=say) -> tuple[list[dict], list]:
    """Every rank: the peer in DDP, then ours in each of ``modes``; -> (rows of each mode against the peer, checks)."""
    from mamba_parallel.config import get_preset
    from mamba_parallel.models.lm import MambaLMHeadModel

    config = get_preset(preset)
    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, targets = rank_batch(config.vocab_size, batch, seq_len, seed, rank, device)
    combine = across_ranks(device)
    figures, errors, handed = {}, {}, {}

    def build_peer():
        torch.manual_seed(seed)
        model = peer.build_lm(config, device)
        handed["folder"] = _hand_over(peer, model, rank)  # before any update; ours reads it once this side is freed
        return peer.data_parallel(model, device)

    def build_ours(mode):
        def build():
            if "folder" in handed:
                model = load_ours(handed["folder"], device, remove=False)
            else:
                torch.manual_seed(seed)
                model = MambaLMHeadModel(config, device=device)
            return our_data_parallel(apply_recompute(model, DEFAULT_RECOMPUTE), mode, device)
        return build

    if peer is not None:
        figures["peer"], errors["peer"] = sbs._side(f"{preset} {peer.name} DDP x{world}", build_peer,
                                                    lambda m: peer.loss(m, ids, targets), device, warmup, steps,
                                                    log, combine)
    for mode in modes:
        figures[mode], errors[mode] = sbs._side(f"{preset} ours {MODE_NAMES[mode]} x{world}", build_ours(mode),
                                                lambda m: sbs.our_loss(m, ids, targets), device, warmup, steps, log,
                                                combine)
    dist.barrier()  # every rank has read the weights
    if rank == 0 and "folder" in handed:
        shutil.rmtree(handed["folder"], ignore_errors=True)
    rows, checks = [], []
    ranks = "GPUs" if device.type == "cuda" else "ranks"
    for mode in modes:
        case = f"{preset} {world} {ranks} b{batch}/rank L{seq_len}, ours {MODE_NAMES[mode]}"
        sides = {"ours": figures[mode], "peer": figures.get("peer")}
        errs = {"ours": errors[mode], "peer": errors.get("peer")}
        rows += sbs._rows(case, sides, errs, batch * seq_len * world, peer is not None, preset=preset,
                          dp_mode=mode, world_size=world)
        check = sbs._loss_check(preset, figures[mode], figures.get("peer"), loss_rtol, log, dp_mode=mode)
        if peer is not None and "folder" not in handed:
            check["note"] = "the peer's weights were not handed over; ours started from its own init"
        checks.append(check)
    return rows, checks


def result_of(rows: list[dict], checks: list[dict], peer, world: int, seq_len: int, batch: int, warmup: int,
              steps: int, modes) -> dict:
    return {"bench": "train_dp", "title": f"One data-parallel training step on {world} GPUs (fp32 params, bf16 "
                                          "autocast, fused AdamW)",
            "settings": {"world_size": world, "seq_len": seq_len, "batch_per_gpu": batch, "warmup_steps": warmup,
                         "timed_steps": steps, "ours_dp_modes": [MODE_NAMES[m] for m in modes],
                         "optimizer": f"AdamW fused, lr {sbs.LR}, weight decay {sbs.WEIGHT_DECAY}, betas {sbs.BETAS}, "
                                      "no clipping",
                         "peer": "MambaLMHeadModel in torch DDP + F.cross_entropy on its logits",
                         "ours": "MambaLMHeadModel.from_pretrained(peer's save_pretrained), parallelize(dp_mode) + "
                                 f"its fused loss, recompute {DEFAULT_RECOMPUTE}",
                         "timing": "median step per rank (CUDA events), the slowest rank",
                         "sides": ["ours"] + (["peer"] if peer is not None else [])},
            "rows": rows, "checks": {"step1_loss": checks}}


def run(presets, peer, device, seq_len=2048, batch=8, warmup=2, steps=5, seed=0, modes=DP_MODES, log=say,
        on_preset=None) -> dict:
    """Every preset on every rank -> the result; ``on_preset(result so far)`` after each preset (rank 0)."""
    rows, checks = [], []
    world = dist.get_world_size()
    for preset in presets:
        new_rows, new_checks = run_preset(preset, peer, device, seq_len, batch, warmup, steps, seed, modes, log=log)
        rows += new_rows
        checks += new_checks
        if on_preset is not None:
            on_preset(result_of(rows, checks, peer, world, seq_len, batch, warmup, steps, modes))
    return result_of(rows, checks, peer, world, seq_len, batch, warmup, steps, modes)


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in DP_MODES]
    if bad or not modes:
        raise SystemExit(f"bench train_dp: --dp-modes {text!r}: expected a comma list of {', '.join(DP_MODES)}")
    return list(dict.fromkeys(modes))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mamba-parallel bench train_dp", description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["mamba2-1.3b"], choices=sorted(PRESETS), metavar="PRESET",
                   help="models, one after another (default: mamba2-1.3b)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: 2048)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per GPU (default: 8)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (default: 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    p.add_argument("--dp-modes", default=",".join(DP_MODES),
                   help="our data-parallel modes timed beside the peer: fsdp (our default), ddp (default: both)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--json", metavar="PATH", default=None, help="a .json file or a results folder")
    add_git_commit_flag(p)
    add_peer_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run_launched(a.presets, a.peer, a.peer_impl, a.device, a.seq_len, a.batch_size, a.warmup_steps, a.steps,
                        parse_modes(a.dp_modes), a.json, git_commit=a.git_commit)


def run_launched(presets, wanted_peer, peer_impl, device, seq_len, batch, warmup, steps, modes, json_path,
                 git_commit: str | None = None) -> int:
    """The side by side on every rank of this launch (torchrun: the data-parallel one; rank 0 prints and writes),
    or in this one process (the one-GPU side by side). ``git_commit``: recorded in the result (default: the
    checkout's)."""
    from mamba_parallel.bench.results import run_metadata, side_names, side_versions
    from mamba_parallel.distributed.data_parallel import init_distributed

    env = init_distributed(device, timeout_s=TIMEOUT_S)
    if env.world_size < 2:
        peer = resolve_peer(wanted_peer, peer_impl)
        result = sbs.run(presets, peer, env.device, seq_len, batch, warmup, steps)
        publish(result, env.device, peer, path=json_path, git_commit=git_commit)
        return 0
    log = say if env.is_main else (lambda _: None)
    peer = resolve_peer(wanted_peer, peer_impl, log=log if env.is_main else (lambda _: None))

    def partial(result):
        if env.is_main and json_path:
            result.update(meta=run_metadata(env.device, side_versions(peer), git_commit=git_commit),
                          side_names=side_names(peer))
            write_result(result, json_path)

    try:
        result = run(presets, peer, env.device, seq_len, batch, warmup, steps, modes=modes, log=log,
                     on_preset=partial)
        if env.is_main:
            publish(result, env.device, peer, path=json_path, git_commit=git_commit)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_worker(main())
