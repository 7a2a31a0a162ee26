"""Reference Mamba-1 selective scan against a closed form (materialised decays, fp64) and the per-segment
sequential recurrence; grouped B/C, initial state, seq_idx, cu_seqlens, gradcheck, argument checks."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

from mamba_parallel.ops import selective_scan, selective_scan_sequential, use_backend

F64 = torch.float64


@pytest.fixture(autouse=True)
def _naive_backend():
    with use_backend("naive"):
        yield


def _inputs(b=2, d=4, n=3, L=7, g=None, dtype=F64, seed=0):
    torch.manual_seed(seed)
    bc = (b, n, L) if g is None else (b, g, n, L)
    return dict(u=torch.randn(b, d, L, dtype=dtype), delta=0.5 * torch.randn(b, d, L, dtype=dtype),
                A=-torch.rand(d, n, dtype=dtype) * 2 - 0.1, B=torch.randn(*bc, dtype=dtype),
                C=torch.randn(*bc, dtype=dtype), D=torch.randn(d, dtype=dtype), z=torch.randn(b, d, L, dtype=dtype),
                delta_bias=torch.randn(d, dtype=dtype), initial_state=torch.randn(b, d, n, dtype=dtype))


def _closed_form(u, delta, A, B, C, D, z, delta_bias, initial_state, seq_idx=None, softplus=True):
    """y_t = C_t . (sum_{s<=t, same seq} exp(sum_{s<r<=t} dl_r A) dl_s u_s B_s + [t in first seq] exp(sum_{r<=t}
    dl_r A) h0), with every decay materialised as a (t, s) matrix; also the state after the last token."""
    b, d, L = u.shape
    dl = F.softplus(delta + delta_bias[:, None]) if softplus else delta + delta_bias[:, None]
    if B.dim() == 3:
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    Bd, Cd = (t.repeat_interleave(d // t.shape[1], 1) for t in (B, C))  # (b, d, n, L)
    cum = torch.cumsum(dl[..., None] * A[:, None, :], dim=2)  # (b, d, L, n)
    seq = torch.zeros(b, L, dtype=torch.long) if seq_idx is None else seq_idx.long()
    same = (seq[:, :, None] == seq[:, None, :]) & torch.ones(L, L, dtype=torch.bool).tril()  # (b, t, s)
    decay = torch.exp(cum[:, :, :, None, :] - cum[:, :, None, :, :]) * same[:, None, :, :, None]  # (b,d,t,s,n)
    inp = (dl * u)[:, :, None, :, None] * Bd.permute(0, 1, 3, 2)[:, :, None]  # (b, d, 1, s, n)
    h = (decay * inp).sum(3)  # (b, d, t, n)
    first = (seq == seq[:, :1])[:, None, :, None]
    h = h + torch.exp(cum) * initial_state[:, :, None, :] * first
    y = (h * Cd.permute(0, 1, 3, 2)).sum(-1) + D[:, None] * u
    return (y if z is None else y * F.silu(z)), h[:, :, -1]


@pytest.mark.parametrize("g", [None, 1, 2, 4])
@pytest.mark.parametrize("use_seq", [False, True])
def test_matches_closed_form(g, use_seq):
    a = _inputs(g=g, seed=3)
    seq = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 6]], dtype=torch.int32) if use_seq else None
    y, last = selective_scan(**a, delta_softplus=True, return_last_state=True, seq_idx=seq)
    y_ref, last_ref = _closed_form(**a, seq_idx=seq)
    assert_close(y, y_ref, F64, name="y")
    assert_close(last, last_ref, F64, name="last_state")
    y_seq, last_seq = selective_scan_sequential(**a, delta_softplus=True, return_last_state=True, seq_idx=seq)
    assert_close(y_seq, y_ref, F64, name="sequential y")
    assert_close(last_seq, last_ref, F64, name="sequential last_state")


def test_optional_terms_off():
    a = _inputs(seed=4)
    y = selective_scan(a["u"], a["delta"], a["A"], a["B"], a["C"])
    y_ref, _ = _closed_form(a["u"], a["delta"], a["A"], a["B"], a["C"], torch.zeros(4, dtype=F64), None,
                            torch.zeros(4, dtype=F64), torch.zeros(2, 4, 3, dtype=F64), softplus=False)
    assert_close(y, y_ref, F64, name="y (no D, z, bias, softplus, state)")


def test_cu_seqlens_equals_separate_sequences():
    a = _inputs(b=1, L=9, g=2, seed=5)
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    init = torch.randn(3, 4, 3, dtype=F64)
    a.pop("initial_state")
    y, last = selective_scan(**a, delta_softplus=True, initial_state=init, return_last_state=True, cu_seqlens=cu)
    assert last.shape == (3, 4, 3)
    for k, (s, e) in enumerate([(0, 4), (4, 4), (4, 9)]):
        part = {key: (v[..., s:e] if key in ("u", "delta", "B", "C", "z") else v) for key, v in a.items()}
        if e > s:
            y_k, last_k = selective_scan(**part, delta_softplus=True, initial_state=init[k:k + 1],
                                         return_last_state=True)
            assert_close(y[..., s:e], y_k, F64, name=f"y of sequence {k}")
            assert_close(last[k:k + 1], last_k, F64, name=f"last state of sequence {k}")
        else:
            assert torch.equal(last[k], init[k]), "an empty sequence keeps its initial state"
    y_seq, last_seq = selective_scan_sequential(**a, delta_softplus=True, initial_state=init,
                                                return_last_state=True, cu_seqlens=cu)
    assert_close(y_seq, y, F64, name="sequential y")
    assert_close(last_seq, last, F64, name="sequential last")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_inputs_keep_dtype_state_fp32(dtype):
    a = {k: v.to(dtype) for k, v in _inputs(g=2, seed=6).items()}
    y, last = selective_scan(**a, delta_softplus=True, return_last_state=True)
    assert y.dtype == dtype and last.dtype == torch.float32
    y_ref, last_ref = _closed_form(**{k: v.double() for k, v in a.items()})
    assert_close(y, y_ref, dtype, name="y")
    assert_close(last, last_ref, dtype, name="last_state")


def test_gradcheck_all_inputs():
    a = _inputs(b=1, d=2, n=2, L=4, g=2, seed=7)
    names = list(a)
    seq = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    for use_seq in (None, seq):
        def fn(*ts):
            return selective_scan(**dict(zip(names, ts)), delta_softplus=True, return_last_state=True,
                                  seq_idx=use_seq)
        assert torch.autograd.gradcheck(fn, tuple(v.requires_grad_() for v in a.values()), fast_mode=True)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    init = torch.randn(2, 2, 2, dtype=F64, requires_grad=True)

    def packed(u, delta, B, C, s0):
        return selective_scan(u, delta, a["A"], B, C, initial_state=s0, delta_softplus=True,
                              return_last_state=True, cu_seqlens=cu)
    assert torch.autograd.gradcheck(packed, (a["u"], a["delta"], a["B"], a["C"], init), fast_mode=True)


def test_bad_inputs_name_the_argument():
    a = _inputs()
    with pytest.raises(ValueError, match="A"):
        selective_scan(a["u"], a["delta"], torch.randn(3, 3), a["B"], a["C"])
    with pytest.raises(ValueError, match="groups"):
        selective_scan(a["u"], a["delta"], a["A"], torch.randn(2, 3, 3, 7), torch.randn(2, 3, 3, 7))
    with pytest.raises(ValueError, match="cu_seqlens"):
        selective_scan(a["u"], a["delta"], a["A"], a["B"], a["C"], cu_seqlens=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="initial_state"):
        selective_scan(a["u"], a["delta"], a["A"], a["B"], a["C"], initial_state=torch.randn(2, 4, 2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        selective_scan(a["u"][:1], a["delta"][:1], a["A"], a["B"][:1], a["C"][:1],
                       cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
