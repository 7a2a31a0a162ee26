"""FSDP2 with k blocks per unit (``apply_fsdp(blocks_per_unit=k)`` / ``parallelize(fsdp_blocks_per_unit=k)``):
same losses and gradients as one process, fewer all-gathers, and DCP checkpoints loadable across k (2 gloo ranks).

One spawn for the module; the one-process reference runs in this process on the global batch (both ranks' rows).
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import spawn
from helpers import RTOL, assert_close

N_LAYER, STEPS = 5, 2  # 5 blocks: k=2 gives units of 2, 2, 1 (a short last unit)


def _model():
    from mamba_parallel.config import get_preset
    from mamba_parallel.train.trainer import init_model

    return init_model(get_preset("tiny-mamba2", n_layer=N_LAYER), torch.device("cpu"), 0)


def _batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(STEPS)]


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def _train(model, rank: int) -> dict:
    """STEPS AdamW steps; per step the mean loss over ranks, and the first step's full gradients."""
    import torch.distributed as dist

    from mamba_parallel.train.optim import build_optimizer

    opt = build_optimizer(model, 3e-3, 0.1)
    losses, grads = [], None
    for tokens in _batches(rank):
        loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
        loss.backward()
        grads = grads or _full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dist.is_initialized():
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(float(loss.detach()))
    return {"loss": losses, "grads": grads}


def _gathers_per_step(model, rank: int) -> int:
    """c10d all-gathers issued by one training step (after a warm-up step), counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    tokens = _batches(rank)[0]
    for _ in range(2):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    return sum(e.count for e in prof.key_averages() if e.key == "c10d::_allgather_base_")


def _checkpoint_across_k(rank: int, ckpt_root: str) -> dict:
    """Train one step at k=1, save a DCP checkpoint, load it into a k=3 model + optimizer; both take one more
    step. Returns the state-dict names of each and the losses / weights after the extra step."""
    from torch.distributed.device_mesh import init_device_mesh

    from mamba_parallel.distributed.data_parallel import apply_fsdp
    from mamba_parallel.distributed.state_dict import full_model_state_dict, model_state_dict
    from mamba_parallel.train.checkpoint import load_checkpoint, save_checkpoint
    from mamba_parallel.train.optim import build_optimizer, build_scheduler

    mesh = init_device_mesh("cpu", (2,))
    first, second = _batches(rank)

    def setup(k: int):
        model = _model()
        apply_fsdp(model, mesh, model.backbone.layers, blocks_per_unit=k)
        opt = build_optimizer(model, 3e-3, 0.1)
        return model, opt, build_scheduler(opt, 0, 10, 0.1)

    def step(model, opt, sched, tokens) -> float:
        loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    m1, o1, s1 = setup(1)
    step(m1, o1, s1, first)
    path = save_checkpoint(ckpt_root, 1, m1, o1, s1, consumed=4, keep=1)
    m3, o3, s3 = setup(3)
    load_checkpoint(path, m3, o3, s3)
    out = {"names1": sorted(model_state_dict(m1)), "names3": sorted(model_state_dict(m3)),
           "loss1": step(m1, o1, s1, second), "loss3": step(m3, o3, s3, second)}
    out["w1"], out["w3"] = full_model_state_dict(m1), full_model_state_dict(m3)
    return out


def _runs(rank: int, world: int, ckpt_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from mamba_parallel.distributed.data_parallel import apply_fsdp
    from mamba_parallel.distributed.parallel_dims import ParallelDims
    from mamba_parallel.distributed.parallelize import parallelize

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for k in (1, 2, N_LAYER):
        model = _model()
        apply_fsdp(model, mesh, model.backbone.layers, blocks_per_unit=k)
        out[f"k{k}"] = _train(model, rank)
        model = _model()
        apply_fsdp(model, mesh, model.backbone.layers, blocks_per_unit=k)
        out[f"gathers_k{k}"] = _gathers_per_step(model, rank)

    # parallelize's plumbing, on an HSDP mesh (replicate 2 x shard 1): blocks 0-1 and 2-3 share an FSDP state
    dims = ParallelDims(dp_replicate=world, dp_shard=1, world_size=world)
    dims.build_mesh("cpu")
    model = parallelize(_model(), dims, fsdp_blocks_per_unit=2)
    layers = model.backbone.layers
    state = [layers[i]._get_fsdp_state() for i in range(N_LAYER)]
    out["shared"] = [state[0] is state[1], state[2] is state[3], state[1] is state[2], state[3] is state[4]]
    out["parallelize"] = _train(model, rank)
    out["ckpt"] = _checkpoint_across_k(rank, ckpt_root)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(_runs, 2, str(tmp_path_factory.mktemp("fsdp_grouping")))


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, global batch = rank 0's rows then rank 1's (the mean loss of equal halves is the same)."""
    batches = [torch.cat(pair) for pair in zip(_batches(0), _batches(1))]
    model = _model()
    from mamba_parallel.train.optim import build_optimizer

    opt = build_optimizer(model, 3e-3, 0.1)
    losses, grads = [], None
    for tokens in batches:
        loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
        loss.backward()
        grads = grads or _full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"loss": losses, "grads": grads}


@pytest.mark.parametrize("key", ["k1", "k2", f"k{N_LAYER}", "parallelize"])
def test_grouped_fsdp_matches_one_process(runs, reference, key):
    got = runs[0][key]
    assert_close(torch.tensor(got["loss"]), torch.tensor(reference["loss"]), name=f"{key} losses")
    assert got["grads"].keys() == reference["grads"].keys()
    for name, g in reference["grads"].items():
        assert_close(got["grads"][name], g, grad=True, name=f"{key} grad {name}")
    assert runs[1][key]["loss"] == got["loss"], "ranks disagree on the mean loss"


def test_grouping_is_exact_against_per_block_units(runs):
    """Grouping changes only which tensors travel together: the k=1 and k>1 runs agree to fp32 rounding."""
    r = runs[0]
    for k in (2, N_LAYER):
        assert_close(torch.tensor(r[f"k{k}"]["loss"]), torch.tensor(r["k1"]["loss"]), name=f"k={k} vs k=1")


def test_grouping_cuts_all_gathers(runs):
    """Forward gathers every unit + the root; backward re-gathers all units but the last (kept gathered)."""
    r = runs[0]
    assert r["gathers_k1"] == (N_LAYER + 1) + (N_LAYER - 1), r["gathers_k1"]  # 5 blocks: 6 + 4
    assert r["gathers_k2"] == 4 + 2, r["gathers_k2"]  # units [0,1] [2,3] [4]: 3 + root, then [0,1] [2,3]
    assert r[f"gathers_k{N_LAYER}"] == 2, r[f"gathers_k{N_LAYER}"]  # one unit + root, nothing re-gathered


def test_parallelize_groups_consecutive_blocks(runs):
    assert runs[0]["shared"] == [True, True, False, False], runs[0]["shared"]


def test_dcp_checkpoint_loads_across_grouping(runs):
    for r in runs:
        c = r["ckpt"]
        assert c["names1"] == c["names3"]
        assert c["names1"] == sorted(_model().state_dict()), "FSDP changed the state-dict names"
        assert abs(c["loss3"] - c["loss1"]) <= RTOL[torch.float32] * abs(c["loss1"]), c
        assert c["w1"].keys() == c["w3"].keys()
        for name, w in c["w1"].items():
            assert_close(c["w3"][name], w, name=f"weight {name} after resume at k=3")


def test_bad_blocks_per_unit_is_refused():
    from mamba_parallel.distributed.data_parallel import fsdp_units
    from mamba_parallel.distributed.parallel_dims import ParallelConfigError, ParallelDims
    from mamba_parallel.distributed.parallelize import parallelize

    assert [len(u) for u in fsdp_units(range(7), 3)] == [3, 3, 1]
    assert [len(u) for u in fsdp_units(range(4), 9)] == [4]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="blocks_per_unit"):
            fsdp_units(range(4), bad)
        with pytest.raises(ParallelConfigError, match="--fsdp-blocks-per-unit"):
            parallelize(_model(), ParallelDims(world_size=1), fsdp_blocks_per_unit=bad)


def test_bench_flag_reaches_parallelize_options():
    from mamba_parallel.bench import bench_train, profile_train

    a = bench_train.build_parser().parse_args(["--fsdp-blocks-per-unit", "4"])
    assert bench_train.dp_options(a)["fsdp_blocks_per_unit"] == 4
    assert bench_train.dp_options(bench_train.build_parser().parse_args([]))["fsdp_blocks_per_unit"] == 1
    b = profile_train.build_parser().parse_args(["--out", "x", "--fsdp-blocks-per-unit", "2"])
    assert profile_train._dp_options(b)["options"]["fsdp_blocks_per_unit"] == 2
    with pytest.raises(SystemExit):
        bench_train.build_parser().parse_args(["--fsdp-blocks-per-unit", "0"])
