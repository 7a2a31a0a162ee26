"""`mamba-parallel train --preset tiny-mamba3 --tp 2` and `--cp 2` (2 gloo ranks) against the same run on 1 rank:
every logged loss and the final evaluation loss (fp32, relative <= 1e-5). The flags go through the CLI's parser."""

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

LAYOUTS = {"tp2": ("--tp", "2"), "cp2": ("--cp", "2")}


def _run(out: str, data: str, *extra: str) -> dict:
    argv = ["train", "--preset", "tiny-mamba3", "--data", data, "--out", out, "--steps", "3", "--seq-len", "32",
            "--batch-size", "2", "--lr", "3e-3", "--warmup", "1", "--log-every", "1", "--eval-every", "0",
            "--eval-batches", "1", "--save-every", "0", "--sample-tokens", "0", "--no-progress", "--device", "cpu",
            *extra]
    res = train(resolve_config(build_parser().parse_args(argv)))
    return {"losses": res["losses"], "eval": res["eval"]}


def _parallel(rank: int, world: int, root: str, data: str) -> dict:
    return {name: _run(os.path.join(root, name), data, *flags) for name, flags in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mamba3_train"))
    src = os.path.join(root, "corpus.txt")
    with open(src, "w") as fh:
        fh.write(open(os.__file__).read())
    data = os.path.join(root, "tokens")
    prepare_data(src, data, ByteTokenizer(), val_fraction=0.05)
    return _run(os.path.join(root, "one"), data), spawn(_parallel, 2, root, data)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_train_matches_one_rank(runs, layout):
    one, ranks = runs
    assert sorted(one["losses"]) == [1, 2, 3] and one["eval"], "the one-rank run logged nothing"
    for rank, res in enumerate(ranks):
        got = res[layout]
        assert sorted(got["losses"]) == sorted(one["losses"])
        for step, expected in one["losses"].items():
            assert math.isclose(got["losses"][step], expected, rel_tol=RTOL[torch.float32]), \
                f"{layout} rank {rank} step {step}: loss {got['losses'][step]} vs 1 rank {expected}"
        for step, expected in one["eval"].items():
            assert math.isclose(got["eval"][step], expected, rel_tol=RTOL[torch.float32]), \
                f"{layout} rank {rank} eval at step {step}: {got['eval'][step]} vs 1 rank {expected}"
