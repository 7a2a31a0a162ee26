"""The eager fast path around the custom ops (ops/eager_fastpath.py): in eager mode the op's Python body runs
directly (through a plain autograd.Function), with the same outputs, gradients and saved tensors as the custom op
(``use_eager_fastpath(False)``); torch.compile still sees the custom op; unused outputs' gradients arrive as None.

CPU: the Triton kernels run in the interpreter (tiny shapes); fp32 results must be bit-for-bit equal.
"""

import contextlib
from typing import Optional

import pytest
import torch
from torch._library.custom_ops import CustomOpDef
from torch.utils._python_dispatch import TorchDispatchMode

from mamba_parallel.ops import eager_fastpath as ef
from mamba_parallel.ops import use_backend
from mamba_parallel.ops.eager_fastpath import eager, fastpath, use_eager_fastpath

pytest.importorskip("triton")

from mamba_parallel.ops.conv1d import triton_impl as conv  # noqa: E402
from mamba_parallel.ops.cross_entropy import triton_impl as ce  # noqa: E402
from mamba_parallel.ops.layout import triton_impl as m1k  # noqa: E402
from mamba_parallel.ops.norm import triton_impl as norm  # noqa: E402
from mamba_parallel.ops.selective_scan import triton_impl as scan  # noqa: E402
from mamba_parallel.ops.ssd import triton_impl as ssd  # noqa: E402


# ------------------------------------------------------------------------------------------------- harness

@pytest.fixture
def op_calls(monkeypatch):
    """Names of the custom ops called from Python (CustomOpDef.__call__), in order."""
    calls = []
    real = CustomOpDef.__call__

    def counting(self, *args, **kwargs):
        calls.append(self._qualname)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CustomOpDef, "__call__", counting)
    return calls


def _leaves(inputs: dict) -> dict:
    """Fresh leaves: floating-point tensors require grad (detach keeps non-contiguous strides)."""
    return {k: (v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v)
            for k, v in inputs.items()}


def _run(fn, inputs: dict, loss_of):
    """fn(**leaves) -> (outputs, {name: grad}) after backward of loss_of(outputs)."""
    leaves = _leaves(inputs)
    out = fn(**leaves)
    loss_of(out).backward()
    outs = out if isinstance(out, tuple) else (out,)
    return [o.detach() for o in outs], {k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor)
                                        and v.requires_grad}


def _weights(t: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(t.dtype)


def _wsum(*outs) -> torch.Tensor:
    return sum((o.float() * _weights(o, i).float()).sum() for i, o in enumerate(outs))


def _both_paths(monkeypatch, op_calls, fn, inputs, loss_of, ops):
    """Runs fn with the fast path on and off: asserts bit-identical outputs and gradients, that the fast path
    called none of the custom ops ``ops`` and the op path all of them."""
    results = {}
    for flag in ("1", "0"):
        set_fastpath(flag)
        op_calls.clear()
        results[flag] = _run(fn, inputs, loss_of)
        called = set(op_calls) & set(ops)
        assert called == (set() if flag == "1" else set(ops)), (flag, op_calls)
    (out_f, g_f), (out_o, g_o) = results["1"], results["0"]
    for a, b in zip(out_f, out_o):
        assert torch.equal(a, b)
    assert g_f.keys() == g_o.keys()
    for k in g_f:
        assert (g_f[k] is None) == (g_o[k] is None), k
        if g_f[k] is not None:
            assert torch.equal(g_f[k], g_o[k]), k
    return results["1"]


def _rnd(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(autouse=True)
def _triton_backend():
    with use_backend("triton"):
        yield
    _fastpath_choice.close()


_fastpath_choice = contextlib.ExitStack()


def set_fastpath(flag: str) -> None:
    """The eager fast path on ("1") or off ("0", every call through the custom op) for the rest of the test."""
    _fastpath_choice.close()
    _fastpath_choice.enter_context(use_eager_fastpath(flag == "1"))


# ---------------------------------------------------------------------------------------------- op families

def _scan_inputs(L=11):
    b, d, n = 2, 8, 4
    return dict(u=_rnd(b, d, L, seed=1), delta=_rnd(b, d, L, seed=2, scale=0.5), A=-(_rnd(d, n, seed=3).abs() + 0.2),
                B=_rnd(b, n, L, seed=4), C=_rnd(b, n, L, seed=5), D=_rnd(d, seed=6), z=_rnd(b, d, L, seed=7),
                delta_bias=_rnd(d, seed=8, scale=0.3), initial_state=_rnd(b, d, n, seed=9))


def test_selective_scan(monkeypatch, op_calls):
    fn = lambda **kw: scan.selective_scan(**kw, delta_softplus=True, return_last_state=True)  # noqa: E731
    _both_paths(monkeypatch, op_calls, fn, _scan_inputs(), lambda o: _wsum(*o),
                ["mamba_parallel::selective_scan_fwd", "mamba_parallel::selective_scan_bwd"])


def test_conv1d(monkeypatch, op_calls):
    b, d, L, w = 2, 6, 9, 4
    x = _rnd(b, L, d, seed=1).transpose(1, 2)  # channels-last, as in the layers
    inputs = dict(x=x, weight=_rnd(d, w, seed=2), bias=_rnd(d, seed=3), initial_state=_rnd(b, d, w - 1, seed=4))
    fn = lambda **kw: conv.causal_conv1d(**kw, activation="silu", return_final_state=True)  # noqa: E731
    ops = ["mamba_parallel::causal_conv1d_fwd", "mamba_parallel::causal_conv1d_bwd"]
    _both_paths(monkeypatch, op_calls, fn, inputs, lambda o: _wsum(*o), ops)
    # only the final state reaches the loss: y's gradient is None on the fast path, zeros on the op's
    _both_paths(monkeypatch, op_calls, fn, inputs, lambda o: _wsum(o[1]), ops)


def test_conv1d_update_mutates_in_place(monkeypatch, op_calls):
    b, d, w = 2, 6, 4
    x, weight, bias = _rnd(b, d, seed=1), _rnd(d, w, seed=2), _rnd(d, seed=3)
    got = {}
    for flag in ("1", "0"):
        set_fastpath(flag)
        op_calls.clear()
        state = _rnd(b, d, w - 1, seed=4)
        version = state._version
        y = conv.causal_conv1d_update(x, state, weight, bias, activation="silu")
        assert state._version > version  # bumped as the op's mutation would
        assert (op_calls == []) == (flag == "1"), op_calls
        got[flag] = (y, state)
    assert torch.equal(got["1"][0], got["0"][0]) and torch.equal(got["1"][1], got["0"][1])
    assert not torch.equal(got["1"][1], _rnd(b, d, w - 1, seed=4))  # the state did shift


def test_norms(monkeypatch, op_calls):
    M, d = 5, 16
    ops = ["mamba_parallel::rms_norm_fwd", "mamba_parallel::rms_norm_bwd"]
    x, r, z, wt = _rnd(M, d, seed=1), _rnd(M, d, seed=2), _rnd(M, d, seed=3), _rnd(d, seed=4) + 1
    _both_paths(monkeypatch, op_calls, lambda **kw: norm.rms_norm(**kw), dict(x=x, weight=wt), _wsum, ops)
    _both_paths(monkeypatch, op_calls, lambda **kw: norm.gated_rms_norm(**kw, group_size=8, norm_before_gate=True),
                dict(x=x, z=z, weight=wt), _wsum, ops)
    add = lambda **kw: norm.add_rms_norm(**kw)  # noqa: E731
    _both_paths(monkeypatch, op_calls, add, dict(x=x, residual=r, weight=wt), lambda o: _wsum(*o), ops)
    # only the new residual reaches the loss: the normed output's gradient is None on the fast path
    _both_paths(monkeypatch, op_calls, add, dict(x=x, residual=r, weight=wt), lambda o: _wsum(o[1]), ops)


def _ssd_inputs():
    b, L, h, p, n = 1, 20, 2, 8, 8
    return dict(x=_rnd(b, L, h, p, seed=1), dt=_rnd(b, L, h, seed=2, scale=0.5) - 1, A=-torch.exp(_rnd(h, seed=3)),
                B=_rnd(b, L, 1, n, seed=4), C=_rnd(b, L, 1, n, seed=5), D=_rnd(h, seed=6), z=_rnd(b, L, h, p, seed=7),
                dt_bias=_rnd(h, seed=8, scale=0.3), initial_states=_rnd(b, h, p, n, seed=9))


@pytest.mark.parametrize("final", [True, False], ids=["with_final", "y_only"])
def test_ssd(monkeypatch, op_calls, final):
    fn = lambda **kw: ssd.ssd_chunk_scan(**kw, chunk_size=16, dt_softplus=True,  # noqa: E731
                                         return_final_states=final)
    _both_paths(monkeypatch, op_calls, fn, _ssd_inputs(), lambda o: _wsum(*o) if final else _wsum(o),
                ["mamba_parallel::ssd_chunk_scan_fwd", "mamba_parallel::ssd_chunk_scan_bwd"])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy(monkeypatch, op_calls, reduction):
    N, d, V = 6, 8, 24
    labels = torch.tensor([1, 5, -100, 23, 0, 7])
    inputs = dict(hidden=_rnd(N, d, seed=1), weight=_rnd(V, d, seed=2), labels=labels)
    fn = lambda **kw: ce.linear_cross_entropy(**kw, reduction=reduction, chunk_size=4)  # noqa: E731
    ops = (["mamba_parallel::linear_cross_entropy_fused"] if reduction == "mean" else
           ["mamba_parallel::linear_cross_entropy_rows", "mamba_parallel::linear_cross_entropy_rows_bwd"])
    _both_paths(monkeypatch, op_calls, fn, inputs, _wsum, ops)


def test_layout_kernels(monkeypatch, op_calls):
    """copy_ / gate_fwd / gate_bwd: direct calls, same results, mutated outputs written in place."""
    b, d, L = 2, 6, 5
    y, z = _rnd(b, d, L, seed=1), _rnd(b, L, d, seed=2).transpose(1, 2)
    dout = _rnd(b, L, d, seed=3)
    got = {}
    for flag in ("1", "0"):
        set_fastpath(flag)
        op_calls.clear()
        dst = torch.empty(b, L, d).transpose(1, 2)
        v = dst._version
        m1k.copy_(y, dst)
        assert dst._version > v
        dz = torch.empty(b, d, L)
        out = m1k.gate_fwd(y, z)
        dy = m1k.gate_bwd(dout, y, z, dz)
        assert (op_calls == []) == (flag == "1"), op_calls
        got[flag] = (dst.clone(), out, dy, dz)
    assert torch.equal(got["1"][0], y)
    for a, b_ in zip(got["1"], got["0"]):
        assert torch.equal(a, b_)


# ------------------------------------------------------------------------------------- whole layers

@pytest.mark.parametrize("kind,mode", [("mamba1", "checkpoint"), ("mamba2", "recompute"), ("mamba2", "plain")])
def test_layers_match_the_op_path(monkeypatch, op_calls, kind, mode):
    """Mamba / Mamba2 layers (Triton path) forward + backward: bit-identical with and without the fast path, also
    under recompute (saved-tensor hooks) and non-reentrant activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    from mamba_parallel.layers.mamba1 import Mamba
    from mamba_parallel.layers.mamba2 import Mamba2

    items = "conv,dt,gate,states" if mode == "recompute" else ""
    torch.manual_seed(0)
    # the modular Mamba-1 layer (its fused middle calls the kernels' Python directly, with no ops to compare)
    layer = (Mamba(16, d_state=4, use_fused_path=False, recompute=items) if kind == "mamba1" else
             Mamba2(16, d_state=8, headdim=8, ngroups=1, chunk_size=16, recompute=items))
    h = _rnd(1, 9, layer.d_model, seed=3)
    fn = (lambda hidden: checkpoint(layer, hidden, use_reentrant=False)) if mode == "checkpoint" else layer
    results = {}
    for flag in ("1", "0"):
        set_fastpath(flag)
        layer.zero_grad()
        op_calls.clear()
        out, grads = _run(lambda hidden: fn(hidden), dict(hidden=h), _wsum)
        assert (op_calls == []) == (flag == "1"), op_calls
        results[flag] = out + [grads["hidden"]] + [p.grad for p in layer.parameters()]
    for a, b in zip(results["1"], results["0"]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ unused gradients, saved tensors

def test_unused_output_gradients_are_none(monkeypatch):
    """Only y reaches the loss: on the fast path the scan's backward gets None for last_state (and the
    checkpoints) and calls the backward op with dlast=None; the custom op hands it allocated zeros."""
    seen = []
    real = eager(scan.selective_scan_bwd)

    def spy(*args):
        seen.append(args[12])  # dlast
        return real(*args)

    monkeypatch.setattr(scan.selective_scan_bwd, ef._ATTR, spy)
    set_fastpath("1")
    leaves = _leaves(_scan_inputs())
    y = scan.selective_scan(**leaves, delta_softplus=True, return_last_state=True)[0]
    _wsum(y).backward()
    assert seen == [None]
    seen.clear()
    set_fastpath("0")
    leaves = _leaves(_scan_inputs())
    _wsum(scan.selective_scan(**leaves, delta_softplus=True, return_last_state=True)[0]).backward()
    (dlast,) = seen  # the custom op's backward: materialised zeros
    assert isinstance(dlast, torch.Tensor) and not dlast.any()


def _saved(fn, inputs):
    """(shape, dtype, stride) of every tensor autograd saves while fn(**leaves) runs."""
    packed = []

    def pack(t):
        packed.append((tuple(t.shape), t.dtype, t.stride()))
        return t

    leaves = _leaves(inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(**leaves)
    return packed


def test_same_saved_tensors(monkeypatch):
    cases = [
        (lambda **kw: scan.selective_scan(**kw, delta_softplus=True, return_last_state=True), _scan_inputs()),
        (lambda **kw: ssd.ssd_chunk_scan(**kw, chunk_size=16, dt_softplus=True), _ssd_inputs()),
    ]
    for fn, inputs in cases:
        set_fastpath("1")
        fast = _saved(fn, inputs)
        set_fastpath("0")
        assert fast == _saved(fn, inputs) and fast


# ----------------------------------------------------------------------------------------------- torch.compile

def test_compile_keeps_the_custom_op(monkeypatch):
    """Under torch.compile the graph holds the custom op (the fast path is eager only); results match eager."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    set_fastpath("1")
    M, d = 4, 16
    x, wt = _rnd(M, d, seed=1), _rnd(d, seed=2) + 1
    f = lambda x, weight: norm.rms_norm(x, weight)  # noqa: E731
    eager_out, eager_g = _run(lambda **kw: f(**kw), dict(x=x, weight=wt), _wsum)
    torch._dynamo.reset()
    comp = torch.compile(f, backend=backend, fullgraph=True)
    comp_out, comp_g = _run(lambda **kw: comp(**kw), dict(x=x, weight=wt), _wsum)
    torch._dynamo.reset()
    assert any("rms_norm_fwd" in t for t in targets), targets
    assert torch.equal(comp_out[0], eager_out[0])
    for k in eager_g:
        assert torch.equal(comp_g[k], eager_g[k]), k


# --------------------------------------------------------------------------------- the adapter on a toy op

_toy_calls = []


def _toy_impl(x: torch.Tensor, y: torch.Tensor, scale: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y (n,) -> (x * scale, x + y)."""
    return x * scale, x + y


toy_op = torch.library.custom_op("mp_test_fastpath::toy", mutates_args=())(_toy_impl)


@toy_op.register_fake
def _(x, y, scale=2.0):
    return torch.empty_like(x), torch.empty_like(x)


def _toy_setup(ctx, inputs, output):
    ctx.scale = inputs[2]
    ctx.save_for_backward(inputs[0])


def _toy_backward(ctx, g0, g1):
    _toy_calls.append((g0, g1))
    gx = None if g0 is None else g0 * ctx.scale
    if g1 is not None:
        gx = g1 if gx is None else gx + g1
    return gx, g1, None


toy_op.register_autograd(_toy_backward, setup_context=_toy_setup)
toy = fastpath(toy_op, _toy_impl, setup_context=_toy_setup, backward=_toy_backward)


def _toy_grad_fn(monkeypatch, flag, *args, **kwargs):
    set_fastpath(flag)
    return type(toy(*args, **kwargs)[0].grad_fn).__name__


def test_adapter_routing(monkeypatch):
    """Fast path: the adapter's Function; op path (env, kwargs, dispatch mode, tensor subclass): the op's."""
    x, y = torch.randn(3, requires_grad=True), torch.randn(3)
    assert eager(toy_op) is toy and toy.__doc__ == _toy_impl.__doc__
    assert "eager" in _toy_grad_fn(monkeypatch, "1", x, y)
    assert "GeneratedBackwardFor" in _toy_grad_fn(monkeypatch, "0", x, y)
    assert "GeneratedBackwardFor" in _toy_grad_fn(monkeypatch, "1", x, y, scale=3.0)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert "GeneratedBackwardFor" in _toy_grad_fn(monkeypatch, "1", x, y)
    set_fastpath("1")
    with torch.no_grad():
        assert toy(x, y)[0].grad_fn is None
    assert toy(x.detach(), y)[0].grad_fn is None  # no input requires grad: no graph node
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:  # fake tensors take the op (its fake implementation)
        out = toy(mode.from_tensor(x), mode.from_tensor(y))
    assert type(out[0]).__name__ == "FakeTensor"


def test_adapter_defaults_gradients_and_none(monkeypatch):
    """Defaults filled for setup_context, gradients equal to the op's, unused outputs' gradients None (the op
    materialises zeros)."""
    x, y = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    grads = {}
    for flag in ("1", "0"):
        set_fastpath(flag)
        _toy_calls.clear()
        a, _ = toy(x, y)
        gx, = torch.autograd.grad(a.sum(), x)
        (g0, g1), = _toy_calls
        assert g0 is not None and (g1 is None) == (flag == "1")
        grads[flag] = gx
    assert torch.equal(grads["1"], grads["0"]) and torch.equal(grads["1"], torch.full((4,), 2.0))
    gcheck = lambda x, y: toy(x, y, 1.5)  # noqa: E731
    set_fastpath("1")
    assert torch.autograd.gradcheck(gcheck, (x.double().detach().requires_grad_(), y.double().detach()
                                             .requires_grad_()))


def test_adapter_rejects_wrong_registration():
    with pytest.raises(ValueError, match="both"):
        fastpath(toy_op, _toy_impl, setup_context=_toy_setup)
    with pytest.raises(ValueError, match="backward"):
        fastpath(toy_op, _toy_impl, setup_context=_toy_setup, backward=lambda ctx, a, b: (a, b, None))


def test_adapter_rejects_defaulted_mutated_arguments():
    """A mutated argument with a default is refused when the fast path is made (torch 2.11's in-place bookkeeping
    indexes mutated arguments by position after dropping trailing defaults: an IndexError at the first call)."""

    def fill(x: torch.Tensor, dst: torch.Tensor, extra: Optional[torch.Tensor] = None) -> None:
        dst.copy_(x)

    op = torch.library.custom_op("mamba_parallel_test::fill_defaulted_", mutates_args=("dst", "extra"))(fill)
    with pytest.raises(ValueError, match=r"mutated arguments \[2\] have defaults"):
        fastpath(op, fill)


# ---------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2", "tiny-hybrid"])
def test_gpu_models_match_the_op_path(monkeypatch, op_calls, preset):
    """Whole models on CUDA (the Triton kernels, fp32, L = 200: several chunks): loss and every parameter's gradient
    with the fast path equal the custom-op path's (to fp32 rounding, in case a kernel sums in a varying order), and
    the fast path dispatches no custom op."""
    from mamba_parallel import MambaLMHeadModel, get_preset

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(preset)).cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 201), device="cuda")
    results = {}
    for flag in ("1", "0"):
        set_fastpath(flag)
        model.zero_grad(set_to_none=True)
        op_calls.clear()
        loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
        loss.backward()
        assert (op_calls == []) == (flag == "1"), op_calls[:5]
        results[flag] = [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]
    for a, b in zip(results["1"], results["0"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
