"""Test setup. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here, first.

On a machine without CUDA, Triton kernels run in the interpreter (fp32/fp16 exact, bf16 wrong, tiny shapes).
GPU tests carry ``@pytest.mark.gpu`` and are skipped without CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MAMBA_PARALLEL_BACKEND", "auto")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nan_poison(monkeypatch):
    """Fill fresh CUDA allocations with NaN so a kernel that reads memory it never wrote fails its test."""
    if not torch.cuda.is_available():
        yield
        return
    orig_empty, orig_empty_like = torch.empty, torch.empty_like

    def empty(*a, **k):
        t = orig_empty(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    def empty_like(*a, **k):
        t = orig_empty_like(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield
