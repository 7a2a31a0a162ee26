"""The fused decode step's stages (Mamba-2's, and Mamba-1's below): kernels (interpreter on CPU) against naive.py,
and naive.py against the unfused ops it replaces (rms_norm + in_proj + causal_conv1d_update, ssd_state_update +
gated_rms_norm, out_proj + the residual add), in fp32 where both should agree to summation order."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close

from mamba_parallel import ops
from mamba_parallel.ops import decode_step
from mamba_parallel.layers.mamba1 import bcdt_rms_norm

pytest.importorskip("triton")


def _inputs(b=1, d_model=48, h=4, p=16, g=2, n=8, dc=4, dtype=torch.float32, seed=0, device="cpu",
            D_hdim=False, bias=True):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    di = h * p
    conv_dim = di + 2 * g * n
    N = 2 * di + 2 * g * n + h
    return dict(
        residual=(torch.randn(b, d_model, generator=gen) * 2).to(device), pre_w=rnd(d_model) + 1,
        W_in=rnd(N, d_model, scale=d_model ** -0.5), b_in=rnd(N, scale=0.1) if bias else None,
        conv_w=rnd(conv_dim, dc, scale=0.5), conv_b=rnd(conv_dim, scale=0.1), conv_state=rnd(b, conv_dim, dc - 1),
        state=torch.randn(b, h, p, n, generator=gen).to(device), A=-torch.rand(h, generator=gen).to(device) - 0.5,
        D=(rnd(h, p) if D_hdim else rnd(h)), dt_bias=rnd(h, scale=0.5), norm_w=rnd(di) + 1,
        W_out=rnd(d_model, di, scale=di ** -0.5), b_out=rnd(d_model, scale=0.1) if bias else None,
        dims=dict(di=di, h=h, p=p, g=g, n=n))


def _stages(kw, ngroups_norm, dt_limit=(0.0, float("inf"))):
    """Run the three stages on copies of the states -> (zxbcdt, conv_state, gw, sumsq, state, residual)."""
    d = kw["dims"]
    di, h, p, g, n = d["di"], d["h"], d["p"], d["g"], d["n"]
    cs, st, res = kw["conv_state"].clone(), kw["state"].clone(), kw["residual"].clone()
    zxbcdt = decode_step.norm_in_proj_conv(res, kw["pre_w"], 1e-5, kw["W_in"], kw["b_in"], kw["conv_w"],
                                           kw["conv_b"], cs, di)
    z, xBC, dt = zxbcdt.split([di, di + 2 * g * n, h], dim=-1)
    x, B, C = xBC.split([di, g * n, g * n], dim=-1)
    b = res.shape[0]
    gw, ss = decode_step.state_update_gate(st, x.view(b, h, p), dt, kw["A"], B.view(b, g, n), C.view(b, g, n),
                                           kw["D"], z.view(b, h, p), kw["dt_bias"], dt_limit, kw["norm_w"],
                                           ngroups_norm)
    decode_step.gated_out_proj_residual(gw, ss.contiguous(), 1e-5, kw["W_out"], kw["b_out"], res)
    return dict(zxbcdt=zxbcdt, conv_state=cs, gw=gw, sumsq=ss.sum(-1), state=st, residual=res)


@pytest.mark.parametrize("b,g,ngroups_norm,D_hdim,bias,dt_limit", [
    (1, 2, 1, False, True, (0.0, float("inf"))), (2, 1, 2, True, False, (0.01, 0.5)), (3, 2, 4, False, True,
                                                                                         (0.0, float("inf")))])
def test_kernels_match_the_reference(b, g, ngroups_norm, D_hdim, bias, dt_limit):
    """Every stage's outputs and updated states, kernels (interpreter) against naive.py; odd widths (d_model 48
    is not a multiple of the 512-wide K step, in_proj's 164 outputs not of the 16-column block)."""
    kw = _inputs(b=b, g=g, D_hdim=D_hdim, bias=bias)
    with ops.use_backend("naive"):
        ref = _stages(kw, ngroups_norm, dt_limit)
    with ops.use_backend("triton"):
        got = _stages(kw, ngroups_norm, dt_limit)
    for name in ref:
        assert_close(got[name], ref[name], dtype=torch.float32, name=name)


def test_reference_is_the_unfused_step():
    """naive.py's three stages against the ops of the unfused step (fp32): the block's norm, in_proj, the conv
    update, the state update, the gated norm, out_proj and the residual add."""
    kw = _inputs(b=2, g=2)
    d = kw["dims"]
    di, h, p, g, n = d["di"], d["h"], d["p"], d["g"], d["n"]
    got = None
    with ops.use_backend("naive"):
        got = _stages(kw, 2)
        res = kw["residual"].clone()
        hidden = ops.rms_norm(res, kw["pre_w"], 1e-5)
        zxbcdt = F.linear(hidden, kw["W_in"], kw["b_in"])
        z, xBC, dt = zxbcdt.split([di, di + 2 * g * n, h], dim=-1)
        cs, st = kw["conv_state"].clone(), kw["state"].clone()
        xBC = ops.causal_conv1d_update(xBC, cs, kw["conv_w"], kw["conv_b"], activation="silu")
        x, B, C = xBC.split([di, g * n, g * n], dim=-1)
        y = ops.ssd_state_update(st, x.view(2, h, p), dt, kw["A"], B.view(2, g, n), C.view(2, g, n), D=kw["D"],
                                 dt_bias=kw["dt_bias"], dt_softplus=True).flatten(-2)
        out = F.linear(ops.gated_rms_norm(y, z, kw["norm_w"], 1e-5, group_size=di // 2), kw["W_out"], kw["b_out"])
    assert_close(got["conv_state"], cs, dtype=torch.float32, name="conv state")
    assert_close(got["state"], st, dtype=torch.float32, name="state")
    assert_close(got["residual"], res + out, dtype=torch.float32, name="residual")


def _mamba1_inputs(b=1, d=48, n=4, r=6, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return dict(state=torch.randn(b, d, n, generator=gen).to(device), x=rnd(b, d), z=rnd(b, d),
                x_proj_weight=rnd(r + 2 * n, d, scale=d ** -0.5), dt_proj_weight=rnd(d, r, scale=r ** -0.5),
                dt_bias=rnd(d, scale=0.5) - 2, A=-torch.rand(d, n, generator=gen).to(device) - 0.2, D=rnd(d))


@pytest.mark.parametrize("b,d,bcdt_eps", [(1, 48, None), (2, 1030, None), (1, 48, 1e-6)])
def test_mamba1_state_stage_matches_the_reference(b, d, bcdt_eps):
    """x_proj split over K (d = 1030: three 512-wide slices, the last partial), dt_proj, the state update and the
    gate, kernels against naive.py; then naive.py against the unfused ops (x_proj, dt_proj,
    selective_state_update)."""
    kw = _mamba1_inputs(b=b, d=d)
    st_ref, st = kw["state"].clone(), kw["state"].clone()
    with ops.use_backend("naive"):
        ref = decode_step.mamba1_x_proj_state_update(**{**kw, "state": st_ref}, bcdt_eps=bcdt_eps)
    with ops.use_backend("triton"):
        got = decode_step.mamba1_x_proj_state_update(**{**kw, "state": st}, bcdt_eps=bcdt_eps)
    assert_close(got, ref, dtype=torch.float32, name="y")
    assert_close(st, st_ref, dtype=torch.float32, name="state")
    st_ops = kw["state"].clone()
    with ops.use_backend("naive"):
        x_dbl = F.linear(kw["x"], kw["x_proj_weight"])
        if bcdt_eps is not None:
            x_dbl = bcdt_rms_norm(x_dbl, 6, 4, bcdt_eps, dim=-1)
        dt_low, B, C = x_dbl.split([6, 4, 4], dim=-1)
        y = ops.selective_state_update(st_ops, kw["x"], F.linear(dt_low, kw["dt_proj_weight"]), kw["A"], B, C,
                                       D=kw["D"], z=kw["z"], dt_bias=kw["dt_bias"], dt_softplus=True)
    assert_close(ref, y, dtype=torch.float32, name="y vs the ops")
    assert_close(st_ref, st_ops, dtype=torch.float32, name="state vs the ops")


def test_out_proj_without_norm():
    """Mamba-1's out_proj: no norm scale, a bf16-valued input; the residual gets out_proj's rounded output."""
    gen = torch.Generator().manual_seed(0)
    y, w, res = torch.randn(2, 40, generator=gen), torch.randn(24, 40, generator=gen), torch.randn(2, 24, generator=gen)
    expect = res + F.linear(y, w)
    for backend in ("naive", "triton"):
        with ops.use_backend(backend):
            got = decode_step.gated_out_proj_residual(y, None, 0.0, w, None, res.clone())
        assert_close(got, expect, dtype=torch.float32, name=backend)


def test_inputs_are_checked():
    kw = _inputs()
    with pytest.raises(ValueError, match="residual must be fp32"):
        decode_step.norm_in_proj_conv(kw["residual"].half(), kw["pre_w"], 1e-5, kw["W_in"], None, kw["conv_w"],
                                      None, kw["conv_state"], 64)
    with pytest.raises(ValueError, match=r"conv columns \[150, 246\)"):
        decode_step.norm_in_proj_conv(kw["residual"], kw["pre_w"], 1e-5, kw["W_in"], None, kw["conv_w"], None,
                                      kw["conv_state"], 150)
    with pytest.raises(ValueError, match="norm groups ngroups"):
        x = torch.zeros(1, 4, 16)
        decode_step.state_update_gate(kw["state"], x, torch.zeros(1, 4), kw["A"], torch.zeros(1, 2, 8),
                                      torch.zeros(1, 2, 8), None, x, None, (0.0, 1.0), kw["norm_w"], 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dims,ngroups_norm", [(dict(d_model=2560, h=80, p=64, g=1, n=128), 1),
                                               (dict(d_model=768, h=24, p=64, g=2, n=64), 2)])
def test_gpu_kernels_match_the_reference(dims, ngroups_norm, nan_poison):
    """mamba2-2.7b's and a two-group block's widths, bf16 weights and conv state, fp32 states: every stage against
    naive.py on the same inputs."""
    kw = _inputs(device="cuda", dtype=torch.bfloat16, **dims)
    with ops.use_backend("naive"):
        ref = _stages(kw, ngroups_norm)
    with ops.use_backend("triton"):
        got = _stages(kw, ngroups_norm)
    for name in ref:
        assert_close(got[name], ref[name], dtype=torch.bfloat16, factor=2, name=name)
