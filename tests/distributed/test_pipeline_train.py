"""`train --pp 2` on 2 gloo ranks against one process at the same global batch; its DCP checkpoint resumed at pp=1
on 2 data-parallel ranks and on one process, and a one-process checkpoint resumed at pp=2 (equal losses); --global-batch-size by gradient accumulation at any
world size (kept when a run resumes on another one); FSDP2 CPU offload and bf16 weights on one process."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dist_harness import spawn
from helpers import RTOL
from mamba_parallel.train.checkpoint import complete_checkpoints
from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer
from mamba_parallel.train.trainer import train

STEPS, SAVE = 4, 2


def _cfg(out: str, data: str, **kw):
    base = dict(preset="tiny-mamba2", data=data, out=out, steps=STEPS, seq_len=32, batch_size=2, lr=3e-3,
                warmup=1, log_every=1, eval_every=0, eval_batches=2, save_every=SAVE, keep=3, sample_tokens=0,
                progress=False, device="cpu")
    base.update(kw)
    return resolve_config(**base)


def _truncate_copy(src: str, dst: str, step: int) -> None:
    shutil.copytree(src, dst)
    for s, path in complete_checkpoints(dst):
        if s > step:
            shutil.rmtree(path)
    shutil.rmtree(os.path.join(dst, "final"), ignore_errors=True)


def _two_rank_runs(rank: int, world: int, root: str, data: str) -> dict:
    pp = train(_cfg(os.path.join(root, "pp2"), data, pp=2, microbatches=2))
    hybrid = train(_cfg(os.path.join(root, "pp2h"), data, preset="tiny-hybrid", pp=2, microbatches=2,
                        pp_schedule="gpipe", save_every=0))
    if rank == 0:
        _truncate_copy(os.path.join(root, "pp2"), os.path.join(root, "pp2-to-dp2"), SAVE)
        _truncate_copy(os.path.join(root, "pp2"), os.path.join(root, "pp2-to-1"), SAVE)
    torch.distributed.barrier()
    dp = train(_cfg(os.path.join(root, "pp2-to-dp2"), data, resume=True))  # pp = 1, dp = 2: accum 1
    # the one-process checkpoint (batch 4, global batch 4) in two stages: 2 micro-batches of 2
    to_pp = train(_cfg(os.path.join(root, "one-to-pp2"), data, resume=True, pp=2, batch_size=2))
    global_batch = train(_cfg(os.path.join(root, "gb-dp2"), data, global_batch_size=4, save_every=0))
    return {"pp": pp["losses"], "pp_eval": pp["eval"], "hybrid": hybrid["losses"], "dp": dp["losses"],
            "gb": global_batch["losses"], "to_pp": to_pp["losses"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pp_train"))
    src = os.path.join(root, "corpus.txt")
    with open(src, "w") as fh:
        fh.write(open(os.__file__).read() * 2)
    data = os.path.join(root, "tokens")
    prepare_data(src, data, ByteTokenizer(), val_fraction=0.05)
    one = train(_cfg(os.path.join(root, "one"), data, batch_size=4))
    _truncate_copy(os.path.join(root, "one"), os.path.join(root, "one-to-pp2"), SAVE)
    one_h = train(_cfg(os.path.join(root, "one-h"), data, batch_size=4, preset="tiny-hybrid", save_every=0))
    accum = train(_cfg(os.path.join(root, "gb-1"), data, global_batch_size=4, save_every=0))
    offload = train(_cfg(os.path.join(root, "offload"), data, batch_size=4, cpu_offload=True, save_every=0))
    bf16 = train(_cfg(os.path.join(root, "bf16"), data, batch_size=4, param_dtype="bf16", steps=8, lr=1e-2,
                      save_every=0))
    two = spawn(_two_rank_runs, 2, root, data)
    # the pp=2 checkpoint of step 2 on one process, its batch size from the run's config.toml (2) and the
    # global batch it recorded (4): 2 micro-steps
    back = train(_cfg(os.path.join(root, "pp2-to-1"), data, resume=True))
    with open(os.path.join(root, "pp2-to-1", "config.toml")) as fh:
        toml = fh.read()
    return {"one": one["losses"], "one_h": one_h["losses"], "accum": accum["losses"], "offload": offload["losses"],
            "bf16": bf16["losses"], "two": two, "back": back["losses"], "toml": toml,
            "offload_metrics": [json.loads(x) for x in open(os.path.join(root, "offload", "metrics.jsonl"))]}


def _assert_losses(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: steps {sorted(actual)} != {sorted(expected)}"
    a = torch.tensor([actual[s] for s in sorted(actual)], dtype=torch.float64)
    e = torch.tensor([expected[s] for s in sorted(expected)], dtype=torch.float64)
    rel = ((a - e).abs() / e.abs()).max().item()
    assert rel <= RTOL[torch.float32], f"{what}: losses {a.tolist()} vs {e.tolist()} (max rel {rel:.2e})"


def test_pp2_matches_one_process(runs):
    for rank in range(2):
        _assert_losses(runs["two"][rank]["pp"], runs["one"], f"pp=2 rank {rank}")
        _assert_losses(runs["two"][rank]["hybrid"], runs["one_h"], f"pp=2 gpipe hybrid rank {rank}")
    assert runs["two"][0]["pp_eval"] and all(v == v for v in runs["two"][0]["pp_eval"].values())


def test_checkpoints_resume_across_pp_degrees(runs):
    later = {s: v for s, v in runs["one"].items() if s > SAVE}
    _assert_losses(runs["two"][0]["dp"], later, "pp=2 checkpoint on dp=2")
    _assert_losses(runs["back"], later, "pp=2 checkpoint on one process")
    for rank in range(2):  # and the other way: a one-process checkpoint (tied embedding, AdamW state) in stages
        _assert_losses(runs["two"][rank]["to_pp"], later, f"one-process checkpoint at pp=2, rank {rank}")
    assert "global_batch_size = 4" in runs["toml"] and "grad_accum = 2" in runs["toml"]


def test_global_batch_by_accumulation_at_any_world_size(runs):
    _assert_losses(runs["accum"], runs["one"], "global batch 4 = 2 x 2 micro-steps on one process")
    _assert_losses(runs["two"][0]["gb"], runs["one"], "global batch 4 on 2 ranks")


def test_cpu_offload_matches_and_bf16_weights_learn(runs):
    _assert_losses(runs["offload"], runs["one"], "FSDP2 CPU offload on one process")
    steps = [r for r in runs["offload_metrics"] if "loss" in r]
    assert steps and all(r["optimizer_s"] >= 0 for r in steps)  # the host update's time, logged per step
    losses = runs["bf16"]
    assert losses[8] < losses[1] - 0.3, losses


def test_batch_size_auto_is_chosen_printed_and_stored(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(open(os.__file__).read())
    data = str(tmp_path / "tokens")
    prepare_data(str(src), data, ByteTokenizer(), val_fraction=0.05)
    out = str(tmp_path / "auto")
    result = train(_cfg(out, data, batch_size="auto", steps=1, save_every=0, eval_batches=1, seq_len=16,
                        save_final=False))
    line = next(x for x in result["log"] if x.startswith("--batch-size auto:"))
    assert "memory model" in line and "capped on CPU" in line, line  # a tiny model: the CPU cap
    with open(os.path.join(out, "config.toml")) as fh:
        toml = fh.read()
    assert "batch_size = 64" in toml and "global_batch_size = 64" in toml
