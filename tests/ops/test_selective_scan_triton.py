"""Triton selective scan (Mamba-1) vs the naive reference: outputs, last state and every gradient.

CPU runs use the Triton interpreter with tiny tiles (chunk 8), so L = 19 / 33 already crosses several chunks.
Every test runs per kernel variant (MAMBA_PARALLEL_SCAN_IMPL: v2, v3, v4; the default picks v3 or v4). On CPU, v3 runs v2's code
(its register-chain / lane-shuffle paths are GPU-only), so it takes only the broad tests there, plus its lane paths
with the shuffles emulated; the GPU tests cover its own paths and run v3's and v4's full dtype x varlen matrix.
"""

import pytest
import torch
import triton
import triton.language as tl
from helpers import assert_close

from mamba_parallel.ops.selective_scan import naive, selective_scan
from mamba_parallel.ops.selective_scan import triton_impl
from mamba_parallel.ops.selective_scan.triton_common import (DEFAULT_IMPL, GPU_TILES, IMPLS, V4_BELOW_WARPS_PER_SM,
                                                              pick_impl, scan_config, scan_impl)
from mamba_parallel.ops.selective_scan.triton_impl import selective_scan_fwd
from mamba_parallel.ops.selective_scan.triton_tiles import scan_adjoint, scan_forward

GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


CPU_DUPLICATES = ("v3", "v4+v3")  # interpreter code paths already run by v2 (but for their lane paths)
BROAD_TESTS = ("test_full_features_all_gradients", "test_custom_op_registration", "test_lane_paths_emulated",
               "test_sparse_checkpoints")
ONCE_TESTS = ("test_token_scans", "test_default_variant_and_removed_ones")  # no variant involved
LANE_CFG = {"v3": "8,32,1,32,1", "v4": "8,16,1,16,1", "v4+v3": "8,16,1,32,1"}  # one warp: 32 rows per program


@pytest.fixture(autouse=True, params=IMPLS + ("v4+v3",))
def impl(request, monkeypatch):
    """Every test runs once per kernel variant (MAMBA_PARALLEL_SCAN_IMPL)."""
    is_gpu = request.node.get_closest_marker("gpu") is not None
    if request.node.originalname in ONCE_TESTS and request.param != "v2":
        pytest.skip("variant-independent")
    if request.param in CPU_DUPLICATES and not is_gpu and (
            request.node.originalname not in BROAD_TESTS or request.node.callspec.params.get("L", 19) != 19):
        pytest.skip(f"{request.param} runs the same interpreter code as another variant")
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_IMPL", request.param)
    return request.param


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


def run_both(kw, grads=True):
    """(triton y, last, grads) and (reference in fp64: y, last, grads) for the same random cotangents."""
    leaves = [k for k in GRAD_NAMES if isinstance(kw.get(k), torch.Tensor)] if grads else []
    ours = {k: (v.detach().clone().requires_grad_(k in leaves) if isinstance(v, torch.Tensor) else v)
            for k, v in kw.items()}
    ref = {k: (v.detach().double().requires_grad_(k in leaves) if isinstance(v, torch.Tensor)
               and v.is_floating_point() else v) for k, v in kw.items()}
    y, last = selective_scan(**ours, return_last_state=True)
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


@pytest.mark.parametrize("L", [1, 19, 33])
def test_full_features_all_gradients(L):
    check(run_both(make_inputs(L=L, n=4 if L != 33 else 3)), torch.float32)


def test_grouped_bc():
    check(run_both(make_inputs(d=8, g=2)), torch.float32)


def test_seq_idx_resets_state():
    check(run_both(make_inputs(mode="seq_idx", L=26)), torch.float32)


@pytest.mark.parametrize("with_init", [True, False])
def test_cu_seqlens_per_sequence_states(with_init):
    kw = make_inputs(b=1, L=27, mode="cu_seqlens", with_init=with_init)
    check(run_both(kw), torch.float32)


def test_cu_seqlens_empty_sequence_keeps_initial_state():
    kw = make_inputs(b=1, L=12, mode=None)
    kw["cu_seqlens"] = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    kw["initial_state"] = torch.randn(3, 8, 4)
    out = run_both(kw)
    check(out, torch.float32)
    torch.testing.assert_close(out["last_state"][0][1], kw["initial_state"][1])


def test_minimal_arguments():
    check(run_both(make_inputs(full=False, with_init=False)), torch.float32)


def test_noncontiguous_inputs():
    kw = make_inputs(d=8, L=13)
    for k in ("u", "delta", "z"):  # (b, d, L) views of (b, L, d) storage
        kw[k] = kw[k].transpose(1, 2).contiguous().transpose(1, 2)
    kw["B"] = kw["B"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not kw["u"].is_contiguous()
    check(run_both(kw), torch.float32)


def test_fp16_inputs():
    check(run_both(make_inputs(dtype=torch.float16, L=21)), torch.float16)


def test_no_grad_forward_saves_nothing():
    kw = make_inputs(L=9)
    with torch.no_grad():
        y = selective_scan(**kw)
    assert_close(y, naive.selective_scan(**kw), name="y")


def test_custom_op_registration(impl):
    kw = make_inputs(L=11, d=4, n=2, b=1)
    args = (kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["delta_bias"],
            kw["initial_state"], None, True, False, 1, True, impl)
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


@pytest.mark.parametrize("mode", ["seq_idx"])
@pytest.mark.parametrize("unrolled", [True, False], ids=["unrolled", "loop"])
def test_lane_paths_emulated(impl, mode, unrolled, monkeypatch):
    """v3 / v4's GPU paths (sequential token chains, lane-shuffle sums of dB / dC, v4's row pairs; v4's forward
    with its states unrolled or in the loop) in the interpreter, the shuffles emulated by gathers over rows: their
    index arithmetic, against the reference."""
    if impl not in LANE_CFG:
        pytest.skip("no lane path")
    if not unrolled and impl == "v3":
        pytest.skip("v3 always runs the state loop")
    monkeypatch.setattr(triton_impl, "EMULATE_LANES_IN_INTERPRETER", True)
    if not unrolled:
        monkeypatch.setattr(triton_impl, "V4_UNROLLED_STATES", 0)
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_CFG", LANE_CFG[impl])
    kw = make_inputs(d=32, L=19, n=4, mode=mode)
    check(run_both(kw), torch.float32)
    check(run_both(kw, grads=False), torch.float32)  # no checkpoints kept: the unrolled carries only


@pytest.mark.parametrize("unrolled", [True, False], ids=["unrolled", "loop"])
def test_sparse_checkpoints(impl, unrolled, monkeypatch):
    """MAMBA_PARALLEL_SCAN_CKPT_EVERY: the forward keeps every K-th chunk's state, the backward recomputes the rest
    per segment (5 chunks, K = 3: a full segment and a partial one), with seq_idx restarts inside the recomputed
    chunks. v2's generic code and the lane paths of v3 / v4 (one / two rows per channel, emulated shuffles)."""
    if not unrolled and impl not in ("v4", "v4+v3"):
        pytest.skip("only v4's forward unrolls its states")
    every = 3
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_CKPT_EVERY", str(every))
    if not unrolled:
        monkeypatch.setattr(triton_impl, "V4_UNROLLED_STATES", 0)
    d = 8
    if impl in LANE_CFG:
        monkeypatch.setattr(triton_impl, "EMULATE_LANES_IN_INTERPRETER", True)
        monkeypatch.setenv("MAMBA_PARALLEL_SCAN_CFG", LANE_CFG[impl])
        d = 32
    kw = make_inputs(d=d, L=33, n=2, mode="seq_idx")
    args = [kw[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")]
    ckpt = selective_scan_fwd(*args, kw["seq_idx"], True, False, 2, True, impl)[2]
    assert ckpt.shape == (2, -(-5 // every), 2, d)  # (b, checkpoints, n, d)
    check(run_both(kw), torch.float32)


def test_default_variant_and_removed_ones(monkeypatch):
    """The default picks v3 or v4 by the warps v3 would give each SM (v3 with one-warp tiles at many channels x
    batch, v4 at few); v3 in the interpreter, with cu_seqlens and odd n; the interpreter keeps its tiny tiles;
    explicit choices win; v1 / v5 are gone with an error that says so."""
    monkeypatch.delenv("MAMBA_PARALLEL_SCAN_IMPL", raising=False)
    monkeypatch.delenv("MAMBA_PARALLEL_SCAN_CFG", raising=False)
    monkeypatch.delenv("MAMBA_PARALLEL_SCAN_CKPT_EVERY", raising=False)
    from mamba_parallel.ops.selective_scan import triton_common

    monkeypatch.setattr(triton_common, "_sm_count", lambda dev: 132)  # an H200
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert DEFAULT_IMPL == "auto" and V4_BELOW_WARPS_PER_SM == 6
    assert scan_impl(8, 4096, 16, gpu, False) == "v3"  # 1024 warps: 7.8 per SM
    assert scan_impl(8, 5120, 16, gpu, False) == "v3"  # mamba-2.8b
    assert scan_impl(4, 5120, 16, gpu, False) == "v4+v3"  # 640 warps: 4.8 per SM
    assert scan_impl(8, 1536, 16, gpu, False) == "v4+v3"  # mamba-130m
    assert scan_impl(8, 2048, 16, gpu, False) == "v4+v3"  # mamba-370m, and mamba-1.4b at tp 2
    assert pick_impl(4, 5120, 15, gpu, False) == "v3"  # v4 halves the states over two rows
    assert pick_impl(4, 5120, 16, gpu, False, varlen=True) == "v3"
    assert scan_impl(4, 5120, 16, gpu, True) == scan_impl(4, 5120, 16, cpu, False) == "v3"
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_IMPL", "v3")
    assert scan_impl(4, 5120, 16, gpu, False) == "v3"
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_IMPL", "V4 ")
    assert scan_impl(8, 8192, 16, gpu, False) == "v4"
    cfg = scan_config(4096, 4096, interpret=False)
    assert (cfg.chunk, cfg.fwd_block_d, cfg.fwd_warps, cfg.bwd_block_d, cfg.bwd_warps) == GPU_TILES["v3"]
    assert GPU_TILES["v3"] == (16, 32, 1, 32, 1) and cfg.ckpt_every == 1
    assert scan_config(4096, 4096, interpret=True).chunk == 8
    for gone in ("v1", "v5"):
        monkeypatch.setenv("MAMBA_PARALLEL_SCAN_IMPL", gone)
        with pytest.raises(ValueError, match="was removed"):
            scan_impl(1, 64, 16, gpu, False)
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_IMPL", "v9")
    with pytest.raises(ValueError, match="MAMBA_PARALLEL_SCAN_IMPL"):
        scan_impl(1, 64, 16, gpu, False)


GPU_OTHER_VARIANT_CASES = ((torch.bfloat16, None), (torch.bfloat16, "cu_seqlens"), (torch.float32, "seq_idx"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("mode", [None, "seq_idx", "cu_seqlens"])
def test_gpu_realistic(dtype, mode, impl, nan_poison):
    if impl in ("v2", "v4+v3") and (dtype, mode) not in GPU_OTHER_VARIANT_CASES:
        pytest.skip("v2 (the fallback code) and v4+v3 (v4's forward, v3's backward) run a representative subset")
    b = 1 if mode == "cu_seqlens" else 2
    L = 700 if mode == "cu_seqlens" else 704  # v3 / v4 take their lane paths at L % 16 == 0 only
    kw = make_inputs(b=b, d=256, L=L, n=16, dtype=dtype, device="cuda", mode=mode, g=2 if mode is None else None)
    check(run_both(kw), dtype, factor=2.0)


@pytest.mark.gpu
def test_gpu_unaligned_length(impl, nan_poison):
    """Token-major rows that are not 16-byte aligned (L = 700): Triton does not vectorise them, so the lane paths
    must step aside."""
    check(run_both(make_inputs(b=2, d=128, L=700, n=16, dtype=torch.bfloat16, device="cuda")), torch.bfloat16,
          factor=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("L", [300, 320])
def test_gpu_channels_last_inputs(impl, L, nan_poison):
    """(b, d, L) views of (b, L, d) storage, as the layer's z: the lane-shuffle paths must step aside."""
    kw = make_inputs(b=2, d=128, L=L, n=16, dtype=torch.bfloat16, device="cuda")
    for k in ("u", "delta", "z"):
        kw[k] = kw[k].transpose(1, 2).contiguous().transpose(1, 2)
    check(run_both(kw), torch.bfloat16, factor=2.0)


@pytest.mark.gpu
def test_gpu_sparse_checkpoints(impl, monkeypatch, nan_poison):
    """MAMBA_PARALLEL_SCAN_CKPT_EVERY=3 on the GPU paths (44 chunks: 14 full segments and a partial one), bf16,
    seq_idx restarts inside the recomputed chunks."""
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_CKPT_EVERY", "3")
    check(run_both(make_inputs(b=2, d=128, L=704, n=16, dtype=torch.bfloat16, device="cuda", mode="seq_idx")),
          torch.bfloat16, factor=2.0)
