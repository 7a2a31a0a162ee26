"""`mamba-parallel train --cp 2` (2 gloo ranks, activation checkpointing on) against the same run on 1 rank.

The flags go through the CLI's own parser; every logged loss (the global mean over the sharded tokens) and the
final evaluation loss must match the 1-rank run (fp32, relative <= 1e-5).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from dist_harness import spawn
from helpers import RTOL
from mamba_parallel.cli import build_parser
from mamba_parallel.train.config import resolve_config
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer
from mamba_parallel.train.trainer import train


def _run(out: str, data: str, *extra: str) -> dict:
    argv = ["train", "--preset", "tiny-mamba2", "--data", data, "--out", out, "--steps", "3", "--seq-len", "40",
            "--batch-size", "2", "--lr", "3e-3", "--warmup", "1", "--log-every", "1", "--eval-every", "0",
            "--eval-batches", "1", "--save-every", "0", "--sample-tokens", "0", "--no-progress", "--device", "cpu",
            *extra]
    return train(resolve_config(build_parser().parse_args(argv)))


def _cp2(rank: int, world: int, root: str, data: str) -> dict:
    res = _run(os.path.join(root, "cp2"), data, "--cp", "2", "--activation-checkpointing")
    return {"losses": res["losses"], "eval": res["eval"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cp_train"))
    src = os.path.join(root, "corpus.txt")
    with open(src, "w") as fh:
        fh.write(open(os.__file__).read())
    data = os.path.join(root, "tokens")
    prepare_data(src, data, ByteTokenizer(), val_fraction=0.05)
    one = _run(os.path.join(root, "one"), data)
    return {"losses": one["losses"], "eval": one["eval"]}, spawn(_cp2, 2, root, data)


def test_train_cp2_matches_one_rank(runs):
    one, two = runs
    assert sorted(one["losses"]) == [1, 2, 3]
    for rank in (0, 1):
        got = two[rank]
        assert sorted(got["losses"]) == sorted(one["losses"])
        for step, expected in one["losses"].items():
            assert math.isclose(got["losses"][step], expected, rel_tol=RTOL[torch.float32]), \
                f"rank {rank} step {step}: loss {got['losses'][step]} vs 1 rank {expected}"
        for step, expected in one["eval"].items():
            assert math.isclose(got["eval"][step], expected, rel_tol=RTOL[torch.float32]), \
                f"rank {rank} eval at step {step}: {got['eval'][step]} vs 1 rank {expected}"
    assert one["eval"], "the runs evaluated nothing"
