"""Sequence split of the Mamba-1 scan (MAMBA_PARALLEL_SCAN_SPLIT, triton_split.py), forward and backward, vs the
naive reference (fp64) and vs the unsplit kernels: outputs, last state and every gradient.

CPU: the interpreter's chunk is 8 tokens, so L = 32 splits into 2 / 4 segments of 16 / 8 tokens, as strided views
of channels-last inputs ((b, L, d) storage) or, for token-major (b, d, L) inputs without seq_idx, of the batch
folded into the channels; L = 19 / 27 (segments that do not divide L) and token-major inputs with seq_idx go through
padded copies.
"""

import pytest
import torch
from helpers import assert_close

from mamba_parallel.ops.selective_scan import naive, selective_scan, triton_impl, triton_split
from mamba_parallel.ops.selective_scan.triton_split import (combine_segments, segment_length, seq_cuts, split_count,
                                                            split_request)

FOLD, FOLD_BWD = triton_split._fold_batch, triton_split._fold_batch_bwd
GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    monkeypatch.delenv("MAMBA_PARALLEL_SCAN_SPLIT", raising=False)
    monkeypatch.delenv("MAMBA_PARALLEL_SCAN_CFG", raising=False)
    monkeypatch.delenv("MAMBA_PARALLEL_SCAN_CKPT_EVERY", raising=False)


def make(b=2, d=8, L=32, n=4, g=None, dtype=torch.float32, device="cpu", layout="channels_last", seq_idx=None,
         full=True, init=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    def act(scale=1.0):  # (b, d, L): a view of (b, L, d) storage, or contiguous (token-major, as the layer's)
        x = rnd(b, L, d, scale=scale).transpose(1, 2)
        return x if layout == "channels_last" else x.contiguous()

    bc = (b, g, n, L) if g else (b, n, L)
    kw = dict(u=act(), delta=act(0.5), A=-(torch.rand(d, n, generator=gen) + 0.2).to(device), B=rnd(*bc),
              C=rnd(*bc))
    if full:
        kw.update(D=rnd(d, dt=torch.float32), z=act(), delta_bias=rnd(d, scale=0.3, dt=torch.float32),
                  delta_softplus=True)
    if init:
        kw["initial_state"] = rnd(b, d, n, dt=torch.float32)
    if seq_idx is not None:
        kw["seq_idx"] = seq_idx.to(device=device, dtype=torch.int32)
    return kw


def run(kw, split, monkeypatch):
    """y, last state and the gradients of every floating input for fixed random cotangents, with the given
    MAMBA_PARALLEL_SCAN_SPLIT (None: the fp64 naive reference)."""
    leaves = [k for k in GRAD_NAMES if isinstance(kw.get(k), torch.Tensor)]
    if split is None:
        args = {k: (v.detach().double().requires_grad_(k in leaves) if isinstance(v, torch.Tensor)
                    and v.is_floating_point() else v) for k, v in kw.items()}
        y, last = naive.selective_scan(**args, return_last_state=True)
    else:
        monkeypatch.setenv("MAMBA_PARALLEL_SCAN_SPLIT", str(split))
        args = {k: (v.detach().clone().requires_grad_(k in leaves) if isinstance(v, torch.Tensor) else v)
                for k, v in kw.items()}
        if kw["u"].stride(1) == 1:  # keep the channels-last layout through the clone
            for k in ("u", "delta", "z"):
                if k in args:
                    args[k] = kw[k].detach().transpose(1, 2).clone().transpose(1, 2).requires_grad_(True)
        y, last = selective_scan(**args, return_last_state=True)
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.device)
    gl = torch.randn(last.shape, generator=gen, dtype=torch.float64).to(y.device)
    grads = torch.autograd.grad((y.double() * gy).sum() + (last.double() * gl).sum(), [args[k] for k in leaves])
    return {"y": y, "last_state": last, **{f"d{k}": gr for k, gr in zip(leaves, grads)}}


def check(ours, ref, dtype):
    for name, a in ours.items():
        assert_close(a, ref[name].to(a.dtype), dtype=dtype, grad=name.startswith("d"), name=name)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("L", [32, 19])
def test_split_matches_reference_and_unsplit(split, L, monkeypatch):
    kw = make(L=L)
    ours = run(kw, split, monkeypatch)
    check(ours, run(kw, None, monkeypatch), torch.float32)
    if (L, split) == (32, 2):
        check(ours, run(kw, 1, monkeypatch), torch.float32)


@pytest.mark.parametrize("L", [32, 27])
def test_split_seq_idx_resets_at_and_inside_segments(L, monkeypatch):
    """k = 4, Ls = 8: a sequence starts at segment 1's first token (entering state 0) and inside segment 2 (its
    decay product cut), with an initial state for the first sequence."""
    sid = torch.zeros(2, L, dtype=torch.int32)
    sid[0, 8:] = 1
    sid[0, 19:] = 2
    sid[1, 3:] = 1
    kw = make(d=4, L=L, seq_idx=sid)
    check(run(kw, 4, monkeypatch), run(kw, None, monkeypatch), torch.float32)


@pytest.mark.parametrize("full", [True, False])
def test_split_token_major_folds_batch(full, monkeypatch):
    """Token-major (b, d, L) inputs without seq_idx: the batch folded into channels (b g groups of B / C); with
    every optional input, and with none (grouped B / C, no softplus)."""
    folds = []
    monkeypatch.setattr(triton_split, "_fold_batch", lambda *a: folds.append("fwd") or FOLD(*a))
    monkeypatch.setattr(triton_split, "_fold_batch_bwd", lambda *a: folds.append("bwd") or FOLD_BWD(*a))
    kw = make(d=4, L=32, g=2, layout="token_major", full=full, init=full)
    check(run(kw, 4 if full else 2, monkeypatch), run(kw, None, monkeypatch), torch.float32)
    assert folds == ["fwd", "bwd"]


def test_split_token_major_seq_idx_copies(monkeypatch):
    """Token-major inputs with seq_idx (b > 1): segment rows are copies (no padding at L = 32)."""
    sid = torch.zeros(2, 32, dtype=torch.int32)
    sid[1, 16:] = 1
    sid[0, 5:] = 1
    kw = make(L=32, layout="token_major", seq_idx=sid)
    check(run(kw, 2, monkeypatch), run(kw, None, monkeypatch), torch.float32)


def test_split_bias_without_softplus_padded(monkeypatch):
    """Padding with delta_bias but no softplus: the bias is folded into delta so padded tokens get dt = 0."""
    kw = make(L=19)
    kw["delta_softplus"] = False
    kw["delta"] = kw["delta"].abs()
    check(run(kw, 4, monkeypatch), run(kw, None, monkeypatch), torch.float32)


def test_split_fp16(monkeypatch):
    kw = make(d=4, L=27, dtype=torch.float16)
    check(run(kw, 2, monkeypatch), run(kw, None, monkeypatch), torch.float16)


def test_split_sparse_checkpoints(monkeypatch):
    """ckpt_every = 2: segments are multiples of 2 chunks, so the sparse slots line up."""
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_CKPT_EVERY", "2")
    kw = make(d=4, L=32)
    check(run(kw, 2, monkeypatch), run(kw, None, monkeypatch), torch.float32)


def test_split_lane_path_emulated(monkeypatch):
    """The pass-1 kernel's register-chain scan (LANES) in the interpreter: one warp of 32 channels."""
    monkeypatch.setattr(triton_impl, "EMULATE_LANES_IN_INTERPRETER", True)
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_IMPL", "v3")
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_CFG", "8,32,1,32,1")
    kw = make(b=1, d=32, L=32, n=2)
    check(run(kw, 2, monkeypatch), run(kw, None, monkeypatch), torch.float32)


def test_split_cu_seqlens_runs_unsplit(monkeypatch):
    kw = make(b=1, L=24, init=False)
    kw["cu_seqlens"] = torch.tensor([0, 5, 24], dtype=torch.int32)
    check(run(kw, 4, monkeypatch), run(kw, None, monkeypatch), torch.float32)


def test_split_request_parsing(monkeypatch):
    for text, want in (("", "1"), ("1", "1"), ("8", "8"), ("auto", "auto"), (" AUTO ", "auto")):
        monkeypatch.setenv("MAMBA_PARALLEL_SCAN_SPLIT", text)
        assert split_request() == want
    for bad in ("3", "0", "-2", "two"):
        monkeypatch.setenv("MAMBA_PARALLEL_SCAN_SPLIT", bad)
        with pytest.raises(ValueError, match="MAMBA_PARALLEL_SCAN_SPLIT"):
            split_request()
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_SPLIT", "auto")
    assert split_count(4, 5120, 8192, torch.device("cpu"), interpreted=True) == 1


def test_segment_length_and_combine():
    assert segment_length(8192, 4, 16, 1) == (2048, 4)
    assert segment_length(19, 4, 8, 1) == (8, 3)  # no empty segment
    assert segment_length(40, 2, 8, 2) == (32, 2)  # a multiple of chunk x ckpt_every
    # two segments of a sequence starting at segment 2's first token: its entering state is 0
    sid = torch.tensor([[0] * 6 + [1] * 2])
    cut, first = seq_cuts(sid, 1, 4, 2, 8, "cpu")
    assert cut.tolist() == [[False, False, False, False]] and first.tolist() == [[False, False, False, True]]
    hloc = torch.ones(1, 3, 1, 1)
    dsum = torch.full((1, 3, 1), 2.0)
    A = torch.tensor([[-0.5]])
    enters = combine_segments(hloc, dsum, A, torch.full((1, 1, 1), 3.0), cut, first)
    e = torch.exp(torch.tensor(-1.0))
    torch.testing.assert_close(enters.flatten(), torch.stack([torch.tensor(3.0), 3 * e + 1, (3 * e + 1) * e + 1,
                                                              torch.tensor(0.0)]))


def _grads_vs_unsplit(kw, split, monkeypatch, dtype):
    check(run(kw, split, monkeypatch), run(kw, 1, monkeypatch), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["v3", "v4"])
@pytest.mark.parametrize("split", [2, 4])
def test_gpu_split_bf16_token_major(impl, split, monkeypatch):
    """The benchmark's layout (token-major, batch folded into channels), bf16, every feature, vs the unsplit."""
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_IMPL", impl)
    kw = make(b=2, d=1024, L=2048, n=16, dtype=torch.bfloat16, device="cuda", layout="token_major")
    _grads_vs_unsplit(kw, split, monkeypatch, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4])
def test_gpu_split_bf16_seq_idx_and_channels_last(split, monkeypatch):
    """seq_idx (token-major copies; channels-last views) and a length that does not divide (padded copies)."""
    sid = torch.zeros(2, 2048, dtype=torch.int32)
    sid[0, 512:] = 1
    sid[0, 1000:] = 2
    sid[1, 1537:] = 1
    for layout in ("token_major", "channels_last"):
        kw = make(b=2, d=512, L=2048, n=16, dtype=torch.bfloat16, device="cuda", layout=layout, seq_idx=sid)
        _grads_vs_unsplit(kw, split, monkeypatch, torch.bfloat16)
    kw = make(b=2, d=512, L=1999, n=16, dtype=torch.bfloat16, device="cuda", layout="token_major")
    _grads_vs_unsplit(kw, split, monkeypatch, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_split_auto_picks_more_programs(monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_SCAN_SPLIT", "auto")
    assert split_count(4, 5120, 8192, torch.device("cuda"), interpreted=False) >= 2
    assert split_count(64, 8192, 8192, torch.device("cuda"), interpreted=False) == 1
