"""Shared test helpers: per-dtype tolerances, written once, a relative error measure, and a stand-in model for
the generation loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.models.outputs import CausalLMOutput

# Relative-RMS error bounds per dtype (kernel vs reference computed in fp32 / fp64).
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Looser bounds for gradients, which sum over long reductions.
GRAD_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny), in float64 (a relative RMS error)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, dtype=torch.float32, grad=False, name="tensor", factor=1.0):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    tol = (GRAD_RTOL if grad else RTOL)[dtype] * factor
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} ({dtype})"


class CountingLM:
    """A stand-in model for generate(): the greedy next token is (token + 1) % V; ``calls`` records (batch, length,
    seqlen_offset) of every forward, to test the decode loop's bookkeeping exactly."""

    def __init__(self, vocab=16):
        self.config = type("Cfg", (), {"vocab_size": vocab})()
        self.calls = []

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        return InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch_size)

    def __call__(self, input_ids, inference_params=None, num_last_tokens=0):
        self.calls.append((*input_ids.shape, inference_params.seqlen_offset))
        nxt = (input_ids + 1) % self.config.vocab_size
        return CausalLMOutput(logits=F.one_hot(nxt, self.config.vocab_size + 4).float())  # 4 padding logits


def one_scan_segment(monkeypatch) -> None:
    """From here on the selective scan's backward walks each sequence in one piece. Segments sum the later parts'
    carries in another order, so runs compared bit for bit must share the segmentation, and the interpreter's
    segments follow each run's checkpoint groups (a GPU's are whole units of 8 chunks either way)."""
    from mamba_parallel.ops.selective_scan import launch

    monkeypatch.setattr(launch, "backward_segment_chunks", lambda b, d, nchunks, *_a, **_k: nchunks)


def saved_bytes(module, fn):
    """Runs fn() recording what autograd keeps -> (fn's result, bytes of the distinct non-parameter storages)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def observe(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()

    def pack(t):
        observe(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def graph_node_names(t: torch.Tensor) -> set[str]:
    """Names of the autograd nodes ``t`` hangs from (each node visited once)."""
    names, seen, todo = set(), set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            names.add(node.name())
            todo.extend(f for f, _ in node.next_functions)
    return names


def eval_model(preset: str, perturbed: tuple[str, ...], device="cpu", dtype=torch.float32, n_layer=None):
    """A seeded preset model in eval mode with the parameters whose names end in ``perturbed`` moved off their
    init (a conv bias of zeros, D of ones or a dt bias at its init would hide mistakes that scale or shift them)."""
    from mamba_parallel import get_preset
    from mamba_parallel.models import MambaLMHeadModel

    torch.manual_seed(0)
    config = get_preset(preset)
    model = MambaLMHeadModel(config.with_layers(n_layer) if n_layer else config, device=device, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(perturbed):
                p.add_(0.1 * torch.randn_like(p))
    return model
