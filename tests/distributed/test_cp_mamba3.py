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


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, spawn(_worker, request.param, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_cp_equals_one_process(ranks, name):
    world, results = ranks
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
