"""MAMBA_PARALLEL_RECOMPUTE's plumbing (layers/recompute.py): the parse is cached, an unset option costs the
layers no context, and a torch without the outer-hooks accessor refuses the option instead of hiding saved
tensors from activation checkpointing. What it saves and its exactness: test_saved_memory.py."""

import pytest
import torch

from mamba_parallel.layers import mamba1, mamba2, recompute
from mamba_parallel.layers.recompute import RECOMPUTE_ENV, recompute_items, recompute_plan


class _Forbidden:
    def __init__(self, *a, **k):
        raise AssertionError("RecomputeInBackward created with MAMBA_PARALLEL_RECOMPUTE unset")


def _layers():
    torch.manual_seed(0)
    return [mamba2.Mamba2(32, d_state=16, headdim=16, ngroups=1, chunk_size=16), mamba1.Mamba(16, d_state=4)]


def test_parse_is_cached_until_the_raw_string_changes(monkeypatch):
    monkeypatch.setenv(RECOMPUTE_ENV, "conv,gate")
    first = recompute_items()
    assert recompute_items() is first  # same raw string: no parse
    monkeypatch.setenv(RECOMPUTE_ENV, "gate")
    assert recompute_items() == {"gate"}
    monkeypatch.setenv(RECOMPUTE_ENV, "gate,bogus")
    with pytest.raises(ValueError, match="bogus"):
        recompute_items()
    with pytest.raises(ValueError, match="bogus"):  # an invalid string is never cached as valid
        recompute_items()
    monkeypatch.delenv(RECOMPUTE_ENV)
    assert recompute_items() == frozenset()


def test_unset_option_creates_no_context(monkeypatch):
    monkeypatch.delenv(RECOMPUTE_ENV, raising=False)
    monkeypatch.setattr(mamba2, "RecomputeInBackward", _Forbidden)
    monkeypatch.setattr(mamba1, "RecomputeInBackward", _Forbidden)
    for m in _layers():
        h = torch.randn(2, 16, m.d_model, requires_grad=True)
        m(h).sum().backward()
        assert h.grad is not None and torch.isfinite(h.grad).all()


def test_plan_drops_conv_for_a_replaced_run_conv(monkeypatch):
    monkeypatch.setenv(RECOMPUTE_ENV, "conv,gate")
    m = _layers()[0]
    assert recompute_plan(m, mamba2.Mamba2) == {"conv", "gate"}
    m.run_conv = lambda *a, **k: None  # as context parallelism does: its conv communicates
    assert recompute_plan(m, mamba2.Mamba2) == {"gate"}
    with torch.no_grad():
        assert recompute_plan(m, mamba2.Mamba2) == frozenset()


def test_missing_outer_hooks_accessor_refuses_the_option(monkeypatch):
    monkeypatch.setattr(recompute, "_top_hooks", None)
    monkeypatch.setenv(RECOMPUTE_ENV, "gate")
    for m in _layers():
        with pytest.raises(RuntimeError, match="MAMBA_PARALLEL_RECOMPUTE.*_top_saved_tensors_default_hooks"):
            m(torch.randn(2, 16, m.d_model, requires_grad=True))
    monkeypatch.delenv(RECOMPUTE_ENV)
    for m in _layers():  # unset: no context, so the accessor is not needed
        m(torch.randn(2, 16, m.d_model, requires_grad=True)).sum().backward()
