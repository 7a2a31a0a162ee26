"""Context parallel Mamba-3 scan (state passing) on 2 and 4 gloo ranks against one process, fp32, relative
<= 1e-5: every rank's slice of y, the whole sequence's final states, and every input's gradient. SISO and MIMO,
with a global initial state and packed sequences whose boundaries fall inside a slice, exactly at a rank boundary,
and a sequence spanning several ranks (L = 24: slices of 12 / 6)."""

from __future__ import annotations

import pytest
import torch

from dist_harness import spawn
from helpers import GRAD_RTOL, RTOL, rel_err
from mamba3_cases import make_inputs
from mamba_parallel.ops.mamba3 import Mamba3State, mamba3_chunk_scan

SEQWISE = ("x", "dt", "A", "B", "C", "trap", "angles", "z")
CASES = {"siso": dict(R=None, rope="interleaved"), "mimo": dict(R=2, rope="halved")}
L = 24


def case_inputs(name):
    args = make_inputs(2, L, 2, 4, 8, R=CASES[name]["R"], dtype=torch.float32, seed=3)
    seq = torch.zeros(2, L, dtype=torch.int32)
    for c in (6, 9):  # a boundary at a cp=4 rank boundary and one inside a slice
        seq[0, c:] += 1
    seq[1, 20:] += 1  # row 1: one sequence over three cp=4 ranks
    return args, seq


def loss_weights(y, final):
    g = torch.Generator().manual_seed(11)
    return torch.randn(y.shape, generator=g), [torch.randn(s.shape, generator=g) for s in final]


def run(args, seq, rope, fn, **kw):
    leaves = {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor) else v)
              for k, v in args.items() if k != "initial_states"}
    init = Mamba3State(*(s.detach().clone().requires_grad_(True) for s in args["initial_states"]))
    y, final = fn(**leaves, chunk_size=4, rope=rope, initial_states=init, seq_idx=seq, return_final_states=True, **kw)
    return y, final, leaves, init


def _worker(rank, world, names):
    from mamba_parallel.distributed.cp_mamba3 import cp_mamba3_chunk_scan

    out = {}
    for name in names:
        args, seq = case_inputs(name)
        n = L // world
        sl = slice(rank * n, (rank + 1) * n)
        local = {k: (v[:, sl] if k in SEQWISE else v) for k, v in args.items()}
        y, final, leaves, init = run(local, seq[:, sl], CASES[name]["rope"], cp_mamba3_chunk_scan)
        gy, gf = loss_weights(torch.empty(2, L, *y.shape[2:]), final)
        loss = (y * gy[:, sl]).sum() + (sum((s * w).sum() for s, w in zip(final, gf)) if rank == 0 else 0)
        loss.backward()
        out[name] = dict(y=y.detach(), final=[s.detach() for s in final],
                         grads={k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor) and
                                v.requires_grad},
                         init_grads=[s.grad for s in init])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_cp_equals_one_process(ranks, name):
    world, results = ranks[0], [r["ops"] for r in ranks[1]]
    args, seq = case_inputs(name)
    y, final, leaves, init = run(args, seq, CASES[name]["rope"], mamba3_chunk_scan)
    gy, gf = loss_weights(y, final)
    ((y * gy).sum() + sum((s * w).sum() for s, w in zip(final, gf))).backward()
    res = [r[name] for r in results]
    assert rel_err(torch.cat([r["y"] for r in res], 1), y) <= RTOL[torch.float32]
    for r in res:  # every rank holds the whole sequence's final states
        for a, b in zip(r["final"], final):
            assert rel_err(a, b) <= RTOL[torch.float32]
    for k, leaf in leaves.items():
        if not (isinstance(leaf, torch.Tensor) and leaf.requires_grad):
            continue
        got = torch.cat([r["grads"][k] for r in res], 1) if k in SEQWISE else sum(r["grads"][k] for r in res)
        assert rel_err(got, leaf.grad) <= GRAD_RTOL[torch.float32], f"d{k} (cp={world})"
    for i, s in enumerate(init):
        got = sum(r["init_grads"][i] for r in res if r["init_grads"][i] is not None)
        assert rel_err(got, s.grad) <= GRAD_RTOL[torch.float32], f"d init.{Mamba3State._fields[i]} (cp={world})"


# ---- whole models: cp alone, cp x tp (sequence parallel), cp x dp through parallelize (FSDP2) -------------------
MODELS = {"siso": "tiny-mamba3", "mimo": "tiny-mamba3-mimo"}
STEPS, LR = 3, 1e-2


def build_model(name: str):
    from mamba_parallel import get_preset
    from mamba_parallel.models import MambaLMHeadModel

    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(MODELS[name]))
    with torch.no_grad():  # biases / norms start at constants: make every gradient distinct
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def model_inputs():
    g = torch.Generator().manual_seed(L)
    ids = torch.randint(0, 256, (2, L), generator=g)
    targets = torch.randint(0, 256, (2, L), generator=g)
    targets[0, :3] = -100
    return ids, targets, case_inputs("siso")[1]


def run_model(model, ids, targets, seq):
    logits = model(ids, seq_idx=seq).logits.detach()
    model.zero_grad()
    loss = model(ids, targets=targets, seq_idx=seq).loss
    loss.backward()
    return logits, loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _mean_over(grads, group, size):
    import torch.distributed as dist

    out = {}
    for k, v in grads.items():
        v = v.detach().clone()
        dist.all_reduce(v, group=group)
        out[k] = v / size
    return out


def _model_worker(rank, world):
    import torch.distributed as dist

    from mamba_parallel.distributed.context_parallel import apply_context_parallel
    from mamba_parallel.distributed.parallel_dims import ParallelDims
    from mamba_parallel.distributed.parallelize import parallelize
    from mamba_parallel.distributed.state_dict import canonical_tensors
    from mamba_parallel.distributed.tp_plan import apply_tensor_parallel

    out = {"cp": {}, "tpcp": {}}
    ids, targets, seq = model_inputs()
    dims = ParallelDims(dp_shard=1, cp=world, world_size=world)
    dims.build_mesh("cpu")
    mesh = dims.submesh("cp")
    n = L // world
    sl = slice(rank * n, (rank + 1) * n)
    for name in MODELS:
        model = apply_context_parallel(build_model(name), mesh)
        logits, loss, grads = run_model(model, ids[:, sl], targets[:, sl], seq[:, sl])
        out["cp"][name] = (logits, loss, _mean_over(grads, mesh.get_group(), world))
    if world == 4:
        # cp 2 x tp 2 (sequence parallel): TP first, then CP, as parallelize() does
        dims = ParallelDims(dp_shard=1, cp=2, tp=2, world_size=world)
        dims.build_mesh("cpu")
        cp_mesh = dims.submesh("cp")
        cr = cp_mesh.get_local_rank()
        half = slice(cr * (L // 2), (cr + 1) * (L // 2))
        for name in MODELS:
            model = build_model(name)
            apply_tensor_parallel(model, dims.submesh("tp"), sequence_parallel=True)
            apply_context_parallel(model, cp_mesh)
            logits, loss, grads = run_model(model, ids[:, half], targets[:, half], seq[:, half])
            full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                    for k, v in canonical_tensors(grads, model).items()}
            out["tpcp"][name] = (logits, loss, _mean_over(full, cp_mesh.get_group(), 2), cr)
        # cp 2 x dp 2 through parallelize (FSDP2 over the flattened dp_shard x cp mesh): AdamW steps
        dims = ParallelDims(dp_shard=2, cp=2, world_size=world)
        dims.build_mesh("cpu")
        cr, dr = dims.submesh("cp").get_local_rank(), dims.submesh("dp_shard").get_local_rank()
        model = parallelize(build_model("siso"), dims)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        half = slice(cr * (L // 2), (cr + 1) * (L // 2))
        my = (ids[dr:dr + 1, half], targets[dr:dr + 1, half], seq[dr:dr + 1, half])
        losses = []
        for _ in range(STEPS):
            loss = model(my[0], targets=my[1], seq_idx=my[2]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        out["dpcp"] = (losses, {k: p.full_tensor().detach() for k, p in model.named_parameters()})
    return out


def _all(rank, world):
    return {"ops": _worker(rank, world, list(CASES)), "models": _model_worker(rank, world)}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    """One spawn per world size runs every check of this file (starting ranks costs seconds)."""
    return request.param, spawn(_all, request.param)


@pytest.fixture(scope="module")
def model_ranks(ranks):
    return ranks[0], [r["models"] for r in ranks[1]]


def _close_grads(got, want, what):
    for k, g in want.items():
        assert rel_err(got[k], g) <= GRAD_RTOL[torch.float32], f"{what}: d{k}"


@pytest.mark.parametrize("name", list(MODELS))
def test_cp_model_equals_one_process(model_ranks, name):
    world, res = model_ranks
    ids, targets, seq = model_inputs()
    logits, loss, grads = run_model(build_model(name), ids, targets, seq)
    assert rel_err(torch.cat([r["cp"][name][0] for r in res], 1), logits) <= RTOL[torch.float32]
    for rank, r in enumerate(res):
        assert abs(r["cp"][name][1] - loss) <= RTOL[torch.float32] * abs(loss), f"rank {rank} loss"
        _close_grads(r["cp"][name][2], grads, f"cp={world} rank {rank}")


@pytest.mark.parametrize("name", list(MODELS))
def test_cp2_tp2_equals_one_process(model_ranks, name):
    world, res = model_ranks
    if world != 4:
        pytest.skip("cp 2 x tp 2 needs 4 ranks")
    ids, targets, seq = model_inputs()
    logits, loss, grads = run_model(build_model(name), ids, targets, seq)
    for rank, r in enumerate(res):
        got_logits, got_loss, got_grads, cr = r["tpcp"][name]
        half = slice(cr * (L // 2), (cr + 1) * (L // 2))
        assert rel_err(got_logits, logits[:, half]) <= RTOL[torch.float32]
        assert abs(got_loss - loss) <= RTOL[torch.float32] * abs(loss)
        _close_grads(got_grads, grads, f"cp2 x tp2 rank {rank}")


def test_cp2_dp2_fsdp_trains_like_one_process(model_ranks):
    world, res = model_ranks
    if world != 4:
        pytest.skip("cp 2 x dp 2 needs 4 ranks")
    ids, targets, seq = model_inputs()
    model = build_model("siso")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for _ in range(STEPS):  # the dp average of the per-row means = the mean over both rows (equal counts)
        loss = sum(model(ids[i:i + 1], targets=targets[i:i + 1], seq_idx=seq[i:i + 1]).loss for i in (0, 1)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = dict(model.named_parameters())
    for r in res:
        got_losses, got_params = r["dpcp"]
        for a, b in zip(got_losses, losses):
            assert abs(a - b) <= RTOL[torch.float32] * abs(b)
        for k, v in got_params.items():
            assert rel_err(v, params[k].detach()) <= GRAD_RTOL[torch.float32], k
