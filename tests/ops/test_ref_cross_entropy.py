"""Chunked linear cross-entropy against F.cross_entropy on full logits (values, gradients, reductions,
ignore_index), gradcheck, and a check that no op ever holds more than one chunk of logits."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from torch.overrides import TorchFunctionMode

from mamba_parallel.ops import linear_cross_entropy, use_backend

F64 = torch.float64


@pytest.fixture(autouse=True)
def _naive_backend():
    with use_backend("naive"):
        yield


def _data(N=10, d=6, V=13, dtype=F64, seed=0):
    torch.manual_seed(seed)
    labels = torch.randint(0, V, (N,))
    labels[::3] = -100
    return torch.randn(N, d, dtype=dtype), torch.randn(V, d, dtype=dtype), labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_matches_full_logits(reduction, chunk_size):
    h, w, labels = _data(seed=chunk_size or 0)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(h1, w1, labels, reduction=reduction, chunk_size=chunk_size)
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.T, labels, ignore_index=-100, reduction=reduction)
    assert_close(loss, ref, F64, name="loss")
    g = torch.randn_like(ref)
    loss.backward(g)
    ref.backward(g)
    assert_close(h1.grad, h2.grad, F64, grad=True, name="grad hidden")
    assert_close(w1.grad, w2.grad, F64, grad=True, name="grad weight")


def test_custom_ignore_index_and_all_ignored():
    h, w, labels = _data(seed=1)
    labels[labels == -100] = 5
    loss = linear_cross_entropy(h, w, labels, ignore_index=5, chunk_size=4)
    assert_close(loss, F.cross_entropy(h @ w.T, labels, ignore_index=5), F64, name="ignore_index=5")
    everything = torch.full_like(labels, -100)
    assert torch.isnan(linear_cross_entropy(h, w, everything))
    assert linear_cross_entropy(h, w, everything, reduction="sum").item() == 0.0


def test_bf16_inputs_fp32_loss():
    h, w, labels = _data(dtype=torch.bfloat16, seed=2)
    loss = linear_cross_entropy(h, w, labels, chunk_size=4)
    assert loss.dtype == torch.float32
    assert_close(loss, F.cross_entropy(h.double() @ w.double().T, labels), torch.bfloat16, name="bf16 loss")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck(reduction):
    h, w, labels = _data(N=5, d=3, V=4, seed=3)
    fn = lambda a, b: linear_cross_entropy(a, b, labels, reduction=reduction, chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_()))


class _LargestOutput(TorchFunctionMode):
    """Records the largest tensor any torch call returns (the custom backward runs in Python, so it is seen)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_more_than_one_chunk_of_logits():
    N, d, V, chunk = 16, 4, 64, 4
    h, w, labels = _data(N=N, d=d, V=V, seed=4)
    h.requires_grad_()
    w.requires_grad_()
    with _LargestOutput() as mode:
        linear_cross_entropy(h, w, labels, chunk_size=chunk).backward()
    # the largest tensors allowed: one chunk of logits, the weight gradient (V, d), the hidden gradient (N, d)
    assert mode.largest <= max(chunk * V, V * d, N * d) < N * V, mode.largest


def test_bad_inputs_name_the_argument():
    h, w, labels = _data()
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, torch.randn(13, 5, dtype=F64), labels)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, labels[:4])
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, labels.double())
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, labels, reduction="avg")
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(h, w, labels, chunk_size=0)


def test_fp32_math_inside_autocast():
    h, w, labels = _data(dtype=torch.float32, seed=5)
    h.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, labels, chunk_size=4)
    loss.backward()
    h2 = h.detach().double().requires_grad_()
    ref = F.cross_entropy(h2 @ w.double().T, labels)
    ref.backward()
    assert_close(loss, ref, torch.float32, name="loss under autocast")
    assert_close(h.grad, h2.grad, torch.float32, grad=True, name="grad under autocast")
