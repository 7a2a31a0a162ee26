"""Mamba-3 under tensor (+ sequence) parallelism on 2 and 4 gloo ranks against one process, fp32: logits, loss
and EVERY parameter's gradient (relative <= 1e-5). tp = 2: SISO with one B / C group (replicated) and with groups
split plus the per-head output norm, MIMO with one and four groups, sequence parallel on and off; tp = 4: one
replicated and one split case with sequence parallel."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dist_harness import spawn
from tp_cases import assert_one_step_matches, batch, one_step_errors
from mamba_parallel import get_preset
from mamba_parallel.distributed.tp_plan import apply_tensor_parallel
from mamba_parallel.models import MambaLMHeadModel

CASES = {
    "siso_g1": ("tiny-mamba3", {}),
    "siso_g2_outproj_norm": ("tiny-mamba3", {"ngroups": 2, "is_outproj_norm": True}),
    "mimo_g1": ("tiny-mamba3-mimo", {}),
    "mimo_g4": ("tiny-mamba3-mimo", {"ngroups": 4}),
}


def build(case: str) -> MambaLMHeadModel:
    preset, ssm = CASES[case]
    cfg = get_preset(preset)
    cfg.ssm_cfg.update(ssm)
    cfg.validate()
    torch.manual_seed(0)
    model = MambaLMHeadModel(cfg)
    with torch.no_grad():  # biases / norms start at constants: make every gradient distinct
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _worker(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for case in CASES:
        if world == 4 and case not in ("siso_g1", "mimo_g4"):
            continue  # at 4 ranks: the replicated and the split groups, sequence parallel (the CI budget)
        for sp in ((True,) if world == 4 else (True, False)):
            ref = build(case)
            tp = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=sp)
            out[(case, sp)] = one_step_errors(tp, ref, *batch())
    return out


@pytest.fixture(scope="module", params=[2, 4])
def results(request):
    return request.param, spawn(_worker, request.param)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
def test_tp_equals_one_process(results, case, sp):
    world, res = results
    if (case, sp) not in res[0]:
        pytest.skip(f"{case} (sp={sp}) runs at tp=2 only")
    for rank, r in enumerate(res):
        assert_one_step_matches(r[(case, sp)], rank)
