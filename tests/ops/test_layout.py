"""The layout ops (ops/layout: ``token_major``, ``silu_gate``): the Triton path against the reference (naive.py),
outputs and every gradient per dtype, on shapes that are not multiples of the tile and inputs of any strides; the
gate's dz written into a gradient-arena slot; input checks."""

import pytest
import torch

from helpers import assert_close
from mamba_parallel import ops
from mamba_parallel.ops.grad_arena import split_with_grad_arena, tag_view
from mamba_parallel.ops.layout import naive

triton = pytest.importorskip("triton")
DTYPES = [torch.float32, torch.float16]


def _inputs(dtype, device="cpu", b=2, d=19, L=37, seed=3):
    """y (b, d, L) token-major, z (b, d, L) channels-last (a transposed view, as in the Mamba layer)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(b, d, L, generator=g).to(device=device, dtype=dtype)
    z = torch.randn(b, L, d, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    return y, z


def _grads(fn, *inputs, dout):
    leaves = [t.detach().clone().requires_grad_() if t.stride(2) == 1 else
              t.detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_gate_matches_the_reference(dtype, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    y, z = _inputs(dtype)
    b, d, L = y.shape
    dout = torch.randn(b, L, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    out, (dy, dz) = _grads(ops.silu_gate, y, z, dout=dout)
    ref, (ry, rz) = _grads(naive.silu_gate, y, z, dout=dout)
    assert out.shape == (b, L, d) and out.is_contiguous() and out.dtype == dtype
    assert_close(out, ref, dtype=dtype, name="gate")
    assert_close(dy, ry, dtype=dtype, grad=True, name="dy")
    assert_close(dz, rz, dtype=dtype, grad=True, name="dz")
    with torch.no_grad():  # no autograd: the launcher alone, same values
        assert torch.equal(ops.silu_gate(y, z), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_major_copies_any_layout(dtype, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    y, z = _inputs(dtype)
    assert ops.token_major(y) is y  # already token-major: no copy
    z = z.detach().requires_grad_()
    tm = ops.token_major(z)
    assert tm.stride(2) == 1 and torch.equal(tm, z)
    g = torch.randn(tm.shape).to(dtype)
    tm.backward(g)
    assert torch.equal(z.grad, g)  # the gradient passes through


def test_gate_writes_dz_into_the_arena_and_the_split_fills_what_no_op_wrote(monkeypatch):
    """in_proj's output split with an arena: the gate writes dz in place; the x half is the token-major copy's
    gradient (copied), or zeros when x reaches no loss. Always the plain split's gradient."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    xz = torch.randn(2, 7, 12, generator=gen)
    y = torch.randn(2, 6, 7, generator=gen)
    wx, dout = torch.randn(2, 6, 7, generator=gen), torch.randn(2, 7, 6, generator=gen)

    def run(split, use_x):
        leaf = xz.clone().requires_grad_()
        x, z = (tag_view(t.transpose(1, 2), t, lambda g: g.transpose(1, 2)) for t in split(leaf))
        loss = (ops.silu_gate(y, z) * dout).sum()
        if use_x:
            loss = loss + (ops.token_major(x) * wx).sum()
        loss.backward()
        return leaf.grad

    for use_x in (True, False):
        got = run(lambda t: split_with_grad_arena(t, [6, 6], dim=-1), use_x)
        ref = run(lambda t: t.split([6, 6], dim=-1), use_x)
        assert torch.equal(got, ref), use_x
    assert torch.equal(got[..., :6], torch.zeros(2, 7, 6))


def test_input_checks_name_the_argument():
    y = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"silu_gate: z has shape \(2, 4, 3\), expected \(b, d, L\) = \(2, 3, 4\)"):
        ops.silu_gate(y, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match=r"token_major: x must be \(b, d, L\)"):
        ops.token_major(torch.randn(3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_layout_ops_match_the_reference(dtype, monkeypatch):
    """mamba-130m's layer shape (d_inner 1536) at L 1000 (not a multiple of the 64-wide tile)."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    y, z = _inputs(dtype, "cuda", b=2, d=1536, L=1000)
    dout = torch.randn(2, 1000, 1536, device="cuda").to(dtype)
    out, (dy, dz) = _grads(ops.silu_gate, y, z, dout=dout)
    ref, (ry, rz) = _grads(naive.silu_gate, y, z, dout=dout)
    assert_close(out, ref, dtype=dtype, name="gate")
    assert_close(dy, ry, dtype=dtype, grad=True, name="dy")
    assert_close(dz, rz, dtype=dtype, grad=True, name="dz")
    assert torch.equal(ops.token_major(z), z)
