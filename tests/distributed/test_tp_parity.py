"""TP=2 (sequence parallel on and off) on 2 gloo ranks against the single-process model, fp32: logits, loss and
EVERY parameter's gradient (relative <= 1e-5), five AdamW steps, a tp2 -> tp1 resume through DCP, bad degrees."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from dist_harness import spawn
from tp_cases import (
    CASES,
    assert_one_step_matches,
    batch,
    bf16_failures,
    bf16_parity,
    build,
    full,
    one_step_errors,
    shadowed_methods,
)
from mamba_parallel import get_preset
from mamba_parallel.distributed import ParallelConfigError
from mamba_parallel.distributed.state_dict import (
    load_model_state_dict,
    load_optim_state_dict,
    model_state_dict,
    optim_state_dict,
)
from mamba_parallel.distributed.tp_plan import apply_tensor_parallel
from mamba_parallel.models import MambaLMHeadModel

STEPS = 5


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _train(model, opt, steps, seed=20):
    losses = []
    ids, labels = batch(seed=seed)  # one batch, seen again: the loss must fall
    for _ in range(steps):
        loss = model(ids, targets=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _parity(mesh, case, sp):
    ref = build(case)
    tp = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=sp)
    patched = shadowed_methods(tp)
    res = one_step_errors(tp, ref, *batch())
    # The trainer's clipping norm: DTensor gradients (sharded and replicated) give the global norm.
    norms = [full(torch.nn.utils.get_total_norm([p.grad for p in m.parameters() if p.grad is not None]))
             for m in (tp, ref)]
    return {**res, "norm": abs(norms[0].item() / norms[1].item() - 1), "patched": patched}


def _steps(mesh, case, sp):
    ref = build(case)
    tp = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=sp)
    return _train(tp, _adamw(tp), STEPS), _train(ref, _adamw(ref), STEPS)


def _resume_tp2_to_tp1(mesh, ckpt_dir):
    """Two steps at tp2, DCP save; load into a single-device (tp1) model + optimizer; the next two steps match."""
    tp = apply_tensor_parallel(build("mamba2_g1"), mesh, sequence_parallel=True)
    opt = _adamw(tp)
    _train(tp, opt, 2)
    dcp.save({"model": model_state_dict(tp), "optim": optim_state_dict(tp, opt)}, checkpoint_id=ckpt_dir)
    keys_tp2 = {k: tuple(v.shape) for k, v in model_state_dict(tp).items()}
    one = build("mamba2_g1", seed=123)  # different weights: all of them must come from the checkpoint
    opt1 = _adamw(one)
    state = {"model": model_state_dict(one), "optim": optim_state_dict(one, opt1)}
    keys_tp1 = {k: tuple(v.shape) for k, v in state["model"].items()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    load_model_state_dict(one, state["model"])
    load_optim_state_dict(one, opt1, state["optim"])
    return {"keys_equal": keys_tp1 == keys_tp2, "after_tp2": _train(tp, opt, 2, seed=40),
            "after_tp1": _train(one, opt1, 2, seed=40)}


def _generate(mesh, case):
    """Greedy decoding with tp2 (no SP: one token at a time) gives the single-process tokens."""
    ref = build(case)
    tp = apply_tensor_parallel(copy.deepcopy(ref), mesh, sequence_parallel=False)
    ids = batch()[0][:, :8]
    return ref.generate(ids, max_new_tokens=6, top_k=1), tp.generate(ids, max_new_tokens=6, top_k=1)


def _bad_degrees(mesh):
    errors = []
    cfgs = [get_preset("tiny-mamba2", d_model=48, ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 32}),
            get_preset("tiny-mamba2", ssm_cfg={"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": 1}),
            get_preset("tiny-hybrid", attn_cfg={"num_heads": 4, "num_heads_kv": 1})]
    cfgs[1].ssm_cfg["ngroups"] = 8  # nheads 8, 8 groups: fine for tp=2 -> no error expected
    for cfg in cfgs:
        try:
            apply_tensor_parallel(MambaLMHeadModel(cfg), mesh)
            errors.append(None)
        except ParallelConfigError as e:
            errors.append(str(e))
    return errors


def _worker(rank, world, ckpt_dir):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {"parity": {}, "steps": {}}
    for case in CASES:
        for sp in (True, False):
            out["parity"][case, sp] = _parity(mesh, case, sp)
        out["steps"][case] = _steps(mesh, case, sp=case != "hybrid")
    out["bf16"] = {case: bf16_parity(lambda m: apply_tensor_parallel(m, mesh), build(case), *batch(), "cpu")
                   for case in ("mamba1", "mamba2_g1", "hybrid")}
    out["resume"] = _resume_tp2_to_tp1(mesh, ckpt_dir)
    out["generate"] = {case: _generate(mesh, case) for case in ("mamba1", "hybrid")}
    out["errors"] = _bad_degrees(mesh)
    return out


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        return spawn(_worker, 2, os.path.join(tmp, "ckpt"))


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "nosp"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_every_gradient(results, case, sp):
    for r in range(2):
        res = results[r]["parity"][case, sp]
        assert_one_step_matches(res, r)
        assert len(res["grads"]) >= 10
        assert res["norm"] <= 1e-5, f"rank {r} total gradient norm rel err {res['norm']:.2e}"
        assert res["patched"] == [], f"rank {r}: instance attributes hide methods: {res['patched']}"


@pytest.mark.parametrize("case", ["mamba1", "mamba2_g1", "hybrid"])
def test_bf16_autocast_error_is_bf16_noise(results, case):
    """Under bf16 autocast, tp's error against fp32 stays within a few times the one-process bf16 error."""
    for r in range(2):
        res = results[r]["bf16"][case]
        assert res["logits"][1] > 0, "autocast did not change the one-process logits: the check would be empty"
        bad = bf16_failures(res)
        assert not bad, f"rank {r} (tp err, one-process err): {bad}"


@pytest.mark.parametrize("case", list(CASES))
def test_five_adamw_steps_match_one_process(results, case):
    tp_losses, ref_losses = results[0]["steps"][case]
    assert len(tp_losses) == STEPS
    for a, b in zip(tp_losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b), f"{case}: tp losses {tp_losses} vs one process {ref_losses}"
    assert ref_losses[-1] < ref_losses[0]


def test_resume_tp2_checkpoint_at_tp1(results):
    res = results[0]["resume"]
    assert res["keys_equal"], "checkpoint keys / global shapes differ between tp2 and tp1"
    for a, b in zip(res["after_tp1"], res["after_tp2"]):
        assert abs(a - b) <= 1e-5 * abs(b), f"tp1 resume {res['after_tp1']} vs tp2 {res['after_tp2']}"


@pytest.mark.parametrize("case", ["mamba1", "hybrid"])
def test_generate_without_sp_matches_one_process(results, case):
    for r in range(2):
        want, got = results[r]["generate"][case]
        assert got.shape == want.shape == (2, 14)
        assert torch.equal(got, want)


def test_bad_degrees_clear_errors(results):
    errors = results[0]["errors"]
    assert errors[0] == "tp=2 does not divide nheads=3"
    assert errors[1] is None
    assert errors[2] == "tp=2 does not divide attn num_heads_kv=1"


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_tp_gated_norm_backward_matches_autograd(norm_before_gate, gated):
    """The hand-written backward of the cross-rank gated norm (one rank here: the sums are then local) against
    autograd through the reference op, in fp64."""
    from mamba_parallel.distributed.tp_modules import TPGatedRMSNormFunc
    from mamba_parallel.ops.norm.naive import gated_rms_norm

    g = torch.Generator().manual_seed(3)
    x, z, w, dy = (torch.randn(2, 5, 12, generator=g, dtype=torch.float64) for _ in range(4))
    w = w[0, 0]
    z = z if gated else None
    leaves = [t.clone().requires_grad_() for t in (x, w)] + ([z.clone().requires_grad_()] if gated else [])
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = TPGatedRMSNormFunc.apply(leaves[0], leaves[2] if gated else None, leaves[1], 1e-5, norm_before_gate,
                                 None, 12)
    y_ref = gated_rms_norm(ref_leaves[0], ref_leaves[2] if gated else None, ref_leaves[1], 1e-5,
                           norm_before_gate=norm_before_gate)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
