"""The recompute option's plumbing (layers/recompute.py): a typed layer attribute set by the constructor or
``apply_recompute``, validated once; nothing to recompute costs the layers no context; and a torch without the
outer-hooks accessor refuses the option instead of hiding saved tensors from activation checkpointing. What it
saves and its exactness: test_saved_memory.py."""

import pytest
import torch

from mamba_parallel import get_preset
from mamba_parallel.layers import mamba1, mamba2, recompute
from mamba_parallel.layers.recompute import apply_recompute, recompute_plan, recompute_set
from mamba_parallel.models import MambaLMHeadModel


class _Forbidden:
    def __init__(self, *a, **k):
        raise AssertionError("RecomputeInBackward created with nothing to recompute")


def _layers(items=()):
    torch.manual_seed(0)
    return [mamba2.Mamba2(32, d_state=16, headdim=16, ngroups=1, chunk_size=16, recompute=items),
            mamba1.Mamba(16, d_state=4, recompute=items)]


def test_items_are_validated_once():
    assert recompute_set(" conv, gate ,") == {"conv", "gate"}
    assert recompute_set(["dt"]) == {"dt"} and recompute_set(None) == frozenset() == recompute_set("")
    with pytest.raises(ValueError, match="recompute: unknown bogus; expected names from conv, dt, gate, states"):
        recompute_set("gate,bogus")
    with pytest.raises(ValueError, match="logits"):
        mamba1.Mamba(16, recompute=["conv", "logits"])


def test_apply_recompute_sets_every_layer():
    model = MambaLMHeadModel(get_preset("tiny-hybrid"))
    assert apply_recompute(model, "gate,conv") is model
    mixers = [b.mixer for b in model.backbone.layers if hasattr(b.mixer, "recompute")]
    assert mixers and all(m.recompute == {"conv", "gate"} for m in mixers)
    apply_recompute(model, None)
    assert all(m.recompute == frozenset() for m in mixers)
    with pytest.raises(ValueError, match="nope"):
        apply_recompute(model, "nope")


def test_nothing_to_recompute_creates_no_context(monkeypatch):
    monkeypatch.setattr(mamba2, "RecomputeInBackward", _Forbidden)
    monkeypatch.setattr(mamba1, "RecomputeInBackward", _Forbidden)
    for m in _layers():
        h = torch.randn(2, 16, m.d_model, requires_grad=True)
        m(h).sum().backward()
        assert h.grad is not None and torch.isfinite(h.grad).all()


def test_plan_follows_grad_mode_and_a_communicating_conv():
    m = _layers("conv,gate")[0]
    assert recompute_plan(m) == {"conv", "gate"}
    assert recompute_plan(m, conv_local=False) == {"gate"}  # as under context parallelism: its conv communicates
    with torch.no_grad():
        assert recompute_plan(m) == frozenset()


def test_missing_outer_hooks_accessor_refuses_the_option(monkeypatch):
    monkeypatch.setattr(recompute, "_top_hooks", None)
    for m in _layers("gate"):
        with pytest.raises(RuntimeError, match="recompute: .*_top_saved_tensors_default_hooks"):
            m(torch.randn(2, 16, m.d_model, requires_grad=True))
    for m in _layers():  # nothing to recompute: no context, so the accessor is not needed
        m(torch.randn(2, 16, m.d_model, requires_grad=True)).sum().backward()
