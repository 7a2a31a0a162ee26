"""Triton SSD chunked scan vs the float64 reference: outputs, final states and every gradient.

CPU: the kernels run in the Triton interpreter (fp32 / fp16, tiny shapes). GPU tests (bf16 / fp16 / fp32,
realistic shapes) carry the ``gpu`` mark.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from helpers import assert_close, saved_bytes
from mamba_parallel.ops.ssd import naive
from mamba_parallel.ops.ssd import triton_impl

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(b, L, h, p, n, g, dtype, device=DEV, D="h", z=False, init=True, nstates=None, seed=0,
                A_scale=1.0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device)

    args = dict(
        x=r(b, L, h, p).to(dtype), dt=r(b, L, h, scale=0.5, shift=-1.0).to(dtype),
        A=-torch.exp(r(h, scale=0.5)) * A_scale, B=r(b, L, g, n).to(dtype), C=r(b, L, g, n).to(dtype),
        D=(r(h) if D == "h" else r(h, p)) if D else None, z=r(b, L, h, p).to(dtype) if z else None,
        dt_bias=r(h, scale=0.3), initial_states=r(nstates or b, h, p, n) if init else None,
    )
    return args


GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def run(fn, args, kw, gy, gf):
    """Forward, a random linear loss on y and the final states, backward -> (y, final, {name: grad})."""
    # detach (not clone) keeps the strides of non-contiguous inputs
    leaves = {k: v.detach().requires_grad_(True) if v is not None else None for k, v in args.items()}
    y, final = fn(**leaves, **kw, return_final_states=True)
    loss = (y.float() * gy).sum() + (final.float() * gf).sum()
    loss.backward()
    return y.detach(), final.detach(), {k: leaves[k].grad for k in GRAD_NAMES if leaves[k] is not None}


def loss_weights(args, kw):
    """The random weights of the linear loss on y and on the final states (a fixed seed: every run gets the same)."""
    b, L, h, p = args["x"].shape
    nst = args["initial_states"].shape[0] if args["initial_states"] is not None else (
        kw["cu_seqlens"].numel() - 1 if kw.get("cu_seqlens") is not None else b)
    gen = torch.Generator().manual_seed(123)
    gy = torch.randn(b, L, h, p, generator=gen).to(args["x"].device)
    gf = torch.randn(nst, h, p, args["B"].shape[-1], generator=gen).to(args["x"].device)
    return gy, gf


def check_against_reference(args, kw, dtype, factor=1.0):
    ref_args = {k: v.double() if v is not None else None for k, v in args.items()}
    gy, gf = loss_weights(args, kw)
    got = run(triton_impl.ssd_chunk_scan, args, kw, gy, gf)
    y, final, grads = got
    assert y.dtype == dtype and final.dtype == torch.float32
    assert all(g.dtype == args[k].dtype for k, g in grads.items()), {k: g.dtype for k, g in grads.items()}
    assert_runs_close(got, run(naive.ssd_chunk_scan, ref_args, kw, gy.double(), gf.double()), dtype, factor)


def assert_runs_close(got, want, dtype, factor=1.0):
    """Two runs' (y, final states, {name: grad}) agree to ``dtype``'s tolerances."""
    assert_close(got[0], want[0], dtype, name="y", factor=factor)
    assert_close(got[1], want[1], dtype, name="final_states", factor=factor)
    assert set(got[2]) == set(want[2])
    for k in want[2]:
        assert_close(got[2][k], want[2][k], dtype, grad=True, name=f"d{k}", factor=factor)


CASES = {
    # name: (b, L, h, p, n, g, chunk, input options, scan options)
    "plain": (2, 45, 4, 16, 16, 1, 16, dict(), dict(dt_softplus=True)),
    "gate_groups_limit": (1, 37, 4, 16, 32, 2, 32, dict(D="hp", z=True),
                          dict(dt_softplus=True, dt_limit=(0.2, 0.5))),
    "no_extras": (1, 32, 2, 16, 16, 1, 16, dict(D=None, init=False), dict()),
    # the decay across one chunk underflows fp32 (exp(-100)); the padded tail of the last chunk must not make
    # exp(+100) * 0 = NaN
    "steep_decay_tail": (1, 62, 2, 16, 16, 1, 32, dict(A_scale=15.0), dict(dt_softplus=True)),
}


# fp16 is left out of the steep case: its dA is a sum of large, nearly cancelling terms there
@pytest.mark.parametrize("case,dtype", [(c, d) for c in CASES for d in (torch.float32, torch.float16)
                                        if not (c == "steep_decay_tail" and d == torch.float16)])
def test_matches_reference(case, dtype):
    b, L, h, p, n, g, chunk, opts, kw = CASES[case]
    args = make_inputs(b, L, h, p, n, g, dtype, **opts)
    if not kw.get("dt_softplus"):  # raw dt is used as is: keep it positive, as a real model's would be
        args["dt"] = torch.nn.functional.softplus(args["dt"].float()).to(dtype)
    check_against_reference(args, dict(chunk_size=chunk, **kw), dtype)


@pytest.fixture(params=["sweep", "wide"])
def states_path(request, monkeypatch):
    """The forward's chunk states by the one-sweep kernel or computed in parallel then chained (triton_impl picks
    by how many (row, head) pairs there are; tests take each)."""
    monkeypatch.setattr(triton_impl, "sweep_states", lambda pairs, device: request.param == "sweep")
    return request.param


@pytest.mark.parametrize("layout", ["seq_idx", "cu_seqlens"])
def test_parallel_chunk_states(monkeypatch, layout):
    """The forward's states computed in parallel then chained (what few (row, head) pairs get on a GPU), through the
    packed layouts' segment codes: initial states, resets inside a row, an empty sequence."""
    monkeypatch.setattr(triton_impl, "sweep_states", lambda pairs, device: False)
    h, p, n, chunk = 2, 16, 16, 16
    if layout == "seq_idx":
        args = make_inputs(2, 40, h, p, n, 1, torch.float32, z=True)
        kw = dict(seq_idx=torch.tensor([[0] * 5 + [1] * 20 + [2] * 15, [0] * 16 + [3] * 24], dtype=torch.int32,
                                       device=DEV))
    else:
        args = make_inputs(1, 50, h, p, n, 1, torch.float32, nstates=4)
        kw = dict(cu_seqlens=torch.tensor([0, 7, 7, 30, 50], dtype=torch.int32, device=DEV))
    check_against_reference(args, dict(chunk_size=chunk, dt_softplus=True, **kw), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_seq_idx(dtype):
    b, L, h, p, n, chunk = 2, 40, 2, 16, 16, 16
    args = make_inputs(b, L, h, p, n, 1, dtype, z=True)
    seq_idx = torch.tensor([[0] * 5 + [1] * 20 + [2] * 15, [0] * 16 + [3] * 24], dtype=torch.int32, device=DEV)
    check_against_reference(args, dict(chunk_size=chunk, dt_softplus=True, seq_idx=seq_idx), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cu_seqlens(dtype):
    h, p, n, chunk = 2, 16, 16, 16
    cu = torch.tensor([0, 7, 7, 30, 50], dtype=torch.int32, device=DEV)  # includes an empty sequence
    args = make_inputs(1, 50, h, p, n, 1, dtype, nstates=4)
    check_against_reference(args, dict(chunk_size=chunk, dt_softplus=True, cu_seqlens=cu), dtype)


def test_blocks_larger_than_chunk(monkeypatch):
    """GPU configs use 64-row blocks, so a chunk of 16 or 32 leaves block rows past the chunk end; with a steep
    decay those must not turn into exp(+big) * 0 = NaN. Interpreter blocks are made 32 wide here to cover it."""
    from mamba_parallel.ops.ssd import triton_tuning

    for name, (gpu, interp, keys, *fp32_gpu) in list(triton_tuning._CONFIGS.items()):
        wide = triton.Config({k: 32 if k.startswith("BLOCK_") else v for k, v in interp.kwargs.items()}, num_warps=4,
                             num_stages=2)
        monkeypatch.setitem(triton_tuning._CONFIGS, name, (gpu, wide, keys, *fp32_gpu))
    monkeypatch.setattr(triton_tuning.tuned, "_cache", {})
    args = make_inputs(1, 29, 2, 16, 16, 1, torch.float32, A_scale=30.0)
    check_against_reference(args, dict(chunk_size=16, dt_softplus=True), torch.float32)


@pytest.mark.parametrize("heads", [1, 2])
def test_chunk_output_heads_per_program(monkeypatch, heads):
    """The chunk-output kernel runs one or two heads of a group per program (sharing C.B); with an odd number of
    heads per group the last program's second head is past the group and must store nothing."""
    from mamba_parallel.ops.ssd import triton_tuning

    gpu, interp, keys, *rest = triton_tuning._CONFIGS["scan_fwd"]
    one = triton.Config({**interp.kwargs, "HEADS": heads}, num_warps=4, num_stages=2)
    monkeypatch.setitem(triton_tuning._CONFIGS, "scan_fwd", (gpu, one, keys, *rest))
    monkeypatch.setattr(triton_tuning.tuned, "_cache", {})
    args = make_inputs(1, 37, 6, 16, 16, 2, torch.float32, z=True)  # 3 heads per group
    check_against_reference(args, dict(chunk_size=16, dt_softplus=True), torch.float32)


def test_strided_inputs():
    """x, B, C, dt as views into one projection output (as a Mamba-2 layer produces them), D a (p, h) transpose."""
    b, L, h, p, n, g = 1, 37, 2, 16, 16, 1
    base = make_inputs(b, L, h, p, n, g, torch.float32, D="hp", z=True)
    proj = torch.cat([base["z"].flatten(2), base["x"].flatten(2), base["B"].flatten(2), base["C"].flatten(2),
                      base["dt"]], dim=-1)
    d = h * p
    args = dict(base, z=proj[..., :d].unflatten(-1, (h, p)), x=proj[..., d:2 * d].unflatten(-1, (h, p)),
                B=proj[..., 2 * d:2 * d + g * n].unflatten(-1, (g, n)),
                C=proj[..., 2 * d + g * n:2 * d + 2 * g * n].unflatten(-1, (g, n)), dt=proj[..., -h:],
                D=base["D"].t().contiguous().t())
    assert not args["x"].is_contiguous() and not args["dt"].is_contiguous()
    check_against_reference(args, dict(chunk_size=16, dt_softplus=True), torch.float32)


def test_matches_sequential_recurrence():
    """The independent token-by-token formulation agrees too (guards against a shared chunking mistake)."""
    args = make_inputs(1, 23, 2, 16, 16, 1, torch.float32, z=True)
    y = triton_impl.ssd_chunk_scan(**args, chunk_size=16, dt_softplus=True)
    y_ref = naive.ssd_sequential(**{k: v.double() if v is not None else None for k, v in args.items()},
                                 dt_softplus=True)
    assert_close(y, y_ref, torch.float32, name="y")


def test_recompute_states_option_keeps_less():
    """recompute_states=True: the backward rebuilds dt, the decay and the chunk states; the forward keeps fewer
    bytes and every gradient is the same bit for bit."""
    args = make_inputs(2, 40, 2, 16, 16, 1, torch.float32, z=True)
    results = {}
    for recompute in (False, True):
        leaves = {k: (v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        y, kept = saved_bytes(torch.nn.Module(), lambda: triton_impl.ssd_chunk_scan(
            **leaves, chunk_size=16, dt_softplus=True, recompute_states=recompute))
        grads = torch.autograd.grad(y.square().sum(), [v for v in leaves.values() if isinstance(v, torch.Tensor)])
        results[recompute] = (y.detach(), grads, kept)
    (y0, g0, kept0), (y1, g1, kept1) = results[False], results[True]
    assert kept1 < kept0
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_rejects_bad_chunk_size():
    args = make_inputs(1, 16, 2, 16, 16, 1, torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        triton_impl.ssd_chunk_scan(**args, chunk_size=24)


def test_compile_single_graph():
    """torch.compile traces through the custom op without graph breaks (fake kernels give the shapes)."""
    args = make_inputs(1, 32, 2, 16, 16, 1, torch.float32)

    def f(x, dt, A, B, C, D, z, dt_bias, initial_states):
        y, fin = triton_impl.ssd_chunk_scan(x, dt, A, B, C, 16, D, z, dt_bias, True, (0.0, math.inf),
                                            initial_states, None, None, True)
        return y * 2, fin

    explain = torch._dynamo.explain(f)(**args)
    assert explain.graph_break_count == 0
    assert explain.graph_count == 1


def test_compile_backward_matches_eager():
    """Forward and backward through torch.compile (aot_eager: traced with the fake kernels, run for real)."""
    args = make_inputs(1, 20, 2, 16, 16, 1, torch.float32, z=True)
    kw = dict(chunk_size=16, dt_softplus=True)

    def f(**a):
        y, fin = triton_impl.ssd_chunk_scan(**a, **kw, return_final_states=True)
        return (y * y).sum() + fin.sum()

    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in args.items()}
        fn(**leaves).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    for k in grads[0]:
        assert_close(grads[1][k], grads[0][k], torch.float32, grad=True, name=f"compiled d{k}")


def test_kernels_run_at_the_kernel_chunk(monkeypatch):
    """A chunk_size above KERNEL_CHUNK_MAX runs the kernels at KERNEL_CHUNK_MAX: the same scan (outputs, final
    states, every gradient) as the reference at the requested chunk."""
    monkeypatch.setattr(triton_impl, "KERNEL_CHUNK_MAX", 16)  # interpreter-sized: asked 32, run at 16
    calls = []
    real = triton_impl.ssd_fwd_op
    monkeypatch.setattr(triton_impl, "ssd_fwd_op", lambda *a: calls.append(a[5]) or real(*a))
    args = make_inputs(2, 45, 4, 16, 16, 2, torch.float32)
    check_against_reference(args, dict(chunk_size=32, dt_softplus=True), torch.float32)
    assert set(calls) == {16}
    assert triton_impl.kernel_chunk(64) == 16 and triton_impl.kernel_chunk(16) == 16
    monkeypatch.undo()
    assert triton_impl.kernel_chunk(256) == triton_impl.KERNEL_CHUNK_MAX == 128
    assert triton_impl.kernel_chunk(64) == 64
    with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16, got 200"):
        triton_impl.kernel_chunk(200)


def test_public_function_dispatches_here(monkeypatch, ops_backend):
    """mamba_parallel.ops.ssd.ssd_chunk_scan on the triton backend runs this module's op."""
    from mamba_parallel.ops.ssd import ssd_chunk_scan

    calls = []
    real = triton_impl.ssd_fwd_op
    monkeypatch.setattr(triton_impl, "ssd_fwd_op", lambda *a: calls.append(1) or real(*a))
    ops_backend("triton")
    args = make_inputs(1, 20, 2, 16, 16, 1, torch.float32)
    y = ssd_chunk_scan(**args, chunk_size=16, dt_softplus=True)
    assert calls and y.shape == args["x"].shape


# ---------------------------------------------------------------- final states into a given tensor (a cache)

OUT_LAYOUTS = {
    # name: (b, L, nstates, scan options): odd lengths, not multiples of the chunk (16)
    "plain": (2, 45, 2, dict()),
    "seq_idx": (2, 40, 2, dict(seq_idx=torch.tensor([[0] * 5 + [1] * 20 + [2] * 15, [0] * 16 + [3] * 24],
                                                    dtype=torch.int32))),
    "cu_seqlens": (1, 50, 4, dict(cu_seqlens=torch.tensor([0, 7, 7, 30, 50], dtype=torch.int32))),  # one empty
}


def _into_case(layout, resume, out_dtype, device=DEV, h=2, p=16, n=16, dtype=torch.float32, seed=0):
    """-> (inputs, scan options, the buffer the final states go into: the initial states when resumed (a cache
    read and written in place), else a NaN-filled one (every element must be written))."""
    b, L, nst, opts = OUT_LAYOUTS[layout]
    args = make_inputs(b, L, h, p, n, 1, dtype, device=device, z=True, nstates=nst, seed=seed)
    if resume:
        args["initial_states"] = args["initial_states"].to(out_dtype)
        out = args["initial_states"]
    else:
        args["initial_states"] = None
        out = torch.full((nst, h, p, n), float("nan"), device=device, dtype=out_dtype)
    kw = {k: v.to(device) for k, v in opts.items()}
    return args, dict(chunk_size=16, dt_softplus=True, **kw), out


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("resume", [False, True], ids=["first", "resumed"])
@pytest.mark.parametrize("layout", list(OUT_LAYOUTS))
def test_final_states_written_into_the_cache(layout, resume, out_dtype, states_path, monkeypatch):
    """final_states_out (no autograd) holds exactly what the returned final states copied into it held, fp32 or
    rounded to a bf16 cache, and y is unchanged; resumed, the buffer is also the initial states the scan starts
    from. The inference op writes it (in the interpreter an fp32 one directly, a bf16 one by one copy)."""
    args, kw, out = _into_case(layout, resume, out_dtype)
    y_ref, final_ref = triton_impl.ssd_chunk_scan(**dict(args, initial_states=(
        args["initial_states"].clone() if resume else None)), **kw, return_final_states=True)
    calls = []
    real = triton_impl.ssd_fwd_into_op
    monkeypatch.setattr(triton_impl, "ssd_fwd_into_op", lambda *a: calls.append(a[-1] is out) or real(*a))
    y, returned = triton_impl.ssd_chunk_scan(**args, **kw, return_final_states=True, final_states_out=out)
    assert calls == [out_dtype == torch.float32]  # the kernels wrote the cache itself where they could
    assert returned is out and out.dtype == out_dtype
    assert torch.equal(y, y_ref)
    assert torch.equal(out, final_ref.to(out_dtype))
    y2 = triton_impl.ssd_chunk_scan(**dict(args, initial_states=None), **kw, final_states_out=out)  # no return
    assert torch.equal(y2, triton_impl.ssd_chunk_scan(**dict(args, initial_states=None), **kw))


@pytest.mark.parametrize("resume", [False, True], ids=["first", "resumed"])
@pytest.mark.parametrize("layout", list(OUT_LAYOUTS))
def test_kernels_round_into_a_narrower_cache(layout, resume, states_path, monkeypatch):
    """The kernels' own rounding store into a narrower cache (what a GPU does for a bf16 one), on an fp16 cache,
    which the interpreter rounds exactly: the returned fp32 final states copied into it, bit for bit."""
    monkeypatch.setattr(triton_impl, "_stores_directly", lambda out, x: True)
    args, kw, out = _into_case(layout, resume, torch.float16)
    y_ref, final_ref = triton_impl.ssd_chunk_scan(**dict(args, initial_states=(
        args["initial_states"].clone() if resume else None)), **kw, return_final_states=True)
    y = triton_impl.ssd_chunk_scan(**args, **kw, final_states_out=out)
    assert torch.equal(y, y_ref) and torch.equal(out, final_ref.to(torch.float16))


def test_final_states_out_with_autograd_is_a_copy():
    """With autograd recording, final_states_out takes a copy of the differentiable final states and is returned
    as them: the same values and the same gradients as the returned final states."""
    args, kw, _ = _into_case("plain", True, torch.float32)
    gf = torch.randn(args["initial_states"].shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    results = []
    for into in (False, True):
        leaves = {k: v.detach().requires_grad_(True) if v is not None else None for k, v in args.items()}
        out = torch.full(args["initial_states"].shape, float("nan"), device=DEV) if into else None
        y, final = triton_impl.ssd_chunk_scan(**leaves, **kw, return_final_states=True, final_states_out=out)
        assert final is out or not into
        ((y.float() ** 2).sum() + (final * gf).sum()).backward()
        results.append((y.detach(), final.detach(), [leaves[k].grad for k in GRAD_NAMES if leaves[k] is not None]))
    (y0, f0, g0), (y1, f1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(f0, f1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_compile_writes_the_cache():
    """torch.compile traces the inference op that writes the cache (also its initial states) in one graph, and the
    compiled call leaves the same cache (aot_eager: traced with the fake kernel, run for real)."""
    args, kw, cache = _into_case("plain", True, torch.float32)
    args.pop("initial_states")
    y_ref, final_ref = triton_impl.ssd_chunk_scan(**args, **kw, initial_states=cache.clone(), return_final_states=True)

    def f(x, dt, A, B, C, D, z, dt_bias, cache):
        return 2 * triton_impl.ssd_chunk_scan(x, dt, A, B, C, 16, D, z, dt_bias, True, (0.0, math.inf), cache,
                                              None, None, False, False, cache)

    with torch.no_grad():
        explain = torch._dynamo.explain(f)(**args, cache=cache.clone())
        assert explain.graph_break_count == 0 and explain.graph_count == 1
        y = torch.compile(f, backend="aot_eager", fullgraph=True)(**args, cache=cache)
    assert torch.equal(y, 2 * y_ref) and torch.equal(cache, final_ref)


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_public_function_writes_final_states_out(backend, ops_backend):
    """ops.ssd_chunk_scan with final_states_out on either backend: the cache (also the initial states) holds what
    the returned final states held; the Triton path's op-level check above covers the rest."""
    from mamba_parallel.ops import ssd_chunk_scan

    ops_backend(backend)
    args, kw, cache = _into_case("seq_idx", True, torch.float32)
    y_ref, final_ref = ssd_chunk_scan(**dict(args, initial_states=cache.clone()), **kw, return_final_states=True)
    y = ssd_chunk_scan(**args, **kw, final_states_out=cache)
    assert torch.equal(y, y_ref) and torch.equal(cache, final_ref)


# ---------------------------------------------------------------- GPU

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_realistic(dtype, nan_poison, states_path):
    args = make_inputs(2, 1000, 8, 64, 128, 1, dtype, device="cuda")
    check_against_reference(args, dict(chunk_size=256, dt_softplus=True), dtype, factor=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_gate_groups_varlen(dtype, nan_poison, states_path):
    args = make_inputs(1, 700, 8, 64, 64, 2, dtype, device="cuda", D="hp", z=True, nstates=3)
    cu = torch.tensor([0, 100, 380, 700], dtype=torch.int32, device="cuda")
    check_against_reference(args, dict(chunk_size=128, dt_softplus=True, dt_limit=(0.0, 0.8), cu_seqlens=cu), dtype)


@pytest.mark.gpu
def test_gpu_seq_idx_chunk64(nan_poison, states_path):
    args = make_inputs(2, 500, 4, 64, 128, 1, torch.bfloat16, device="cuda")
    seq_idx = torch.zeros(2, 500, dtype=torch.int32, device="cuda")
    seq_idx[0, 130:] = 1
    seq_idx[0, 333:] = 2
    seq_idx[1, 64:] = 5
    check_against_reference(args, dict(chunk_size=64, dt_softplus=True, seq_idx=seq_idx), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("resume", [False, True], ids=["first", "resumed"])
@pytest.mark.parametrize("layout", list(OUT_LAYOUTS))
def test_gpu_final_states_written_into_the_cache(layout, resume, out_dtype, nan_poison, states_path):
    """On a GPU the kernels write the final states into the cache themselves, a bf16 one too (their store
    rounds to nearest even): bit for bit the returned fp32 final states copied into it."""
    args, kw, out = _into_case(layout, resume, out_dtype, device="cuda", h=8, p=64, n=128, dtype=torch.bfloat16)
    y_ref, final_ref = triton_impl.ssd_chunk_scan(**dict(args, initial_states=(
        args["initial_states"].clone() if resume else None)), **kw, return_final_states=True)
    y, returned = triton_impl.ssd_chunk_scan(**args, **kw, return_final_states=True, final_states_out=out)
    assert returned is out
    assert torch.equal(y, y_ref)
    assert torch.equal(out, final_ref.to(out_dtype))


def _every_candidate():
    from mamba_parallel.ops.ssd.triton_tuning import tuned

    for name, entry in tuned.table.items():
        for dtype in (torch.bfloat16, torch.float32):
            if dtype == torch.float32 and len(entry) <= 3:
                continue  # one list for both widths: the bf16 run covers it
            for i, _ in enumerate(tuned.candidates(name, dtype)):
                yield pytest.param(name, dtype, i, id=f"{name}-{str(dtype)[6:]}-{i}")


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype, index", list(_every_candidate()))
def test_gpu_every_candidate_alone(name, dtype, index, monkeypatch, nan_poison):
    """Each launch candidate that autotuning may pick, run alone (its kernel's table cut to it, the others at their
    first), with the state path that launches it, on a partial last chunk at the kernels' chunk: in fp32 outputs,
    final states and every gradient against the reference; in bf16 against the first candidates' run on the same
    path, to bf16's tolerances (at this input dA sums terms that cancel, and every bf16 launch, the first
    included, is 6.8e-2 from the float64 reference, beyond the 3e-2 a gradient is allowed). A candidate Triton
    miscompiles fails here by name."""
    from mamba_parallel.ops import use_autotune
    from mamba_parallel.ops.ssd.triton_tuning import tuned

    monkeypatch.setattr(triton_impl, "sweep_states", lambda pairs, device: name != "chunk_states")
    args = make_inputs(2, 300, 4, 64, 128, 1, dtype, device="cuda", z=True)
    kw = dict(chunk_size=128, dt_softplus=True)
    gy, gf = loss_weights(args, kw)
    with use_autotune(False):
        monkeypatch.setattr(tuned, "_cache", {})
        first = None if dtype == torch.float32 else run(triton_impl.ssd_chunk_scan, args, kw, gy, gf)
        entry = list(tuned.table[name])
        slot = 3 if dtype == torch.float32 and len(entry) > 3 else 0
        entry[slot] = [entry[slot][index]]
        monkeypatch.setattr(tuned, "table", {**tuned.table, name: tuple(entry)})
        monkeypatch.setattr(tuned, "_cache", {})
        if first is None:
            check_against_reference(args, kw, dtype)
        else:
            assert_runs_close(run(triton_impl.ssd_chunk_scan, args, kw, gy, gf), first, dtype)


@pytest.mark.gpu
def test_gpu_resumed_cache_survives_autotuning(nan_poison, monkeypatch):
    """With autotuning on, the state pass that tunes is the one writing the cache it continues from: its trial runs
    must put the cache back before the real launch reads it (the reference runs after, on the tuned launch)."""
    from mamba_parallel.ops import use_autotune
    from mamba_parallel.ops.ssd import triton_tuning

    monkeypatch.setattr(triton_tuning.tuned, "_cache", {})  # new autotuners: the first call below tunes
    monkeypatch.setattr(triton_impl, "sweep_states", lambda pairs, device: True)
    args, kw, cache = _into_case("plain", True, torch.float32, device="cuda", h=8, p=64, n=128,
                                 dtype=torch.bfloat16)
    init = cache.clone()
    with use_autotune(True):
        y = triton_impl.ssd_chunk_scan(**args, **kw, final_states_out=cache)
        y_ref, final_ref = triton_impl.ssd_chunk_scan(**dict(args, initial_states=init), **kw,
                                                      return_final_states=True)
    assert torch.equal(y, y_ref)
    assert torch.equal(cache, final_ref)
