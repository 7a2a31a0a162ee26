"""Triton causal conv1d and its decode update vs the PyTorch reference (naive.py): outputs, final states and
every gradient, in both memory layouts, with initial states, seq_idx and odd lengths, for both backward paths
(one_pass, two_pass; the interpreter's tiny backward tiles cross tiles, programs and channel blocks on these
shapes); the gradient arena (dx written into the split's buffer); the launch choice for the layers' shapes."""

import pytest
import torch

from helpers import assert_close
from mamba_parallel.ops.conv1d import launch, naive
from mamba_parallel.ops.conv1d import triton_impl as tri
from mamba_parallel.ops.grad_arena import split_with_grad_arena, tag_view

DTYPES = [torch.float32, torch.float16]


@pytest.fixture(params=launch.BACKWARD_PATHS)
def variant(request):
    """Runs the test once per backward path."""
    return request.param


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
           final=False, seed=0, path=None):
    x = _make_x(b, d, L, dtype, channels_last, seed)
    weight = _rand((d, w), dtype, seed + 1, 0.5)
    bias_t = _rand((d,), dtype, seed + 2) if bias else None
    init_t = _rand((b, d, w - 1), dtype, seed + 3) if init else None
    seq = _seq_idx(b, L, seq_cuts) if seq_cuts is not None else None
    g = torch.Generator(device="cpu").manual_seed(seed + 9)
    grads_out = [torch.randn((b, d, L), generator=g).to(_dev())]
    if final:
        grads_out.append(torch.randn((b, d, w - 1), generator=g).to(_dev()))

    def ours(x, wt, bs, it):
        return tri.causal_conv1d(x, wt, bs, act, it, seq, final, bwd_path=path)

    def reference(x, wt, bs, it):
        return naive.causal_conv1d(x, wt, bs, act, it, seq, final)

    outs_t, grads_t = _run(ours, [x, weight, bias_t, init_t], grads_out)
    outs_r, grads_r = _run(reference, [x, weight, bias_t, init_t], grads_out)
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
def test_conv1d_layouts(dtype, channels_last, act, variant):
    _check(2, 12, 23, 4, dtype, channels_last=channels_last, act=act, path=variant)


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize("L", [1, 29])  # L = 1 < w - 1: the final state keeps initial-state inputs
def test_conv1d_init_and_final_state(w, L, variant):
    _check(2, 12, L, w, torch.float32, init=True, final=True, seed=w + L, path=variant)


def test_conv1d_no_bias_final_without_init(variant):
    _check(1, 8, 2, 4, torch.float32, bias=False, final=True, path=variant)


@pytest.mark.parametrize("channels_last, dtype", [(True, torch.float32), (True, torch.float16),
                                                  (False, torch.float32)])
def test_conv1d_seq_idx(channels_last, dtype, variant):
    # sequence boundaries at 1, 2 (a length-1 sequence) and 20; the initial state feeds only the first sequence
    _check(2, 10, 26, 4, dtype, channels_last=channels_last, init=True, seq_cuts=[1, 2, 20], final=True,
           path=variant)


@pytest.mark.parametrize("channels_last", [True, False])
def test_conv1d_long_backward_tiles(channels_last, variant):
    """Several tiles per program, several programs and channel blocks (the interpreter's 4-channel tiles of 2 / 4
    positions, 3 per program): weight-gradient partials are summed, tile edges fall inside sequences and at a
    sequence boundary; width 3 (a zero-padded tap of the one-pass backward)."""
    L = 2 * 3 * 4 - 3
    _check(1, 6, L, 4, torch.float32, channels_last=channels_last, init=True, seq_cuts=[L // 2, 13], path=variant)
    _check(1, 5, L, 3, torch.float16, channels_last=channels_last, init=True, seq_cuts=[9], final=True,
           path=variant)


@pytest.mark.parametrize("w", [1, 5])
def test_conv1d_width_outside_one_pass_taps(w, variant):
    """w = 1 (no neighbours) and w = 5 (wider than the one-pass backward's taps: the two-pass path runs)."""
    x = _make_x(1, 4, 5, torch.float32, True)
    assert tri.backward_path(x, w, variant) == (launch.TWO_PASS if w > launch.ONE_PASS_MAX_WIDTH else variant)
    _check(2, 6, 13, w, torch.float32, init=w > 1, final=w > 1, seq_cuts=[6], path=variant)


def test_conv1d_backward_default_path():
    """One pass for channels-last inputs (the layers'; timed fastest), two passes otherwise and for w > 4; an
    unknown path is refused."""
    assert tri.backward_path(_make_x(1, 4, 5, torch.float32, True), 4) == launch.ONE_PASS
    assert tri.backward_path(_make_x(1, 4, 5, torch.float32, False), 4) == launch.TWO_PASS
    assert tri.backward_path(_make_x(1, 4, 5, torch.float32, True), 5) == launch.TWO_PASS
    with pytest.raises(ValueError, match="backward path 'fused_scan' is not one of"):
        tri.backward_path(_make_x(1, 4, 5, torch.float32, True), 4, "fused_scan")


def test_conv1d_forward_choice_reaches_backward(monkeypatch):
    """The forward picks the backward path once and its backward runs that one."""
    seen = []
    real = tri._launch_bwd_two_pass
    monkeypatch.setattr(tri, "_launch_bwd_two_pass", lambda run, *a: seen.append(run.path) or real(run, *a))
    x = _make_x(1, 6, 9, torch.float32, True).requires_grad_()
    tri.causal_conv1d(x, _rand((6, 4), torch.float32, 1), None, "silu", bwd_path=launch.TWO_PASS).sum().backward()
    assert seen == [launch.TWO_PASS]


# (what, channels_last, d, L, w) -> (forward BLOCK_L, BLOCK_D, warps), backward (path, BLOCK_L, BLOCK_D, warps,
# tiles per program): the launches the layers' shapes are timed with on a GPU (docs/kernels/conv1d.md), pinned
GPU_LAUNCHES = [
    ("mamba-130m (b8 L2048)", True, 1536, 2048, 4, (16, 128, 4), (launch.ONE_PASS, 4, 256, 2, 32)),
    ("mamba-2.8b", True, 5120, 2048, 4, (16, 128, 4), (launch.ONE_PASS, 4, 256, 2, 32)),
    ("mamba2-2.7b x | B | C", True, 5376, 2048, 4, (16, 128, 4), (launch.ONE_PASS, 4, 256, 2, 32)),
    ("contiguous", False, 1536, 2048, 4, (128, 16, 4), (launch.TWO_PASS, 64, 8, 4, 16)),
    ("width 6", True, 512, 300, 6, (16, 128, 4), (launch.TWO_PASS, 8, 64, 4, 16)),
    ("small d / L", True, 100, 37, 4, (16, 128, 4), (launch.ONE_PASS, 4, 128, 2, 10)),
]


@pytest.mark.parametrize("what,cl,d,L,w,fwd,bwd", GPU_LAUNCHES, ids=[c[0] for c in GPU_LAUNCHES])
def test_gpu_launch_choice(what, cl, d, L, w, fwd, bwd):
    t = launch.forward_tiles(cl, d, L)
    assert (t.block_l, t.block_d, t.num_warps) == fwd
    run = launch.backward_launch(cl, d, L, launch.backward_path(cl, w), on_gpu=True)
    assert (run.path, run.block_l, run.block_d, run.num_warps, run.tiles_per_program) == bwd
    assert run.fast_sigmoid == (run.path == launch.ONE_PASS)


def test_interpreter_backward_tiles_cross_channel_blocks():
    """The interpreter's backward tiles (tests): up to 16 channels, at least two channel blocks, several programs
    along L."""
    for d, block in ((5, 4), (8, 4), (40, 16), (128, 16)):
        for path in launch.BACKWARD_PATHS:
            run = launch.backward_launch(True, d, 19, path, on_gpu=False)
            assert run.block_d == block and -(-d // run.block_d) >= 2
            assert run.block_l * run.tiles_per_program < 19


def _arena_chain(arena: bool, final: bool, dtype, seed=0, path=None):
    """A Mamba-2-like chain: h = u (b, L, 5 + d + 3) * 1 -> split -> transpose -> conv (+ final state) and two
    side pieces. -> (loss, h, [the conv's dx, captured by a hook])."""
    b, L, d, w = 2, 11, 6, 4
    u = _rand((b, L, 5 + d + 3), dtype, seed).requires_grad_()
    weight, bias = _rand((d, w), dtype, seed + 1, 0.5), _rand((d,), dtype, seed + 2)
    g = torch.Generator(device="cpu").manual_seed(seed + 3)
    gz, gy = torch.randn((b, L, 5), generator=g).to(_dev()), torch.randn((b, d, L), generator=g).to(_dev())
    gf = torch.randn((b, d, w - 1), generator=g).to(_dev())
    h = u * 1.0  # a non-leaf: its gradient is the split's returned buffer
    if arena:
        z, xbc, dt = split_with_grad_arena(h, [5, d, 3], dim=-1)
        xt = tag_view(xbc.transpose(1, 2), xbc, lambda t: t.transpose(1, 2))
    else:
        z, xbc, dt = h.split([5, d, 3], dim=-1)
        xt = xbc.transpose(1, 2)
    seen = []
    xt.register_hook(lambda gr: seen.append(gr))
    y, fs = tri.causal_conv1d(xt, weight, bias, "silu", return_final_state=True, bwd_path=path)
    loss = (y.float() * gy).sum() + (z.float() * gz).sum() + dt.float().square().sum()
    if final:
        loss = loss + (fs.float() * gf).sum()
    return loss, h, seen


@pytest.mark.parametrize("final", [False, True])
def test_conv1d_writes_dx_into_grad_arena(final, variant):
    ref_loss, ref_h, _ = _arena_chain(False, final, torch.float32, path=variant)
    (ref_grad,) = torch.autograd.grad(ref_loss, [ref_h])
    loss, h, seen = _arena_chain(True, final, torch.float32, path=variant)
    (grad,) = torch.autograd.grad(loss, [h])
    assert torch.equal(grad, ref_grad), "arena gradient differs from the plain split's"
    (dx,) = seen
    assert dx.data_ptr() == grad[:, :, 5:].data_ptr() and dx.stride() == grad[:, :, 5:].transpose(1, 2).stride(), \
        "the conv's dx must be the arena slice itself"


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
def test_conv1d_gpu(dtype, channels_last, variant, nan_poison):
    _check(4, 2 * 768 + 2 * 128, 1000, 4, dtype, channels_last=channels_last, init=True, seq_cuts=[300, 301],
           final=True, path=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("extras", [False, True])
def test_conv1d_gpu_mamba2_shape(extras, variant, nan_poison):
    """mamba2-1.3b's conv (d 4352 = x | B | C) at L 2048, bf16, channels-last; with initial state and seq_idx."""
    _check(2, 4352, 2048, 4, torch.bfloat16, channels_last=True, init=extras, final=extras,
           seq_cuts=[700, 701, 1500] if extras else None, path=variant)


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
