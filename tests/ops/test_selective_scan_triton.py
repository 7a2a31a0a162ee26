"""Triton selective scan (Mamba-1) vs the naive reference: outputs, last state and every gradient, per kernel path.

CPU runs use the Triton interpreter with tiny tiles (chunk 8), so L = 19 / 33 already crosses several chunks. The
interpreter's default is the generic code; the row-per-thread paths run there when asked for by name, their lane
shuffles emulated by gathers (their index arithmetic, against the reference). The GPU tests run every path's real
code across dtypes, seq_idx / cu_seqlens and the layouts that make the row-per-thread paths step aside.
"""

import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_close, one_scan_segment

from mamba_parallel.ops import use_backend
from mamba_parallel.ops.selective_scan import launch, naive, triton_impl
from mamba_parallel.ops.selective_scan import selective_scan as public_selective_scan
from mamba_parallel.ops.selective_scan.triton_impl import selective_scan_fwd
from mamba_parallel.ops.selective_scan.triton_tiles import scan_adjoint, scan_forward

GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


# The generic code on one and two rows per channel: what the interpreter runs by default (and any layout on a GPU).
GENERIC_PATHS = (launch.GENERIC, launch.GENERIC_TWO_ROWS)
ROW_PATHS = (launch.ROW_PER_THREAD, launch.TWO_ROWS_PER_CHANNEL, launch.TWO_ROWS_STATE_LOOP)


@pytest.fixture(autouse=True)
def _triton_backend():
    with use_backend("triton"):
        yield


def make_inputs(b=2, d=8, L=19, n=4, g=None, dtype=torch.float32, device="cpu", mode=None, with_init=True,
                full=True, seed=0):
    """Random scan inputs (dict of public-argument name -> tensor). mode: None | "seq_idx" | "cu_seqlens"."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    bc = (b, g, n, L) if g else (b, n, L)
    kw = dict(u=rnd(b, d, L), delta=rnd(b, d, L, scale=0.5), A=-(torch.rand(d, n, generator=gen) + 0.2).to(device),
              B=rnd(*bc), C=rnd(*bc))
    nstates = b
    if mode == "seq_idx":
        kw["seq_idx"] = torch.sort(torch.randint(0, 3, (b, L), generator=gen), -1)[0].to(device, torch.int32)
    elif mode == "cu_seqlens":
        cuts = sorted(torch.randint(1, L, (3,), generator=gen).tolist())
        kw["cu_seqlens"] = torch.tensor([0] + cuts + [L], dtype=torch.int32, device=device)
        nstates = len(cuts) + 1
    if full:
        kw.update(D=rnd(d, dt=torch.float32), z=rnd(b, d, L), delta_bias=rnd(d, scale=0.3, dt=torch.float32),
                  delta_softplus=True)
    if with_init:
        kw["initial_state"] = rnd(nstates, d, n, dt=torch.float32)
    return kw


def run_both(kw, grads=True, path=None, checkpoint_every=1):
    """(triton y, last, grads) on kernel path ``path`` (None: the default), one checkpoint per
    ``checkpoint_every`` chunks, and (reference in fp64: y, last, grads) for the same random cotangents."""
    leaves = [k for k in GRAD_NAMES if isinstance(kw.get(k), torch.Tensor)] if grads else []
    ours = {k: (v.detach().clone().requires_grad_(k in leaves) if isinstance(v, torch.Tensor) else v)
            for k, v in kw.items()}
    ref = {k: (v.detach().double().requires_grad_(k in leaves) if isinstance(v, torch.Tensor)
               and v.is_floating_point() else v) for k, v in kw.items()}
    y, last = triton_impl.selective_scan(**ours, return_last_state=True, path=path, checkpoint_every=checkpoint_every)
    yr, lastr = naive.selective_scan(**ref, return_last_state=True)
    out = {"y": (y, yr), "last_state": (last, lastr)}
    if grads:
        gen = torch.Generator().manual_seed(1)
        gy = torch.randn(yr.shape, generator=gen, dtype=torch.float64).to(yr.device)
        gl = torch.randn(lastr.shape, generator=gen, dtype=torch.float64).to(yr.device)
        g1 = torch.autograd.grad((y.double() * gy).sum() + (last.double() * gl).sum(), [ours[k] for k in leaves])
        g2 = torch.autograd.grad((yr * gy).sum() + (lastr * gl).sum(), [ref[k] for k in leaves])
        out.update({f"d{k}": (a, c) for k, a, c in zip(leaves, g1, g2)})
    return out


def check(out, dtype, factor=1.0):
    for name, (a, c) in out.items():
        assert a.dtype == (torch.float32 if name == "last_state" else a.dtype)
        assert_close(a, c.to(a.dtype) if name == "y" else c, dtype=dtype, grad=name.startswith("d"), name=name,
                     factor=factor)


def resolved(kw, path):
    """The forward path a request runs for these inputs (where the layout cannot take it, another one)."""
    varlen = kw.get("cu_seqlens") is not None
    return triton_impl.scan_path(kw["u"], kw["delta"], kw.get("z"), kw["A"], kw["B"], varlen, path)


# ---------------------------------------------------------------------------------- CPU: the generic code

@pytest.fixture(params=GENERIC_PATHS)
def generic(request):
    """One and two rows per channel of the generic code (the interpreter's default is the first)."""
    return request.param


@pytest.mark.parametrize("L", [1, 19, 33])
def test_full_features_all_gradients(L, generic):
    check(run_both(make_inputs(L=L, n=4 if L != 33 else 3), path=generic), torch.float32)


def test_grouped_bc(generic):
    check(run_both(make_inputs(d=8, g=2), path=generic), torch.float32)


def test_seq_idx_resets_state(generic):
    check(run_both(make_inputs(mode="seq_idx", L=26), path=generic), torch.float32)


@pytest.mark.parametrize("with_init", [True, False])
def test_cu_seqlens_per_sequence_states(with_init):
    kw = make_inputs(b=1, L=27, mode="cu_seqlens", with_init=with_init)
    assert resolved(kw, launch.GENERIC_TWO_ROWS) == launch.GENERIC  # packed sequences: one row per channel
    check(run_both(kw), torch.float32)


def test_cu_seqlens_empty_sequence_keeps_initial_state():
    kw = make_inputs(b=1, L=12, mode=None)
    kw["cu_seqlens"] = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    kw["initial_state"] = torch.randn(3, 8, 4)
    out = run_both(kw)
    check(out, torch.float32)
    torch.testing.assert_close(out["last_state"][0][1], kw["initial_state"][1])


def test_minimal_arguments(generic):
    check(run_both(make_inputs(full=False, with_init=False), path=generic), torch.float32)


def test_noncontiguous_inputs(generic):
    kw = make_inputs(d=8, L=13)
    for k in ("u", "delta", "z"):  # (b, d, L) views of (b, L, d) storage
        kw[k] = kw[k].transpose(1, 2).contiguous().transpose(1, 2)
    kw["B"] = kw["B"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not kw["u"].is_contiguous()
    check(run_both(kw, path=generic), torch.float32)


def test_fp16_inputs(generic):
    check(run_both(make_inputs(dtype=torch.float16, L=21), path=generic), torch.float16)


def test_no_grad_forward_saves_nothing():
    kw = make_inputs(L=9)
    with torch.no_grad():
        y = triton_impl.selective_scan(**kw)
    assert_close(y, naive.selective_scan(**kw), name="y")


def test_public_op_runs_the_kernel(monkeypatch):
    """ops.selective_scan on the triton backend runs this module's forward op (the interpreter's default path)."""
    calls = []
    real = triton_impl.selective_scan

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_impl, "selective_scan", spy)
    kw = make_inputs(L=9)
    assert_close(public_selective_scan(**kw), naive.selective_scan(**kw), name="y")
    assert calls == [1]


@pytest.mark.parametrize("path", GENERIC_PATHS + ROW_PATHS)
def test_custom_op_registration(path):
    kw = make_inputs(L=11, d=4, n=2, b=1)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], None, True, False, 1, True, path)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(selective_scan_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                               "test_autograd_registration"))


@triton.jit
def _token_scans_kernel(a_ptr, b_ptr, h_ptr, out_ptr, P: tl.constexpr, BD: tl.constexpr, V: tl.constexpr,
                        SEQ: tl.constexpr):
    offs = (tl.arange(0, P)[:, None, None] * BD + tl.arange(0, BD)[None, :, None]) * V + tl.arange(0, V)[None, None, :]
    a, b = tl.load(a_ptr + offs), tl.load(b_ptr + offs)
    h = tl.load(h_ptr + tl.arange(0, BD))
    v_idx, p_idx = tl.arange(0, V)[None, None, :], tl.arange(0, P)[:, None]
    tl.store(out_ptr + offs, scan_forward(a, b, h, v_idx, p_idx, P, V, SEQ))
    tl.store(out_ptr + P * BD * V + offs, scan_adjoint(a, b, h, v_idx, p_idx, P, V, SEQ))


@pytest.mark.parametrize("P,V", [(1, 4), (2, 4), (4, 2)])
@pytest.mark.parametrize("seq", [True, False], ids=["sequential", "associative"])
def test_token_scans(P, V, seq):
    """Both token-scan forms of the kernels (sequential chains for thread-local tokens, two-level associative
    scans otherwise) against Python loops, with decays that cut the chain (a = 0 where a sequence starts)."""
    BD, S = 4, P * V
    gen = torch.Generator().manual_seed(3)
    a = torch.rand(P, BD, V, generator=gen) * (torch.rand(P, BD, V, generator=gen) > 0.2)
    b, h = torch.randn(P, BD, V, generator=gen), torch.randn(BD, generator=gen)
    out = torch.empty(2, P, BD, V)
    _token_scans_kernel[(1,)](a, b, h, out, P=P, BD=BD, V=V, SEQ=seq)
    at, bt = a.permute(1, 0, 2).reshape(BD, S), b.permute(1, 0, 2).reshape(BD, S)  # (channel, token)
    fwd, adj = torch.empty(BD, S), torch.empty(BD, S)
    state = h.clone()
    for t in range(S):  # h_t = a_t h_{t-1} + b_t
        state = at[:, t] * state + bt[:, t]
        fwd[:, t] = state
    d = bt[:, S - 1] + h  # dh_t = b_t + a_{t+1} dh_{t+1}, with a dh entering the last token = h
    adj[:, S - 1] = d
    for t in range(S - 2, -1, -1):
        d = bt[:, t] + at[:, t + 1] * d
        adj[:, t] = d
    torch.testing.assert_close(out[0], fwd.view(BD, P, V).permute(1, 0, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], adj.view(BD, P, V).permute(1, 0, 2), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------- CPU: the row-per-thread paths, shuffles emulated

@pytest.mark.parametrize("path", ROW_PATHS)
@pytest.mark.parametrize("mode", [None, "seq_idx"])
def test_row_paths_emulated(path, mode):
    """The row-per-thread paths' code (sequential token chains, lane-shuffle sums of dB / dC, two rows per channel
    with the states unrolled or in the loop; their backward) in the interpreter, one warp of 32 rows per program,
    against the reference; without gradients the unrolled forward keeps no checkpoints (its carries only)."""
    kw = make_inputs(d=32, L=19, n=4, mode=mode)
    assert resolved(kw, path) == path
    check(run_both(kw, path=path), torch.float32)
    check(run_both(kw, grads=False, path=path), torch.float32)


def test_row_paths_step_aside():
    """Requests the inputs cannot take fall back in the documented order (launch.plan): no row-per-thread layout
    -> the generic code of as many rows; odd n -> one row per channel."""
    kw = make_inputs(d=32, L=19, n=4)
    cl = dict(kw, **{k: kw[k].transpose(1, 2).contiguous().transpose(1, 2) for k in ("u", "delta", "z")})
    assert resolved(cl, launch.ROW_PER_THREAD) == launch.GENERIC
    assert resolved(cl, launch.TWO_ROWS_PER_CHANNEL) == launch.GENERIC_TWO_ROWS
    assert resolved(make_inputs(d=32, L=19, n=3), launch.TWO_ROWS_PER_CHANNEL) == launch.ROW_PER_THREAD
    assert resolved(kw, None) == launch.GENERIC  # the interpreter's default
    with pytest.raises(ValueError, match="path 'v4' is not one of"):
        resolved(kw, "v4")


# ------------------------------------------------------------- CPU: one checkpoint per K chunks (checkpoint_every)

def _grads_equal(a, c):
    """Two run_both results hold the same values bit for bit."""
    for name in a:
        assert torch.equal(a[name][0], c[name][0]), name


@pytest.mark.parametrize("L,K", [(45, 4), (25, 16)])
def test_checkpoint_every_all_gradients(K, L, generic, monkeypatch):
    """Chunks of 8 tokens: L = 45 is 6 chunks (the last partial; with K = 4 the last group has 2 of 4 chunks),
    L = 25 is 4 (the last of one token) and K = 16 one group, of 4 chunks, for the whole sequence (K = 2: the
    tests below). Every output and gradient against the reference, and bit for bit what one checkpoint per chunk
    gives (the rebuilt states are the forward's, recomputed)."""
    kw = make_inputs(L=L, n=3 if L == 25 else 4)
    check(run_both(kw, path=generic, checkpoint_every=K), torch.float32)
    one_scan_segment(monkeypatch)
    _grads_equal(run_both(kw, path=generic, checkpoint_every=K), run_both(kw, path=generic))


@pytest.mark.parametrize("K", [2])
def test_checkpoint_every_minimal_arguments(K):
    """No z, D, delta_bias, initial state."""
    check(run_both(make_inputs(L=45, full=False, with_init=False), checkpoint_every=K), torch.float32)


@pytest.mark.parametrize("mode,with_init,K", [("seq_idx", True, 2), ("cu_seqlens", True, 4),
                                              ("cu_seqlens", False, 2)])
def test_checkpoint_every_packed(K, mode, with_init, monkeypatch):
    """Restarts inside rebuilt chunks: seq_idx, and packed sequences with their own initial states."""
    kw = make_inputs(b=1 if mode == "cu_seqlens" else 2, L=43, mode=mode, with_init=with_init)
    check(run_both(kw, checkpoint_every=K), torch.float32)
    one_scan_segment(monkeypatch)
    _grads_equal(run_both(kw, checkpoint_every=K), run_both(kw))


@pytest.mark.parametrize("K", [4])
def test_checkpoint_every_grouped_bc_fp16(K, generic):
    check(run_both(make_inputs(d=8, g=2, L=37, dtype=torch.float16), path=generic, checkpoint_every=K),
          torch.float16)


@pytest.mark.parametrize("path,mode", [(launch.ROW_PER_THREAD, None), (launch.TWO_ROWS_PER_CHANNEL, "seq_idx"),
                                       (launch.TWO_ROWS_STATE_LOOP, None)])
def test_checkpoint_every_row_paths_emulated(path, mode, monkeypatch):
    """The row-per-thread paths' code with K = 4 (the unrolled forward stores only the groups' states; the
    backward's rebuild runs token chains): 5 chunks, the last group of one partial chunk."""
    kw = make_inputs(d=32, L=35, n=4, mode=mode)
    assert resolved(kw, path) == path
    check(run_both(kw, path=path, checkpoint_every=4), torch.float32)
    one_scan_segment(monkeypatch)
    _grads_equal(run_both(kw, path=path, checkpoint_every=4), run_both(kw, path=path))


@pytest.mark.parametrize("path", [launch.GENERIC, launch.TWO_ROWS_PER_CHANNEL])
def test_checkpoint_every_keeps_every_kth_state(path):
    """K = 1 keeps one (b, n, d) state per chunk as before; K keeps every K-th of them, the same values, and
    cdiv(nchunks, K) of them (K past the chunk count: the initial state only)."""
    d = 32 if path in launch.ROW_LAYOUT_PATHS else 8
    kw = make_inputs(d=d, L=45, n=4)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], None, True, False, 2)
    run = resolved(kw, path)
    assert run == path
    y1, last1, ck1 = triton_impl.scan_forward(*args, True, run)
    assert ck1.shape == (2, 6, 4, d)
    for K in (2, 4, 64):
        y, last, ck = triton_impl.scan_forward(*args, True, run, checkpoint_every=K)
        assert ck.shape == (2, -(-6 // K), 4, d)
        assert torch.equal(ck, ck1[:, ::K]) and torch.equal(y, y1) and torch.equal(last, last1)


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("mode", [None, "seq_idx"])
def test_scan_into_is_scan_forward(with_init, mode):
    """The inference forward planned once (``forward_launch`` + ``scan_into``) gives scan_forward's y and last state
    bit for bit, with the last state written into the buffer that also holds the initial state (the cache)."""
    kw = make_inputs(L=19, with_init=with_init, mode=mode, seed=3)
    u, delta, A, D, dtb = kw["u"], kw["delta"], kw["A"], kw["D"], kw["delta_bias"]
    B4, C4 = kw["B"].unsqueeze(1), kw["C"].unsqueeze(1)
    h0 = kw.get("initial_state")
    sid = kw.get("seq_idx")
    y, last, ck = triton_impl.scan_forward(u, delta, A, B4, C4, D, None, dtb, h0, sid, True, False, 2, False,
                                                 triton_impl.scan_path(u, delta, None, A, B4))
    assert ck.numel() == 0
    run = triton_impl.forward_launch(u, delta, A, B4)
    y2, fresh = triton_impl.scan_into(run, u, delta, A, B4, C4, D, dtb, h0, sid, None)
    assert torch.equal(y2, y) and torch.equal(fresh, last)
    cache = h0.clone() if with_init else torch.full_like(last, float("nan"))
    y3, into = triton_impl.scan_into(run, u, delta, A, B4, C4, D, dtb, cache if with_init else None, sid, cache)
    assert into is cache and torch.equal(y3, y) and torch.equal(cache, last)
    narrow = torch.full_like(last, float("nan"), dtype=torch.float16)
    y4, into = triton_impl.scan_into(run, u, delta, A, B4, C4, D, dtb, h0, sid, narrow)
    assert into is narrow and torch.equal(y4, y) and torch.equal(narrow, last.half())  # rounded by one copy


def test_checkpoint_every_is_checked():
    kw = make_inputs(L=9)
    for bad in (0, 3, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match="checkpoint_every must be a power of two"):
            public_selective_scan(**kw, checkpoint_every=bad)
    with use_backend("naive"):  # the reference ignores it, but the check is the public op's
        with pytest.raises(ValueError, match="checkpoint_every"):
            public_selective_scan(**kw, checkpoint_every=6)
        assert_close(public_selective_scan(**kw, checkpoint_every=4), naive.selective_scan(**kw), name="y")


def test_checkpoint_every_backward_needs_the_forwards():
    kw = make_inputs(L=45, full=False, with_init=False)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], None, None, None, None, None, False, False, 2)
    run = resolved(kw, None)
    _, _, ck = triton_impl.scan_forward(*args, True, run, checkpoint_every=4)
    with pytest.raises(RuntimeError, match="one kept per 2"):
        triton_impl.scan_backward(*args[:10], ck, torch.ones_like(kw["u"]), None, False, False, run,
                                  checkpoint_every=2)


def test_checkpoint_every_custom_op_registration():
    kw = make_inputs(L=27, d=4, n=2, b=1)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], None, True, False, 1, True, launch.GENERIC, 2)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(selective_scan_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                               "test_autograd_registration"))


# ------------------------------------------------------------------------------- CPU: bf16 checkpoints

# what the backward reads only through the adjoint (not the rebuilt states): bit-equal whatever the checkpoints
# (dz is not: it comes from y before the gate, rebuilt from the states)
ADJOINT_ONLY = ("y", "last_state", "du", "dB", "dD", "dinitial_state")


def ours_with(kw, path, checkpoint_dtype):
    """Our y, last state and every gradient (fixed random cotangents) with checkpoints in ``checkpoint_dtype``."""
    leaves = [k for k in GRAD_NAMES if isinstance(kw.get(k), torch.Tensor)]
    ours = {k: (v.detach().clone().requires_grad_(k in leaves) if isinstance(v, torch.Tensor) else v)
            for k, v in kw.items()}
    y, last = triton_impl.selective_scan(**ours, return_last_state=True, path=path,
                                         checkpoint_dtype=checkpoint_dtype)
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=gen).to(y.device, y.dtype)
    gl = torch.randn(last.shape, generator=gen).to(y.device)
    g = torch.autograd.grad((y * gy).sum() + (last * gl).sum(), [ours[k] for k in leaves])
    return dict(y=y, last_state=last, **{f"d{k}": t for k, t in zip(leaves, g)})


def check_bf16_checkpoints(kw, path, tol):
    """bf16 checkpoints against fp32 ones: the forward and the adjoint-only gradients bit for bit, ddelta, dA,
    dC, dz and d delta_bias within ``tol`` (relative norm) and not equal (the rounded states were read)."""
    a, c = ours_with(kw, path, torch.float32), ours_with(kw, path, torch.bfloat16)
    moved = []
    for name in a:
        if name in ADJOINT_ONLY:
            assert torch.equal(a[name], c[name]), name
        else:
            err = ((a[name].float() - c[name].float()).norm() / a[name].float().norm()).item()
            assert err < tol, (name, err)
            moved.append(err > 0)
    assert any(moved)


@pytest.mark.parametrize("path,mode", [(launch.GENERIC, None), (launch.GENERIC_TWO_ROWS, "seq_idx"),
                                       (launch.ROW_PER_THREAD, None), (launch.TWO_ROWS_PER_CHANNEL, "seq_idx"),
                                       (launch.TWO_ROWS_STATE_LOOP, None), (None, "cu_seqlens")])
def test_bf16_checkpoints(path, mode):
    """Every kernel form (the unrolled forward stores its register states apart; the state loop carries through
    fp32 slots and stores the checkpoints beside), restarts and packed sequences; L = 21 is 3 chunks, the last
    partial. The interpreter truncates to bf16 (a GPU rounds), so the error here is up to twice a GPU's."""
    kw = make_inputs(b=1 if mode == "cu_seqlens" else 2, d=32 if path in launch.ROW_LAYOUT_PATHS else 8, L=21,
                     n=4, mode=mode)
    if path is not None:
        assert resolved(kw, path) == path
    check_bf16_checkpoints(kw, path, tol=1e-2)


def test_bf16_checkpoints_kept():
    """One bf16 (b, n, d) state per chunk, the fp32 ones rounded; the default for bf16 inputs only, with K = 1."""
    kw = make_inputs(d=8, L=45, n=4)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], None, True, False, 2, True, resolved(kw, None))
    _, _, ck32 = triton_impl.scan_forward(*args)
    _, _, ck16 = triton_impl.scan_forward(*args, checkpoint_dtype=torch.bfloat16)
    assert ck16.dtype == torch.bfloat16 and ck16.shape == ck32.shape == (2, 6, 4, 8)
    assert torch.equal(ck16[:, 0].float(), ck32[:, 0].to(torch.bfloat16).float())  # the initial state
    assert (ck16.float() - ck32).abs().max() <= ck32.abs().max() * 2 ** -7  # one bf16 step (truncated here)
    default = triton_impl.default_checkpoint_dtype
    assert default(kw["u"].bfloat16(), 1) == torch.bfloat16
    assert default(kw["u"].bfloat16(), 2) == default(kw["u"].half(), 1) == default(kw["u"], 1) == torch.float32


def test_bf16_checkpoints_are_checked():
    kw = make_inputs(L=9)
    with pytest.raises(ValueError, match="checkpoint_dtype must be"):
        public_selective_scan(**kw, checkpoint_dtype=torch.float16)
    with pytest.raises(ValueError, match="bf16 checkpoints need one per chunk"):
        public_selective_scan(**kw, checkpoint_every=2, checkpoint_dtype=torch.bfloat16)
    kw = make_inputs(L=45, full=False, with_init=False)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], None, None, None, None, None, False, False, 2)
    run = resolved(kw, None)
    _, _, ck = triton_impl.scan_forward(*args, True, run, checkpoint_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp32 unless one per chunk"):
        triton_impl.scan_backward(*args[:10], ck[:, ::2], torch.ones_like(kw["u"]), None, False, False, run,
                                  checkpoint_every=2)


def test_checkpoint_precision_tool(capsys):
    """tools/scan_checkpoint_precision.py (the figures docs/memory.md cites) on a short sequence: bf16 checkpoints
    leave du and dB exactly as they are (the backward reads them through the adjoint only) and move the others
    less than bf16 activations do."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "scan_checkpoint_precision.py")
    spec = importlib.util.spec_from_file_location("scan_checkpoint_precision", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["--length", "40", "--channels", "4", "--states", "4", "--chunk", "8"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if "bf16 checkpoints" in line or "bf16 activations" in line]
    assert len(rows) == 4
    for ck, act in zip(rows[0::2], rows[1::2]):
        ck_err, act_err = [float(v) for v in ck[-5:]], [float(v) for v in act[-5:]]
        assert ck_err[0] == ck_err[3] == 0.0  # du, dB
        assert all(0 < ck_err[i] < act_err[i] for i in (1, 2, 4))  # ddelta, dA, dC
    rebuilt = [line.split() for line in lines if "rebuilt" in line]
    assert len(rebuilt) == 2
    for row in rebuilt:  # y rebuilt for dz: no further from y than a bf16 copy of it
        assert 0 < float(row[-6]) <= float(row[-1].rstrip(")"))


def test_bf16_checkpoints_custom_op_registration():
    kw = make_inputs(L=27, d=4, n=2, b=1)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], None, True, False, 1, True, launch.GENERIC, 1, torch.bfloat16)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(selective_scan_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                               "test_autograd_registration"))


# ------------------------------------------------------------------------------------------------------ GPU

GPU_SUBSET = ((torch.bfloat16, None), (torch.bfloat16, "cu_seqlens"), (torch.float32, "seq_idx"))
FULL_MATRIX = (launch.ROW_PER_THREAD, launch.TWO_ROWS_PER_CHANNEL)  # the paths the defaults train with


@pytest.mark.gpu
@pytest.mark.parametrize("path", ROW_PATHS + GENERIC_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", [None, "seq_idx", "cu_seqlens"])
def test_gpu_realistic(dtype, mode, path, nan_poison):
    if path not in FULL_MATRIX and (dtype, mode) not in GPU_SUBSET:
        pytest.skip("the other paths run a representative subset")
    b = 1 if mode == "cu_seqlens" else 2
    L = 700 if mode == "cu_seqlens" else 704  # the row-per-thread paths need L % 16 == 0
    kw = make_inputs(b=b, d=256, L=L, n=16, dtype=dtype, device="cuda", mode=mode, g=2 if mode is None else None)
    if mode != "cu_seqlens":
        assert resolved(kw, path) == path
    check(run_both(kw, path=path), dtype, factor=2.0)


@pytest.mark.gpu
def test_gpu_default_paths(nan_poison):
    """The default at few and many channels x batch (two rows per channel / one row on an H200's 132 SMs) and
    with more than 8 states per row (the state loop), bf16, against the reference."""
    if triton_impl._sm_count(torch.device("cuda")) != 132:
        pytest.skip("the expected paths are an H200's")
    for (b, d, n), want in (((2, 256, 16), launch.TWO_ROWS_PER_CHANNEL), ((32, 1024, 16), launch.ROW_PER_THREAD),
                            ((2, 256, 32), launch.TWO_ROWS_STATE_LOOP)):
        kw = make_inputs(b=b, d=d, L=256, n=n, dtype=torch.bfloat16, device="cuda")
        assert resolved(kw, None) == want
        check(run_both(kw), torch.bfloat16, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ROW_PATHS)
def test_gpu_unaligned_length(path, nan_poison):
    """Token-major rows that are not 16-byte aligned (L = 700): Triton does not vectorise them, so the
    row-per-thread paths must step aside (to the generic code of as many rows)."""
    kw = make_inputs(b=2, d=128, L=700, n=16, dtype=torch.bfloat16, device="cuda")
    assert resolved(kw, path) in GENERIC_PATHS
    check(run_both(kw, path=path), torch.bfloat16, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ROW_PATHS)
@pytest.mark.parametrize("L", [300, 320])
def test_gpu_channels_last_inputs(path, L, nan_poison):
    """(b, d, L) views of (b, L, d) storage, as the layer's z: the row-per-thread paths must step aside."""
    kw = make_inputs(b=2, d=128, L=L, n=16, dtype=torch.bfloat16, device="cuda")
    for k in ("u", "delta", "z"):
        kw[k] = kw[k].transpose(1, 2).contiguous().transpose(1, 2)
    assert resolved(kw, path) in GENERIC_PATHS
    check(run_both(kw, path=path), torch.bfloat16, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [2, 8, 64])
@pytest.mark.parametrize("path", (None,) + ROW_PATHS + GENERIC_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_gpu_checkpoint_every(dtype, path, K, nan_poison):
    """One checkpoint per K chunks of 16 tokens on every path: L = 704 is 44 chunks (K = 8: the last group has 4
    of 8; K = 64: one group), the scratch and carries NaN-poisoned; packed sequences and unaligned rows (the
    generic code) on the default path. The named paths run K = 8 only."""
    if path is not None and K != 8:
        pytest.skip("the named paths run K = 8")
    kw = make_inputs(b=2, d=256, L=704, n=16, dtype=dtype, device="cuda", g=2)
    if path is not None:
        assert resolved(kw, path) == path
    check(run_both(kw, path=path, checkpoint_every=K), dtype, factor=2.0)
    if path is None:
        for mode, L in (("cu_seqlens", 700), ("seq_idx", 704), (None, 700)):
            kw = make_inputs(b=1 if mode == "cu_seqlens" else 2, d=256, L=L, n=16, dtype=dtype, device="cuda",
                             mode=mode)
            check(run_both(kw, checkpoint_every=K), dtype, factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("path", (None,) + ROW_PATHS + GENERIC_PATHS)
def test_gpu_bf16_checkpoints(path, nan_poison):
    """bf16 checkpoints (the default for bf16 inputs) against fp32 ones on every path: the forward and the
    adjoint-only gradients bit for bit, the others within 1e-2 (fp32 inputs: only the checkpoints round); packed
    sequences and an unaligned length on the default path."""
    kw = make_inputs(b=2, d=256, L=704, n=16, device="cuda", g=2)
    if path is not None:
        assert resolved(kw, path) == path
    check_bf16_checkpoints(kw, path, tol=1e-2)
    if path is None:
        for mode, L in (("cu_seqlens", 700), (None, 700)):
            kw = make_inputs(b=1 if mode == "cu_seqlens" else 2, d=256, L=L, n=16, device="cuda", mode=mode)
            check_bf16_checkpoints(kw, None, tol=1e-2)
