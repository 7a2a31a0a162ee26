"""One-token state updates (Mamba-1 / Mamba-2) chained over a sequence == the full scans (outputs and final
states); state_indices rows; gradcheck through the in-place update; argument checks."""

import pytest
import torch
from helpers import assert_close

from mamba_parallel.ops import selective_scan, selective_state_update, ssd_chunk_scan, ssd_state_update, use_backend

F64 = torch.float64


@pytest.fixture(autouse=True)
def _naive_backend():
    with use_backend("naive"):
        yield


@pytest.mark.parametrize("g", [None, 2])
def test_selective_state_update_chained_equals_scan(g):
    torch.manual_seed(0)
    b, d, n, L = 2, 4, 3, 6
    bc = (b, n, L) if g is None else (b, g, n, L)
    u, delta, z = torch.randn(b, d, L, dtype=F64), torch.randn(b, d, L, dtype=F64), torch.randn(b, d, L, dtype=F64)
    A, B, C = -torch.rand(d, n, dtype=F64) - 0.1, torch.randn(*bc, dtype=F64), torch.randn(*bc, dtype=F64)
    D, bias, h0 = torch.randn(d, dtype=F64), torch.randn(d, dtype=F64), torch.randn(b, d, n, dtype=F64)
    y, last = selective_scan(u, delta, A, B, C, D, z, bias, True, h0, return_last_state=True)
    state = h0.clone()
    ys = [selective_state_update(state, u[..., t], delta[..., t], A, B[..., t], C[..., t], D, z[..., t], bias, True)
          for t in range(L)]
    assert_close(torch.stack(ys, -1), y, F64, name="chained y")
    assert_close(state, last, F64, name="state after the last token")


@pytest.mark.parametrize("d_hp", [False, True])
def test_ssd_state_update_chained_equals_scan(d_hp):
    torch.manual_seed(1)
    b, L, h, p, g, n = 2, 5, 4, 3, 2, 3
    x, z = torch.randn(b, L, h, p, dtype=F64), torch.randn(b, L, h, p, dtype=F64)
    dt, A = torch.randn(b, L, h, dtype=F64), -torch.rand(h, dtype=F64) * 2 - 0.1
    B, C = torch.randn(b, L, g, n, dtype=F64), torch.randn(b, L, g, n, dtype=F64)
    D = torch.randn(h, p, dtype=F64) if d_hp else torch.randn(h, dtype=F64)
    bias, h0 = torch.randn(h, dtype=F64), torch.randn(b, h, p, n, dtype=F64)
    lim = (0.1, 1.2)
    y, fin = ssd_chunk_scan(x, dt, A, B, C, 2, D, z, bias, True, lim, h0, return_final_states=True)
    state = h0.clone()
    ys = [ssd_state_update(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, z[:, t], bias, True, lim)
          for t in range(L)]
    assert_close(torch.stack(ys, 1), y, F64, name="chained y")
    assert_close(state, fin, F64, name="state after the last token")


def test_state_indices_touch_only_their_rows():
    torch.manual_seed(2)
    h, p, n = 2, 3, 4
    pool = torch.randn(5, h, p, n)
    before = pool.clone()
    idx = torch.tensor([4, 0], dtype=torch.int32)
    args = (torch.randn(2, h, p), torch.rand(2, h), -torch.rand(h), torch.randn(2, 1, n), torch.randn(2, 1, n))
    y = ssd_state_update(pool, *args, state_indices=idx)
    own = before[[4, 0]].clone()
    assert_close(y, ssd_state_update(own, *args), torch.float32, name="y")
    assert torch.equal(pool[[4, 0]], own) and torch.equal(pool[1:4], before[1:4])

    pool1 = torch.randn(3, 4, n)
    before1 = pool1.clone()
    args1 = (torch.randn(1, 4), torch.rand(1, 4), -torch.rand(4, n), torch.randn(1, n), torch.randn(1, n))
    y1 = selective_state_update(pool1, *args1, state_indices=torch.tensor([1]))
    own1 = before1[1:2].clone()
    assert_close(y1, selective_state_update(own1, *args1), torch.float32, name="y (Mamba-1)")
    assert torch.equal(pool1[1:2], own1) and torch.equal(pool1[[0, 2]], before1[[0, 2]])


def test_bf16_inputs_fp32_state():
    torch.manual_seed(3)
    state = torch.randn(2, 2, 3, 4)
    ref_state = state.double()
    args = [torch.randn(2, 2, 3), torch.randn(2, 2), -torch.rand(2), torch.randn(2, 1, 4), torch.randn(2, 1, 4)]
    half = [a.bfloat16() if i != 2 else a for i, a in enumerate(args)]
    y = ssd_state_update(state, *half, dt_softplus=True)
    y_ref = ssd_state_update(ref_state, *[a.double() for a in half], dt_softplus=True)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert_close(y, y_ref, torch.bfloat16, name="y")
    assert_close(state, ref_state, torch.float32, name="state")


def test_gradcheck_through_in_place_updates():
    torch.manual_seed(4)
    b, d, n = 2, 2, 2
    t = lambda *s: torch.randn(*s, dtype=F64, requires_grad=True)  # noqa: E731

    def m1(s0, x, dt, A, B, C, D, z, bias):
        s = s0.clone()
        return selective_state_update(s, x, dt, A, B, C, D, z, bias, True), s
    assert torch.autograd.gradcheck(m1, (t(b, d, n), t(b, d), t(b, d), t(d, n), t(b, 2, n), t(b, 2, n), t(d),
                                         t(b, d), t(d)), fast_mode=True)

    def m2(s0, x, dt, A, B, C, D, z, bias):
        s = s0.clone()
        return ssd_state_update(s, x, dt, A, B, C, D, z, bias, True, (0.1, 5.0)), s
    h, p = 2, 2
    assert torch.autograd.gradcheck(m2, (t(b, h, p, n), t(b, h, p), t(b, h), t(h), t(b, 1, n), t(b, 1, n),
                                         t(h, p), t(b, h, p), t(h)), fast_mode=True)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="state"):
        selective_state_update(torch.randn(2, 4, 3), torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, 2),
                               torch.randn(2, 2), torch.randn(2, 2))
    with pytest.raises(ValueError, match="A"):
        ssd_state_update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3), torch.randn(2, 2), torch.randn(3),
                         torch.randn(2, 1, 4), torch.randn(2, 1, 4))
    with pytest.raises(ValueError, match="state_indices"):
        ssd_state_update(torch.randn(5, 2, 3, 4), torch.randn(2, 2, 3), torch.randn(2, 2), torch.randn(2),
                         torch.randn(2, 1, 4), torch.randn(2, 1, 4), state_indices=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="groups"):
        ssd_state_update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3), torch.randn(2, 2), torch.randn(2),
                         torch.randn(2, 3, 4), torch.randn(2, 3, 4))
