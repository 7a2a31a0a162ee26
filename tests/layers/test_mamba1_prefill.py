"""Mamba-1's prefill into the inference cache on the kernels (``layers/mamba1.py``'s ``_prefill``: the fused
node's forward without autograd) against the op-by-op forward: the same logits and the same conv / SSM states,
for a first prompt and for a chunk that continues from the cache; interpreter on CPU, bf16 on a GPU."""

import pytest
import torch
from helpers import assert_close, eval_model

from mamba_parallel import ops
from mamba_parallel.layers import mamba1
from mamba_parallel.layers.mamba1 import Mamba

pytest.importorskip("triton")


def _model(preset, device="cpu", dtype=torch.float32, n_layer=None):
    return eval_model(preset, ("conv1d.bias", ".D", "dt_proj.bias"), device, dtype, n_layer)


def _prefill_twice(model, ids, split, fused, state_dtype=None):
    """Prefill ids[:, :split], then ids[:, split:] from the cache -> (logits of both, every cached state)."""
    for m in model.modules():
        if isinstance(m, Mamba):
            m.use_fused_path = fused
    cache = model.allocate_inference_cache(ids.shape[0], ids.shape[1], state_dtype=state_dtype)
    with torch.inference_mode(), ops.use_backend("triton"):
        first = model(ids[:, :split], inference_params=cache).logits
        cache.seqlen_offset = split
        second = model(ids[:, split:], inference_params=cache).logits
    states = [t.clone() for entry in cache.key_value_memory_dict.values() for t in entry]
    return torch.cat([first, second], dim=1), states


def _spy(monkeypatch):
    calls = []
    real = mamba1._prefill
    monkeypatch.setattr(mamba1, "_prefill", lambda *a: calls.append(a[5]) or real(*a))
    return calls


@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-falcon-mamba"])
def test_prefill_matches_the_ops(preset, monkeypatch):
    """Odd lengths; the second chunk (2 tokens) is shorter than the conv's window, so its final conv state mixes
    the cached one with the new tokens. One layer: the interpreter's scans are what take the time."""
    model = _model(preset, n_layer=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    calls = _spy(monkeypatch)
    ref_logits, ref_states = _prefill_twice(model, ids, 11, fused=False)
    assert calls == []
    logits, states = _prefill_twice(model, ids, 11, fused=True)
    assert calls == [False] * model.config.n_layer + [True] * model.config.n_layer  # then resumed from the cache
    assert_close(logits, ref_logits, name="logits")
    for i, (s, r) in enumerate(zip(states, ref_states)):
        assert_close(s, r, name=f"cached state {i}")


def test_prefill_with_grad_takes_the_ops(monkeypatch):
    """With autograd recording (a prompt whose logits are differentiated), the op-by-op forward runs."""
    model = _model("tiny-mamba", n_layer=1)
    calls = _spy(monkeypatch)
    cache = model.allocate_inference_cache(1, 3)
    with ops.use_backend("triton"):
        model(torch.arange(3)[None], inference_params=cache).logits.sum().backward()
    assert calls == []


@pytest.mark.parametrize("L", [1, 2, 3, 7])
@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_saved_conv_state_is_the_final_state(L, resume, packed):
    """The prefill's conv-state write (``final_state`` into the cache: x's tail alone where that is all of it) is
    the conv's ``final_state``, bit for bit: prompts shorter and longer than d_conv - 1 = 3, first or resumed (the
    cache holds the state the prompt continues from and receives the new one), with and without seq_idx."""
    from mamba_parallel.ops.conv1d import naive as conv

    g = torch.Generator().manual_seed(L)
    b, d, w = 2, 8, 4
    x = torch.randn(b, L, d, generator=g).transpose(1, 2)  # (b, d, L) channels-last, as in_proj's output
    init = torch.randn(b, d, w - 1, generator=g) if resume else None
    sid = torch.tensor([[0] * (L // 2) + [1] * (L - L // 2)] * b, dtype=torch.int32) if packed else None
    expected = conv.final_state(x, init, sid, w)
    cache = init.clone() if resume else torch.full((b, d, w - 1), float("nan"))
    conv.final_state(x, cache if resume else None, sid, w, out=cache)
    assert torch.equal(cache, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["fp32-states", "bf16-states"])
def test_gpu_prefill_matches_the_ops(state_dtype, monkeypatch, nan_poison):
    model = _model("mamba-130m", device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 50000, (3, 301), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    calls = _spy(monkeypatch)
    ref_logits, ref_states = _prefill_twice(model, ids, 253, fused=False, state_dtype=state_dtype)
    logits, states = _prefill_twice(model, ids, 253, fused=True, state_dtype=state_dtype)
    assert len(calls) == 2 * model.config.n_layer
    assert_close(logits, ref_logits, dtype=torch.bfloat16, name="logits")
    for i, (s, r) in enumerate(zip(states, ref_states)):
        assert_close(s.float(), r.float(), dtype=torch.bfloat16, name=f"cached state {i}")
