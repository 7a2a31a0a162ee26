"""The Mamba-1 layer (layers/mamba1.py) on the Triton path: the reference forward against the reference ops, with
no torch copy of an activation-sized tensor (no transposing copy, no concatenation of dx | dz) in forward or
backward; and the fused training path: one autograd node with the reference's values and gradients, taken only
where it applies, keeping less."""

import pytest
import torch
from helpers import assert_close, graph_node_names, saved_bytes
from torch.utils._python_dispatch import TorchDispatchMode

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.layers import Mamba
from mamba_parallel.layers.mamba1 import Mamba1Ops, fused_ok
from mamba_parallel.layers.recompute import apply_recompute
from mamba_parallel.ops.selective_scan import launch

pytest.importorskip("triton")
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


# Tests of what the layer keeps, which node runs and bit-equality between two of its paths take a layer half as wide
# (d_inner 16: the interpreted kernels still run several blocks of channels); the value checks keep 16.
NARROW = 8


def _layer(dtype, device="cpu", d_model=16, d_state=4):
    torch.manual_seed(0)
    m = Mamba(d_model, d_state=d_state, d_conv=4, expand=2).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.D.normal_()  # non-trivial skip, conv bias and A so their gradients are checked
        m.conv1d.bias.normal_()
        m.A_log.add_(0.1 * torch.randn_like(m.A_log))
    return m


def _run(m, h, monkeypatch, fused: bool, fn=None, backend="triton", **kwargs):
    """Forward (of ``fn``, default m) + backward of a fixed non-uniform loss on ``backend`` -> [out, dh, m's
    parameter grads] and the graph's node names."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", backend)
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


# ---- the reference forward on the Triton path ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.float32, True), (torch.float16, False)])
def test_reference_forward_on_triton_matches_the_reference_ops(dtype, packed, monkeypatch):
    m = _layer(dtype)
    b, L = (1, 13) if packed else (2, 11)
    h = torch.randn(b, L, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    kw = dict(cu_seqlens=torch.tensor([0, 5, 13], dtype=torch.int32)) if packed else {}
    ref, _ = _run(m, h, monkeypatch, fused=False, backend="naive", **kw)
    got, _ = _run(m, h, monkeypatch, fused=False, **kw)
    for g, r, name in zip(got, ref, _names(m)):
        assert_close(g, r, dtype=dtype, grad=name != "out", name=name)


def test_no_activation_sized_torch_copies(monkeypatch):
    """Every activation-sized layout change runs in the layout op's Triton kernels: one copy in forward (the conv's
    output made token-major); in backward the conv and the gate write dx / dz into in_proj's output gradient."""
    m = _layer(torch.float32)
    b, L = 2, 9
    with _OpLog() as log:
        _run(m, torch.randn(b, L, 16), monkeypatch, fused=False)
    act = b * L * m.d_inner
    big_copies = [(op, n) for op, n in log.ops if op.startswith(_COPIES) and n >= act]
    assert big_copies == [], big_copies
    own = [op for op, _ in log.ops if op.startswith("mamba_parallel.token_major_copy_")]
    assert len(own) == 1, own
    assert any(op.startswith("mamba_parallel.silu_gate_bwd") for op, _ in log.ops)


@pytest.mark.parametrize("fused", [False, True])
def test_activation_checkpointing_keeps_gradients(fused, monkeypatch):
    """Non-reentrant checkpointing (parallelize's) replays the forward: the recomputed layer and the original
    backward nodes must still meet in one in_proj gradient."""
    from torch.utils.checkpoint import checkpoint

    m = _layer(torch.float32, d_model=NARROW)
    h = torch.randn(2, 7, NARROW, generator=torch.Generator().manual_seed(5))
    ref, _ = _run(m, h, monkeypatch, fused)
    got, _ = _run(m, h, monkeypatch, fused, fn=lambda x: checkpoint(m, x, use_reentrant=False))
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


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


# ---- the fused training path ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,b,L,packed,gate_in_scan", [(torch.float32, 2, 19, False, True),
                                                          (torch.float32, 1, 21, True, True),
                                                          (torch.float16, 2, 19, False, True),
                                                          (torch.float32, 2, 19, False, False),
                                                          (torch.float16, 1, 21, True, False)])
def test_fused_matches_the_modular_path(dtype, b, L, packed, gate_in_scan, monkeypatch):
    """Outputs, the input gradient and every parameter gradient (A_log, D, dt bias, conv, projections) on the
    Triton path (interpreter on CPU: chunk 8, so L = 19 crosses several chunks), one node instead of many; with
    the gate inside the scan's forward (one row per channel on a GPU) or in a kernel after it (two rows)."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    gates = []
    if not gate_in_scan:
        monkeypatch.setattr(launch, "GATED_FORWARD_PATHS", frozenset())
        from mamba_parallel.ops.layout import triton_impl as layout

        gate = layout._gate_fwd
        monkeypatch.setattr(layout, "_gate_fwd", lambda y, z: gates.append(y.shape) or gate(y, z))
    m = _layer(dtype)
    h = torch.randn(b, L, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    kw = dict(cu_seqlens=torch.tensor([0, 8, L], dtype=torch.int32)) if packed else {}
    ref, ref_nodes = _run(m, h, monkeypatch, fused=False, **kw)
    got, nodes = _run(m, h, monkeypatch, fused=True, **kw)
    assert "_Mamba1InnerBackward" in nodes and "_Mamba1InnerBackward" not in ref_nodes
    assert not any("SiluGate" in n or "TokenMajor" in n or "BmmBackward" in n for n in nodes), nodes
    assert len(gates) == (0 if gate_in_scan else 1)  # the node's forward gated after the scan
    for g, r, name in zip(got, ref, _names(m)):
        assert g is not None, name
        assert_close(g, r, dtype=dtype, grad=name != "out", name=name)


@pytest.mark.parametrize("fused", [True, False])
def test_bf16_scan_checkpoints_in_both_paths(fused, monkeypatch):
    """``scan_checkpoint_dtype=torch.bfloat16``: the same output bit for bit, the gradients within bf16 rounding of
    the fp32 checkpoints' (fp32 layer; the default picks bf16 only for bf16 inputs). L = 19: three chunks of 8 in
    the interpreter, the backward rebuilding the last two from rounded checkpoints."""
    m = _layer(torch.float32)
    h = torch.randn(2, 19, 16, generator=torch.Generator().manual_seed(1))
    ref, _ = _run(m, h, monkeypatch, fused=fused)
    m.scan_checkpoint_dtype = torch.bfloat16
    got, _ = _run(m, h, monkeypatch, fused=fused)
    assert torch.equal(got[0], ref[0])
    for g, r, name in zip(got[1:], ref[1:], _names(m)[1:]):
        assert_close(g, r, dtype=torch.bfloat16, grad=True, name=name)
    assert not torch.equal(m.A_log.grad, ref[_names(m).index("A_log")])


def test_scan_checkpoint_dtype_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="scan_checkpoint_dtype must be"):
        Mamba(16, scan_checkpoint_dtype=torch.float16)
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = Mamba(16, scan_checkpoint_dtype=torch.bfloat16, recompute="states")
    with pytest.raises(ValueError, match="recompute 'states' keeps one fp32 scan checkpoint"):
        m(torch.randn(1, 9, 16, requires_grad=True))


def test_fused_matches_the_reference_ops(monkeypatch):
    """Against the pure-PyTorch reference ops (the modular layer on MAMBA_PARALLEL_BACKEND=naive)."""
    m = _layer(torch.float32)
    h = torch.randn(2, 17, 16, generator=torch.Generator().manual_seed(2))
    ref, _ = _run(m, h, monkeypatch, fused=True, backend="naive")
    got, nodes = _run(m, h, monkeypatch, fused=True)
    assert "_Mamba1InnerBackward" in nodes
    for g, r, name in zip(got, ref, _names(m)):
        assert_close(g, r, dtype=torch.float32, grad=name != "out", name=name)


def test_frozen_parameters_get_no_gradient(monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32, d_model=NARROW)
    m.A_log.requires_grad_(False)
    m.conv1d.requires_grad_(False)
    got, nodes = _run(m, torch.randn(2, 9, NARROW), monkeypatch, fused=True)
    assert "_Mamba1InnerBackward" in nodes
    assert m.A_log.grad is None and m.conv1d.weight.grad is None and m.x_proj.weight.grad is not None


def test_where_the_fused_path_does_not_apply(monkeypatch):
    """Off: naive backend, no autograd, use_fused_path=False, a gate recompute, sequence ops that communicate
    (context / tensor parallelism install such strategies: layers/seq_ops.py)."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32, d_model=NARROW)
    xz = torch.randn(1, 5, 2 * m.d_inner, requires_grad=True)
    assert fused_ok(xz)
    with torch.no_grad():
        assert not fused_ok(xz)
    assert not fused_ok(xz.detach())
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    assert not fused_ok(xz)
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    h = torch.randn(1, 5, NARROW)
    assert "_Mamba1InnerBackward" in _run(m, h, monkeypatch, fused=True)[1]
    assert "_Mamba1InnerBackward" not in _run(m, h, monkeypatch, fused=False)[1]

    class Communicating(Mamba1Ops):
        local = False

    m.seq_ops = Communicating()
    assert "_Mamba1InnerBackward" not in _run(m, h, monkeypatch, fused=True)[1]
    m.seq_ops = Mamba1Ops()
    # a gate recompute: nothing to do with out_proj in the node (it keeps no out_proj input); with an out_proj the
    # node cannot take in (a hook), the modular path rebuilds out_proj's input through saved-tensor hooks
    apply_recompute(m, "conv,gate")
    assert "_Mamba1InnerBackward" in _run(m, h, monkeypatch, fused=True)[1]
    hook = m.out_proj.register_forward_hook(lambda mod, args, out: None)
    assert "_Mamba1InnerBackward" not in _run(m, h, monkeypatch, fused=True)[1]
    hook.remove()


def test_fused_keeps_no_delta_and_rebuilds_the_conv_on_request(monkeypatch):
    """delta is never kept (rebuilt by its matmul); recompute=conv (or conv,dt) drops the conv output too;
    gradients bit-identical either way."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    m = _layer(torch.float32, d_model=NARROW)
    b, L = 2, 12
    h = torch.randn(b, L, NARROW, generator=torch.Generator().manual_seed(6))
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
    # against the modular layer: no delta, no scan output y, no out_proj input, no exp(A_log) output (fp32 here:
    # B / C need no fp32 copy)
    assert modular - saved[""] == 4 * (3 * b * L * m.d_inner + m.d_inner * m.d_state)


@pytest.mark.parametrize("bias", [False, True])
def test_out_proj_in_the_node_is_exact(bias, monkeypatch):
    """out_proj inside the node (its input written again by the scan's backward) gives the values of the node
    followed by out_proj as a module (a forward hook keeps it outside), bit for bit, and keeps b * L * d_inner
    values less; a frozen out_proj gets no gradient."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    torch.manual_seed(0)
    m = Mamba(NARROW, d_state=4, bias=bias)
    b, L = 2, 7
    h = torch.randn(b, L, NARROW, generator=torch.Generator().manual_seed(3))
    saved = []
    counted = lambda x: saved.append(saved_bytes(m, lambda: m(x))) or saved[-1][0]  # noqa: E731
    inside, nodes = _run(m, h, monkeypatch, fused=True, fn=counted)
    hook = m.out_proj.register_forward_hook(lambda mod, args, out: None)
    outside, outside_nodes = _run(m, h, monkeypatch, fused=True, fn=counted)
    hook.remove()
    assert "_Mamba1InnerBackward" in nodes and "_Mamba1InnerBackward" in outside_nodes
    for g, r, name in zip(inside, outside, _names(m)):
        assert torch.equal(g, r), name
    assert saved[1][1] - saved[0][1] == 4 * b * L * m.d_inner
    if bias:
        m.out_proj.requires_grad_(False)
        _run(m, h, monkeypatch, fused=True)
        assert m.out_proj.weight.grad is None and m.out_proj.bias.grad is None and m.x_proj.weight.grad is not None


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


@pytest.mark.gpu
def test_gpu_out_proj_in_the_node_under_autocast(monkeypatch, nan_poison):
    """Training's setting (fp32 parameters, bf16 autocast) at mamba-130m's layer shape: out_proj inside the node
    gives the values of out_proj as a module after it (same GEMMs) and fp32 weight gradients, keeping neither its
    input nor its weight's bf16 copy."""
    m = _layer(torch.float32, "cuda", d_model=768, d_state=16)
    h = torch.randn(2, 1000, 768, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    saved = []
    counted = lambda x: saved.append(saved_bytes(m, lambda: m(x))) or saved[-1][0]  # noqa: E731
    with torch.autocast("cuda", dtype=torch.bfloat16):
        inside, _ = _run(m, h, monkeypatch, fused=True, fn=counted)
        hook = m.out_proj.register_forward_hook(lambda mod, args, out: None)
        outside, _ = _run(m, h, monkeypatch, fused=True, fn=counted)
        hook.remove()
    assert saved[1][1] - saved[0][1] == 2 * (2000 * m.d_inner + m.out_proj.weight.numel())
    assert all(g.dtype == torch.float32 for g in inside[2:])  # every parameter's gradient, out_proj's too
    for g, r, name in zip(inside, outside, _names(m)):
        assert g.dtype == r.dtype, name
        assert_close(g, r, dtype=torch.bfloat16, grad=name != "out", factor=0.5, name=name)


@pytest.mark.gpu
def test_gpu_bf16_reference_forward_matches_reference_ops_without_copies(monkeypatch):
    m = _layer(torch.bfloat16, "cuda")
    b, L = 2, 300
    h = torch.randn(b, L, 16, device="cuda", dtype=torch.bfloat16)
    ref, _ = _run(m, h, monkeypatch, fused=False, backend="naive")
    with _OpLog() as log:
        got, _ = _run(m, h, monkeypatch, fused=False)
    for gv, r, name in zip(got, ref, _names(m)):
        assert_close(gv, r, dtype=torch.bfloat16, grad=name != "out", factor=2, name=name)
    act = b * L * m.d_inner
    assert [(op, n) for op, n in log.ops if op.startswith(_COPIES) and n >= act] == []
