"""Data parallel training on 2 gloo ranks vs 1 rank at the same global batch, and resume across world sizes.

One spawn for the whole module: the 2-rank side runs FSDP, DDP and a resume of a 1-rank checkpoint; the 1-rank
side runs in this process (no process group). The corpus is many short documents, so most sequences hold
document boundaries (seq_idx): every layout, tensor and context parallel included, keeps them apart alike.
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import torch
import torch.distributed as dist

from dist_harness import spawn
from helpers import RTOL
from mamba_parallel.train import run_folder
from mamba_parallel.train.checkpoint import complete_checkpoints
from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer
from mamba_parallel.train.trainer import train

STEPS, SAVE = 4, 2


def _cfg(out: str, data: str, **kw):
    base = dict(preset="tiny-mamba2", data=data, out=out, steps=STEPS, seq_len=32, batch_size=2, lr=3e-3,
                warmup=1, log_every=1, eval_every=0, eval_batches=1, save_every=SAVE, keep=3, sample_tokens=0,
                progress=False, device="cpu")
    base.update(kw)
    return resolve_config(**base)


def _truncate_to(out: str, step: int) -> None:
    """Keep only the checkpoints up to ``step`` (as if the run had stopped there)."""
    for s, path in complete_checkpoints(out):
        if s > step:
            shutil.rmtree(path)
    shutil.rmtree(os.path.join(out, "final"), ignore_errors=True)


def _lock_refusal(root: str) -> str | None:
    """Both ranks ask for a folder another live run holds: rank 0 checks, every rank gets the same refusal."""
    folder = os.path.join(root, "locked")
    if dist.get_rank() == 0:
        os.makedirs(folder)
        with open(os.path.join(folder, run_folder.LOCK), "w") as fh:
            json.dump({"pid": os.getppid(), "host": socket.gethostname(), "started": "now"}, fh)  # the test process
    dist.barrier()
    try:
        run_folder.agree(run_folder.acquire_lock, folder)
    except run_folder.FolderError as e:
        return str(e)
    return None


def _two_rank_runs(rank: int, world: int, root: str, data: str) -> dict:
    refused = _lock_refusal(root)
    fsdp = train(_cfg(os.path.join(root, "fsdp2"), data, dp_mode="fsdp"))
    ddp = train(_cfg(os.path.join(root, "ddp2"), data, dp_mode="ddp"))
    hsdp = train(_cfg(os.path.join(root, "hsdp2"), data, dp_replicate=2, save_every=0))
    # Tensor / context parallel: one data-parallel group, so its batch is the whole global batch.
    tp = train(_cfg(os.path.join(root, "tp2"), data, tp=2, batch_size=4, save_every=0))
    cp = train(_cfg(os.path.join(root, "cp2"), data, cp=2, batch_size=4, save_every=0))
    resumed = train(_cfg(os.path.join(root, "from1"), data, resume=True))
    return {"fsdp": fsdp["losses"], "ddp": ddp["losses"], "hsdp": hsdp["losses"], "tp": tp["losses"],
            "cp": cp["losses"], "resumed": resumed["losses"], "refused": refused}


def _text() -> str:
    import textwrap
    return textwrap.dedent(json.__doc__) * 6 + open(json.__file__).read()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dp"))
    src = os.path.join(root, "corpus.jsonl")
    text, docs, at = _text(), [], 0
    while at < len(text):  # documents of 20 .. 160 bytes
        n = 20 + (len(docs) * 37) % 140
        docs.append(text[at:at + n])
        at += n
    with open(src, "w") as fh:
        fh.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    data = os.path.join(root, "tokens")
    prepare_data(src, data, ByteTokenizer(), val_fraction=0.05)

    one = train(_cfg(os.path.join(root, "one"), data, batch_size=4))  # global batch 4 = 2 ranks x 2
    accum = train(_cfg(os.path.join(root, "accum"), data, batch_size=2, grad_accum=2))
    shutil.copytree(os.path.join(root, "one"), os.path.join(root, "from1"))
    _truncate_to(os.path.join(root, "from1"), SAVE)

    two = spawn(_two_rank_runs, 2, root, data)

    shutil.copytree(os.path.join(root, "fsdp2"), os.path.join(root, "from2"))
    _truncate_to(os.path.join(root, "from2"), SAVE)
    from2 = train(_cfg(os.path.join(root, "from2"), data, batch_size=4, resume=True))
    return {"one": one["losses"], "accum": accum["losses"], "two": two, "from2": from2["losses"], "root": root}


def _assert_losses(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: steps {sorted(actual)} != {sorted(expected)}"
    a = torch.tensor([actual[s] for s in sorted(actual)], dtype=torch.float64)
    e = torch.tensor([expected[s] for s in sorted(expected)], dtype=torch.float64)
    rel = ((a - e).abs() / e.abs()).max().item()
    assert rel <= RTOL[torch.float32], f"{what}: losses {a.tolist()} vs {e.tolist()} (max rel {rel:.2e})"


def test_losses_fall_and_ranks_agree(runs):
    one = runs["one"]
    assert one[STEPS] < one[1], f"loss did not fall over {STEPS} steps: {one}"
    for r in (0, 1):  # the logged loss is the all-reduced mean: the same on every rank
        assert runs["two"][r]["fsdp"] == runs["two"][0]["fsdp"]


def test_a_held_folder_is_refused_alike_on_every_rank(runs):
    refused = [runs["two"][r]["refused"] for r in (0, 1)]
    assert refused[0] and refused[0] == refused[1] and "is in use by another run" in refused[0], refused


def test_fsdp_two_ranks_match_one_rank(runs):
    _assert_losses(runs["two"][0]["fsdp"], runs["one"], "FSDP 2 ranks vs 1 rank")


def test_ddp_two_ranks_match_one_rank(runs):
    _assert_losses(runs["two"][0]["ddp"], runs["one"], "DDP 2 ranks vs 1 rank")


def test_hsdp_two_replicas_match_one_rank(runs):
    _assert_losses(runs["two"][0]["hsdp"], runs["one"], "HSDP (2 replicas x 1 shard) vs 1 rank")


@pytest.mark.parametrize("layout", ["tp", "cp"])
def test_tensor_and_context_parallel_match_one_rank(runs, layout):
    _assert_losses(runs["two"][0][layout], runs["one"], f"{layout}=2 vs 1 rank")


def test_grad_accum_matches_bigger_batch(runs):
    _assert_losses(runs["accum"], runs["one"], "grad_accum 2 x batch 2 vs batch 4")


def test_resume_one_rank_checkpoint_on_two_ranks(runs):
    expected = {s: v for s, v in runs["one"].items() if s > SAVE}
    _assert_losses(runs["two"][0]["resumed"], expected, "1-rank checkpoint resumed on 2 ranks")


def test_resume_two_rank_checkpoint_on_one_rank(runs):
    expected = {s: v for s, v in runs["two"][0]["fsdp"].items() if s > SAVE}
    _assert_losses(runs["from2"], expected, "2-rank checkpoint resumed on 1 rank")
    assert os.path.isfile(os.path.join(runs["root"], "from2", "final", "config.json"))
