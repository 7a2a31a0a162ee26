"""train/host_norm.py: the squared gradient norm of host tensors, on a thread pool."""

import pytest
import torch

from mamba_parallel.train import host_norm
from mamba_parallel.train.host_norm import squared_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_squared_norm_matches_float64_and_not_the_thread_count(monkeypatch, dtype):
    monkeypatch.setattr(host_norm, "PIECE", 1000)  # tensors of one piece, of several, with a short last one
    torch.manual_seed(0)
    tensors = [torch.randn(n).to(dtype) for n in (10, 1000, 4321, 2500)] + [torch.randn(30, 70).to(dtype)]
    exact = sum(t.double().pow(2).sum() for t in tensors)
    results = [squared_norm(tensors, workers=w) for w in (1, 2, 3, 8)]
    for r in results:
        assert r.dtype == torch.float32 and r.shape == ()
        assert torch.equal(r, results[0])  # the pieces, not the threads, fix the arithmetic
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: each piece's norm is rounded to bf16
    assert abs(results[0].double() - exact) / exact < tol


def test_squared_norm_refuses_an_empty_list():
    with pytest.raises(ValueError, match="no tensors"):
        squared_norm([])
