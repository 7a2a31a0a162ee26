"""Triton decode steps (Mamba-1 and Mamba-2) vs the naive reference step, including state_indices rows."""

import math

import pytest
import torch
from helpers import assert_close

from mamba_parallel.ops import use_backend
from mamba_parallel.ops.state_update import naive, selective_state_update, ssd_state_update


@pytest.fixture(autouse=True)
def _force_triton():
    with use_backend("triton"):
        yield


def _rnd(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _compare(fn, ref_fn, state, kw, dtype, steps=3):
    """Run ``steps`` tokens through both (each on its own state copy); compare outputs and the whole state."""
    s1, s2 = state.clone(), state.clone()
    for i in range(steps):
        step = {k: (v[i] if k in kw["_per_step"] else v) for k, v in kw.items() if k != "_per_step"}
        y1 = fn(s1, **step)
        y2 = ref_fn(s2, **step)
        assert y1.dtype == step["x"].dtype
        assert_close(y1, y2, dtype=dtype, name=f"y step {i}")
    assert_close(s1, s2, dtype=torch.float32 if dtype == torch.float32 else dtype, name="state")
    return s1, state


def mamba1_inputs(b=3, d=12, n=5, g=None, dtype=torch.float32, device="cpu", rows=None, full=True, steps=3):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s, **k: _rnd(gen, *s, device=device, **k)  # noqa: E731
    bc = (steps, b, g, n) if g else (steps, b, n)
    kw = dict(x=r(steps, b, d, dtype=dtype), dt=r(steps, b, d, dtype=dtype, scale=0.5),
              A=-(torch.rand(d, n, generator=gen) + 0.1).to(device), B=r(*bc, dtype=dtype), C=r(*bc, dtype=dtype),
              _per_step={"x", "dt", "B", "C", "z"})
    if full:
        kw.update(D=r(d), z=r(steps, b, d, dtype=dtype), dt_bias=r(d, scale=0.3), dt_softplus=True)
    if rows is not None:
        kw["state_indices"] = torch.tensor(rows, dtype=torch.int32, device=device)
    nrows = max(rows) + 2 if rows is not None else b
    return r(nrows, d, n), kw


def mamba2_inputs(b=3, h=4, p=6, n=5, g=2, dtype=torch.float32, device="cpu", rows=None, D2=False,
                  dt_limit=(0.0, math.inf), steps=3):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s, **k: _rnd(gen, *s, device=device, **k)  # noqa: E731
    kw = dict(x=r(steps, b, h, p, dtype=dtype), dt=r(steps, b, h, dtype=dtype, scale=0.5),
              A=-(torch.rand(h, generator=gen) + 0.1).to(device), B=r(steps, b, g, n, dtype=dtype),
              C=r(steps, b, g, n, dtype=dtype), D=r(h, p) if D2 else r(h), z=r(steps, b, h, p, dtype=dtype),
              dt_bias=r(h, scale=0.3), dt_softplus=True, dt_limit=dt_limit, _per_step={"x", "dt", "B", "C", "z"})
    if rows is not None:
        kw["state_indices"] = torch.tensor(rows, dtype=torch.int32, device=device)
    nrows = max(rows) + 2 if rows is not None else b
    return r(nrows, h, p, n), kw


@pytest.mark.parametrize("g", [None, 2])
@pytest.mark.parametrize("rows", [None, [4, 0, 2]])
def test_mamba1_step(g, rows):
    state, kw = mamba1_inputs(g=g, rows=rows)
    new, old = _compare(selective_state_update, naive.selective_state_update, state, kw, torch.float32)
    if rows is not None:  # rows not picked are untouched
        untouched = [i for i in range(state.shape[0]) if i not in rows]
        torch.testing.assert_close(new[untouched], old[untouched], rtol=0, atol=0)


def test_mamba1_step_minimal_fp16():
    state, kw = mamba1_inputs(full=False, dtype=torch.float16, n=16, d=40)
    _compare(selective_state_update, naive.selective_state_update, state, kw, torch.float16)


@pytest.mark.parametrize("D2", [False, True])
@pytest.mark.parametrize("rows", [None, [1, 4, 3]])
def test_mamba2_step(D2, rows):
    state, kw = mamba2_inputs(D2=D2, rows=rows)
    _compare(ssd_state_update, naive.ssd_state_update, state, kw, torch.float32)


def test_mamba2_step_dt_limit_fp16():
    state, kw = mamba2_inputs(dtype=torch.float16, dt_limit=(0.05, 0.4), g=1, n=8)
    _compare(ssd_state_update, naive.ssd_state_update, state, kw, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_steps_realistic(dtype, nan_poison):
    state, kw = mamba1_inputs(b=8, d=5120, n=16, dtype=dtype, device="cuda", rows=[9, 3, 0, 7, 12, 1, 5, 2])
    _compare(selective_state_update, naive.selective_state_update, state, kw, dtype)
    state, kw = mamba2_inputs(b=8, h=80, p=64, n=128, g=1, dtype=dtype, device="cuda",
                              rows=[9, 3, 0, 7, 12, 1, 5, 2])
    _compare(ssd_state_update, naive.ssd_state_update, state, kw, dtype)
