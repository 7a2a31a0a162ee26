"""Triton causal conv1d and its decode update vs the PyTorch reference (naive.py): outputs, final states and
every gradient, in both memory layouts, with initial states, seq_idx and odd lengths."""

import pytest
import torch

from helpers import assert_close
from mamba_parallel.ops.conv1d import naive
from mamba_parallel.ops.conv1d import triton_impl as tri

DTYPES = [torch.float32, torch.float16]


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=_dev(), dtype=dtype)


def _make_x(b, d, L, dtype, channels_last, seed=0):
    if channels_last:  # the Mamba-2 layout: a transpose of (b, L, d), itself a column slice of a wider tensor
        return _rand((b, L, d + 3), dtype, seed)[:, :, 1:d + 1].transpose(1, 2)
    return _rand((b, d, L), dtype, seed)


def _seq_idx(b, L, cuts):
    s = torch.zeros(b, L, dtype=torch.int32)
    for c in cuts:
        s[:, c:] += 1
    s[-1] = 0  # the last row is one sequence
    return s.to(_dev())


def _run(fn, inputs, grads_out):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None and t.is_floating_point() else t
              for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * g).sum() for o, g in zip(outs, grads_out))
    loss.backward()
    return outs, [t.grad if t is not None and t.is_floating_point() else None for t in leaves]


def _check(b, d, L, w, dtype, channels_last=True, bias=True, act="silu", init=False, seq_cuts=None,
           final=False, seed=0):
    x = _make_x(b, d, L, dtype, channels_last, seed)
    weight = _rand((d, w), dtype, seed + 1, 0.5)
    bias_t = _rand((d,), dtype, seed + 2) if bias else None
    init_t = _rand((b, d, w - 1), dtype, seed + 3) if init else None
    seq = _seq_idx(b, L, seq_cuts) if seq_cuts is not None else None
    g = torch.Generator(device="cpu").manual_seed(seed + 9)
    grads_out = [torch.randn((b, d, L), generator=g).to(_dev())]
    if final:
        grads_out.append(torch.randn((b, d, w - 1), generator=g).to(_dev()))

    def call(mod):
        return lambda x, wt, bs, it: mod.causal_conv1d(x, wt, bs, act, it, seq, final)

    outs_t, grads_t = _run(call(tri), [x, weight, bias_t, init_t], grads_out)
    outs_r, grads_r = _run(call(naive), [x, weight, bias_t, init_t], grads_out)
    if channels_last and L > 1:
        assert outs_t[0].stride(1) == 1, "channels-last input must give a channels-last output"
    for name, a, r in zip(["y", "final_state"], outs_t, outs_r):
        assert a.dtype == r.dtype
        assert_close(a, r, dtype, name=name)
    for name, a, r in zip(["dx", "dweight", "dbias", "dinitial_state"], grads_t, grads_r):
        if r is not None:
            assert a.dtype == r.dtype, name
            assert_close(a, r, dtype, grad=True, name=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("act", [None, "silu"])
def test_conv1d_layouts(dtype, channels_last, act):
    _check(2, 20, 37, 4, dtype, channels_last=channels_last, act=act)


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize("L", [1, 2, 45])
def test_conv1d_init_and_final_state(w, L):
    _check(2, 12, L, w, torch.float32, init=True, final=True, seed=w + L)


def test_conv1d_no_bias_final_without_init():
    _check(1, 8, 2, 4, torch.float32, bias=False, final=True)


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d_seq_idx(channels_last, dtype):
    # sequence boundaries at 1, 2 (a length-1 sequence) and 30; the initial state feeds only the first sequence
    _check(2, 10, 40, 4, dtype, channels_last=channels_last, init=True, seq_cuts=[1, 2, 30], final=True)


@pytest.mark.parametrize("channels_last", [True, False])
def test_conv1d_long_backward_tiles(channels_last, monkeypatch):
    """More positions than one backward program covers, so weight-gradient partials are summed."""
    monkeypatch.setattr(tri, "BWD_TILES_PER_PROGRAM", 2)
    L = 3 * 2 * tri.TILES[("bwd", "channels_last" if channels_last else "contiguous")][0] - 5
    _check(2, 4, L, 4, torch.float32, channels_last=channels_last, init=True, seq_cuts=[L // 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("indices", [False, True])
@pytest.mark.parametrize("w", [2, 4])
def test_conv1d_update(dtype, indices, w):
    b, d, nb = 3, 20, 5
    x = _rand((b, d), dtype, 0)
    weight = _rand((d, w), dtype, 1, 0.5)
    bias = _rand((d,), dtype, 2)
    state = _rand((nb if indices else b, d, w - 1), dtype, 3)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=_dev()) if indices else None
    st_t, st_r = state.clone(), state.clone()
    y_t = tri.causal_conv1d_update(x, st_t, weight, bias, "silu", idx)
    y_r = naive.causal_conv1d_update(x, st_r, weight, bias, "silu", idx)
    assert_close(y_t, y_r, dtype, name="y")
    assert torch.equal(st_t, st_r), "conv_state after the update differs"


def test_update_matches_full_conv():
    """Decoding token by token from the final state continues the full convolution."""
    b, d, L, w = 2, 6, 9, 4
    x, weight, bias = _rand((b, d, L + 3), torch.float32, 0), _rand((d, w), torch.float32, 1), \
        _rand((d,), torch.float32, 2)
    y_full = naive.causal_conv1d(x, weight, bias, "silu")
    _, state = tri.causal_conv1d(x[:, :, :L], weight, bias, "silu", return_final_state=True)
    state = state.clone()
    for t in range(L, L + 3):
        y_t = tri.causal_conv1d_update(x[:, :, t], state, weight, bias, "silu")
        assert_close(y_t, y_full[:, :, t], name=f"y[{t}]")


def test_compile_keeps_custom_op():
    x = _make_x(1, 8, 6, torch.float32, True)
    weight = _rand((8, 4), torch.float32, 1)

    def f(x, w):
        return tri.causal_conv1d(x, w, None, "silu").sum()

    explained = torch._dynamo.explain(f)(x, weight)
    assert explained.graph_break_count == 0, explained.break_reasons


# ------------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [True, False])
def test_conv1d_gpu(dtype, channels_last, nan_poison):
    _check(4, 2 * 768 + 2 * 128, 1000, 4, dtype, channels_last=channels_last, init=True, seq_cuts=[300, 301],
           final=True)


@pytest.mark.gpu
def test_conv1d_update_gpu(nan_poison):
    b, d, w = 64, 5376, 4
    x, weight = _rand((b, d), torch.bfloat16, 0), _rand((d, w), torch.bfloat16, 1)
    state = _rand((128, d, w - 1), torch.bfloat16, 2)
    idx = torch.randperm(128, device="cuda")[:b].to(torch.int32)
    st_t, st_r = state.clone(), state.clone()
    y_t = tri.causal_conv1d_update(x, st_t, weight, None, "silu", idx)
    y_r = naive.causal_conv1d_update(x, st_r, weight, None, "silu", idx)
    assert_close(y_t, y_r, torch.bfloat16, name="y")
    assert torch.equal(st_t, st_r)
