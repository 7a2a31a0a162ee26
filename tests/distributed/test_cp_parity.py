"""Context parallel (state passing) on 4 gloo ranks against one process, fp32, relative <= 1e-5.

One spawn runs every case; the single-process references are computed here, in the parent:
- cp = 4: Mamba-2 (with and without packed sequences), Mamba-1 and a hybrid (attention + MLP) stack, with
  seq_idx boundaries inside a slice, exactly at a rank boundary and a sequence spanning three ranks; the length
  (40) is not a multiple of the SSD chunk (16): logits, loss and every gradient.
- cp = 4, the sequence ops alone with a non-zero initial state (conv, SSD, selective scan): outputs, final states
  and every input's gradient.
- cp = 2 x tp = 2 (sequence parallel), Mamba-2 and Mamba-1: logits, loss and every gradient.
- cp = 2 x dp = 2 through ``parallelize`` (FSDP2): first-step gradients, five AdamW steps (losses and weights).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dist_harness import spawn
from helpers import GRAD_RTOL, RTOL, rel_err
from mamba_parallel import get_preset, ops
from mamba_parallel.models import MambaLMHeadModel

WORLD = 4
PRESETS = {"mamba2": "tiny-mamba2", "mamba1": "tiny-mamba", "hybrid": "tiny-hybrid", "nemotron_h": "tiny-nemotron-h"}
# (model, packed) cases at cp = 4; slices of 10 tokens, L = 40
CP4_CASES = [("mamba2", False), ("mamba2", True), ("mamba1", True), ("hybrid", True), ("nemotron_h", True)]
CUTS = {40: ([10, 21], [5, 30, 31]), 24: ([12, 15], [7])}  # seq_idx boundaries per row, by total length
TPCP_CASES = ["mamba2", "mamba1"]
STEPS, LR = 5, 1e-2


def build(name: str) -> MambaLMHeadModel:
    torch.manual_seed(0)
    return MambaLMHeadModel(get_preset(PRESETS[name]))


def inputs(L: int, packed: bool, ignore: bool = True):
    g = torch.Generator().manual_seed(L)
    ids = torch.randint(0, 256, (2, L), generator=g)
    labels = torch.randint(0, 256, (2, L), generator=g)
    if ignore:
        labels[0, :3] = -100
    if not packed:
        return ids, labels, None
    seq = torch.zeros(2, L, dtype=torch.int32)
    for row, cuts in enumerate(CUTS[L]):
        for c in cuts:
            seq[row, c:] += 1
    return ids, labels, seq


def run_model(model, ids, labels, seq):
    """-> (logits, loss, {name: grad}) of one forward without / one with labels (+ backward)."""
    logits = model(ids, seq_idx=seq).logits.detach()
    model.zero_grad()
    loss = model(ids, targets=labels, seq_idx=seq).loss
    loss.backward()
    return logits, loss.item(), {n: p.grad for n, p in model.named_parameters()}


# ---- the sequence ops alone ------------------------------------------------------------------------------------
def op_inputs():
    """Global inputs of conv / SSD / selective scan with initial states; L = 40 (4 slices of 10), packed."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).requires_grad_()  # noqa: E731
    b, L, h, p, n, gr, d = 2, 40, 4, 8, 8, 2, 12
    seq = inputs(L, True)[2]
    conv = dict(x=r(b, d, L), weight=r(d, 4, scale=0.5), bias=r(d), initial_state=r(b, d, 3))
    ssd = dict(x=r(b, L, h, p), dt=r(b, L, h), A=(-torch.rand(h, generator=g) - 0.5).requires_grad_(),
               B=r(b, L, gr, n), C=r(b, L, gr, n), D=r(h), z=r(b, L, h, p), dt_bias=r(h, scale=0.5),
               initial_states=r(b, h, p, n))
    sel = dict(u=r(b, d, L), delta=r(b, d, L, scale=0.5), A=(-torch.rand(d, n, generator=g) - 0.5).requires_grad_(),
               B=r(b, n, L), C=r(b, n, L), D=r(d), z=r(b, d, L), delta_bias=r(d, scale=0.5),
               initial_state=r(b, d, n))
    # the sequence dim of each sliced argument (the others are replicated)
    seq_dims = {"conv": {"x": 2}, "ssd": {k: 1 for k in ("x", "dt", "B", "C", "z")},
                "sel": {k: 2 for k in ("u", "delta", "B", "C", "z")}}
    return {"conv": conv, "ssd": ssd, "sel": sel}, seq_dims, seq


def op_call(kind: str, args: dict, seq, fns):
    if kind == "conv":
        return fns["conv"](**args, activation="silu", seq_idx=seq, return_final_state=True)
    if kind == "ssd":
        return fns["ssd"](**args, chunk_size=16, dt_softplus=True, seq_idx=seq, return_final_states=True)
    return fns["sel"](**args, delta_softplus=True, seq_idx=seq, return_last_state=True)


def op_weights(y, final):
    g = torch.Generator().manual_seed(3)
    return torch.randn(y.shape, generator=g), torch.randn(final.shape, generator=g)


def op_reference():
    """The ops on the whole sequence in one process: outputs, final states, every input's gradient."""
    args, seq_dims, seq = op_inputs()
    fns = {"conv": ops.causal_conv1d, "ssd": ops.ssd_chunk_scan, "sel": ops.selective_scan}
    out = {}
    for kind, a in args.items():
        y, final = op_call(kind, a, seq, fns)
        wy, wf = op_weights(y, final)
        ((y * wy).sum() + (final * wf).sum()).backward()
        out[kind] = (y.detach(), final.detach(), {k: v.grad.clone() for k, v in a.items()})
    return out


def op_cp(rank: int, cp_group):
    """This rank's slice through the cp ops; gradients of replicated inputs summed over the ranks."""
    import functools

    from mamba_parallel.distributed.cp_ops import cp_causal_conv1d, cp_selective_scan, cp_ssd_chunk_scan

    args, seq_dims, seq = op_inputs()
    fns = {"conv": functools.partial(cp_causal_conv1d, group=cp_group),
           "ssd": functools.partial(cp_ssd_chunk_scan, group=cp_group),
           "sel": functools.partial(cp_selective_scan, group=cp_group)}
    out = {}
    for kind, a in args.items():
        dims = seq_dims[kind]
        local = {k: (v.detach().narrow(dims[k], rank * 10, 10).requires_grad_() if k in dims else
                     v.detach().clone().requires_grad_()) for k, v in a.items()}
        y, final = op_call(kind, local, seq[:, rank * 10:(rank + 1) * 10], fns)
        ydim = 1 if kind == "ssd" else 2
        gshape = list(y.shape)
        gshape[ydim] = 40
        wy, wf = op_weights(torch.empty(gshape), final)
        wy = wy.narrow(ydim, rank * 10, 10)
        loss = (y * wy).sum() + ((final * wf).sum() if rank == 0 else 0.0)  # the final state counted once
        loss.backward()
        grads = {}
        for k, v in local.items():
            gr = v.grad.clone() if v.grad is not None else torch.zeros_like(v)  # unused on this rank
            if k not in dims:
                dist.all_reduce(gr, group=cp_group)
            grads[k] = gr
        out[kind] = (y.detach(), final.detach(), grads, dims, ydim)
    return out


# ---- models ----------------------------------------------------------------------------------------------------
def _avg_over(grads: dict, group, size: int) -> dict:
    out = {}
    for k, v in grads.items():
        v = v.detach().clone()
        dist.all_reduce(v, group=group)
        out[k] = v / size
    return out


def _refusals(model, rank: int) -> dict:
    """What a cp model must refuse, with a message naming the problem (every rank raises at the same point)."""
    out = {}
    ids = torch.zeros(1, 10, dtype=torch.long)
    cases = {"short": lambda: model(ids[:, :2]),
             "cu_seqlens": lambda: model(ids, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32)),
             "generate": lambda: model.generate(ids, max_new_tokens=2),
             "labels": lambda: model(ids, labels=ids)}
    for key, call in cases.items():
        try:
            call()
            out[key] = None
        except (ValueError, RuntimeError) as e:
            out[key] = str(e)
    return out


def _ranks(rank: int, world: int) -> dict:
    from mamba_parallel.distributed.context_parallel import apply_context_parallel
    from mamba_parallel.distributed.parallel_dims import ParallelDims
    from mamba_parallel.distributed.parallelize import parallelize
    from mamba_parallel.distributed.state_dict import canonical_tensors
    from mamba_parallel.distributed.tp_plan import apply_tensor_parallel

    res = {"cp4": {}, "tpcp": {}}
    dims = ParallelDims(dp_shard=1, cp=4, world_size=world)
    dims.build_mesh("cpu")
    cp_mesh = dims.submesh("cp")
    from tp_cases import shadowed_methods

    for name, packed in CP4_CASES:
        model = apply_context_parallel(build(name), cp_mesh)
        res.setdefault("patched", []).extend(shadowed_methods(model))
        ids, labels, seq = inputs(40, packed)
        sl = slice(rank * 10, (rank + 1) * 10)
        logits, loss, grads = run_model(model, ids[:, sl], labels[:, sl], None if seq is None else seq[:, sl])
        res["cp4"][(name, packed)] = (logits, loss, _avg_over(grads, cp_mesh.get_group(), 4))
    res["errors"] = _refusals(model, rank)
    res["ops"] = op_cp(rank, cp_mesh.get_group())

    # cp 2 x tp 2 (sequence parallel): TP first, then CP, as parallelize() does
    dims = ParallelDims(dp_shard=1, cp=2, tp=2, world_size=world)
    dims.build_mesh("cpu")
    cp_mesh, cp_rank = dims.submesh("cp"), dims.submesh("cp").get_local_rank()
    for name in TPCP_CASES:
        model = build(name)
        apply_tensor_parallel(model, dims.submesh("tp"), sequence_parallel=True)
        apply_context_parallel(model, cp_mesh)
        res["patched"].extend(shadowed_methods(model))
        ids, labels, seq = inputs(24, True)
        sl = slice(cp_rank * 12, (cp_rank + 1) * 12)
        logits, loss, grads = run_model(model, ids[:, sl], labels[:, sl], seq[:, sl])
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                for k, v in canonical_tensors(grads, model).items()}
        res["tpcp"][name] = (logits, loss, _avg_over(full, cp_mesh.get_group(), 2), cp_rank)

    # cp 2 x dp 2 through parallelize (FSDP2 over the flattened dp_shard x cp mesh), AdamW steps
    dims = ParallelDims(dp_shard=2, cp=2, world_size=world)
    dims.build_mesh("cpu")
    cp_rank, dp_rank = dims.submesh("cp").get_local_rank(), dims.submesh("dp_shard").get_local_rank()
    model = parallelize(build("mamba2"), dims)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    ids, labels, seq = inputs(24, True, ignore=False)
    sl = slice(cp_rank * 12, (cp_rank + 1) * 12)
    ids, labels, seq = ids[dp_rank:dp_rank + 1, sl], labels[dp_rank:dp_rank + 1, sl], seq[dp_rank:dp_rank + 1, sl]
    losses, first_grads = [], None
    for step in range(STEPS):
        loss = model(ids, targets=labels, seq_idx=seq).loss
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    res["dpcp"] = (losses, first_grads, params)
    return res


def dpcp_reference():
    """One process on both rows: loss = mean of the per-row means (= the dp average of the 2-rank run)."""
    model = build("mamba2")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    ids, labels, seq = inputs(24, True, ignore=False)
    losses, first_grads = [], None
    for step in range(STEPS):
        loss = model(ids, targets=labels, seq_idx=seq).loss
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first_grads, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def results():
    torch.set_num_threads(1)
    refs = {"cp4": {}, "tpcp": {}}
    for name, packed in CP4_CASES:
        refs["cp4"][(name, packed)] = run_model(build(name), *inputs(40, packed))
    for name in TPCP_CASES:
        refs["tpcp"][name] = run_model(build(name), *inputs(24, True))
    refs["ops"] = op_reference()
    refs["dpcp"] = dpcp_reference()
    return refs, spawn(_ranks, WORLD)


def _check_grads(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: parameters differ"
    errs = {k: rel_err(actual[k], expected[k]) for k in expected}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= RTOL[torch.float32], f"{what}: gradient of {worst} off by {errs[worst]:.2e}"


def _check_model(got_per_rank, ref, what: str):
    """got_per_rank: (logits slice, loss, cp-averaged grads) per cp rank in order; ref: the one-process run."""
    ref_logits, ref_loss, ref_grads = ref
    logits = torch.cat([g[0] for g in got_per_rank], dim=1)
    assert rel_err(logits, ref_logits) <= RTOL[torch.float32], f"{what}: logits off by {rel_err(logits, ref_logits)}"
    for g in got_per_rank:
        assert math.isclose(g[1], ref_loss, rel_tol=RTOL[torch.float32]), f"{what}: loss {g[1]} != {ref_loss}"
    _check_grads(got_per_rank[0][2], ref_grads, what)


@pytest.mark.parametrize("name,packed", CP4_CASES)
def test_cp4_model_matches_one_process(results, name, packed):
    refs, ranks = results
    key = (name, packed)
    _check_model([r["cp4"][key] for r in ranks], refs["cp4"][key], f"cp4 {name} packed={packed}")


def test_cp_refuses_what_it_cannot_shard(results):
    _, ranks = results
    for r in ranks:
        assert r["patched"] == [], f"instance attributes hide methods: {r['patched']}"
        errs = r["errors"]
        assert errs["short"] and "d_conv - 1" in errs["short"], errs["short"]
        assert errs["cu_seqlens"] and "seq_idx" in errs["cu_seqlens"], errs["cu_seqlens"]
        assert errs["generate"] and "generate" in errs["generate"], errs["generate"]
        assert errs["labels"] and "targets=" in errs["labels"], errs["labels"]


@pytest.mark.parametrize("kind", ["conv", "ssd", "sel"])
def test_cp4_ops_with_initial_state(results, kind):
    refs, ranks = results
    ref_y, ref_final, ref_grads = refs["ops"][kind]
    dims, ydim = ranks[0]["ops"][kind][3], ranks[0]["ops"][kind][4]
    y = torch.cat([r["ops"][kind][0] for r in ranks], dim=ydim)
    assert rel_err(y, ref_y) <= RTOL[torch.float32], f"{kind}: output off by {rel_err(y, ref_y):.2e}"
    for r in ranks:  # the whole sequence's final state, on every rank
        assert rel_err(r["ops"][kind][1], ref_final) <= RTOL[torch.float32], f"{kind}: final state"
    for k, ref in ref_grads.items():
        got = torch.cat([r["ops"][kind][2][k] for r in ranks], dims[k]) if k in dims else ranks[0]["ops"][kind][2][k]
        assert rel_err(got, ref) <= RTOL[torch.float32], f"{kind}: gradient of {k} off by {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("name", TPCP_CASES)
def test_cp2_tp2_matches_one_process(results, name):
    refs, ranks = results
    by_cp = {}
    for r in ranks:
        by_cp.setdefault(r["tpcp"][name][3], r["tpcp"][name])
    _check_model([by_cp[0], by_cp[1]], refs["tpcp"][name], f"cp2 x tp2 {name}")


def test_cp2_dp2_fsdp_five_adamw_steps(results):
    refs, ranks = results
    ref_losses, ref_grads, ref_params = refs["dpcp"]
    losses, grads, params = ranks[0]["dpcp"]
    _check_grads(grads, ref_grads, "cp2 x dp2 first step")
    for s, (a, e) in enumerate(zip(losses, ref_losses)):
        assert math.isclose(a, e, rel_tol=RTOL[torch.float32]), f"step {s + 1}: loss {a} != {e}"
    errs = {k: rel_err(params[k], ref_params[k]) for k in ref_params}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_RTOL[torch.float32], f"weights after {STEPS} steps: {worst} off by {errs[worst]:.2e}"
