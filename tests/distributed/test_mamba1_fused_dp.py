"""The Mamba-1 layer's fused training path (layers/mamba1.py) under FSDP2 and DDP on 2 gloo ranks: it runs there
(one ``_Mamba1Inner`` node per layer) and gives one process's loss and gradients on the global batch.

The Triton path on CPU (MAMBA_PARALLEL_BACKEND=triton, the interpreter): the fused node only runs where the
kernels do. One spawn for the module.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import spawn
from helpers import assert_close, graph_node_names

pytest.importorskip("triton")


def _model():
    from mamba_parallel.config import get_preset
    from mamba_parallel.train.trainer import init_model

    return init_model(get_preset("tiny-mamba", n_layer=1, d_model=16), torch.device("cpu"), 0)  # the interpreter is slow


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(7 + rank))


def _step(model, tokens: torch.Tensor) -> dict:
    """Forward + backward -> loss, full gradients, and the names of the autograd nodes the loss hangs from."""
    loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
    nodes = graph_node_names(loss)
    loss.backward()
    inner = getattr(model, "module", model)  # DDP wraps the model
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for n, p in inner.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "fused": "_Mamba1InnerBackward" in nodes}


def _ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from mamba_parallel.distributed.parallel_dims import ParallelDims
    from mamba_parallel.distributed.parallelize import parallelize

    os.environ["MAMBA_PARALLEL_BACKEND"] = "triton"
    out = {}
    for mode, dims in (("fsdp", ParallelDims(dp_shard=world, world_size=world)),
                       ("ddp", ParallelDims(dp_replicate=world, dp_shard=1, world_size=world))):
        dims.build_mesh("cpu")
        res = _step(parallelize(_model(), dims, dp_mode=mode), _tokens(rank))
        loss = torch.tensor(res["loss"])
        dist.all_reduce(loss)
        res["loss"] = float(loss) / world
        out[mode] = res
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_ranks, 2)


@pytest.fixture(scope="module")
def reference():
    """One process on both ranks' rows (equal halves: the mean loss is the same)."""
    os.environ["MAMBA_PARALLEL_BACKEND"] = "triton"
    try:
        return _step(_model(), torch.cat([_tokens(0), _tokens(1)]))
    finally:
        os.environ["MAMBA_PARALLEL_BACKEND"] = "auto"


def test_fused_layers_under_data_parallel_match_one_process(runs, reference):
    """FSDP2 and DDP in one test: the spawn behind both is the module's slowest step, run once."""
    assert reference["fused"]
    for mode in ("fsdp", "ddp"):
        for rank in runs:
            got = rank[mode]
            assert got["fused"], f"{mode}: the fused node did not run"
            assert abs(got["loss"] - reference["loss"]) < 1e-5 * abs(reference["loss"]), mode
            for name, g in reference["grads"].items():
                assert_close(got["grads"][name], g, dtype=torch.float32, grad=True, name=f"{mode} {name}")
