"""The Mamba-3 reference: the chunked form equals the token-by-token recurrence (outputs, final states, every
gradient), float64 gradcheck of every input, packed sequences, and the public function's input checks."""

from __future__ import annotations

import math

import pytest
import torch

from mamba3_cases import grads, leaves, make_inputs, random_loss
from mamba_parallel.ops.mamba3 import mamba3_chunk_scan
from mamba_parallel.ops.mamba3 import Mamba3State, naive  # noqa: F811

F64 = torch.float64


def run(fn, args, **kw):
    lv = leaves(args)
    y, final = fn(**lv, **kw, return_final_states=True)
    random_loss(y, final).backward()
    return y.detach(), Mamba3State(*(s.detach() for s in final)), grads(lv)


def assert_same(a, b, tol=1e-10, what=""):
    ya, fa, ga = a
    yb, fb, gb = b
    assert (ya - yb).abs().max() <= tol * (1 + yb.abs().max()), f"{what} y"
    for name, s, t in zip(naive.Mamba3State._fields, fa, fb):
        assert s.shape == t.shape, f"{what} final {name}"
        assert (s - t).abs().max() <= tol * (1 + t.abs().max()), f"{what} final {name}"
    assert set(ga) == set(gb)
    for k in gb:
        assert (ga[k] - gb[k]).abs().max() <= tol * (1 + gb[k].abs().max()), f"{what} d{k}"


CASES = {
    # name: (make_inputs kwargs, scan kwargs)
    "siso": (dict(b=2, L=11, h=4, p=3, n=8, g=2, a=2), dict(chunk_size=4)),
    "siso_halved_full_rope": (dict(b=1, L=9, h=2, p=2, n=6, a=3), dict(chunk_size=4, rope="halved")),
    "siso_bare": (dict(b=1, L=7, h=2, p=2, n=4, init=False, z=False, D=False, bias=False), dict(chunk_size=8)),
    "mimo": (dict(b=2, L=10, h=2, p=3, n=8, R=3), dict(chunk_size=4, rope="halved")),
    "mimo_unreduced": (dict(b=1, L=6, h=2, p=2, n=4, R=2, mimo_o=False, z=False), dict(chunk_size=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_chunked_equals_recurrence(case):
    mk, kw = CASES[case]
    args = make_inputs(**mk, dtype=F64)
    assert_same(run(naive.mamba3_chunk_scan, args, **kw), run(naive.mamba3_sequential, args, **kw), what=case)


@pytest.mark.parametrize("R", [None, 2])
def test_packed_sequences_equal_recurrence(R):
    args = make_inputs(2, 12, 2, 2, 4, R=R, dtype=F64)
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [3] * 4 + [4] * 1 + [5] * 7], dtype=torch.int32)
    kw = dict(chunk_size=4, seq_idx=seq_idx)
    assert_same(run(naive.mamba3_chunk_scan, args, **kw), run(naive.mamba3_sequential, args, **kw), what="seq_idx")
    args = make_inputs(1, 14, 2, 2, 4, R=R, dtype=F64, nstates=4)
    cu = torch.tensor([0, 6, 6, 11, 14], dtype=torch.int32)  # with an empty sequence
    kw = dict(chunk_size=4, cu_seqlens=cu)
    assert_same(run(naive.mamba3_chunk_scan, args, **kw), run(naive.mamba3_sequential, args, **kw), what="cu")


def test_packed_equals_separate_calls():
    """A packed sequence gives what the same sequence gives alone, from its own initial state."""
    args = make_inputs(1, 13, 2, 2, 4, dtype=F64, nstates=2)
    cu = torch.tensor([0, 8, 13], dtype=torch.int32)
    y, fin = naive.mamba3_chunk_scan(**args, chunk_size=4, cu_seqlens=cu, return_final_states=True)
    for i, (s, e) in enumerate([(0, 8), (8, 13)]):
        part = {k: (v[:, s:e] if k not in ("D", "B_bias", "C_bias", "initial_states") else v)
                for k, v in args.items()}
        part["initial_states"] = Mamba3State(*(t[i:i + 1] for t in args["initial_states"]))
        yi, fi = naive.mamba3_chunk_scan(**part, chunk_size=4, return_final_states=True)
        torch.testing.assert_close(y[:, s:e], yi)
        for a, b in zip(fin, fi):
            torch.testing.assert_close(a[i:i + 1], b)


def test_chunk_size_does_not_change_the_result():
    args = make_inputs(1, 19, 2, 3, 8, R=2, dtype=F64)
    outs = [naive.mamba3_chunk_scan(**args, chunk_size=T, return_final_states=True) for T in (1, 5, 32)]
    for y, fin in outs[1:]:
        torch.testing.assert_close(y, outs[0][0])
        for a, b in zip(fin, outs[0][1]):
            torch.testing.assert_close(a, b)


def test_state_passing_equals_one_call():
    """Splitting a sequence in two and handing the first half's final states on gives the whole's outputs: the
    phase, the state and the trapezoid's previous token all cross the cut."""
    args = make_inputs(2, 15, 2, 3, 8, dtype=F64)
    y, fin = naive.mamba3_chunk_scan(**args, chunk_size=4, return_final_states=True)
    cut = 6
    seqwise = ("x", "dt", "A", "B", "C", "trap", "angles", "z")
    first = {k: (v[:, :cut] if k in seqwise else v) for k, v in args.items()}
    second = {k: (v[:, cut:] if k in seqwise else v) for k, v in args.items()}
    y1, f1 = naive.mamba3_chunk_scan(**first, chunk_size=4, return_final_states=True)
    second["initial_states"] = f1
    y2, f2 = naive.mamba3_chunk_scan(**second, chunk_size=4, return_final_states=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    for a, b in zip(f2, fin):
        torch.testing.assert_close(a, b)


def test_trapezoid_and_rotation_matter():
    """Guards against a reference that silently ignores a feature: each one changes the output."""
    args = make_inputs(1, 9, 2, 2, 8, dtype=F64)
    y = naive.mamba3_chunk_scan(**args, chunk_size=4)
    euler = naive.mamba3_chunk_scan(**dict(args, trap=torch.ones_like(args["trap"])), chunk_size=4)
    still = naive.mamba3_chunk_scan(**dict(args, angles=torch.zeros_like(args["angles"])), chunk_size=4)
    halved = naive.mamba3_chunk_scan(**args, chunk_size=4, rope="halved")
    for other in (euler, still, halved):
        assert (y - other).abs().max() > 1e-3


@pytest.mark.parametrize("R", [None, 2])
def test_gradcheck_every_input(R):
    args = make_inputs(1, 5, 2, 2, 4, a=1, R=R, dtype=F64)
    names = [k for k, v in args.items() if k != "initial_states" and v is not None]
    init = list(args["initial_states"])

    def f(*tensors):
        kw = dict(zip(names, tensors[:len(names)]))
        y, fin = naive.mamba3_chunk_scan(**kw, initial_states=Mamba3State(*tensors[len(names):]), chunk_size=2,
                                         rope="halved" if R else "interleaved", return_final_states=True)
        return (y, *fin)

    inputs = [args[k].detach().double().requires_grad_(True) for k in names] + \
             [s.detach().double().requires_grad_(True) for s in init]
    assert torch.autograd.gradcheck(f, inputs, atol=1e-7, rtol=1e-6)


def test_steep_decay_no_nan():
    args = make_inputs(1, 21, 2, 2, 4, dtype=torch.float32, A_scale=200.0)
    lv = leaves(args)
    y, fin = naive.mamba3_chunk_scan(**lv, chunk_size=8, return_final_states=True)
    random_loss(y, fin).backward()
    assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in grads(lv).values())


def test_dtypes():
    args = make_inputs(1, 6, 2, 2, 4, dtype=torch.float16)
    y, fin = mamba3_chunk_scan(**args, chunk_size=4, return_final_states=True)
    assert y.dtype == torch.float16 and fin.angle.dtype == fin.ssm.dtype == fin.k.dtype == torch.float32
    assert 0 <= fin.angle.min() and fin.angle.max() < 2 * math.pi


def test_expanded_angles_view():
    """The layer passes the head-shared angles as an expanded view; the gradient arrives summed over heads."""
    args = make_inputs(1, 7, 3, 2, 4, dtype=F64, expand_angles=True)
    base = args["angles"][:, :, :1].detach().clone().requires_grad_(True)
    y = mamba3_chunk_scan(**dict(args, angles=base.expand_as(args["angles"])), chunk_size=4)
    y.sum().backward()
    full = args["angles"].detach().clone().requires_grad_(True)
    mamba3_chunk_scan(**dict(args, angles=full), chunk_size=4).sum().backward()
    torch.testing.assert_close(base.grad, full.grad.sum(2, keepdim=True))


@pytest.mark.parametrize("change,match", [
    (dict(dt=torch.zeros(1, 5, 2)), "dt has shape"),
    (dict(B=torch.zeros(1, 6, 3, 4), C=torch.zeros(1, 6, 3, 4)), "B/C groups g = 3 must divide heads h = 2"),
    (dict(angles=torch.zeros(1, 6, 2, 3)), "a = 3 rotated pairs"),
    (dict(mimo_x=torch.zeros(2, 1, 2)), "mimo_x is a MIMO projection"),
    (dict(rope="spiral"), "rope must be one of"),
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(initial_states=Mamba3State(torch.zeros(1, 2, 1), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 3),
                                     torch.zeros(1, 2, 2))), "initial_states.k has shape"),
])
def test_input_checks(change, match):
    args = make_inputs(1, 6, 2, 2, 4, init=False)
    args.update(change)
    kw = {"chunk_size": args.pop("chunk_size", 4), "rope": args.pop("rope", "interleaved")}
    with pytest.raises(ValueError, match=match):
        mamba3_chunk_scan(**args, **kw)


@pytest.mark.parametrize("R", [None, 2])
def test_decode_steps_equal_the_scan(R):
    """Prefill half of a sequence with the scan, decode the rest token by token: same outputs and states."""
    from mamba_parallel.ops.mamba3 import mamba3_state_update

    args = make_inputs(2, 9, 2, 3, 8, R=R, dtype=F64)
    kw = dict(rope="halved" if R else "interleaved")
    y, fin = naive.mamba3_chunk_scan(**args, chunk_size=4, return_final_states=True, **kw)
    cut = 4
    seqwise = ("x", "dt", "A", "B", "C", "trap", "angles", "z")
    pre = {k: (v[:, :cut] if k in seqwise else v) for k, v in args.items()}
    _, state = naive.mamba3_chunk_scan(**pre, chunk_size=4, return_final_states=True, **kw)
    state = Mamba3State(*(s.clone() for s in state))
    for t in range(cut, 9):
        step = {k: (v[:, t] if k in seqwise else v) for k, v in args.items() if k != "initial_states"}
        yt = mamba3_state_update(state, **step, **kw)
        torch.testing.assert_close(yt, y[:, t])
    for a, b in zip(state, fin):
        torch.testing.assert_close(a, b)
