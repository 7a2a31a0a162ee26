"""Reference norms (rms_norm, add_rms_norm, gated_rms_norm) against direct formulas, plus gradcheck and checks."""

import pytest
import torch
from helpers import assert_close

from mamba_parallel.ops import add_rms_norm, gated_rms_norm, gated_rms_norm_linear, rms_norm, use_backend

F64 = torch.float64


@pytest.fixture(autouse=True)
def _naive_backend():
    with use_backend("naive"):
        yield


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps) * w


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_matches_formula(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 8, dtype=F64), torch.randn(8, dtype=F64)
    y = rms_norm(x.to(dtype), w.to(dtype), eps=1e-3)
    assert y.dtype == dtype
    assert_close(y, _rms(x.to(dtype).double(), w.to(dtype).double(), 1e-3), dtype, name="rms_norm")


@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_add_rms_norm(residual_in_fp32):
    torch.manual_seed(1)
    x, r, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8), torch.randn(8, dtype=torch.bfloat16)
    y, new_res = add_rms_norm(x, r, w, eps=1e-5, residual_in_fp32=residual_in_fp32)
    expect_res = x.double() + r.double()
    assert y.dtype == torch.bfloat16
    assert new_res.dtype == (torch.float32 if residual_in_fp32 else torch.bfloat16)
    assert_close(new_res, expect_res, new_res.dtype, name="new_residual")
    assert_close(y, _rms(expect_res, w.double(), 1e-5), torch.bfloat16, name="normed")
    y0, res0 = add_rms_norm(x, None, w)
    assert torch.equal(res0, x.float())
    assert_close(y0, _rms(x.double(), w.double(), 1e-5), torch.bfloat16, name="normed without residual")


@pytest.mark.parametrize("group_size", [None, 4, 2])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm_per_group(group_size, norm_before_gate):
    torch.manual_seed(2)
    x, z, w = torch.randn(2, 5, 8, dtype=F64), torch.randn(2, 5, 8, dtype=F64), torch.randn(8, dtype=F64)
    y = gated_rms_norm(x, z, w, eps=1e-4, group_size=group_size, norm_before_gate=norm_before_gate)
    gs = group_size or 8
    v = x if norm_before_gate else x * torch.sigmoid(z) * z
    parts = [_rms(v[..., i:i + gs], w[i:i + gs], 1e-4) for i in range(0, 8, gs)]
    expect = torch.cat(parts, -1)
    if norm_before_gate:
        expect = expect * torch.sigmoid(z) * z
    assert_close(y, expect, F64, name="gated_rms_norm")
    # no gate: plain grouped RMSNorm
    assert_close(gated_rms_norm(x, None, w, 1e-4, group_size), torch.cat(
        [_rms(x[..., i:i + gs], w[i:i + gs], 1e-4) for i in range(0, 8, gs)], -1), F64, name="ungated")


def test_norms_gradcheck():
    torch.manual_seed(3)
    x = torch.randn(2, 6, dtype=F64, requires_grad=True)
    r = torch.randn(2, 6, dtype=F64, requires_grad=True)
    z = torch.randn(2, 6, dtype=F64, requires_grad=True)
    w = torch.randn(6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-3), (x, w))
    assert torch.autograd.gradcheck(lambda a, b, c: add_rms_norm(a, b, c, 1e-3), (x, r, w))
    for nbg in (False, True):
        assert torch.autograd.gradcheck(lambda a, b, c: gated_rms_norm(a, b, c, 1e-3, 3, nbg), (x, z, w))


def test_norm_bad_inputs_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(7))
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.randn(3, 8), torch.randn(8))
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(x, x, torch.randn(8), group_size=3)
    with pytest.raises(ValueError, match="z"):
        gated_rms_norm(x, torch.randn(2, 4), torch.randn(8))


def test_gated_rms_norm_linear_is_the_norm_then_linear():
    """The norm's output (x.dtype) into F.linear: in the promoted dtype without autocast, in autocast's with it."""
    torch.manual_seed(4)
    x, z, w = torch.randn(2, 5, 8, dtype=F64), torch.randn(2, 5, 8, dtype=F64), torch.randn(8, dtype=F64)
    W, b = torch.randn(3, 8, dtype=F64), torch.randn(3, dtype=F64)
    for nbg in (False, True):
        out = gated_rms_norm_linear(x, z, w, W, b, 1e-4, 4, nbg)
        assert_close(out, gated_rms_norm(x, z, w, 1e-4, 4, nbg) @ W.T + b, F64, name="norm + linear")
    xb = x.to(torch.bfloat16)
    assert gated_rms_norm_linear(xb, None, w.float(), W.float()).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gated_rms_norm_linear(x.float(), z.float(), w.float(), W.float(), b.float())
    assert out.dtype == torch.bfloat16
    x.requires_grad_(True), z.requires_grad_(True), w.requires_grad_(True), W.requires_grad_(True)
    b.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: gated_rms_norm_linear(*a, 1e-3, 4), (x, z, w, W, b))


def test_gated_rms_norm_linear_bad_inputs_name_the_argument():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="out_weight has shape"):
        gated_rms_norm_linear(x, x, w, torch.randn(3, 7))
    with pytest.raises(ValueError, match="out_weight must be"):
        gated_rms_norm_linear(x, x, w, torch.randn(8))
    with pytest.raises(ValueError, match="out_bias"):
        gated_rms_norm_linear(x, x, w, torch.randn(3, 8), torch.randn(4))
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm_linear(x, x, w, torch.randn(3, 8), group_size=3)
