"""Pipeline parallel (torch.distributed.pipelining) against one process: pp = 2 alone (2 gloo ranks) and with
FSDP2 / DDP-style replicas / tensor / context parallel (4 ranks), for Mamba-1, Mamba-2 and a hybrid, every schedule; fp32,
five AdamW steps: losses within 1e-5 of the one-process run, and each step's gradients within 1e-5 (all of them
together; 1e-4 each) of the one-process gradients at the same weights. Plus the checks that need no processes:
stage splits, bad degrees, the meta build's initial values."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import spawn
from helpers import GRAD_RTOL, RTOL
from mamba_parallel.config import get_preset
from mamba_parallel.distributed import ParallelConfigError, ParallelDims
from mamba_parallel.distributed.materialize import materialize
from mamba_parallel.distributed.parallelize import parallelize_pipeline
from mamba_parallel.distributed.pipeline import PipelinePlan, pipeline_step, split_layers
from mamba_parallel.distributed.state_dict import canonical_tensors, full_model_state_dict
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.train.optim import build_optimizer

SEED, STEPS, BATCH, LR = 5, 5, 4, 1e-3
EMB, HEAD = "backbone.embedding.weight", "lm_head.weight"


def _config(preset: str, n_layer: int | None = None):
    return get_preset(preset, n_layer=n_layer) if n_layer else get_preset(preset)


def _batch(config):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (BATCH, 33), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _reference(config):
    model = MambaLMHeadModel(config, device="meta")
    materialize(model, config, "cpu", SEED)
    model.tie_weights()
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _pipeline_case(rank, world, preset, n_layer, schedule, microbatches, pp, tp, dp_mode, cp=1):
    config = _config(preset, n_layer)
    dp = world // (pp * tp * cp)
    dims = ParallelDims(pp=pp, tp=tp, cp=cp, dp_replicate=dp if dp_mode == "ddp" else 1,
                        dp_shard=1 if dp_mode == "ddp" else -1, world_size=world)
    dims.build_mesh("cpu")
    plan = PipelinePlan(pp, schedule, microbatches)
    pm = parallelize_pipeline(MambaLMHeadModel(config, device="meta"), dims, plan, torch.device("cpu"),
                              materialize=lambda m: materialize(m, config, "cpu", SEED), dp_mode=dp_mode,
                              timed=True)
    opt = build_optimizer(pm, LR, 0.1)
    ref, twin = _reference(config), _reference(config)  # twin: the one-process model at the pipeline's weights
    ref_opt = build_optimizer(ref, LR, 0.1)
    x, y = _batch(config)
    rows = slice(dims.dp_rank(rank) * BATCH // dp, (dims.dp_rank(rank) + 1) * BATCH // dp)
    n = x.shape[1] // cp  # context parallel: this rank's slice of every sequence
    cols = slice(dims.coords(rank)["cp"] * n, (dims.coords(rank)["cp"] + 1) * n)
    out = {"loss": [], "grad_all": [], "grad_each": []}
    for step in range(STEPS):
        # the pipeline's current weights, whole, in the twin (every stage's, gathered over the pipeline)
        mine = full_model_state_dict(pm)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        weights = {k: v for p in parts for k, v in p.items()}
        twin.load_state_dict({k: weights[EMB if k == HEAD and config.tie_embeddings else k]
                              for k in twin.state_dict()})
        twin.zero_grad()
        twin(x, targets=y).loss.backward()

        t0 = time.perf_counter()
        loss = pipeline_step(pm, x[rows, cols], y[rows, cols])
        if step == 0:
            out["busy_s"], out["bubble"] = pm.timer.busy_s(), pm.timer.bubble_fraction(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = ref(x, targets=y).loss
        ref_loss.backward()
        out["loss"].append(abs(mean.item() / world - ref_loss.item()) / ref_loss.item())

        got = canonical_tensors({k: p.grad for k, p in pm.named_parameters()}, pm)
        want = dict(twin.named_parameters())
        num = den = 0.0
        each = 0.0
        for k, g in got.items():
            r = want[EMB if k == HEAD and config.tie_embeddings else k].grad
            g = _full(g)
            num += (g.double() - r.double()).pow(2).sum().item()
            den += r.double().pow(2).sum().item()
            each = max(each, _rel(g, r))
        out["grad_all"].append((num / den) ** 0.5)
        out["grad_each"].append(each)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return out


CASES_2 = [  # (preset, n_layer, schedule, microbatches): pp = 2 on 2 ranks
    ("tiny-mamba", None, "gpipe", 2),
    ("tiny-mamba2", None, "1f1b", 4),
    ("tiny-hybrid", None, "interleaved-1f1b", 4),
    ("tiny-hybrid", None, "zbv", 2),
    ("tiny-nemotron-h", None, "interleaved-zb", 2),  # MLP-only and attention blocks
]
CASES_4 = [  # (preset, n_layer, schedule, microbatches, tp, dp_mode, cp): pp = 2 on 4 ranks
    ("tiny-mamba2", None, "1f1b", 2, 1, "fsdp", 1),
    ("tiny-hybrid", None, "1f1b", 2, 2, "fsdp", 1),
    ("tiny-mamba", None, "gpipe", 2, 1, "ddp", 1),
    ("tiny-mamba2", None, "1f1b", 2, 1, "fsdp", 2),
]


def _all_2(rank, world):
    return [_pipeline_case(rank, world, p, n, s, m, 2, 1, "fsdp") for p, n, s, m in CASES_2]


def _meta_build_dp2_tp2(rank, world):
    """FSDP2 over TP DTensors built on meta and materialised shard by shard: the single-device initial values."""
    from mamba_parallel.distributed.parallelize import parallelize

    config = get_preset("tiny-hybrid")
    dims = ParallelDims(dp_shard=2, tp=2, world_size=world)
    dims.build_mesh("cpu")
    model = parallelize(MambaLMHeadModel(config, device="meta"), dims,
                        materialize=lambda m: materialize(m, config, "cpu", SEED))
    full = full_model_state_dict(model)
    return sorted(k for k, v in _reference(config).state_dict().items() if not torch.equal(v, full[k]))


def _all_4(rank, world):
    cases = [_pipeline_case(rank, world, p, n, s, m, 2, tp, mode, cp) for p, n, s, m, tp, mode, cp in CASES_4]
    return cases + [_meta_build_dp2_tp2(rank, world)]


@pytest.fixture(scope="module")
def runs():
    return {2: spawn(_all_2, 2), 4: spawn(_all_4, 4)}


def _check(results, label):
    for rank, r in enumerate(results):
        assert max(r["loss"]) <= RTOL[torch.float32], f"{label} rank {rank}: loss errors {r['loss']}"
        assert max(r["grad_all"]) <= RTOL[torch.float32], f"{label} rank {rank}: gradient errors {r['grad_all']}"
        assert max(r["grad_each"]) <= GRAD_RTOL[torch.float32], \
            f"{label} rank {rank}: worst single gradient {r['grad_each']}"
        assert r["busy_s"] > 0 and 0 <= r["bubble"] < 1, (r["busy_s"], r["bubble"])  # the stage timer measures


@pytest.mark.parametrize("i", range(len(CASES_2)), ids=[f"{c[0]}-{c[2]}" for c in CASES_2])
def test_pp2_matches_one_process(runs, i):
    _check([r[i] for r in runs[2]], f"pp=2 {CASES_2[i]}")


@pytest.mark.parametrize("i", range(len(CASES_4)), ids=["pp2xdp2-fsdp-mamba2", "pp2xtp2-hybrid",
                                                         "pp2xdp2-ddp-mamba1", "pp2xcp2-mamba2"])
def test_pp2_composed_matches_one_process(runs, i):
    _check([r[i] for r in runs[4]], f"pp=2 x {CASES_4[i]}")


# ---- no processes ---------------------------------------------------------------------------------------------------
def test_balanced_split_and_given_split():
    config = get_preset("mamba2-370m")
    ranges = split_layers(config, 4)
    assert [r.start for r in ranges][0] == 0 and ranges[-1].stop == config.n_layer
    sizes = [len(r) for r in ranges]
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[1], sizes  # embedding / head weigh on the end stages
    assert [len(r) for r in split_layers(config, 2, [20, 28])] == [20, 28]
    with pytest.raises(ParallelConfigError, match="--pp-split 20,20"):
        split_layers(config, 2, [20, 20])


def test_bad_pp_degree_is_one_line_naming_it():
    with pytest.raises(ParallelConfigError, match=r"pp=4 needs at least 4 layers") as e:
        ParallelDims(pp=4, world_size=4).validate_for_model(get_preset("tiny-mamba2"))
    assert "\n" not in str(e.value)
    with pytest.raises(ParallelConfigError, match=r"not divisible by pp\*dp_replicate\*cp\*tp"):
        ParallelDims(pp=3, world_size=4)
    with pytest.raises(ParallelConfigError, match="pp must be an integer >= 1"):
        ParallelDims(pp=0, world_size=4)
    with pytest.raises(ParallelConfigError, match="--microbatches 1 < --pp 2"):
        PipelinePlan(2, "1f1b", 1)
    with pytest.raises(ParallelConfigError, match="zbv runs exactly two stages per rank"):
        PipelinePlan(2, "zbv", 4, stages_per_rank=3)
    with pytest.raises(ParallelConfigError, match="--pp-schedule must be one of"):
        PipelinePlan(2, "dualpipe", 4)


@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv"])
def test_zero_bubble_refused_where_torch_adds_up_output_gradients(schedule, monkeypatch):
    """torch 2.11's zero-bubble weight pass feeds the sum of a node's output gradients into its first output (wrong
    weight gradients for the fused add + norm): refused there, naming the flag and the torch that works; the
    other schedules and torch >= 2.12 are unaffected."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ParallelConfigError, match=rf"--pp-schedule {schedule} needs torch >= 2.12, this is 2.11.0"):
        PipelinePlan(2, schedule, 4)
    assert PipelinePlan(2, "1f1b", 4).n_stages == 2 and PipelinePlan(2, "interleaved-1f1b", 4).n_stages == 4
    monkeypatch.setattr(torch, "__version__", "2.12.0+cu130")
    assert PipelinePlan(2, schedule, 4).n_stages == 4


def test_stage_placement():
    assert PipelinePlan(4, "interleaved-1f1b", 4).stage_ids(1) == [1, 5]
    assert PipelinePlan(4, "zbv", 4).stage_ids(1) == [1, 6]
    assert PipelinePlan(4, "zbv", 4).rank_of_stage(7) == 0
    assert ParallelDims(pp=2, tp=2, world_size=8).coords(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0,
                                                                "cp": 0, "tp": 1}


@pytest.mark.parametrize("preset,kw", [("tiny-mamba", {}), ("tiny-mamba2", {}), ("tiny-hybrid", {}),
                                       ("tiny-hybrid", {"tie_embeddings": False}), ("tiny-nemotron-h", {})])
def test_meta_build_gets_the_init_weights_values(preset, kw):
    config = get_preset(preset, **kw)
    torch.manual_seed(SEED)
    plain = MambaLMHeadModel(config)
    plain.to_empty(device="cpu")
    torch.manual_seed(SEED)
    plain.init_weights()
    built = _reference(config)
    for (k, a), (_, b) in zip(plain.state_dict().items(), built.state_dict().items()):
        assert torch.equal(a, b), k


def test_meta_build_of_fsdp_over_tp_holds_the_init_values(runs):
    for rank, r in enumerate(runs[4]):
        assert r[-1] == [], f"rank {rank}: entries differing from the single-device init: {r[-1]}"
