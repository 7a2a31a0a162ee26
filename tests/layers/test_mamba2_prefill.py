"""Mamba-2's prefill into the inference cache: with the single-device ops and no autograd the scan writes its
final states into the cache itself and the conv's final state is one copy of its input's tail into the cache.
Logits and every cached state are bit for bit those of the ops returning the states for the layer to copy (what
a strategy that is not ``local``, e.g. context parallelism, gets): first and resumed prompts of odd lengths, one
shorter than the conv's window, packed rows, fp32 and bf16 state caches; the reference ops and the Triton
kernels (interpreter on CPU, bf16 on a GPU)."""

import pytest
import torch
from helpers import eval_model

from mamba_parallel import ops
from mamba_parallel.layers.mamba2 import Mamba2, Mamba2Ops


class _Returning(Mamba2Ops):
    """The single-device ops, declared not ``local``: the layer asks for the final states back and copies them."""

    local = False


class _Spying(Mamba2Ops):
    """The single-device ops, recording what the layer asks of them."""

    def __init__(self, calls):
        self.calls = calls

    def conv(self, *args, **kwargs):
        self.calls.append(("conv", kwargs.get("return_final_state", False)))
        return super().conv(*args, **kwargs)

    def scan(self, *args, **kwargs):
        self.calls.append(("scan", kwargs.get("return_final_states", False),
                           kwargs.get("final_states_out") is not None))
        return super().scan(*args, **kwargs)


def _model(preset, device="cpu", dtype=torch.float32, n_layer=None):
    return eval_model(preset, ("conv1d.bias", ".D", "dt_bias"), device, dtype, n_layer)


def _mixers(model):
    return [m for m in model.modules() if isinstance(m, Mamba2)]


def _prefill_twice(model, ids, split, backend, state_dtype=None, seq_idx=None, rows=None):
    """Prefill ids[:, :split], then ids[:, split:] from the cache (``rows`` >= b rows allocated: only the first b
    may change) -> (logits of both, every cached state)."""
    b = ids.shape[0]
    cache = model.allocate_inference_cache(rows or b, ids.shape[1], state_dtype=state_dtype)
    for states in cache.key_value_memory_dict.values():
        for t in states:
            t.normal_(generator=torch.Generator(t.device).manual_seed(3))  # rows past b must keep these
    first_sid = seq_idx[:, :split] if seq_idx is not None else None
    with torch.inference_mode(), ops.use_backend(backend):
        first = model(ids[:, :split], inference_params=cache, seq_idx=first_sid).logits
        cache.seqlen_offset = split
        second = model(ids[:, split:], inference_params=cache).logits
    states = [t.clone() for entry in cache.key_value_memory_dict.values() for t in entry]
    return torch.cat([first, second], dim=1), states


def _with_ops(model, make):
    for m in _mixers(model):
        m.seq_ops = make()


@pytest.mark.parametrize("backend", ["naive", "triton"])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["fp32-states", "bf16-states"])
@pytest.mark.parametrize("split,packed", [(11, False), (2, False), (7, True)],
                         ids=["resume-short", "first-short", "packed"])
def test_prefill_into_the_cache_is_the_copy(backend, state_dtype, split, packed):
    """13 tokens: a second chunk of 2 (shorter than d_conv - 1 = 3: its conv state mixes the cached one with the
    new tokens), a first one of 2, or a first chunk of 7 with two sequences in a row (seq_idx) that continues
    the last; three rows in a cache of four."""
    if backend == "triton":
        pytest.importorskip("triton")
    model = _model("tiny-mamba2", n_layer=1)
    ids = torch.randint(0, model.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    # a sequence starts inside the first chunk's last d_conv - 1 tokens (rows 0, 1): the conv state drops them
    sid = torch.tensor([[0] * 5 + [1] * 8, [0] * 6 + [2] * 7, [0] * 13], dtype=torch.int32) if packed else None
    _with_ops(model, _Returning)
    ref_logits, ref_states = _prefill_twice(model, ids, split, backend, state_dtype, sid, rows=4)
    calls = []
    _with_ops(model, lambda: _Spying(calls))
    logits, states = _prefill_twice(model, ids, split, backend, state_dtype, sid, rows=4)
    assert calls == [("conv", False), ("scan", False, True)] * 2  # both prompts: the states go into the cache
    assert torch.equal(logits, ref_logits)
    for i, (s, r) in enumerate(zip(states, ref_states)):
        assert s.dtype == r.dtype and torch.equal(s, r), f"cached state {i}"


def test_prefill_with_grad_returns_the_states():
    """With autograd recording (a prompt whose logits are differentiated), the layer takes the final states back
    from the ops and copies them, as before."""
    model = _model("tiny-mamba2", n_layer=1)
    calls = []
    _with_ops(model, lambda: _Spying(calls))
    cache = model.allocate_inference_cache(1, 3)
    with ops.use_backend("naive"):
        model(torch.arange(3)[None], inference_params=cache).logits.sum().backward()
    assert calls == [("conv", True), ("scan", True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16], ids=["fp32-states", "bf16-states"])
def test_gpu_prefill_into_the_cache_is_the_copy(state_dtype, nan_poison):
    model = _model("mamba2-130m", device="cuda", dtype=torch.bfloat16, n_layer=4)
    ids = torch.randint(0, 50000, (3, 301), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    _with_ops(model, _Returning)
    ref_logits, ref_states = _prefill_twice(model, ids, 253, "triton", state_dtype, rows=5)
    _with_ops(model, Mamba2Ops)
    logits, states = _prefill_twice(model, ids, 253, "triton", state_dtype, rows=5)
    assert torch.equal(logits, ref_logits)
    for i, (s, r) in enumerate(zip(states, ref_states)):
        assert s.dtype == r.dtype and torch.equal(s, r), f"cached state {i}"
