"""Falcon-Mamba's weightless RMS norms on dt_low, B and C (``ssm_cfg.bcdt_rms_norm``): the reference layer, the
decode step and the fused training node agree, with every gradient; the model round-trips in our format."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, graph_node_names

from mamba_parallel import MambaLMHeadModel, get_preset
from mamba_parallel.config import ConfigError
from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.layers import Mamba
from mamba_parallel.layers.mamba1 import bcdt_rms_norm
from mamba_parallel.models.formats import load_pretrained, save_pretrained


def _layer(dtype=torch.float32, device="cpu", d_model=16, d_state=4, eps=1e-6):
    torch.manual_seed(0)
    m = Mamba(d_model, d_state=d_state, bcdt_rms_norm=True, bcdt_rms_eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.D.normal_()
        m.conv1d.bias.normal_()
        m.x_proj.weight.mul_(3)  # large raw dt / B / C: the norms must change them
    return m


def _run(m, h, monkeypatch, fused: bool, backend: str = "triton"):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", backend)
    m.use_fused_path = fused
    m.zero_grad()
    h = h.detach().requires_grad_()
    out = m(h)
    nodes = graph_node_names(out)
    w = torch.linspace(-1, 1, out.numel(), device=h.device).view_as(out)
    (out.float() * w).sum().backward()
    names = ["out", "d hidden"] + [n for n, _ in m.named_parameters()]
    return dict(zip(names, [out.detach(), h.grad] + [p.grad for p in m.parameters()])), nodes


def test_norm_is_each_piece_over_its_rms():
    x = torch.randn(2, 3 + 4 + 4, 5, dtype=torch.float64)
    y = bcdt_rms_norm(x, 3, 4, 1e-6, dim=1)
    for a, b in ((0, 3), (3, 7), (7, 11)):
        p = x[:, a:b]
        torch.testing.assert_close(y[:, a:b], p / (p.square().mean(1, keepdim=True) + 1e-6).sqrt())
    assert torch.equal(bcdt_rms_norm(x.transpose(1, 2), 3, 4, 1e-6, dim=-1), y.transpose(1, 2))


def test_reference_differs_from_plain_mamba_and_steps_like_its_forward():
    m = _layer().eval()
    plain = Mamba(16, d_state=4)
    plain.load_state_dict(m.state_dict())  # same weights, no norms (nothing extra is stored)
    h = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(h)
        assert (full - plain(h)).abs().max() > 1e-2
        m.layer_idx = 0
        cache = InferenceParams(max_seqlen=9, max_batch_size=2)
        cache.key_value_memory_dict[0] = m.allocate_inference_cache(2, 9)
        pieces = [m(h[:, :4], inference_params=cache)]
        for t in range(4, 9):
            cache.seqlen_offset = t
            pieces.append(m(h[:, t:t + 1], inference_params=cache))
    assert_close(torch.cat(pieces, dim=1), full, name="prefill + steps")


@pytest.mark.parametrize("dtype,against_naive", [(torch.float32, True), (torch.float16, False)])
def test_fused_node_matches_the_reference_with_every_gradient(dtype, against_naive, monkeypatch):
    """On the Triton path (the interpreter on CPU: chunk 8, so L = 11 crosses a chunk boundary)."""
    pytest.importorskip("triton")
    m = _layer(dtype)
    h = torch.randn(2, 11, 16, dtype=dtype, generator=torch.Generator().manual_seed(2))
    ref, ref_nodes = _run(m, h, monkeypatch, fused=False)
    got, nodes = _run(m, h, monkeypatch, fused=True)
    assert "_Mamba1InnerBackward" in nodes and "_Mamba1InnerBackward" not in ref_nodes
    for name, r in ref.items():
        assert got[name] is not None, name
        assert_close(got[name], r, dtype=dtype, grad=name != "out", name=name)
    if not against_naive:
        return
    naive, _ = _run(m, h, monkeypatch, fused=False, backend="naive")  # and against the reference ops
    for name, r in naive.items():
        assert_close(got[name], r, dtype=dtype, grad=name != "out", name=f"{name} vs naive")


def test_model_round_trip_and_config_checks(tmp_path):
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset("tiny-falcon-mamba")).eval()
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert back.config == model.config and back.backbone.layers[0].mixer.bcdt_rms_eps == 1e-6
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    with pytest.raises(ConfigError, match="bcdt_rms_eps"):
        get_preset("tiny-falcon-mamba", ssm_cfg={"layer": "Mamba1", "bcdt_rms_norm": True, "bcdt_rms_eps": 0.0})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_node_matches_the_reference(dtype, monkeypatch):
    """Falcon-Mamba-7B's mixer widths per token (d_state 16, dt_rank 256 at d_model 4096) at a small d_inner."""
    m = _layer(dtype, "cuda", d_model=512, d_state=16)
    h = torch.randn(2, 700, 512, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(1))
    ref, _ = _run(m, h, monkeypatch, fused=False)
    got, nodes = _run(m, h, monkeypatch, fused=True)
    assert "_Mamba1InnerBackward" in nodes
    for name, r in ref.items():
        assert torch.isfinite(got[name]).all(), name
        assert_close(got[name], r, dtype=dtype, grad=name != "out", factor=2, name=name)
