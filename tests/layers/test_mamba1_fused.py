"""The Mamba-1 layer's fused middle (layers/mamba1_fused.py): one autograd node with the modular path's values and
gradients, taken only where it applies."""

import pytest
import torch
from helpers import assert_close, graph_node_names, saved_bytes

from mamba_parallel.layers import Mamba
from mamba_parallel.layers.mamba1 import Mamba1Ops
from mamba_parallel.layers.mamba1_fused import fused_ok
from mamba_parallel.layers.recompute import apply_recompute

pytest.importorskip("triton")


def _layer(dtype, device="cpu", d_model=16, d_state=4):
    torch.manual_seed(0)
    m = Mamba(d_model, d_state=d_state, d_conv=4, expand=2).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.D.normal_()  # non-trivial skip, conv bias and A so their gradients are checked
        m.conv1d.bias.normal_()
        m.A_log.add_(0.1 * torch.randn_like(m.A_log))
    return m


def _run(m, h, monkeypatch, fused: bool, fn=None, **kwargs):
    """Forward + backward of a fixed non-uniform loss -> [out, dh, m's parameter grads] and the graph's node names."""
    m.use_fused_path = fused
    m.zero_grad()
    h = h.detach().requires_grad_()
    out = (fn or m)(h, **kwargs)
    nodes = graph_node_names(out)
    w = torch.linspace(-1, 1, out.numel(), device=h.device).view_as(out)
    (out.float() * w).sum().backward()
    return [out.detach(), h.grad] + [p.grad for p in m.parameters()], nodes


def _names(m):
    return ["out", "d hidden"] + [n for n, _ in m.named_parameters()]


@pytest.mark.parametrize("dtype,b,L,packed", [(torch.float32, 2, 19, False), (torch.float32, 1, 21, True),
                                             (torch.float16, 2, 19, False)])
def test_fused_matches_the_modular_path(dtype, b, L, packed, monkeypatch):
    """Outputs, the input gradient and every parameter gradient (A_log, D, dt bias, conv, projections) on the
    Triton path (interpreter on CPU: chunk 8, so L = 19 crosses several chunks), one node instead of many."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(dtype)
    h = torch.randn(b, L, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    kw = dict(cu_seqlens=torch.tensor([0, 8, L], dtype=torch.int32)) if packed else {}
    ref, ref_nodes = _run(m, h, monkeypatch, fused=False, **kw)
    got, nodes = _run(m, h, monkeypatch, fused=True, **kw)
    assert "_Mamba1InnerBackward" in nodes and "_Mamba1InnerBackward" not in ref_nodes
    assert not any("SplitXZ" in n or "GateTokenLast" in n or "BmmBackward" in n for n in nodes), nodes
    for g, r, name in zip(got, ref, _names(m)):
        assert g is not None, name
        assert_close(g, r, dtype=dtype, grad=name != "out", name=name)


def test_fused_matches_the_reference_ops(monkeypatch):
    """Against the pure-PyTorch reference ops (the modular layer on MAMBA_PARALLEL_BACKEND=naive)."""
    m = _layer(torch.float32)
    h = torch.randn(2, 17, 16, generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    ref, _ = _run(m, h, monkeypatch, fused=True)
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    got, nodes = _run(m, h, monkeypatch, fused=True)
    assert "_Mamba1InnerBackward" in nodes
    for g, r, name in zip(got, ref, _names(m)):
        assert_close(g, r, dtype=torch.float32, grad=name != "out", name=name)


def test_frozen_parameters_get_no_gradient(monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32)
    m.A_log.requires_grad_(False)
    m.conv1d.requires_grad_(False)
    got, nodes = _run(m, torch.randn(2, 9, 16), monkeypatch, fused=True)
    assert "_Mamba1InnerBackward" in nodes
    assert m.A_log.grad is None and m.conv1d.weight.grad is None and m.x_proj.weight.grad is not None


def test_activation_checkpointing(monkeypatch):
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32)
    h = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(5))
    ref, _ = _run(m, h, monkeypatch, fused=True)
    got, _ = _run(m, h, monkeypatch, fused=True, fn=lambda x: checkpoint(m, x, use_reentrant=False))
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_where_the_fused_path_does_not_apply(monkeypatch):
    """Off: naive backend, no autograd, use_fused_path=False, a gate recompute, sequence ops that communicate
    (context / tensor parallelism install such strategies: layers/seq_ops.py)."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32)
    xz = torch.randn(1, 5, 2 * m.d_inner, requires_grad=True)
    assert fused_ok(m, xz)
    with torch.no_grad():
        assert not fused_ok(m, xz)
    assert not fused_ok(m, xz.detach())
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    assert not fused_ok(m, xz)
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    h = torch.randn(1, 5, 16)
    assert "_Mamba1InnerBackward" in _run(m, h, monkeypatch, fused=True)[1]
    assert "_Mamba1InnerBackward" not in _run(m, h, monkeypatch, fused=False)[1]

    class Communicating(Mamba1Ops):
        local = False

    m.seq_ops = Communicating()
    assert "_Mamba1InnerBackward" not in _run(m, h, monkeypatch, fused=True)[1]
    m.seq_ops = Mamba1Ops()
    # a gate recompute keeps the modular path (it rebuilds out_proj's input through saved-tensor hooks)
    apply_recompute(m, "conv,gate")
    assert "_Mamba1InnerBackward" not in _run(m, h, monkeypatch, fused=True)[1]


def test_fused_keeps_no_delta_and_rebuilds_the_conv_on_request(monkeypatch):
    """delta is never kept (rebuilt by its matmul); recompute=conv (or conv,dt) drops the conv output too;
    gradients bit-identical either way."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32)
    b, L = 2, 12
    h = torch.randn(b, L, 16, generator=torch.Generator().manual_seed(6))
    saved, grads = {}, {}
    for items in ("", "conv,dt"):
        apply_recompute(m, items)
        grads[items], nodes = _run(m, h, monkeypatch, fused=True)
        assert "_Mamba1InnerBackward" in nodes
        saved[items] = saved_bytes(m, lambda: m(h.detach().requires_grad_()))[1]
    apply_recompute(m, "")
    m.use_fused_path = False
    modular = saved_bytes(m, lambda: m(h.detach().requires_grad_()))[1]
    for g, r in zip(grads["conv,dt"], grads[""]):
        assert torch.equal(g, r)
    assert saved[""] - saved["conv,dt"] == 4 * b * L * m.d_inner  # the conv output
    # against the modular layer: no delta, no exp(A_log) output (fp32 here: B / C need no fp32 copy)
    assert modular - saved[""] == 4 * (b * L * m.d_inner + m.d_inner * m.d_state)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fused_matches_the_modular_path(dtype, monkeypatch, nan_poison):
    """mamba-130m's layer shape (d_inner 1536, n 16) at b 2, L 1000 (not a multiple of the chunk)."""
    m = _layer(dtype, "cuda", d_model=768, d_state=16)
    h = torch.randn(2, 1000, 768, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(1))
    ref, _ = _run(m, h, monkeypatch, fused=False)
    got, nodes = _run(m, h, monkeypatch, fused=True)
    assert "_Mamba1InnerBackward" in nodes
    for g, r, name in zip(got, ref, _names(m)):
        assert torch.isfinite(g).all(), name
        assert_close(g, r, dtype=dtype, grad=name != "out", factor=2, name=name)
