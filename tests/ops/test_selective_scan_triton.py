"""Triton selective scan (Mamba-1) vs the naive reference: outputs, last state and every gradient.

CPU runs use the Triton interpreter with tiny tiles (chunk 8), so L = 19 / 33 already crosses several chunks.
"""

import pytest
import torch
from helpers import assert_close

from mamba_parallel.ops.selective_scan import naive, selective_scan
from mamba_parallel.ops.selective_scan.triton_impl import selective_scan_fwd

GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


@pytest.fixture(autouse=True)
def _force_triton(monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")


def make_inputs(b=2, d=8, L=19, n=4, g=None, dtype=torch.float32, device="cpu", mode=None, with_init=True,
                full=True, seed=0):
    """Random scan inputs (dict of public-argument name -> tensor). mode: None | "seq_idx" | "cu_seqlens"."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    bc = (b, g, n, L) if g else (b, n, L)
    kw = dict(u=rnd(b, d, L), delta=rnd(b, d, L, scale=0.5), A=-(torch.rand(d, n, generator=gen) + 0.2).to(device),
              B=rnd(*bc), C=rnd(*bc))
    nstates = b
    if mode == "seq_idx":
        kw["seq_idx"] = torch.sort(torch.randint(0, 3, (b, L), generator=gen), -1)[0].to(device, torch.int32)
    elif mode == "cu_seqlens":
        cuts = sorted(torch.randint(1, L, (3,), generator=gen).tolist())
        kw["cu_seqlens"] = torch.tensor([0] + cuts + [L], dtype=torch.int32, device=device)
        nstates = len(cuts) + 1
    if full:
        kw.update(D=rnd(d, dt=torch.float32), z=rnd(b, d, L), delta_bias=rnd(d, scale=0.3, dt=torch.float32),
                  delta_softplus=True)
    if with_init:
        kw["initial_state"] = rnd(nstates, d, n, dt=torch.float32)
    return kw


def run_both(kw, grads=True):
    """(triton y, last, grads) and (reference in fp64: y, last, grads) for the same random cotangents."""
    leaves = [k for k in GRAD_NAMES if isinstance(kw.get(k), torch.Tensor)] if grads else []
    ours = {k: (v.detach().clone().requires_grad_(k in leaves) if isinstance(v, torch.Tensor) else v)
            for k, v in kw.items()}
    ref = {k: (v.detach().double().requires_grad_(k in leaves) if isinstance(v, torch.Tensor)
               and v.is_floating_point() else v) for k, v in kw.items()}
    y, last = selective_scan(**ours, return_last_state=True)
    yr, lastr = naive.selective_scan(**ref, return_last_state=True)
    out = {"y": (y, yr), "last_state": (last, lastr)}
    if grads:
        gen = torch.Generator().manual_seed(1)
        gy = torch.randn(yr.shape, generator=gen, dtype=torch.float64).to(yr.device)
        gl = torch.randn(lastr.shape, generator=gen, dtype=torch.float64).to(yr.device)
        g1 = torch.autograd.grad((y.double() * gy).sum() + (last.double() * gl).sum(), [ours[k] for k in leaves])
        g2 = torch.autograd.grad((yr * gy).sum() + (lastr * gl).sum(), [ref[k] for k in leaves])
        out.update({f"d{k}": (a, c) for k, a, c in zip(leaves, g1, g2)})
    return out


def check(out, dtype, factor=1.0):
    for name, (a, c) in out.items():
        assert a.dtype == (torch.float32 if name == "last_state" else a.dtype)
        assert_close(a, c.to(a.dtype) if name == "y" else c, dtype=dtype, grad=name.startswith("d"), name=name,
                     factor=factor)


@pytest.mark.parametrize("L", [1, 7, 19, 33])
def test_full_features_all_gradients(L):
    check(run_both(make_inputs(L=L, n=4 if L != 33 else 3)), torch.float32)


def test_grouped_bc():
    check(run_both(make_inputs(d=8, g=2)), torch.float32)


def test_seq_idx_resets_state():
    check(run_both(make_inputs(mode="seq_idx", L=26)), torch.float32)


@pytest.mark.parametrize("with_init", [True, False])
def test_cu_seqlens_per_sequence_states(with_init):
    kw = make_inputs(b=1, L=27, mode="cu_seqlens", with_init=with_init)
    check(run_both(kw), torch.float32)


def test_cu_seqlens_empty_sequence_keeps_initial_state():
    kw = make_inputs(b=1, L=12, mode=None)
    kw["cu_seqlens"] = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    kw["initial_state"] = torch.randn(3, 8, 4)
    out = run_both(kw)
    check(out, torch.float32)
    torch.testing.assert_close(out["last_state"][0][1], kw["initial_state"][1])


def test_minimal_arguments():
    check(run_both(make_inputs(full=False, with_init=False)), torch.float32)


def test_noncontiguous_inputs():
    kw = make_inputs(d=8, L=13)
    for k in ("u", "delta", "z"):  # (b, d, L) views of (b, L, d) storage
        kw[k] = kw[k].transpose(1, 2).contiguous().transpose(1, 2)
    kw["B"] = kw["B"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not kw["u"].is_contiguous()
    check(run_both(kw), torch.float32)


def test_fp16_inputs():
    check(run_both(make_inputs(dtype=torch.float16, L=21)), torch.float16)


def test_no_grad_forward_saves_nothing():
    kw = make_inputs(L=9)
    with torch.no_grad():
        y = selective_scan(**kw)
    assert_close(y, naive.selective_scan(**kw), name="y")


def test_custom_op_registration():
    kw = make_inputs(L=11, d=4, n=2, b=1)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], None, True, False, 1, True)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(selective_scan_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                               "test_autograd_registration"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", [None, "seq_idx", "cu_seqlens"])
def test_gpu_realistic(dtype, mode, nan_poison):
    b = 1 if mode == "cu_seqlens" else 2
    kw = make_inputs(b=b, d=256, L=700, n=16, dtype=dtype, device="cuda", mode=mode, g=2 if mode is None else None)
    check(run_both(kw), dtype, factor=2.0)
