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
