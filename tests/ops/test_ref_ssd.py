"""Reference Mamba-2 SSD: the chunked form against the token-by-token recurrence (chunk sizes, ragged lengths,
D shapes, z, dt_bias/softplus/dt_limit, states, groups, seq_idx, cu_seqlens), gradcheck, argument checks."""

import pytest
import torch
from helpers import assert_close

from mamba_parallel.ops import ssd_chunk_scan, ssd_sequential, use_backend
from mamba_parallel.ops.ssd.naive import segsum

F64 = torch.float64
SEQ = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8]], dtype=torch.int32)


@pytest.fixture(autouse=True)
def _naive_backend():
    with use_backend("naive"):
        yield


def _inputs(b=2, L=11, h=4, p=3, g=2, n=3, d_hp=False, dtype=F64, seed=0):
    torch.manual_seed(seed)
    return dict(x=torch.randn(b, L, h, p, dtype=dtype), dt=torch.randn(b, L, h, dtype=dtype),
                A=-torch.rand(h, dtype=dtype) * 3 - 0.2, B=torch.randn(b, L, g, n, dtype=dtype),
                C=torch.randn(b, L, g, n, dtype=dtype),
                D=torch.randn(h, p, dtype=dtype) if d_hp else torch.randn(h, dtype=dtype),
                z=torch.randn(b, L, h, p, dtype=dtype), dt_bias=torch.randn(h, dtype=dtype),
                initial_states=torch.randn(b, h, p, n, dtype=dtype))


def _check(a, name, **kw):
    y, fin = ssd_chunk_scan(**a, return_final_states=True, **kw)
    kw.pop("chunk_size")
    y_ref, fin_ref = ssd_sequential(**a, return_final_states=True, **kw)
    assert_close(y, y_ref, F64, name=f"{name}: y")
    assert_close(fin, fin_ref, F64, name=f"{name}: final_states")


@pytest.mark.parametrize("chunk_size,L", [(1, 5), (3, 7), (4, 8), (4, 11), (5, 11), (16, 11)])
def test_chunked_matches_sequential(chunk_size, L):
    a = _inputs(L=L, d_hp=chunk_size % 2 == 1, seed=chunk_size + L)
    _check(a, "softplus+limit", chunk_size=chunk_size, dt_softplus=True, dt_limit=(0.05, 1.5))
    _check(a, "seq_idx", chunk_size=chunk_size, dt_softplus=True, seq_idx=SEQ[:, :L])
    plain = {k: a[k] for k in ("x", "A", "B", "C")}
    _check(dict(plain, dt=a["dt"].abs()), "no optional terms", chunk_size=chunk_size)


@pytest.mark.parametrize("g", [1, 4])
def test_group_counts(g):
    _check(_inputs(g=g, seed=g), f"g={g}", chunk_size=4, dt_softplus=True)


def test_dt_processing_order():
    a = _inputs(L=6, seed=11)
    y = ssd_chunk_scan(**a, chunk_size=4, dt_softplus=True, dt_limit=(0.2, 0.4))
    dt = torch.clamp(torch.nn.functional.softplus(a["dt"] + a["dt_bias"]), 0.2, 0.4)
    b = dict(a, dt=dt, dt_bias=None)
    assert_close(y, ssd_chunk_scan(**b, chunk_size=4), F64, name="clamp(softplus(dt + dt_bias))")


def test_seq_idx_restarts_state():
    a = _inputs(seed=12)
    y, fin = ssd_chunk_scan(**a, chunk_size=4, dt_softplus=True, seq_idx=SEQ, return_final_states=True)
    # row 0's last sequence (positions 9, 10) from a zero state equals the op on those tokens alone
    part = {k: (v[:1, 9:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in a.items()}
    part["initial_states"] = None
    y_k, fin_k = ssd_chunk_scan(**part, chunk_size=4, dt_softplus=True, return_final_states=True)
    assert_close(y[:1, 9:], y_k, F64, name="last sequence y")
    assert_close(fin[:1], fin_k, F64, name="last sequence final state")


def test_cu_seqlens_per_sequence_states():
    a = _inputs(b=1, L=11, seed=13)
    a.pop("initial_states")
    init = torch.randn(4, 4, 3, 3, dtype=F64)
    cu = torch.tensor([0, 3, 3, 8, 11], dtype=torch.int32)
    y, fin = ssd_chunk_scan(**a, chunk_size=2, dt_softplus=True, initial_states=init, cu_seqlens=cu,
                            return_final_states=True)
    y_ref, fin_ref = ssd_sequential(**a, dt_softplus=True, initial_states=init, cu_seqlens=cu,
                                    return_final_states=True)
    assert_close(y, y_ref, F64, name="y")
    assert_close(fin, fin_ref, F64, name="final_states")
    assert torch.equal(fin[1], init[1]), "an empty sequence keeps its initial state"
    part = {k: (v[:, 3:8] if k in ("x", "dt", "B", "C", "z") else v) for k, v in a.items()}
    y_k, fin_k = ssd_chunk_scan(**part, chunk_size=4, dt_softplus=True, initial_states=init[2:3],
                                return_final_states=True)
    assert_close(y[:, 3:8], y_k, F64, name="sequence 2 alone")
    assert_close(fin[2:3], fin_k, F64, name="sequence 2 final state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_inputs_keep_dtype_states_fp32(dtype):
    a = {k: v.to(dtype) for k, v in _inputs(seed=14).items()}
    y, fin = ssd_chunk_scan(**a, chunk_size=4, dt_softplus=True, return_final_states=True)
    assert y.dtype == dtype and fin.dtype == torch.float32
    y_ref, fin_ref = ssd_sequential(**{k: v.double() for k, v in a.items()}, dt_softplus=True,
                                    return_final_states=True)
    assert_close(y, y_ref, dtype, name="y")
    assert_close(fin, fin_ref, dtype, name="final_states")


def test_segsum():
    a = torch.randn(2, 5, dtype=F64)
    s = segsum(a)
    cs = a.cumsum(-1)
    low = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.allclose(s[..., low], (cs[..., :, None] - cs[..., None, :])[..., low])
    assert torch.isinf(s[..., ~low]).all() and (s[..., ~low] < 0).all()


def test_gradcheck_all_inputs():
    a = _inputs(b=1, L=5, h=2, p=2, g=1, n=2, d_hp=True, seed=15)
    names = list(a)
    for kw in (dict(dt_limit=(0.1, 2.0)), dict(seq_idx=torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.int32))):
        def fn(*ts):
            return ssd_chunk_scan(**dict(zip(names, ts)), chunk_size=2, dt_softplus=True, return_final_states=True,
                                  **kw)
        assert torch.autograd.gradcheck(fn, tuple(v.requires_grad_() for v in a.values()), fast_mode=True)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    init = torch.randn(2, 2, 2, 2, dtype=F64, requires_grad=True)

    def packed(x, dt, B, C, s0):
        return ssd_chunk_scan(x, dt, a["A"], B, C, 2, dt_softplus=True, initial_states=s0, cu_seqlens=cu,
                              return_final_states=True)
    assert torch.autograd.gradcheck(packed, (a["x"], a["dt"], a["B"], a["C"], init), fast_mode=True)


def test_bad_inputs_name_the_argument():
    a = _inputs()
    base = {k: a[k] for k in ("x", "dt", "A", "B", "C")}
    with pytest.raises(ValueError, match="dt"):
        ssd_chunk_scan(**dict(base, dt=torch.randn(2, 11, 3)), chunk_size=4)
    with pytest.raises(ValueError, match="groups"):
        ssd_chunk_scan(**dict(base, B=torch.randn(2, 11, 3, 3), C=torch.randn(2, 11, 3, 3)), chunk_size=4)
    with pytest.raises(ValueError, match="D"):
        ssd_chunk_scan(**base, chunk_size=4, D=torch.randn(4, 2))
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunk_scan(**base, chunk_size=0)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_chunk_scan(**base, chunk_size=4, initial_states=torch.randn(2, 4, 3, 2))
    with pytest.raises(ValueError, match="dt_limit"):
        ssd_chunk_scan(**base, chunk_size=4, dt_limit=(1.0, 0.5))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ssd_chunk_scan(**base, chunk_size=4, cu_seqlens=torch.tensor([0, 11], dtype=torch.int32))
    one = {k: v[:1] if k != "A" else v for k, v in base.items()}
    with pytest.raises(ValueError, match="cu_seqlens"):  # must end at L = 11
        ssd_chunk_scan(**one, chunk_size=4, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))


def test_fp32_math_inside_autocast():
    a = {k: v.float() for k, v in _inputs(seed=16).items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ssd_chunk_scan(**a, chunk_size=4, dt_softplus=True)
    assert y.dtype == torch.float32
    y_ref = ssd_sequential(**{k: v.double() for k, v in a.items()}, dt_softplus=True)
    assert_close(y, y_ref, torch.float32, name="y under autocast")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("resume", [False, True], ids=["first", "resumed"])
@pytest.mark.parametrize("layout", ["plain", "seq_idx", "cu_seqlens"])
def test_final_states_out_written_in_place(layout, resume, out_dtype):
    """final_states_out holds what the returned final states copied into it held (fp32, or rounded to a bf16
    cache), y is unchanged, and it is the final_states returned; resumed, it is also the initial states the scan
    starts from (a cache read and written in place). The sequential form takes the argument too."""
    a = {k: v.float() for k, v in _inputs(L=11, seed=21).items()}
    kw = dict(chunk_size=4, dt_softplus=True)
    if layout == "seq_idx":
        kw["seq_idx"] = SEQ
    elif layout == "cu_seqlens":
        a = {k: v[:1] if k not in ("A", "D", "dt_bias", "initial_states") else v for k, v in a.items()}
        a["initial_states"] = torch.randn(3, 4, 3, 3)
        kw["cu_seqlens"] = torch.tensor([0, 4, 4, 11], dtype=torch.int32)  # an empty sequence
    init = a.pop("initial_states").to(out_dtype)
    for fn, fkw in ((ssd_chunk_scan, kw), (ssd_sequential, {k: v for k, v in kw.items() if k != "chunk_size"})):
        y_ref, final_ref = fn(**a, **fkw, initial_states=init.clone() if resume else None, return_final_states=True)
        out = init.clone() if resume else torch.full_like(init, float("nan"))
        y, returned = fn(**a, **fkw, initial_states=out if resume else None, return_final_states=True,
                         final_states_out=out)
        assert returned is out and torch.equal(y, y_ref), fn.__name__
        assert torch.equal(out, final_ref.to(out_dtype)), fn.__name__


def test_bad_final_states_out_names_the_argument():
    a = _inputs()
    base = {k: a[k] for k in ("x", "dt", "A", "B", "C")}
    cache = torch.zeros(3, 4, 3, 3, dtype=F64)
    bad = {
        "shape": torch.zeros(2, 4, 3, 4, dtype=F64),
        "must be floating point": torch.zeros(2, 4, 3, 3, dtype=torch.int32),
        "contiguous": torch.zeros(2, 4, 3, 3, dtype=F64).transpose(2, 3),
        "device": torch.zeros(2, 4, 3, 3, dtype=F64, device="meta"),
    }
    for what, out in bad.items():
        with pytest.raises(ValueError, match=f"final_states_out.*{what}"):
            ssd_chunk_scan(**base, chunk_size=4, final_states_out=out)
    with pytest.raises(ValueError, match="final_states_out overlaps initial_states"):  # a shifted view of one cache
        ssd_chunk_scan(**base, chunk_size=4, initial_states=cache[:2], final_states_out=cache[1:])
    ssd_chunk_scan(**base, chunk_size=4, initial_states=cache[:2], final_states_out=cache[:2])  # the same view
    ssd_chunk_scan(**base, chunk_size=4, initial_states=cache[:2].clone(), final_states_out=cache[1:])  # apart
