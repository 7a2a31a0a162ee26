"""Triton RMSNorm family vs the PyTorch reference (naive.py): outputs, new residual and every gradient."""

import pytest
import torch

from helpers import assert_close
from mamba_parallel.ops.norm import naive
from mamba_parallel.ops.norm import triton_impl as tri

DTYPES = [torch.float32, torch.float16]


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run(fn, inputs, grad_out):
    """Run fn on fresh leaves; return outputs and the gradients of sum(out * grad_out) w.r.t. each input."""
    leaves = [None if t is None else _leaf(t) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.float() * g).sum() for o, g in zip(outs, grad_out))
    loss.backward()
    return outs, [None if t is None else t.grad for t in leaves]


def _compare(fn_tri, fn_ref, inputs, dtype, shapes_out, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    grad_out = [torch.randn(s, generator=g).to(_dev()) for s in shapes_out]
    outs_t, grads_t = _run(fn_tri, inputs, grad_out)
    outs_r, grads_r = _run(fn_ref, inputs, grad_out)
    for i, (a, b) in enumerate(zip(outs_t, outs_r)):
        assert a.dtype == b.dtype, f"output {i}: dtype {a.dtype} != {b.dtype}"
        assert_close(a, b, dtype, name=f"output {i}")
    for i, (a, b) in enumerate(zip(grads_t, grads_r)):
        if b is None:
            continue
        assert a.dtype == b.dtype, f"grad {i}: dtype {a.dtype} != {b.dtype}"
        assert_close(a, b, dtype, grad=True, name=f"grad of input {i}")


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=_dev(), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 24), (2, 3, 40)])
def test_rms_norm(dtype, shape):
    x = _rand(shape, dtype, 0)
    w = _rand(shape[-1:], dtype, 1, 0.5) + 1
    _compare(lambda x, w: tri.rms_norm(x, w, 1e-5), lambda x, w: naive.rms_norm(x, w, 1e-5), [x, w], dtype,
             [shape])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("res", ["none", "same", "fp32"])
@pytest.mark.parametrize("residual_in_fp32", [True, False])
def test_add_rms_norm(dtype, res, residual_in_fp32):
    shape = (3, 5, 40)
    x = _rand(shape, dtype, 0)
    w = _rand(shape[-1:], dtype, 1, 0.5) + 1
    r = None if res == "none" else _rand(shape, dtype if res == "same" else torch.float32, 2)
    _compare(lambda x, r, w: tri.add_rms_norm(x, r, w, 1e-6, residual_in_fp32),
             lambda x, r, w: naive.add_rms_norm(x, r, w, 1e-6, residual_in_fp32), [x, r, w], dtype,
             [shape, shape])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [None, 8, 12])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm(dtype, group_size, norm_before_gate):
    shape = (2, 9, 24)
    x, z = _rand(shape, dtype, 0), _rand(shape, dtype, 3)
    w = _rand(shape[-1:], dtype, 1, 0.5) + 1
    _compare(lambda x, z, w: tri.gated_rms_norm(x, z, w, 1e-5, group_size, norm_before_gate),
             lambda x, z, w: naive.gated_rms_norm(x, z, w, 1e-5, group_size, norm_before_gate), [x, z, w], dtype,
             [shape])


def test_gated_without_gate_and_strided_input():
    """z None is a grouped RMSNorm; a non-contiguous x (a column slice) is read through its strides."""
    base = _rand((6, 40), torch.float32, 0)
    x = base[:, 4:36]
    w = _rand((32,), torch.float32, 1) + 1
    _compare(lambda x, w: tri.gated_rms_norm(x, None, w, 1e-5, 16),
             lambda x, w: naive.gated_rms_norm(x, None, w, 1e-5, 16), [x, w], torch.float32, [(6, 32)])


def _norm_then_linear(fn_norm):
    return lambda x, z, w, W, b: torch.nn.functional.linear(fn_norm(x, z, w), W, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size,norm_before_gate,gate,bias", [(None, False, True, False), (8, False, True, True),
                                                                   (12, True, True, False), (8, False, False, True)])
def test_gated_rms_norm_linear(dtype, group_size, norm_before_gate, gate, bias):
    """Against the reference (the norm, then F.linear) on odd row counts; against the Triton norm followed by
    F.linear bit for bit: the rebuilt norm output is the forward's."""
    shape = (3, 7, 24)
    x, z = _rand(shape, dtype, 0), _rand(shape, dtype, 3) if gate else None
    w = _rand(shape[-1:], dtype, 1, 0.5) + 1
    W, b = _rand((10, 24), dtype, 4, 0.3), _rand((10,), dtype, 5) if bias else None
    args = dict(eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    fused = lambda x, z, w, W, b: tri.gated_rms_norm_linear(x, z, w, W, b, **args)  # noqa: E731
    _compare(fused, lambda x, z, w, W, b: naive.gated_rms_norm_linear(x, z, w, W, b, **args), [x, z, w, W, b], dtype,
             [(3, 7, 10)])
    g = torch.Generator(device="cpu").manual_seed(9)
    grad_out = [torch.randn((3, 7, 10), generator=g).to(_dev())]
    got = _run(fused, [x, z, w, W, b], grad_out)
    unfused = _run(_norm_then_linear(lambda x, z, w: tri.gated_rms_norm(x, z, w, **args)), [x, z, w, W, b], grad_out)
    for a, r in zip([*got[0], *got[1]], [*unfused[0], *unfused[1]]):
        assert (a is None and r is None) or torch.equal(a, r)


def test_gated_rms_norm_linear_keeps_no_norm_output():
    """Saved for the backward: x, z, rstd and the linear's weight as given (no norm output, no cast copy)."""
    x, z = _rand((5, 16), torch.float32, 0).requires_grad_(), _rand((5, 16), torch.float32, 1).requires_grad_()
    w, W = _rand((16,), torch.float32, 2).requires_grad_(), _rand((6, 16), torch.float32, 3).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tri.gated_rms_norm_linear(x, z, w, W, None, 1e-5, 8)
    assert sorted(tuple(t.shape) for t in saved) == sorted([(5, 16), (5, 16), (16,), (2, 5), (6, 16)])
    assert any(t is W for t in saved)


def _add_norm_then_linear(fn_add_norm):
    def f(x, r, w, W, b):
        y, res = fn_add_norm(x, r, w)
        return torch.nn.functional.linear(y, W, b), res
    return f


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("res, residual_in_fp32, bias", [("none", True, False), ("fp32", True, True),
                                                         ("same", False, False), ("fp32", False, True)])
def test_add_rms_norm_linear(dtype, res, residual_in_fp32, bias):
    """Against the reference (add + norm, then F.linear) on odd row counts: the output, the new residual and every
    gradient (x, residual, the norm weight, the linear's weight and bias); against the Triton add + norm followed by
    F.linear bit for bit: the rebuilt norm output is the forward's."""
    shape = (3, 7, 24)
    x = _rand(shape, dtype, 0)
    r = None if res == "none" else _rand(shape, dtype if res == "same" else torch.float32, 2)
    w = _rand(shape[-1:], dtype, 1, 0.5) + 1
    W, b = _rand((10, 24), dtype, 4, 0.3), _rand((10,), dtype, 5) if bias else None
    fused = lambda x, r, w, W, b: tri.add_rms_norm_linear(x, r, w, W, b, 1e-5, residual_in_fp32)  # noqa: E731
    _compare(fused, lambda x, r, w, W, b: naive.add_rms_norm_linear(x, r, w, W, b, 1e-5, residual_in_fp32),
             [x, r, w, W, b], dtype, [(3, 7, 10), shape])
    g = torch.Generator(device="cpu").manual_seed(9)
    grad_out = [torch.randn((3, 7, 10), generator=g).to(_dev()), torch.randn(shape, generator=g).to(_dev())]
    got = _run(fused, [x, r, w, W, b], grad_out)
    unfused = _run(_add_norm_then_linear(lambda x, r, w: tri.add_rms_norm(x, r, w, 1e-5, residual_in_fp32)),
                   [x, r, w, W, b], grad_out)
    for a, ref in zip([*got[0], *got[1]], [*unfused[0], *unfused[1]]):
        assert (a is None and ref is None) or torch.equal(a, ref)


def test_add_rms_norm_linear_keeps_no_norm_output():
    """Saved for the backward: the new residual, the norm weight, rstd and the linear's weight as given (no norm
    output, no cast copy of the weight)."""
    x, r = _rand((5, 16), torch.float32, 0).requires_grad_(), _rand((5, 16), torch.float32, 1).requires_grad_()
    w, W = _rand((16,), torch.float32, 2).requires_grad_(), _rand((6, 16), torch.float32, 3).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, res = tri.add_rms_norm_linear(x, r, w, W, None, 1e-5)
    assert sorted(tuple(t.shape) for t in saved) == sorted([(5, 16), (16,), (1, 5), (6, 16)])
    assert any(t is W for t in saved) and any(t.data_ptr() == res.data_ptr() for t in saved)


def test_add_rms_norm_linear_frozen_and_unused():
    """Gradients only for what requires them (a frozen linear weight skips the rebuilt output); an output that does
    not reach the loss is a zero gradient."""
    x, r = _rand((4, 16), torch.float32, 0).requires_grad_(), _rand((4, 16), torch.float32, 1)
    w, W, b = _rand((16,), torch.float32, 2), _rand((6, 16), torch.float32, 3), _rand((6,), torch.float32, 4)
    out, res = tri.add_rms_norm_linear(x, r, w, W, b.requires_grad_(), 1e-5)
    out.sum().backward()
    assert x.grad is not None and b.grad is not None and W.grad is None and w.grad is None
    ref_x = x.detach().requires_grad_()
    naive.add_rms_norm_linear(ref_x, r, w, W, b, 1e-5)[0].sum().backward()
    assert_close(x.grad, ref_x.grad, torch.float32, grad=True)
    x.grad = None
    tri.add_rms_norm_linear(x, r, w, W, b, 1e-5)[1].sum().backward()  # only the residual reaches the loss
    assert torch.equal(x.grad, torch.ones_like(x))


def test_add_rms_norm_linear_checks_shapes():
    x, w = torch.randn(2, 3, 16), torch.randn(16)
    from mamba_parallel.ops import add_rms_norm_linear
    with pytest.raises(ValueError, match="add_rms_norm_linear.*lin_weight"):
        add_rms_norm_linear(x, None, w, torch.randn(8, 12))
    with pytest.raises(ValueError, match="add_rms_norm_linear.*residual"):
        add_rms_norm_linear(x, torch.randn(2, 4, 16), w, torch.randn(8, 16))


def test_gated_rms_norm_linear_frozen_weights():
    """Gradients only for what requires them; a frozen linear weight skips the rebuilt output."""
    x, z = _rand((4, 16), torch.float32, 0).requires_grad_(), _rand((4, 16), torch.float32, 1)
    w, W, b = _rand((16,), torch.float32, 2), _rand((6, 16), torch.float32, 3), _rand((6,), torch.float32, 4)
    out = tri.gated_rms_norm_linear(x, z, w, W, b.requires_grad_(), 1e-5, None)
    out.sum().backward()
    assert x.grad is not None and b.grad is not None and W.grad is None and w.grad is None
    ref = naive.gated_rms_norm_linear(x.detach().requires_grad_(), z, w, W, b, 1e-5)
    assert_close(tri.gated_rms_norm_linear(x, z, w, W, b, 1e-5), ref, torch.float32)


@pytest.mark.parametrize("rows", [0, 1, 3, 13])
@pytest.mark.parametrize("programs", [1, 3, 64])
def test_backward_row_split(rows, programs, monkeypatch):
    """The weight gradient is summed over per-program partials: any row count (none, fewer rows than programs,
    rows that do not divide evenly among programs) and groups, with the gate on either side and a residual."""
    monkeypatch.setattr(tri, "_CPU_BWD_PROGRAMS", programs)
    shape = (rows, 24)
    x, z = _rand(shape, torch.float32, 0), _rand(shape, torch.float32, 3)
    r = _rand(shape, torch.float32, 2)
    w = _rand((24,), torch.float32, 1, 0.5) + 1
    for nbg in (False, True):
        _compare(lambda x, z, w: tri.gated_rms_norm(x, z, w, 1e-5, 8, nbg),
                 lambda x, z, w: naive.gated_rms_norm(x, z, w, 1e-5, 8, nbg), [x, z, w], torch.float32, [shape])
    _compare(lambda x, r, w: tri.add_rms_norm(x, r, w, 1e-5, True),
             lambda x, r, w: naive.add_rms_norm(x, r, w, 1e-5, True), [x, r, w], torch.float32, [shape, shape])
    if rows == 0:  # no rows: the weight gradient is exactly zero, not uninitialised memory
        _, (_, _, dw) = _run(lambda x, r, w: tri.add_rms_norm(x, r, w), [x, r, w], [torch.ones(shape)] * 2)
        assert torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("rows", [0, 1, 7, 131, 16384])
@pytest.mark.parametrize("groups", [1, 3, 80])
@pytest.mark.parametrize("per_sm", [1, 3, 12])
def test_row_split_covers_rows_once(rows, groups, per_sm, monkeypatch):
    """GPU grid arithmetic (a fake 132-SM device): every row in exactly one program, no program empty, and about
    ``per_sm`` programs per SM over all groups when there are enough rows."""
    monkeypatch.setattr(tri, "_sm_count", lambda index: 132)
    fake_cuda = type("FakeCuda", (), {"is_cuda": True, "device": torch.device("cpu")})()
    n, per = tri._bwd_row_split(fake_cuda, rows, groups, per_sm)
    target = per_sm * 132  # programs over all groups
    assert n >= 1 and per >= 1
    assert (n - 1) * per < max(rows, 1) <= n * per
    assert n <= -(-target // groups)
    if rows >= 16384:  # enough rows: the grid is filled (within the rounding of rows per program)
        assert n * groups >= 0.9 * target


@pytest.mark.parametrize("group_size, block, warps", [(24, 32, 4), (2048, 2048, 4), (2560, 4096, 8),
                                                     (5120, 8192, 16), (16384, 16384, 32)])
def test_backward_launch_shape(group_size, block, warps):
    """16 values per thread per row tensor as in the forward, up to 32 warps for the widest group."""
    assert tri._bwd_launch_shape(group_size) == (block, warps)


@pytest.mark.parametrize("has_z, nbg, block, expected", [
    (False, False, 2048, 4), (True, False, 2048, 3), (True, True, 2048, 4), (False, False, 4096, 2),
    (True, False, 4096, 1), (False, False, 32, 12), (True, False, 8192, 1), (False, False, 16384, 1)])
def test_backward_programs_per_sm(has_z, nbg, block, expected):
    """One wave of resident programs: the register file (64K per SM) and 64 warps per SM bound them."""
    _, warps = tri._bwd_launch_shape(block)
    per_sm = tri._bwd_programs_per_sm(block, warps, has_z, nbg)
    assert per_sm == expected
    assert per_sm * warps <= 64


def test_compile_keeps_custom_op():
    """torch.compile traces the custom ops through their fake kernels without a graph break."""
    x, w = _rand((4, 16), torch.float32, 0), _rand((16,), torch.float32, 1)
    z = _rand((4, 16), torch.float32, 2)

    def f(x, z, w):
        y, res = tri.add_rms_norm(x, None, w)
        return tri.gated_rms_norm(y, z, w, group_size=8) + res

    explained = torch._dynamo.explain(f)(x, z, w)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_compile_keeps_norm_linear_op():
    """The norm + linear node compiles as one custom op (no graph break) and trains to the eager values."""
    x, z = _rand((4, 16), torch.float32, 0), _rand((4, 16), torch.float32, 2)
    w, W = _rand((16,), torch.float32, 1), _rand((8, 16), torch.float32, 3)

    def f(x, z, w, W):
        return tri.gated_rms_norm_linear(x, z, w, W, None, 1e-5, 8)

    explained = torch._dynamo.explain(f)(x, z, w, W)
    assert explained.graph_break_count == 0, explained.break_reasons
    g = [_rand((4, 8), torch.float32, 5)]
    eager_run = _run(f, [x, z, w, W], g)
    compiled_run = _run(torch.compile(f, backend="aot_eager", fullgraph=True), [x, z, w, W], g)
    for a, r in zip([*compiled_run[0], *compiled_run[1]], [*eager_run[0], *eager_run[1]]):
        assert_close(a, r, torch.float32)



def test_compile_keeps_add_norm_linear_op():
    """The add + norm + linear node compiles as one custom op (no graph break) and trains to the eager values; the
    custom op's own autograd (the eager fast path off) gives them too."""
    from mamba_parallel.ops import use_eager_fastpath

    x, r = _rand((4, 16), torch.float32, 0), _rand((4, 16), torch.float32, 2)
    w, W = _rand((16,), torch.float32, 1), _rand((8, 16), torch.float32, 3)

    def f(x, r, w, W):
        return tri.add_rms_norm_linear(x, r, w, W, None, 1e-5)

    explained = torch._dynamo.explain(f)(x, r, w, W)
    assert explained.graph_break_count == 0, explained.break_reasons
    g = [_rand((4, 8), torch.float32, 5), _rand((4, 16), torch.float32, 6)]
    eager_run = _run(f, [x, r, w, W], g)
    compiled_run = _run(torch.compile(f, backend="aot_eager", fullgraph=True), [x, r, w, W], g)
    with use_eager_fastpath(False):
        op_run = _run(f, [x, r, w, W], g)
    for a, c, o in zip([*eager_run[0], *eager_run[1]], [*compiled_run[0], *compiled_run[1]],
                       [*op_run[0], *op_run[1]]):
        assert_close(c, a, torch.float32)
        assert torch.equal(o, a)

# ------------------------------------------------------------------------------------------------------ GPU

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("d", [2560, 5120])
def test_add_rms_norm_gpu(dtype, d, nan_poison):
    m = 4096
    x, r = _rand((m, d), dtype, 0), _rand((m, d), torch.float32, 1)
    w = _rand((d,), dtype, 2, 0.5) + 1
    _compare(lambda x, r, w: tri.add_rms_norm(x, r, w, 1e-5, True),
             lambda x, r, w: naive.add_rms_norm(x, r, w, 1e-5, True), [x, r, w], dtype, [(m, d), (m, d)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("group_size", [None, 1280])
def test_gated_rms_norm_gpu(dtype, group_size, nan_poison):
    m, d = 4096, 5120
    x, z = _rand((m, d), dtype, 0), _rand((m, d), dtype, 1)
    w = _rand((d,), dtype, 2, 0.5) + 1
    _compare(lambda x, z, w: tri.gated_rms_norm(x, z, w, 1e-5, group_size, False),
             lambda x, z, w: naive.gated_rms_norm(x, z, w, 1e-5, group_size, False), [x, z, w], dtype, [(m, d)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, d, group_size", [(1, 2048, None), (131, 8192, 4096), (4099, 2560, None),
                                              (257, 16384, None)])
def test_backward_rows_and_groups_gpu(dtype, m, d, group_size, nan_poison):
    """The fused backward on the real grid: fewer rows than programs, rows that do not divide among the SMs,
    groups, and the widest group (16384 channels, 32 warps)."""
    x, z = _rand((m, d), dtype, 0), _rand((m, d), dtype, 1)
    w = _rand((d,), dtype, 2, 0.5) + 1
    for nbg in (False, True):
        _compare(lambda x, z, w: tri.gated_rms_norm(x, z, w, 1e-5, group_size, nbg),
                 lambda x, z, w: naive.gated_rms_norm(x, z, w, 1e-5, group_size, nbg), [x, z, w], dtype, [(m, d)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("m, d, e, group_size, nbg, bias", [(4099, 5120, 2560, None, False, False),
                                                           (1000, 4096, 2048, 1024, False, True),
                                                           (131, 2560, 1280, None, True, False)])
def test_gated_rms_norm_linear_gpu(dtype, m, d, e, group_size, nbg, bias, nan_poison):
    """Mamba-2's norm + out_proj shapes: against the reference, and the Triton norm followed by F.linear."""
    x, z = _rand((m, d), dtype, 0), _rand((m, d), dtype, 1)
    w = _rand((d,), dtype, 2, 0.5) + 1
    W, b = _rand((e, d), dtype, 3, d ** -0.5), _rand((e,), dtype, 4) if bias else None
    args = dict(eps=1e-5, group_size=group_size, norm_before_gate=nbg)
    fused = lambda x, z, w, W, b: tri.gated_rms_norm_linear(x, z, w, W, b, **args)  # noqa: E731
    _compare(fused, lambda x, z, w, W, b: naive.gated_rms_norm_linear(x, z, w, W, b, **args), [x, z, w, W, b], dtype,
             [(m, e)])
    _compare(fused, _norm_then_linear(lambda x, z, w: tri.gated_rms_norm(x, z, w, **args)), [x, z, w, W, b], dtype,
             [(m, e)])


@pytest.mark.gpu
def test_gated_rms_norm_linear_under_autocast_gpu(nan_poison):
    """fp32 parameters under bf16 autocast (training): the matmuls in bf16 as nn.Linear's, fp32 weight gradients,
    the values of the Triton norm followed by nn.Linear."""
    m, d, e = 2048, 4096, 2048
    x, z = _rand((m, d), torch.bfloat16, 0), _rand((m, d), torch.bfloat16, 1)
    w = _rand((d,), torch.float32, 2, 0.5) + 1
    W, b = _rand((e, d), torch.float32, 3, d ** -0.5), _rand((e,), torch.float32, 4)
    g = [_rand((m, e), torch.float32, 5)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _run(lambda *a: tri.gated_rms_norm_linear(*a, 1e-5), [x, z, w, W, b], g)
        ref = _run(_norm_then_linear(lambda x, z, w: tri.gated_rms_norm(x, z, w, 1e-5)), [x, z, w, W, b], g)
    assert got[0][0].dtype == torch.bfloat16 and got[1][3].dtype == torch.float32
    # nn.Linear's weight gradient is a bf16 matmul rounded to bf16 (relative RMS ~1e-3 from rounding alone); the
    # fused node's accumulates in fp32: the gradients get the gradient bound
    for i, (a, r) in enumerate(zip([*got[0], *got[1]], [*ref[0], *ref[1]])):
        assert a.dtype == r.dtype
        assert_close(a, r, torch.bfloat16, grad=i >= len(got[0]), factor=0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("m, d, e, first", [(4099, 2560, 10576, False), (131, 2048, 8192, True),
                                            (1000, 768, 3328, False)])
def test_add_rms_norm_linear_gpu(dtype, m, d, e, first, nan_poison):
    """The block's add + norm + in_proj at Mamba-2 / Mamba sizes (the first block has no residual yet): against the
    reference, and the Triton add + norm followed by F.linear."""
    x = _rand((m, d), dtype, 0)
    r = None if first else _rand((m, d), torch.float32, 1)
    w = _rand((d,), dtype, 2, 0.5) + 1
    W = _rand((e, d), dtype, 3, d ** -0.5)
    fused = lambda x, r, w, W: tri.add_rms_norm_linear(x, r, w, W, None, 1e-5)  # noqa: E731
    outs = [(m, e), (m, d)]
    _compare(fused, lambda x, r, w, W: naive.add_rms_norm_linear(x, r, w, W, None, 1e-5), [x, r, w, W], dtype, outs)
    _compare(fused, lambda x, r, w, W: _add_norm_then_linear(lambda x, r, w: tri.add_rms_norm(x, r, w, 1e-5))(
        x, r, w, W, None), [x, r, w, W], dtype, outs)


@pytest.mark.gpu
def test_add_rms_norm_linear_under_autocast_gpu(nan_poison):
    """fp32 parameters and residual under bf16 autocast (training): the matmuls in bf16 as nn.Linear's, fp32 weight
    gradients, the values of the Triton add + norm followed by nn.Linear."""
    m, d, e = 2048, 2048, 8448
    x, r = _rand((m, d), torch.bfloat16, 0), _rand((m, d), torch.float32, 1)
    w, W = _rand((d,), torch.float32, 2, 0.5) + 1, _rand((e, d), torch.float32, 3, d ** -0.5)
    g = [_rand((m, e), torch.float32, 5), _rand((m, d), torch.float32, 6)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _run(lambda *a: tri.add_rms_norm_linear(*a, None, 1e-5), [x, r, w, W], g)
        unfused = _add_norm_then_linear(lambda x, r, w: tri.add_rms_norm(x, r, w, 1e-5))
        ref = _run(lambda x, r, w, W: unfused(x, r, w, W, None), [x, r, w, W], g)
    assert got[0][0].dtype == torch.bfloat16 and got[0][1].dtype == torch.float32
    assert got[1][3].dtype == torch.float32
    for i in range(2):
        assert torch.equal(got[0][i], ref[0][i]), f"output {i}"
    for i in range(3):  # x, the residual and the norm weight: the same kernels on the same values
        assert_close(got[1][i], ref[1][i], torch.bfloat16, grad=True, name=f"grad {i}")
    # both weight gradients are a bf16 GEMM of the same operands cast to fp32; cuBLAS may pick another algorithm
    assert_close(got[1][3], ref[1][3].float(), torch.bfloat16, grad=True, name="grad of the linear weight")


@pytest.mark.gpu
def test_bench_times_kernels_gpu():
    """bench_ops' fwd+bwd is kernel time (at most the one-call wall time), and a norm forward + backward is one
    kernel each plus small ops: no second pass over x / dy for the weight gradient."""
    from mamba_parallel.bench import bench_ops

    m, d = 4096, 2560
    x = _rand((m, d), torch.bfloat16, 0).requires_grad_()
    r = _rand((m, d), torch.float32, 1).requires_grad_()
    w = (_rand((d,), torch.bfloat16, 2, 0.1) + 1).requires_grad_()
    dy, dres = _rand((m, d), torch.bfloat16, 3), _rand((m, d), torch.float32, 4)
    t = bench_ops._fwd_and_fb(lambda x, r, w: tri.add_rms_norm(x, r, w, 1e-5, True), [x, r, w], [dy, dres])
    assert 0 < t["fwd_ms"] < t["fwd_bwd_ms"] <= 1.05 * t["fwd_bwd_wall_ms"], t
    assert t["fwd_launches"] == 1, t
    # forward, backward, sum of the weight-gradient partials, its cast to bf16, autograd's zero grad for rstd
    assert t["fwd_bwd_launches"] <= 5, t
