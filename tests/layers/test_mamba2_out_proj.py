"""Mamba2's gated norm and out_proj as one node on the Triton path (``ops.gated_rms_norm_linear``): the values and
every gradient of the norm followed by out_proj as a module, taken only where it applies, keeping no out_proj
input."""

import pytest
import torch
from helpers import assert_close, graph_node_names, saved_bytes

from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.layers.recompute import apply_recompute

pytest.importorskip("triton")


def _fused(nodes) -> bool:
    """Whether the graph has the norm + linear op's node (its eager autograd node, ops/eager_fastpath.py)."""
    return any("gated_norm_linear_fwd" in n for n in nodes)


def _layer(dtype=torch.float32, device="cpu", bias=False, d_model=32, d_state=16, headdim=16, chunk_size=16, **kw):
    torch.manual_seed(0)
    m = Mamba2(d_model, d_state=d_state, headdim=headdim, chunk_size=chunk_size, bias=bias, **kw)
    m = m.to(device=device, dtype=dtype)
    with torch.no_grad():
        m.norm.weight.normal_(1.0, 0.2)  # non-trivial norm weight, so its gradient and the rebuilt output differ
    return m


def _run(m, h, backend="triton", out_proj_hook=False, **kwargs):
    """Forward + backward of a fixed non-uniform loss -> ([out, dh, parameter grads], node names, saved bytes);
    ``out_proj_hook``: a forward hook on out_proj, which keeps it a module call (the unfused path)."""
    from mamba_parallel import ops

    hook = m.out_proj.register_forward_hook(lambda mod, args, out: None) if out_proj_hook else None
    m.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_()
    with ops.use_backend(backend):
        out, saved = saved_bytes(m, lambda: m(h, **kwargs))
        nodes = graph_node_names(out)
        w = torch.linspace(-1, 1, out.numel(), device=h.device).view_as(out)
        (out.float() * w).sum().backward()
    if hook is not None:
        hook.remove()
    return [out.detach(), h.grad] + [p.grad for p in m.parameters()], nodes, saved


def _names(m):
    return ["out", "d hidden"] + [n for n, _ in m.named_parameters()]


@pytest.mark.parametrize("bias,packed,ngroups", [(False, False, 1), (True, True, 2)])
def test_fused_equals_the_norm_then_out_proj(bias, packed, ngroups):
    """Bit for bit (fp32, interpreter) on an odd length / packed sequences, keeping b * L * d_inner values less."""
    m = _layer(bias=bias, ngroups=ngroups)
    b, L = (1, 23) if packed else (2, 19)
    h = torch.randn(b, L, m.d_model, generator=torch.Generator().manual_seed(1))
    kw = dict(cu_seqlens=torch.tensor([0, 9, L], dtype=torch.int32)) if packed else {}
    got, nodes, saved = _run(m, h, **kw)
    ref, ref_nodes, ref_saved = _run(m, h, out_proj_hook=True, **kw)
    assert _fused(nodes) and not _fused(ref_nodes)
    for g, r, name in zip(got, ref, _names(m)):
        assert g is not None and torch.equal(g, r), name
    assert ref_saved - saved == 4 * b * L * m.d_inner


def test_fused_matches_the_reference_ops_and_gate_is_a_no_op():
    """Against the pure-PyTorch ops (naive backend: the norm, then nn.Linear); recompute "gate" changes nothing
    where the node applies (nothing left to rebuild) and still rebuilds out_proj's input where it does not."""
    m = _layer()
    h = torch.randn(1, 11, m.d_model, generator=torch.Generator().manual_seed(2))
    ref, ref_nodes, _ = _run(m, h, backend="naive")
    got, _, saved = _run(m, h)
    assert not _fused(ref_nodes)
    for g, r, name in zip(got, ref, _names(m)):
        assert_close(g, r, dtype=torch.float32, grad=name != "out", name=name)
    apply_recompute(m, "gate")
    gated, nodes, gate_saved = _run(m, h)
    assert _fused(nodes) and gate_saved == saved
    for g, r in zip(gated, got):
        assert torch.equal(g, r)
    _, _, hooked_saved = _run(m, h, out_proj_hook=True)  # the module call: "gate" rebuilds its input
    assert hooked_saved == saved


def test_where_the_node_does_not_apply():
    """Off: no autograd, the naive backend, an out_proj or norm with hooks (the module calls run)."""
    m = _layer()
    h = torch.randn(1, 5, m.d_model)
    with torch.no_grad():
        assert not m._norm_out_proj_fused(h)
    from mamba_parallel import ops

    with ops.use_backend("naive"):
        assert not m._norm_out_proj_fused(h)
    with ops.use_backend("triton"):
        assert m._norm_out_proj_fused(h)
        hook = m.norm.register_forward_pre_hook(lambda mod, args: None)
        assert not m._norm_out_proj_fused(h)
        hook.remove()
    assert not _fused(_run(m, h, out_proj_hook=True)[1])


# ------------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_fused_equals_the_norm_then_out_proj(dtype, nan_poison):
    """mamba2-130m's layer shape (d_model 768, 24 heads of 64, n 128) at b 2, L 1000 (not a multiple of the chunk):
    the same kernels and GEMMs, so the values agree to rounding."""
    m = _layer(dtype, "cuda", d_model=768, d_state=128, headdim=64, chunk_size=256)
    h = torch.randn(2, 1000, 768, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(1))
    got, nodes, saved = _run(m, h)
    ref, _, ref_saved = _run(m, h, out_proj_hook=True)
    assert _fused(nodes)
    assert ref_saved - saved == 2000 * m.d_inner * torch.finfo(dtype).bits // 8
    for g, r, name in zip(got, ref, _names(m)):
        assert torch.isfinite(g).all(), name
        assert_close(g, r, dtype=dtype, grad=name != "out", factor=0.5, name=name)


@pytest.mark.gpu
def test_gpu_fused_under_autocast(nan_poison):
    """Training's setting: fp32 parameters under bf16 autocast; fp32 gradients, the unfused values; the cast copy
    of out_proj's weight is not kept either (cast again in the backward)."""
    m = _layer(torch.float32, "cuda", d_model=768, d_state=128, headdim=64, chunk_size=256, bias=True)
    h = torch.randn(2, 1000, 768, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, nodes, saved = _run(m, h)
        ref, _, ref_saved = _run(m, h, out_proj_hook=True)
    assert _fused(nodes) and got[0].dtype == torch.bfloat16
    assert ref_saved - saved == 2 * (2000 * m.d_inner + m.out_proj.weight.numel())  # addmm keeps no bias
    for g, r, name in zip(got, ref, _names(m)):
        assert g.dtype == r.dtype, name
        assert_close(g, r, dtype=torch.bfloat16, grad=name != "out", factor=0.5, name=name)
