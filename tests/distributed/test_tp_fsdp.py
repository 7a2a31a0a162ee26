"""DP=2 x TP=2 on 4 gloo ranks: FSDP2 over the dp mesh on top of TP(+SP) DTensors (2-D), against the
single-process model on the global batch (fp32, relative <= 1e-5); AdamW steps; a dp2 x tp2 -> dp4 resume through
DCP; a meta-device build initialised after parallelisation."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_harness import spawn
from tp_cases import assert_one_step_matches, batch, build, full, one_step_errors, rel_errs
from mamba_parallel.distributed import ParallelDims
from mamba_parallel.distributed.data_parallel import apply_fsdp
from mamba_parallel.distributed.parallelize import parallelize
from mamba_parallel.distributed.state_dict import (
    canonical_tensors,
    load_model_state_dict,
    load_optim_state_dict,
    model_state_dict,
    optim_state_dict,
)
from mamba_parallel.distributed.materialize import materialize
from mamba_parallel.distributed.tp_plan import apply_tensor_parallel
from mamba_parallel.models import MambaLMHeadModel

GLOBAL_BATCH = 4


def _dp2tp2(model, dims, sp):
    """The order of parallelize(): TP first, then FSDP2 per block + root over the dp mesh."""
    if sp:
        return parallelize(model, dims)
    apply_tensor_parallel(model, dims.submesh("tp"), sequence_parallel=False)
    return apply_fsdp(model, dims.submesh("dp_shard"), model.backbone.layers)


def _my_rows(dims) -> slice:
    """This dp rank's rows of the global batch."""
    dp_rank, n = dims.submesh("dp_shard").get_local_rank(), GLOBAL_BATCH // dims.dp
    return slice(dp_rank * n, (dp_rank + 1) * n)


def _mean_over_world(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _train(model, opt, dims, steps):
    ids, labels = (t[_my_rows(dims)] for t in batch(GLOBAL_BATCH, ignore=False, seed=30))
    losses = []
    for _ in range(steps):
        loss = model(ids, targets=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean_over_world(loss.item()))
    return losses


def _parity(dims, case, sp):
    ref = build(case)
    model = _dp2tp2(copy.deepcopy(ref), dims, sp)
    # equal token counts on every rank: the mean of the dp means is the global mean
    return one_step_errors(model, ref, *batch(GLOBAL_BATCH, ignore=False), _my_rows(dims), _mean_over_world)


def _resume_dp4(case, ckpt_dir):
    dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
    model = parallelize(build(case), dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, dims, 2)
    dcp.save({"model": model_state_dict(model), "optim": optim_state_dict(model, opt)}, checkpoint_id=ckpt_dir)
    after_tp = _train(model, opt, dims, 2)
    dims4 = ParallelDims(dp_shard=4, tp=1, world_size=4)
    model4 = parallelize(build(case, seed=99), dims4)
    opt4 = torch.optim.AdamW(model4.parameters(), lr=1e-3)
    state = {"model": model_state_dict(model4), "optim": optim_state_dict(model4, opt4)}
    dcp.load(state, checkpoint_id=ckpt_dir)
    load_model_state_dict(model4, state["model"])
    load_optim_state_dict(model4, opt4, state["optim"])
    return {"after_dp2tp2": after_tp, "after_dp4": _train(model4, opt4, dims4, 2)}


def _meta_init(dims, case):
    model = build(case)
    with torch.device("meta"):
        meta = MambaLMHeadModel(model.config)
    parallelize(meta, dims)
    materialize(meta, model.config, "cpu", seed=0)  # build() seeds 0 before its single-device init
    got = {k: full(v).detach() for k, v in canonical_tensors(dict(meta.named_parameters()), meta).items()}
    want = dict(model.named_parameters())
    return rel_errs(got, {k: v.detach() for k, v in want.items()})


def _worker(rank, world, ckpt_dir):
    torch.manual_seed(0)
    dims = ParallelDims(dp_shard=2, tp=2, world_size=world)
    dims.build_mesh("cpu")
    out = {"parity": {}}
    for case, sp in (("mamba1", True), ("mamba2_g1", False), ("hybrid", True)):
        out["parity"][case, sp] = _parity(dims, case, sp)
    out["resume"] = _resume_dp4("mamba2_g2", ckpt_dir)
    out["meta"] = _meta_init(dims, "hybrid")
    return out


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        return spawn(_worker, 4, os.path.join(tmp, "ckpt"))


@pytest.mark.parametrize("case,sp", [("mamba1", True), ("mamba2_g1", False), ("hybrid", True)])
def test_dp2_tp2_matches_one_process(results, case, sp):
    for r in range(4):
        assert_one_step_matches(results[r]["parity"][case, sp], r)


def test_resume_dp2_tp2_checkpoint_at_dp4(results):
    res = results[0]["resume"]
    for a, b in zip(res["after_dp4"], res["after_dp2tp2"]):
        assert abs(a - b) <= 1e-5 * abs(b), f"dp4 resume {res['after_dp4']} vs dp2 x tp2 {res['after_dp2tp2']}"


def test_meta_build_then_init_weights_equals_single_device(results):
    for r in range(4):
        bad = {k: v for k, v in results[r]["meta"].items() if not v <= 1e-7}
        assert not bad, f"rank {r}: {bad}"
