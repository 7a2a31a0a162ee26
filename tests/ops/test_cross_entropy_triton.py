"""Triton chunked linear cross-entropy vs the PyTorch reference (naive.py) and F.cross_entropy on full logits:
loss and both gradients, every reduction, ignore_index, chunking."""

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from mamba_parallel.ops.cross_entropy import naive
from mamba_parallel.ops.cross_entropy import triton_impl as tri


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, d, v, dtype, seed=0, n_ignored=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(device=_dev(), dtype=dtype)
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(device=_dev(), dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[:n_ignored]] = -100
    return h, w, labels.to(_dev())


def _loss_and_grads(fn, h, w, labels, reduction, seed=5):
    h, w = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    loss = fn(h, w, labels, reduction)
    if reduction == "none":
        g = torch.randn(loss.shape, generator=torch.Generator(device="cpu").manual_seed(seed)).to(loss.device)
        (loss * g).sum().backward()
    else:
        (loss * 1.7).backward()
    return loss, h.grad, w.grad


def _naive(chunk):
    return lambda h, w, lab, red: naive.linear_cross_entropy(h, w, lab, -100, red, chunk)


def _tri(chunk):
    return lambda h, w, lab, red: tri.linear_cross_entropy(h, w, lab, -100, red, chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_ce_matches_reference(dtype, reduction):
    h, w, labels = _inputs(37, 16, 45, dtype, n_ignored=5)
    lt, ght, gwt = _loss_and_grads(_tri(8), h, w, labels, reduction)
    lr, ghr, gwr = _loss_and_grads(_naive(8), h, w, labels, reduction)
    assert lt.dtype == torch.float32 and lt.shape == lr.shape
    assert_close(lt, lr.float(), dtype, name="loss")
    assert ght.dtype == dtype and gwt.dtype == dtype
    assert_close(ght, ghr, dtype, grad=True, name="d hidden")
    assert_close(gwt, gwr, dtype, grad=True, name="d weight")
    if reduction == "none":
        assert torch.all(lt[labels == -100] == 0)


@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
def test_linear_ce_chunking_matches_full_logits(chunk):
    """Any chunk size equals F.cross_entropy on the full fp32 logits (vocab wider than one kernel block)."""
    h, w, labels = _inputs(20, 8, 5000, torch.float32, seed=1, n_ignored=3)
    full = lambda h, w, lab, red: F.cross_entropy(h @ w.T, lab, ignore_index=-100, reduction=red)  # noqa: E731
    lt, ght, gwt = _loss_and_grads(_tri(chunk), h, w, labels, "mean")
    lr, ghr, gwr = _loss_and_grads(full, h, w, labels, "mean")
    assert_close(lt, lr, name="loss")
    assert_close(ght, ghr, grad=True, name="d hidden")
    assert_close(gwt, gwr, grad=True, name="d weight")


def test_linear_ce_all_ignored_is_nan_like_torch():
    h, w, labels = _inputs(4, 8, 11, torch.float32)
    labels[:] = -100
    assert torch.isnan(tri.linear_cross_entropy(h, w, labels))
    assert tri.linear_cross_entropy(h, w, labels, reduction="sum").item() == 0.0


def test_linear_ce_no_grad_and_weight_only_grad():
    h, w, labels = _inputs(9, 8, 13, torch.float32)
    with torch.no_grad():
        assert_close(tri.linear_cross_entropy(h, w, labels), naive.linear_cross_entropy(h, w, labels), name="loss")
    w1 = w.clone().requires_grad_(True)
    w2 = w.clone().requires_grad_(True)
    tri.linear_cross_entropy(h, w1, labels).backward()
    naive.linear_cross_entropy(h, w2, labels).backward()
    assert_close(w1.grad, w2.grad, grad=True, name="d weight")


def test_compile_keeps_custom_op():
    h, w, labels = _inputs(6, 8, 13, torch.float32)

    def f(h, w, lab):
        return tri.linear_cross_entropy(h, w, lab, reduction="sum") + tri.linear_cross_entropy(
            h, w, lab, reduction="none").sum()

    explained = torch._dynamo.explain(f)(h, w, labels)
    assert explained.graph_break_count == 0, explained.break_reasons


# ------------------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_ce_gpu(dtype, reduction, nan_poison):
    h, w, labels = _inputs(3000, 768, 50288, dtype, n_ignored=100)
    lt, ght, gwt = _loss_and_grads(_tri(1024), h, w, labels, reduction)
    lr, ghr, gwr = _loss_and_grads(_naive(1024), h, w, labels, reduction)
    assert_close(lt, lr.float(), dtype, name="loss")
    assert_close(ght, ghr, dtype, grad=True, name="d hidden")
    assert_close(gwt, gwr, dtype, grad=True, name="d weight")
