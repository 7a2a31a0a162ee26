"""The fused one-token decode step (layers/fused_step.py): a block's pre-norm folded into its mixer's in_proj, the
conv into the same kernel, the gated norm into out_proj. Its logits and states equal the unfused reference step's
(Triton interpreter vs the naive backend), and it steps aside where it cannot apply."""

import pytest
import torch
from helpers import assert_close

from mamba_parallel import get_preset, ops
from mamba_parallel.layers import fused_step
from mamba_parallel.models import MambaLMHeadModel


def _decode(model, ids, steps, backend):
    """Prefill ids (reference ops: both sides start from the same states), then ``steps`` greedy one-token steps
    on ``backend`` -> (stacked logits, final states)."""
    with torch.inference_mode():
        cache = model.allocate_inference_cache(ids.shape[0], ids.shape[1] + steps)
        with ops.use_backend("naive"):
            model(ids, inference_params=cache)
        cache.seqlen_offset = ids.shape[1]
    with torch.inference_mode(), ops.use_backend(backend):
        token, logits = ids[:, -1:], []
        for _ in range(steps):
            out = model(token, inference_params=cache).logits.float()
            logits.append(out)
            token = out.argmax(-1)
            cache.seqlen_offset += 1
        states = [t.clone() for v in cache.key_value_memory_dict.values()
                  for t in (v if isinstance(v, tuple) else (v,))]
    return torch.cat(logits, 1), states


def _count_fused(monkeypatch):
    calls = []
    real = fused_step.can_fuse_step

    def counting(*a, **k):
        ok = real(*a, **k)
        calls.append(ok)
        return ok
    monkeypatch.setattr("mamba_parallel.layers.block.can_fuse_step", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-mamba", "tiny-falcon-mamba", "tiny-hybrid", "tiny-nemotron-h"])
def test_fused_step_equals_reference_step(name, dtype, monkeypatch):
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(name), dtype=dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(1))
    want, want_states = _decode(model, ids, 3, "naive")
    calls = _count_fused(monkeypatch)
    got, got_states = _decode(model, ids, 3, "triton")
    assert any(calls), "the fused step never ran"
    assert_close(got, want, dtype=dtype, name=f"{name} logits")
    for i, (a, b) in enumerate(zip(got_states, want_states)):
        assert_close(a.float(), b.float(), dtype=dtype, name=f"{name} state {i}")


def test_fused_step_steps_aside(monkeypatch):
    """A hooked projection, autograd, a batch over the kernel's rows or the reference backend: the unfused step."""
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset("tiny-mamba2")).eval()
    calls = _count_fused(monkeypatch)
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    _decode(model, ids, 1, "naive")
    assert calls and not any(calls)
    calls.clear()
    handle = model.backbone.layers[0].mixer.in_proj.register_forward_hook(lambda *a: None)
    _decode(model, ids, 1, "triton")
    assert calls[-2:] == [False, True]  # layer 0 (hooked) steps unfused, layer 1 fused
    handle.remove()
    calls.clear()
    big = torch.randint(0, model.config.vocab_size, (fused_step.STEP_ROWS + 1, 2))
    _decode(model, big, 1, "triton")
    assert calls and not any(calls)
