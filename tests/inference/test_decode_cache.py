"""The recurrent path (prefill -> chunked prefill -> one-token steps through the cache) reproduces the full
forward's logits at every position, for Mamba-1, Mamba-2 and a hybrid with attention + MLP."""

import pytest
import torch
from helpers import assert_close

from mamba_parallel import get_preset
from mamba_parallel.models import MambaLMHeadModel

PRESETS = ["tiny-mamba", "tiny-mamba2", "tiny-hybrid"]


def _model(name):
    torch.manual_seed(0)
    return MambaLMHeadModel(get_preset(name)).eval()


@pytest.mark.parametrize("name", PRESETS)
def test_decode_matches_full_forward(name):
    model = _model(name)
    b, L, prefill, chunk = 2, 23, 7, 5  # odd lengths: the prefill is not a multiple of the scan chunk (16)
    ids = torch.randint(0, model.config.vocab_size, (b, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_inference_cache(b, L)
        pieces = [model(ids[:, :prefill], inference_params=cache).logits]
        cache.seqlen_offset = prefill
        # A second multi-token chunk resumes from the cached conv / SSM / KV states.
        pieces.append(model(ids[:, prefill:prefill + chunk], inference_params=cache).logits)
        cache.seqlen_offset += chunk
        for t in range(prefill + chunk, L):
            pieces.append(model(ids[:, t:t + 1], inference_params=cache).logits)
            cache.seqlen_offset += 1
    assert_close(torch.cat(pieces, dim=1), full, name=f"{name} recurrent logits")


@pytest.mark.parametrize("name", PRESETS)
def test_cache_layout_and_reset(name):
    model = _model(name)
    cfg = model.config
    cache = model.allocate_inference_cache(3, 11)
    assert set(cache.key_value_memory_dict) == set(range(cfg.n_layer))
    for i, layer in enumerate(model.backbone.layers):
        entry = cache.key_value_memory_dict[i]
        if i in cfg.attn_layer_idx:
            a = cfg.attn_params
            assert entry.shape == (3, 11, 2, a["num_heads_kv"], a["head_dim"])
        else:
            conv_state, ssm_state = entry
            assert conv_state.shape[::2] == (3, cfg.mixer_cfg["d_conv"] - 1)
            assert ssm_state.dtype == torch.float32 and ssm_state.shape[0] == 3
    # Attention's one-token step reads the offset from a device tensor (CUDA-graph replays see it change).
    cache.seqlen_offset = 6
    assert (cache.position is not None and int(cache.position) == 6) == bool(cfg.attn_layer_idx)
    cache.seqlen_offset = 0
    ids = torch.randint(0, cfg.vocab_size, (3, 4))
    with torch.no_grad():
        first = model(ids, inference_params=cache).logits
        cache.seqlen_offset = 4
        cache.reset(11, 3)
        assert cache.seqlen_offset == 0
        assert_close(model(ids, inference_params=cache).logits, first, name="logits after reset")


def test_cache_overflow_is_a_clear_error():
    model = _model("tiny-hybrid")
    cache = model.allocate_inference_cache(1, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="max_seqlen"):
        model(torch.zeros(1, 5, dtype=torch.long), inference_params=cache)


@pytest.mark.gpu
@pytest.mark.parametrize("name", PRESETS)
def test_gpu_bf16_decode_matches_full_forward(name):
    model = _model(name).cuda().to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 30), device="cuda")
    with torch.no_grad():
        full = model(ids).logits
        cache = model.allocate_inference_cache(2, 30)
        pieces = [model(ids[:, :17], inference_params=cache).logits]
        cache.seqlen_offset = 17
        for t in range(17, 30):
            pieces.append(model(ids[:, t:t + 1], inference_params=cache).logits)
            cache.seqlen_offset += 1
    assert_close(torch.cat(pieces, dim=1).float(), full.float(), dtype=torch.bfloat16, factor=2,
                 name=f"{name} bf16 recurrent logits")
    out = model.generate(ids[:, :5], max_new_tokens=20, temperature=0.0)
    assert out.shape == (2, 25) and out.is_cuda


@pytest.mark.parametrize("name", ["tiny-mamba", "tiny-mamba2"])
def test_decode_constants_follow_in_place_updates(name):
    """-exp(A_log) is derived once per parameter version: a step after an in-place update (an optimizer step
    between generations) uses the new value, and with autograd on the parameter gets its gradient."""
    model = _model(name)
    b, L = 2, 9
    ids = torch.randint(0, model.config.vocab_size, (b, L), generator=torch.Generator().manual_seed(2))
    mixers = [layer.mixer for layer in model.backbone.layers]
    SLOT = "_decode_A_log_neg_exp_fp32"  # the decode step's A (derived keeps one slot per function)

    def decode_last():
        cache = model.allocate_inference_cache(b, L)
        model(ids[:, :-1], inference_params=cache)
        cache.seqlen_offset = L - 1
        return model(ids[:, -1:], inference_params=cache).logits

    with torch.no_grad():
        decode_last()
        cached = [m.__dict__[SLOT][1] for m in mixers]
        decode_last()
        assert all(m.__dict__[SLOT][1] is c for m, c in zip(mixers, cached))  # reused, not recomputed
        for m in mixers:
            m.A_log.add_(0.25)
        stepped = decode_last()
        assert_close(stepped, model(ids).logits[:, -1:], name=f"{name} step after an in-place update")
    assert all(m.__dict__[SLOT][1] is not c for m, c in zip(mixers, cached))

    from mamba_parallel.layers.decode_constants import derived, neg_exp_fp32

    A = derived(mixers[0], "A_log", neg_exp_fp32)  # grad enabled: a fresh, differentiable value, not the cache
    assert A.requires_grad and A is not mixers[0].__dict__[SLOT][1]
    A.sum().backward()
    assert_close(mixers[0].A_log.grad, -torch.exp(mixers[0].A_log.detach()), name="d sum(-exp(A_log))")


def test_graph_key_tracks_parameter_versions():
    from mamba_parallel.inference.cuda_graph import _param_state

    model = _model("tiny-mamba2")
    before = _param_state(model)
    with torch.no_grad():
        model.backbone.layers[0].mixer.A_log.mul_(1.0)
    assert _param_state(model) != before  # a captured decode step would be recaptured


@pytest.mark.parametrize("name", ["tiny-mamba", "tiny-mamba2", "tiny-hybrid", "tiny-mamba3"])
def test_state_dtype(name):
    """Recurrent states in bf16 on request (fp32 by default): the cache holds them so, decoding stays close to the
    fp32 states' logits, generate takes the option by name, a bad one is a clear error."""
    model = _model(name)
    cache = model.allocate_inference_cache(2, 12, state_dtype=torch.bfloat16)
    ssm = [v[1] for v in cache.key_value_memory_dict.values() if isinstance(v, tuple)]
    assert ssm and all(t.dtype == torch.bfloat16 for t in ssm)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            cache = model.allocate_inference_cache(2, 12, state_dtype=dtype)
            model(ids[:, :6], inference_params=cache)
            cache.seqlen_offset = 6
            steps = []
            for t in range(6, 9):
                steps.append(model(ids[:, t:t + 1], inference_params=cache).logits)
                cache.seqlen_offset += 1
        logits[dtype] = torch.cat(steps, 1)
    assert_close(logits[torch.bfloat16], logits[torch.float32], dtype=torch.bfloat16, name=f"{name} bf16 states")
    out = model.generate(ids[:, :4], max_new_tokens=3, state_dtype="bf16")
    assert out.shape == (2, 7)
    with pytest.raises(ValueError, match="state_dtype"):
        model.generate(ids[:, :4], max_new_tokens=3, state_dtype="int8")
    with pytest.raises(ValueError, match="state_dtype"):
        model.allocate_inference_cache(1, 4, state_dtype=torch.int32)


def test_decode_constants_are_per_function():
    """Two functions of one parameter give their own values, not whichever was cached first."""
    from mamba_parallel.layers.decode_constants import derived, fp32, neg_exp_fp32

    mixer = _model("tiny-mamba2").backbone.layers[0].mixer
    with torch.no_grad():
        a, raw = derived(mixer, "A_log", neg_exp_fp32), derived(mixer, "A_log", fp32)
    assert torch.equal(a, -torch.exp(mixer.A_log.float())) and torch.equal(raw, mixer.A_log.float())
