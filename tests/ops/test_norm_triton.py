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
