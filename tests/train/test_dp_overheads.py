"""The data-parallel step's speed options keep its numerics: gradient clipping on local shards, FSDP2 without
reshard-after-forward, FSDP2 bf16 params, DDP bucket size and bf16 gradient all-reduce (2 gloo ranks).

One spawn for the module: every variant trains the same tiny model for a few steps on the same batches.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import spawn
from helpers import RTOL

STEPS = 3


def _model(seed: int = 0):
    from mamba_parallel.config import get_preset
    from mamba_parallel.train.trainer import init_model

    return init_model(get_preset("tiny-mamba2", n_layer=3), torch.device("cpu"), seed)


def _batches(rank: int):
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(STEPS)]


def _train(model, rank: int, bf16: bool) -> dict:
    """STEPS optimizer steps with clipping; per-step mean loss over ranks and gradient norm."""
    import torch.distributed as dist

    from mamba_parallel.train.optim import build_optimizer
    from mamba_parallel.train.trainer import _grad_norm

    opt = build_optimizer(model, 3e-3, 0.1)
    losses, norms = [], []
    for tokens in _batches(rank):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
        loss.backward()
        norms.append(float(_grad_norm(model, 0.5)))  # 0.5 < the norms here: clipping is active
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return {"loss": losses, "norm": norms}


def _reference_clip(model, max_norm: float):
    """torch's own DTensor path (the old trainer code): norm and clipped local gradients."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def _clip_matches_torch(mesh, rank: int) -> dict:
    """Same gradients clipped by ``_grad_norm`` and by torch's DTensor path: (norm rel err, max grad rel err)."""
    from mamba_parallel.distributed.data_parallel import apply_fsdp
    from mamba_parallel.train.trainer import _grad_norm

    model = _model()
    apply_fsdp(model, mesh, model.backbone.layers)
    tokens = _batches(rank)[0]
    model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    saved = [p.grad.to_local().clone() for p in model.parameters()]
    ours = _grad_norm(model, 0.5)
    ours_grads = [p.grad.to_local().clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), saved):
        p.grad.to_local().copy_(g)
    ref = _reference_clip(model, 0.5)
    grad_err = max(float((a - p.grad.to_local()).abs().max() / p.grad.to_local().abs().max().clamp_min(1e-30))
                   for a, p in zip(ours_grads, model.parameters()))
    return {"norm": float(ours), "ref": float(ref), "grad_err": grad_err}


def _all_gathers_per_step(mesh, rank: int, **kw) -> int:
    """c10d all-gathers issued by one FSDP2 training step (after a warm-up step), counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from mamba_parallel.distributed.data_parallel import apply_fsdp

    model = _model()
    apply_fsdp(model, mesh, model.backbone.layers, **kw)
    tokens = _batches(rank)[0]
    for i in range(2):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    return sum(e.count for e in prof.key_averages() if e.key == "c10d::_allgather_base_")


def _variants(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from mamba_parallel.bench.bench_train import _allreduce_busbw
    from mamba_parallel.distributed.data_parallel import apply_ddp, apply_fsdp

    mesh = init_device_mesh("cpu", (world,))
    out = {"clip_fsdp": _clip_matches_torch(mesh, rank),
           "clip_hsdp": _clip_matches_torch(init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard")), rank)}

    out["gathers"] = _all_gathers_per_step(mesh, rank)
    out["gathers_keep"] = _all_gathers_per_step(mesh, rank, reshard_after_forward=False)

    def fsdp(**kw):
        model = _model()
        return apply_fsdp(model, mesh, model.backbone.layers, **kw)

    out["fsdp"] = _train(fsdp(), rank, bf16=False)
    out["fsdp_keep"] = _train(fsdp(reshard_after_forward=False), rank, bf16=False)
    out["fsdp_autocast"] = _train(fsdp(), rank, bf16=True)
    out["fsdp_bf16"] = _train(fsdp(param_dtype=torch.bfloat16), rank, bf16=True)
    out["ddp"] = _train(apply_ddp(_model(), mesh), rank, bf16=False)
    out["ddp_small_buckets"] = _train(apply_ddp(_model(), mesh, bucket_cap_mb=0.01), rank, bf16=False)
    out["ddp_bf16_grads"] = _train(apply_ddp(_model(), mesh, bf16_grads=True), rank, bf16=False)
    out["busbw"] = _allreduce_busbw(torch.device("cpu"), lambda: None)
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_variants, 2)


def _rel(a: list, b: list) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


@pytest.mark.parametrize("layout", ["clip_fsdp", "clip_hsdp"])
def test_local_shard_clip_equals_torch_dtensor_clip(runs, layout):
    for r in runs:
        c = r[layout]
        assert abs(c["norm"] - c["ref"]) <= RTOL[torch.float32] * c["ref"], f"{layout}: norm {c}"
        assert c["norm"] > 0.5, f"{layout}: the test needs clipping to be active, norm {c['norm']}"
        assert c["grad_err"] <= RTOL[torch.float32], f"{layout}: clipped grads differ, {c}"
    assert runs[0][layout]["norm"] == runs[1][layout]["norm"], "ranks disagree on the global norm"


def test_fsdp_gathers_root_and_last_block_once(runs):
    """3 blocks + root: forward gathers 4 groups; backward re-gathers only blocks 0 and 1 (not the last block,
    not the root with the vocab-sized tied embedding); without reshard-after-forward, nothing is re-gathered."""
    assert runs[0]["gathers"] == 6, runs[0]["gathers"]
    assert runs[0]["gathers_keep"] == 4, runs[0]["gathers_keep"]


def test_fsdp_without_reshard_after_forward_is_exact(runs):
    r = runs[0]
    assert r["fsdp_keep"]["loss"] == r["fsdp"]["loss"] and r["fsdp_keep"]["norm"] == r["fsdp"]["norm"]


def test_fsdp_bf16_params_match_autocast_within_bf16(runs):
    r = runs[0]
    assert r["fsdp_bf16"]["loss"] != r["fsdp_autocast"]["loss"], "param_dtype=bf16 had no effect"
    assert _rel(r["fsdp_bf16"]["loss"], r["fsdp_autocast"]["loss"]) <= RTOL[torch.bfloat16]
    assert _rel(r["fsdp_autocast"]["loss"], r["fsdp"]["loss"]) <= RTOL[torch.bfloat16]


def test_ddp_options_keep_losses(runs):
    r = runs[0]
    assert _rel(r["ddp"]["loss"], r["fsdp"]["loss"]) <= RTOL[torch.float32]
    assert r["ddp_small_buckets"]["loss"] == r["ddp"]["loss"] or \
        _rel(r["ddp_small_buckets"]["loss"], r["ddp"]["loss"]) <= RTOL[torch.float32]
    assert _rel(r["ddp_bf16_grads"]["loss"], r["ddp"]["loss"]) <= RTOL[torch.bfloat16]
    assert _rel(r["ddp_bf16_grads"]["norm"], r["ddp"]["norm"]) <= RTOL[torch.bfloat16]


def test_allreduce_bandwidth_probe(runs):
    assert all(r["busbw"] > 0 for r in runs)


def test_dp_options_from_config():
    from types import SimpleNamespace

    from mamba_parallel.train.config import resolve_config
    from mamba_parallel.train.trainer import dp_options

    assert dp_options(resolve_config(preset="tiny-mamba2", out="unused")) == {
        "param_dtype": None, "reshard_after_forward": True, "fsdp_blocks_per_unit": 1, "ddp_bucket_cap_mb": None,
        "ddp_bf16_grads": False}
    cfg = SimpleNamespace(fsdp_param_dtype="bf16", reshard_after_forward=False, fsdp_blocks_per_unit=4,
                          ddp_bucket_mb=100.0, ddp_bf16_grads=True)
    assert dp_options(cfg) == {"param_dtype": torch.bfloat16, "reshard_after_forward": False,
                               "fsdp_blocks_per_unit": 4, "ddp_bucket_cap_mb": 100.0, "ddp_bf16_grads": True}
