"""`mamba-parallel generate --tp 2` (two gloo ranks, as under torchrun): every rank holds half of each sharded
weight, rank 0 prints exactly what one process prints, greedy and sampled, for Mamba-1, a Mamba-2 + attention
hybrid and Mamba-3."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from dist_harness import spawn
from mamba_parallel import MambaLMHeadModel, get_preset
from mamba_parallel.cli import main

PRESETS = ("tiny-mamba", "tiny-hybrid", "tiny-mamba3")
RUNS = {"greedy": ["--max-new-tokens", "10"], "sampled": ["--max-new-tokens", "10", "--do-sample", "--seed", "3"]}


def _argv(folder: str, extra: list[str]) -> list[str]:
    return ["generate", "--checkpoint", folder, "--prompt", "ab", "--no-stream", "--device", "cpu", *extra]


def _printed(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def _two_ranks(rank: int, world: int, folders: dict) -> dict:
    import torch.distributed as dist

    got = {}
    for preset, folder in folders.items():
        for name, extra in RUNS.items():
            got[preset, name] = _printed(_argv(folder, [*extra, "--tp", "2"]))
    # what one rank holds: its shards (DTensors' local parts, or the tensor-parallel layers' own slices)
    from mamba_parallel.inference import cli_generate

    args = type("Args", (), {"tp": 2, "cuda_graph": False, "checkpoint": folders["tiny-mamba"]})()
    model, _, created = cli_generate._load_tensor_parallel(args, torch.device("cpu"), "auto")
    assert not created  # the group was there: the command leaves it to its owner
    got["local_numel"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    dist.barrier()
    return got


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for preset in PRESETS:
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(preset)
        MambaLMHeadModel(get_preset(preset)).save_pretrained(path)
        out[preset] = str(path)
    return out


@pytest.fixture(scope="module")
def ranks(folders):
    return spawn(_two_ranks, 2, folders)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("run", list(RUNS))
def test_rank0_prints_what_one_process_prints(ranks, folders, preset, run):
    want = _printed(_argv(folders[preset], RUNS[run]))
    assert len(want) > len("ab\n")
    assert ranks[0][preset, run] == want
    assert ranks[1][preset, run] == ""  # only rank 0 prints


def test_each_rank_holds_a_shard(ranks, folders):
    full = sum(p.numel() for p in MambaLMHeadModel.from_pretrained(folders["tiny-mamba"]).parameters())
    for r in ranks:  # everything but the norms' and a few per-channel vectors' replicas is split in two
        assert r["local_numel"] < 0.6 * full, (r["local_numel"], full)


def test_tp_needs_as_many_processes(folders, capsys):
    assert main(_argv(folders["tiny-mamba"], ["--tp", "2"])) == 2
    err = capsys.readouterr().err
    assert "--tp 2 needs as many processes" in err and "WORLD_SIZE is 1" in err
    assert main(_argv(folders["tiny-mamba"], ["--tp", "0"])) == 2
    assert "--tp must be >= 1" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_torchrun_tp2_prints_what_one_gpu_prints(folders, preset):
    """Under torchrun on two GPUs (NCCL, Triton kernels), fp32 greedy: the text of one GPU."""
    import os
    import subprocess
    import sys

    argv = _argv(folders[preset], ["--max-new-tokens", "10", "--dtype", "fp32"])
    argv[argv.index("cpu")] = "cuda"
    want = _printed(argv)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "mamba_parallel.cli", *argv, "--tp", "2"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == want
