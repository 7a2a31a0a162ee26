"""The real peer adapters on a GPU: mamba_ssm's kernels and fla's simple GLA (with the Mamba-2 preparation) compute
what our reference computes on small shapes, and a side-by-side training step and generation run end to end.
Skipped without CUDA, or without mamba_ssm / fla."""

import pytest
import torch
from helpers import rel_err

from mamba_parallel.bench import bench_generate, bench_selective_scan, bench_ssd, train_side_by_side
from mamba_parallel.bench.peer import PeerUnavailable, fla_ssd, load_fla, load_peer
from mamba_parallel.ops.selective_scan import naive as scan_naive
from mamba_parallel.ops.ssd import naive as ssd_naive

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def peer():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        return load_peer("mamba_ssm")
    except PeerUnavailable as e:
        pytest.skip(str(e))


def _fp32(inputs):
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-2), (torch.bfloat16, 5e-2)])
def test_fla_ssd_equals_our_reference(dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fn = load_fla()
    if fn is None:
        pytest.skip("fla does not import")
    inputs = bench_ssd.make_inputs(2, 333, 4, 64, 32, 1, dtype, "cuda", chunk=64)
    want = ssd_naive.ssd_chunk_scan(**_fp32(inputs))
    assert rel_err(fla_ssd(fn)(**inputs).float(), want) < tol  # fp32: the dots may use TF32; a wrong mapping is O(1)


def test_peer_kernels_equal_our_reference(peer):
    inputs = bench_ssd.make_inputs(2, 333, 4, 64, 32, 1, torch.float32, "cuda", chunk=64)
    assert rel_err(peer.ssd(**inputs), ssd_naive.ssd_chunk_scan(**inputs)) < 1e-2  # TF32 dots
    inputs = bench_selective_scan.make_inputs(2, 64, 333, 16, torch.float32, "cuda")
    assert rel_err(peer.selective_scan(**inputs), scan_naive.selective_scan(**inputs)) < 1e-3


def test_train_side_by_side_losses_agree(peer):
    rows, check = train_side_by_side.run_preset("tiny-mamba2", peer, "cuda", seq_len=128, batch=2, warmup=1, steps=1,
                                                log=lambda _: None)
    assert check["agree"], check
    assert all(r["ours"] and r["peer"] for r in rows), rows


def test_generate_side_by_side_runs(peer):
    res = bench_generate.run(["tiny-mamba"], peer, "cuda", batch_sizes=(2,), prompt_len=8, new_tokens=4, repeats=1,
                             dtype="fp32", log=lambda _: None)
    decode, _ = res["rows"]
    assert decode["ours"] is not None and decode["peer"] is not None, decode
    assert decode["tokens_match"] >= 0.75  # same fp32 weights, greedy; near-ties may flip a token
