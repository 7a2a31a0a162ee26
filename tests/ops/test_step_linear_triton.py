"""The decode step's fused linears (ops/step_linear) and the Mamba-1 step from x_proj's partials, Triton kernel vs
the unfused reference ops: outputs, the new residual, the conv state and the SSM state, per dtype, odd sizes."""

import pytest
import torch
from helpers import assert_close

from mamba_parallel import ops
from mamba_parallel.ops.norm import naive as norm_naive
from mamba_parallel.ops.state_update import naive as state_naive
from mamba_parallel.ops.step_linear import ConvStep, add_rms_norm_linear, linear_partials
from mamba_parallel.ops.step_linear import naive

DTYPES = [torch.float32, torch.float16]


def _rnd(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def norm_linear_inputs(b, k, n, conv_channels, conv_start, dtype, device="cpu", residual=True, bias=True):
    g = torch.Generator().manual_seed(1)
    r = lambda *s, **kw: _rnd(g, *s, device=device, **kw)  # noqa: E731
    conv = None
    if conv_channels:
        conv = ConvStep(r(b, conv_channels, 3, dtype=dtype), r(conv_channels, 4, dtype=dtype, scale=0.5),
                        r(conv_channels, dtype=dtype) if bias else None, conv_start)
    return dict(x=r(b, k, dtype=dtype), residual=r(b, k) if residual else None, norm_weight=r(k, dtype=dtype),
                weight=r(n, k, dtype=dtype, scale=k ** -0.5), bias=r(n, dtype=dtype) if bias else None, conv=conv)


def _run_both(fn, ref_fn, kw):
    """fn on the kernel, ref_fn on the reference, each on its own copy of the conv state."""
    kw2 = dict(kw)
    if kw.get("conv") is not None:
        kw2["conv"] = kw["conv"]._replace(state=kw["conv"].state.clone())
    with ops.use_backend("triton"):
        got = fn(**kw)
    want = ref_fn(**kw2)
    return got, want, kw, kw2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("conv", [(0, 0), (27, 17), (41, 0)], ids=["no-conv", "conv-mid", "conv-first"])
def test_add_rms_norm_linear(dtype, b, conv):
    kw = norm_linear_inputs(b, 75, 69, conv[0], conv[1], dtype)
    (out, res), (out_r, res_r), kw, kw2 = _run_both(add_rms_norm_linear, naive.add_rms_norm_linear, kw)
    assert out.dtype == dtype and res.dtype == torch.float32
    assert_close(out, out_r, dtype=dtype, name="out")
    assert_close(res, res_r, dtype=torch.float32, name="residual")
    if kw["conv"] is not None:
        assert_close(kw["conv"].state, kw2["conv"].state, dtype=dtype, name="conv state")


@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_add_rms_norm_linear_first_block_and_low_precision_residual(residual_in_fp32):
    kw = norm_linear_inputs(2, 40, 33, 0, 0, torch.float16, residual=False, bias=False)
    kw["residual_in_fp32"] = residual_in_fp32
    (out, res), (out_r, res_r), _, _ = _run_both(add_rms_norm_linear, naive.add_rms_norm_linear, kw)
    assert res.dtype == res_r.dtype == (torch.float32 if residual_in_fp32 else torch.float16)
    assert_close(out, out_r, dtype=torch.float16, name="out")
    assert_close(res, res_r, dtype=torch.float16, name="residual")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 4])
def test_linear_partials(dtype, b):
    g = torch.Generator().manual_seed(2)
    x, w = _rnd(g, b, 150, dtype=dtype), _rnd(g, 21, 150, dtype=dtype)
    with ops.use_backend("triton"):
        got = linear_partials(x, w, 64)
    want = naive.linear_partials(x, w, 64)
    assert got.shape == (3, b, 21) and got.dtype == torch.float32
    assert_close(got, want, dtype=torch.float32, name="partials")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("norm", [(None, False), (24, False), (24, True)], ids=["one-group", "groups", "before-gate"])
def test_gated_rms_norm_linear_few_rows(dtype, b, norm):
    """A few rows without autograd take the step kernel inside ops.gated_rms_norm_linear."""
    g = torch.Generator().manual_seed(3)
    x, z = _rnd(g, b, 72, dtype=dtype), _rnd(g, b, 72, dtype=dtype)
    w, ow, ob = _rnd(g, 72, dtype=dtype), _rnd(g, 37, 72, dtype=dtype, scale=0.2), _rnd(g, 37, dtype=dtype)
    with ops.use_backend("triton"), torch.no_grad():
        got = ops.gated_rms_norm_linear(x, z, w, ow, ob, 1e-5, norm[0], norm[1])
    want = norm_naive.gated_rms_norm_linear(x, z, w, ow, ob, 1e-5, norm[0], norm[1])
    assert_close(got, want, dtype=dtype, name="out")


def xproj_step_inputs(b, d, n, r, dtype, device="cpu", slices=3):
    g = torch.Generator().manual_seed(4)
    rn = lambda *s, **kw: _rnd(g, *s, device=device, **kw)  # noqa: E731
    return dict(state=rn(b, d, n), x=rn(b, d, dtype=dtype), x_dbl_parts=rn(slices, b, r + 2 * n, scale=0.5),
                dt_proj_weight=rn(d, r, dtype=dtype, scale=r ** -0.5),
                A=-(torch.rand(d, n, generator=g) + 0.1).to(device), D=rn(d, dtype=dtype), z=rn(b, d, dtype=dtype),
                dt_bias=rn(d, dtype=dtype, scale=0.3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bcdt_eps", [None, 1e-6], ids=["mamba", "falcon-norms"])
def test_selective_step_from_xproj(dtype, bcdt_eps):
    kw = xproj_step_inputs(3, 37, 5, 6, dtype)
    kw["bcdt_eps"] = bcdt_eps
    state_ref = kw["state"].clone()
    with ops.use_backend("triton"):
        y = ops.selective_step_from_xproj(**kw)
    y_ref = state_naive.selective_step_from_xproj(**{**kw, "state": state_ref})
    assert_close(y, y_ref, dtype=dtype, name="y")
    assert_close(kw["state"], state_ref, dtype=dtype, name="state")


def test_bad_inputs_name_the_argument():
    kw = norm_linear_inputs(2, 16, 12, 8, 6, torch.float32)
    with pytest.raises(ValueError, match="conv columns"):
        add_rms_norm_linear(**kw)
    kw = norm_linear_inputs(2, 16, 12, 0, 0, torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        add_rms_norm_linear(**{**kw, "norm_weight": torch.ones(15)})
    with pytest.raises(ValueError, match="weight is torch.float16"):
        add_rms_norm_linear(**{**kw, "weight": kw["weight"].half()})
    with pytest.raises(ValueError, match="x_dbl_parts"):
        kw = xproj_step_inputs(2, 8, 4, 3, torch.float32)
        ops.selective_step_from_xproj(**{**kw, "x_dbl_parts": torch.zeros(2, 2, 10)})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b", [1, 5, 64])
def test_gpu_decode_linears(dtype, b, nan_poison):
    """The layer shapes of a 2.7B Mamba-2 / 2.8B Mamba-1 step and of an LM head, on the GPU kernel."""
    kw = norm_linear_inputs(b, 2560, 10576, 5376, 5120, dtype, device="cuda")
    (out, res), (out_r, res_r), kw, kw2 = _run_both(add_rms_norm_linear, naive.add_rms_norm_linear, kw)
    assert_close(out, out_r, dtype=dtype, name="in_proj out")
    assert_close(res, res_r, dtype=torch.float32, name="residual")
    assert_close(kw["conv"].state, kw2["conv"].state, dtype=dtype, name="conv state")
    kw = norm_linear_inputs(b, 2560, 50280, 0, 0, dtype, device="cuda", bias=False)
    (out, _), (out_r, _), _, _ = _run_both(add_rms_norm_linear, naive.add_rms_norm_linear, kw)
    assert_close(out, out_r, dtype=dtype, name="lm head")
    g = torch.Generator().manual_seed(5)
    x, z = _rnd(g, b, 5120, dtype=dtype, device="cuda"), _rnd(g, b, 5120, dtype=dtype, device="cuda")
    w = _rnd(g, 5120, dtype=dtype, device="cuda")
    ow = _rnd(g, 2560, 5120, dtype=dtype, device="cuda", scale=5120 ** -0.5)
    for gs in (5120, 640):
        with ops.use_backend("triton"), torch.no_grad():
            got = ops.gated_rms_norm_linear(x, z, w, ow, None, 1e-5, gs, False)
        assert_close(got, norm_naive.gated_rms_norm_linear(x, z, w, ow, None, 1e-5, gs, False), dtype=dtype,
                     name=f"gated norm + out_proj, group {gs}")
    xp = _rnd(g, 192, 5120, dtype=dtype, device="cuda", scale=5120 ** -0.5)
    with ops.use_backend("triton"):
        parts = linear_partials(x, xp)
    assert_close(parts.sum(0), naive.linear_partials(x, xp, 5120).sum(0), dtype=torch.float32, factor=10,
                 name="x_proj partials")
    kw = xproj_step_inputs(b, 5120, 16, 160, dtype, device="cuda", slices=parts.shape[0])
    state_ref = kw["state"].clone()
    with ops.use_backend("triton"):
        y = ops.selective_step_from_xproj(**kw, bcdt_eps=1e-6)
    y_ref = state_naive.selective_step_from_xproj(**{**kw, "state": state_ref}, bcdt_eps=1e-6)
    assert_close(y, y_ref, dtype=dtype, name="mamba-1 step")
    assert_close(kw["state"], state_ref, dtype=dtype, name="mamba-1 state")
