"""Mamba-1 layer on the Triton path: same values and gradients as the reference ops, and no torch copy of an
activation-sized tensor (no transposing copy, no concatenation of dx | dz) in forward or backward."""

import pytest
import torch
from helpers import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.layers import Mamba
from mamba_parallel.layers.mamba1_layout import gate_to_token_last, split_xz, token_major

triton = pytest.importorskip("triton")
_COPIES = ("aten.cat", "aten.clone", "aten.copy_", "aten._to_copy", "aten.contiguous", "aten.stack")


class _OpLog(TorchDispatchMode):
    """Names of the ops run, with the largest floating-point output (or mutated argument) of each."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ts = [t for t in (list(out) if isinstance(out, (list, tuple)) else [out]) + list(args)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
        self.ops.append((str(func), max((t.numel() for t in ts), default=0)))
        return out


def _layer(dtype, device="cpu"):
    torch.manual_seed(0)
    m = Mamba(16, d_state=4, d_conv=4, expand=2).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.D.normal_()  # non-trivial skip and conv bias so their gradients are checked
        m.conv1d.bias.normal_()
    return m


def _run(m, h, backend, monkeypatch, fn=None, **kwargs):
    """Forward (of ``fn``, default m) + backward of a fixed non-uniform loss -> [out, dh, m's parameter grads]."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", backend)
    m.zero_grad()
    h = h.detach().requires_grad_()
    out = (fn or m)(h, **kwargs)
    w = torch.linspace(-1, 1, out.numel(), device=h.device).view_as(out)
    (out.float() * w).sum().backward()
    return [out.detach(), h.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.float32, True), (torch.float16, False)])
def test_triton_layer_matches_reference(dtype, packed, monkeypatch):
    m = _layer(dtype)
    b, L = (1, 13) if packed else (2, 11)
    h = torch.randn(b, L, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    kw = dict(cu_seqlens=torch.tensor([0, 5, 13], dtype=torch.int32)) if packed else {}
    ref = _run(m, h, "naive", monkeypatch, **kw)
    got = _run(m, h, "triton", monkeypatch, **kw)
    names = ["out", "d hidden"] + [n for n, _ in m.named_parameters()]
    for g, r, name in zip(got, ref, names):
        assert_close(g, r, dtype=dtype, grad=name != "out", name=name)


def test_no_activation_sized_torch_copies(monkeypatch):
    """Every activation-sized layout change runs in the layer's own Triton copies: one in forward (the conv's
    output made token-major), one in backward (dx into in_proj's output gradient, whose z half the gate wrote)."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32)
    b, L = 2, 9
    h = torch.randn(b, L, 16, requires_grad=True)
    with _OpLog() as log:
        m(h).sum().backward()
    act = b * L * m.d_inner
    big_copies = [(op, n) for op, n in log.ops if op.startswith(_COPIES) and n >= act]
    assert big_copies == [], big_copies
    own = [op for op, _ in log.ops if op.startswith("mamba_parallel.m1_copy_")]
    assert len(own) == 2, own
    assert any(op.startswith("mamba_parallel.m1_gate_bwd") for op, _ in log.ops)


def test_activation_checkpointing_keeps_gradients(monkeypatch):
    """Non-reentrant checkpointing (parallelize's) replays the forward: the recomputed layer and the original
    backward nodes must still meet in one in_proj gradient."""
    from torch.utils.checkpoint import checkpoint

    m = _layer(torch.float32)
    h = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(5))
    ref = _run(m, h, "triton", monkeypatch)
    got = _run(m, h, "triton", monkeypatch, fn=lambda x: checkpoint(m, x, use_reentrant=False))
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_split_gradient_without_the_gate(monkeypatch):
    """split_xz's backward also assembles gradients that did not come through the gate's buffer."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    xz = torch.randn(2, 5, 12, requires_grad=True)
    x, z, _ = split_xz(xz, 6)
    assert x.shape == z.shape == (2, 6, 5) and x.stride(1) == 1
    wx, wz = torch.randn(2, 6, 5), torch.randn(2, 6, 5)
    ((token_major(x) * wx).sum() + (z * wz).sum()).backward()
    assert torch.equal(xz.grad, torch.cat([wx, wz], dim=1).transpose(1, 2))
    xz.grad = None
    x, z, _ = split_xz(xz, 6)  # only z reaches the loss: the x half of the gradient is zero
    (z * wz).sum().backward()
    assert torch.equal(xz.grad, torch.cat([torch.zeros_like(wx), wz], dim=1).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_and_token_major_kernels(dtype, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    g = torch.Generator().manual_seed(3)
    b, d, L = 2, 19, 37  # not multiples of the tile
    y = torch.randn(b, d, L, generator=g).to(dtype).requires_grad_()
    z = torch.randn(b, L, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()  # channels-last
    out = gate_to_token_last(y, z)
    ref = (y.float() * torch.nn.functional.silu(z.float()))
    assert out.shape == (b, L, d) and out.is_contiguous()
    assert_close(out, ref.transpose(1, 2), dtype=dtype, name="gate")
    dout = torch.randn(b, L, d, generator=g).to(dtype)
    dy, dz = torch.autograd.grad(out, (y, z), dout)
    ry, rz = torch.autograd.grad(ref, (y, z), dout.float().transpose(1, 2))
    assert_close(dy, ry, dtype=dtype, grad=True, name="dy")
    assert_close(dz, rz, dtype=dtype, grad=True, name="dz")
    tm = token_major(z)
    assert tm.stride(2) == 1 and torch.equal(tm, z)
    assert token_major(y) is y  # already token-major


def test_chunked_prefill_and_decode_on_triton_path(monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32).eval()
    m.layer_idx = 0
    b, L, prefill = 2, 12, 5
    h = torch.randn(b, L, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(h)
        cache = InferenceParams(max_seqlen=L, max_batch_size=b)
        cache.key_value_memory_dict[0] = m.allocate_inference_cache(b, L)
        pieces = [m(h[:, :prefill], inference_params=cache)]
        cache.seqlen_offset = prefill
        pieces.append(m(h[:, prefill:L - 1], inference_params=cache))  # resumes from the cached states
        cache.seqlen_offset = L - 1
        pieces.append(m(h[:, L - 1:], inference_params=cache))  # one-token step
    assert_close(torch.cat(pieces, dim=1), full, name="chunked prefill + step")


@pytest.mark.gpu
def test_gpu_bf16_layer_matches_reference_without_copies(monkeypatch):
    m = _layer(torch.bfloat16, "cuda")
    b, L = 2, 300
    h = torch.randn(b, L, 16, device="cuda", dtype=torch.bfloat16)
    ref = _run(m, h, "naive", monkeypatch)
    with _OpLog() as log:
        got = _run(m, h, "triton", monkeypatch)
    names = ["out", "d hidden"] + [n for n, _ in m.named_parameters()]
    for gv, r, name in zip(got, ref, names):
        assert_close(gv, r, dtype=torch.bfloat16, grad=name != "out", factor=2, name=name)
    act = b * L * m.d_inner
    assert [(op, n) for op, n in log.ops if op.startswith(_COPIES) and n >= act] == []
