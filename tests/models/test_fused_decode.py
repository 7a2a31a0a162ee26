"""The fused Mamba-2 decode step (three kernels per block, MixerModel._fused_decode_step) against the blocks' ops
one by one, on the kernels (interpreter on CPU): the same logits and states step after step; where it applies."""

import copy

import pytest
import torch
from helpers import assert_close

from mamba_parallel import ops
from mamba_parallel.config import get_preset
from mamba_parallel.layers.mamba1 import Mamba
from mamba_parallel.layers.mamba2 import Mamba2
from mamba_parallel.models import MambaLMHeadModel

pytest.importorskip("triton")

# every option the fused stages read: B / C groups (2 norm groups), a dt clamp, per-channel D, projection biases
OPTIONS = dict(ngroups=2, dt_limit=(0.01, 0.3), D_has_hdim=True, bias=True)


def _model(preset="tiny-mamba2", dtype=torch.float32, device="cpu", **ssm):
    cfg = get_preset(preset)
    if ssm:
        cfg = get_preset(preset, ssm_cfg={**cfg.ssm_cfg, **ssm})
    torch.manual_seed(0)
    model = MambaLMHeadModel(cfg, device=device, dtype=dtype).eval()
    with torch.no_grad():  # not the init's ones / zeros: every weight the stages fold in is checked
        for name, prm in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".bias", ".D")):
                prm.add_(0.1 * torch.randn_like(prm))
    return model


def _decode(model, prompt, steps, fused, tokens=None):
    """Prefill (the reference ops), then ``steps`` one-token steps -> (logits per step, the cache, the tokens fed).
    Greedy, or fed ``tokens`` (b, steps) when given: comparing two runs on the same tokens keeps one near-tie
    argmax (random weights have many) from sending them down different sequences."""
    model.backbone.fused_decode = fused
    cache = model.allocate_inference_cache(prompt.shape[0], prompt.shape[1] + steps)
    with torch.no_grad():
        # the prefill on the reference ops: the same states for every run (the one-token steps are under test), and
        # a Mamba-1 prefill through the CPU interpreter takes tens of seconds
        with ops.use_backend("naive"):
            logits = model(prompt, inference_params=cache, num_last_tokens=1).logits
        cache.seqlen_offset = prompt.shape[1]
        out, fed = [], []
        for i in range(steps):
            token = logits[:, -1].argmax(-1, keepdim=True) if tokens is None else tokens[:, i:i + 1]
            logits = model(token, inference_params=cache).logits
            cache.seqlen_offset += 1
            out.append(logits)
            fed.append(token)
    return out, cache, torch.cat(fed, dim=1)


def _count_steps(monkeypatch):
    """The unfused steps run (Mamba.step and Mamba2.step calls)."""
    calls = []
    for cls in (Mamba, Mamba2):
        monkeypatch.setattr(cls, "step", lambda self, *a, _real=cls.step, **k: calls.append(1) or _real(self, *a, **k))
    return calls


@pytest.mark.parametrize("preset,ssm", [("tiny-mamba2", {}), ("tiny-mamba2", OPTIONS),
                                        ("tiny-mamba", dict(bias=True)), ("tiny-falcon-mamba", {})],
                         ids=["mamba2", "mamba2-options", "mamba", "falcon-mamba"])
def test_fused_decode_matches_the_ops(preset, ssm, monkeypatch):
    model = _model(preset, **ssm)
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    calls = _count_steps(monkeypatch)
    with ops.use_backend("triton"):
        ref, ref_cache, tokens = _decode(model, prompt, 3, fused=False)
        assert len(calls) == 3 * model.config.n_layer
        got, cache, _ = _decode(model, prompt, 3, fused=True, tokens=tokens)
    assert len(calls) == 3 * model.config.n_layer  # no unfused step: every block fused
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, dtype=torch.float32, name=f"logits, step {i}")
    for i in range(model.config.n_layer):
        for s_got, s_ref, name in zip(cache.states(i), ref_cache.states(i), ("conv", "ssm")):
            assert_close(s_got, s_ref, dtype=torch.float32, name=f"layer {i} {name} state")


def test_generate_gives_the_same_tokens(monkeypatch):
    """The public ``generate`` (greedy) with the fused step gives the tokens the ops one by one give."""
    model = _model()
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    calls = _count_steps(monkeypatch)
    out = {}
    with ops.use_backend("triton"):
        for fused in (False, True):
            model.backbone.fused_decode = fused
            out[fused] = model.generate(prompt, max_new_tokens=5, top_k=1)
    assert len(calls) == 4 * model.config.n_layer  # only the unfused run's four one-token steps
    assert torch.equal(out[True], out[False])


def test_where_the_fused_step_does_not_apply(monkeypatch):
    """Batch 2, the reference ops, a hybrid stack: the blocks' ops one by one."""
    calls = _count_steps(monkeypatch)
    model = _model()
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    with ops.use_backend("triton"):
        _decode(model, prompt, 1, fused=True)
    assert len(calls) == model.config.n_layer
    with ops.use_backend("naive"):
        _decode(model, prompt[:1], 1, fused=True)
    assert len(calls) == 2 * model.config.n_layer
    hybrid = _model("tiny-hybrid")
    with ops.use_backend("triton"):
        _decode(hybrid, prompt[:1], 1, fused=True)
    mamba_layers = sum(isinstance(layer.mixer, Mamba2) for layer in hybrid.backbone.layers)
    assert len(calls) == 2 * model.config.n_layer + mamba_layers
    assert not copy.deepcopy(model).backbone._fused_decode_ok(2)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,ssm", [("mamba2-130m", {}), ("mamba2-130m", OPTIONS), ("mamba-130m", {})],
                         ids=["mamba2", "mamba2-options", "mamba"])
def test_gpu_fused_decode_matches_the_ops(preset, ssm, monkeypatch, nan_poison):
    """bf16 weights on a GPU, 8 steps on the same tokens: the fused step's logits against the ops one by one (its
    matmul inputs stay fp32 where the ops round them to bf16: bf16 tolerance)."""
    model = _model(preset, dtype=torch.bfloat16, device="cuda", **ssm)
    prompt = torch.randint(0, 50000, (1, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    calls = _count_steps(monkeypatch)
    ref, _, tokens = _decode(model, prompt, 8, fused=False)
    got, _, _ = _decode(model, prompt, 8, fused=True, tokens=tokens)
    assert len(calls) == 8 * model.config.n_layer
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, dtype=torch.bfloat16, factor=4, name=f"logits, step {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["mamba2-130m", "mamba-130m"])
def test_gpu_fused_decode_graph_replay_equals_eager(preset):
    """The fused step captured in a CUDA graph (as generate runs it; on Hopper its kernels overlap by programmatic
    dependent launch) gives the eager step's logits and states exactly, step after step, on the same tokens: a
    kernel that read its predecessor's output before waiting for it would not."""
    from mamba_parallel.inference.cuda_graph import make_graphed_decoder

    model = _model(preset, dtype=torch.bfloat16, device="cuda")
    steps, prompt_len = 12, 17
    gen = torch.Generator("cuda").manual_seed(2)
    prompt = torch.randint(0, 50000, (1, prompt_len), device="cuda", generator=gen)
    tokens = torch.randint(0, 50000, (1, steps), device="cuda", generator=gen)
    decoder = make_graphed_decoder(model, 1, prompt_len + steps + 1)
    runs = []
    for run in (model, decoder):
        cache = decoder.new_cache() if run is decoder else model.allocate_inference_cache(1, prompt_len + steps + 1)
        with torch.inference_mode():
            run(prompt, inference_params=cache, num_last_tokens=1)
            cache.seqlen_offset = prompt_len
            logits = []
            for i in range(steps):
                logits.append(run(tokens[:, i:i + 1], inference_params=cache).logits.clone())
                cache.seqlen_offset += 1
            states = [t.clone() for entry in cache.key_value_memory_dict.values() for t in entry]
        runs.append((logits, states))
    (eager, eager_states), (graphed, graphed_states) = runs
    assert model.backbone._fused_decode_ok(1)
    for i, (g, e) in enumerate(zip(graphed, eager)):
        assert torch.equal(g, e), f"logits of step {i} differ: max {(g.float() - e.float()).abs().max().item()}"
    for g, e in zip(graphed_states, eager_states):
        assert torch.equal(g, e)
