"""The block's add + norm and the mixer's in_proj as one node on the Triton path (``ops.add_rms_norm_linear``): the
values and every gradient of add_rms_norm followed by in_proj as a module, taken only in a training forward of a
Mamba / Mamba2 mixer with a plain in_proj, keeping no norm output."""

import pytest
import torch
from helpers import graph_node_names, saved_bytes

from mamba_parallel import ops
from mamba_parallel.config import get_preset
from mamba_parallel.inference.cache import InferenceParams
from mamba_parallel.layers.block import Block, create_block

pytest.importorskip("triton")


def _block(preset: str, layer: int = 1) -> Block:
    torch.manual_seed(0)
    block = create_block(get_preset(preset), layer)
    with torch.no_grad():
        block.norm.weight.normal_(1.0, 0.2)  # a non-trivial norm weight: its gradient and the rebuilt output differ
    return block


def _run(block, h, res, node: bool, monkeypatch=None):
    """Forward + backward of a fixed non-uniform loss on both outputs -> ([hidden, residual, dh, dres, parameter
    grads], autograd node names, saved bytes); ``node`` False forces the module call (the unfused path)."""
    if not node:
        monkeypatch.setattr(Block, "_norm_in_proj_node", lambda self, ip: False)
    block.zero_grad(set_to_none=True)
    h, res = h.detach().requires_grad_(), res.detach().requires_grad_()
    with ops.use_backend("triton"):
        (out, new_res), saved = saved_bytes(block, lambda: block(h, res))
        nodes = graph_node_names(out)
        w = torch.linspace(-1, 1, out.numel()).view_as(out)
        ((out.float() * w).sum() + (new_res * w.flip(-1)).sum()).backward()
    if not node:
        monkeypatch.undo()
    return [out.detach(), new_res.detach(), h.grad, res.grad] + [p.grad for p in block.parameters()], nodes, saved


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-mamba"])
def test_node_equals_add_norm_then_in_proj(preset, monkeypatch):
    """Bit for bit (fp32, interpreter) on an odd length, keeping b * L * d_model values less (the norm output)."""
    block = _block(preset)
    b, L, d = 2, 7, block.norm.weight.numel()
    g = torch.Generator().manual_seed(1)
    h, res = torch.randn(b, L, d, generator=g), torch.randn(b, L, d, generator=g)
    got, nodes, saved = _run(block, h, res, node=True)
    ref, ref_nodes, ref_saved = _run(block, h, res, node=False, monkeypatch=monkeypatch)
    assert any("add_norm_linear_fwd" in n for n in nodes)
    assert not any("add_norm_linear_fwd" in n for n in ref_nodes)
    names = ["hidden", "residual", "d hidden", "d residual"] + [n for n, _ in block.named_parameters()]
    for name, a, r in zip(names, got, ref):
        assert (a is None and r is None) or torch.equal(a, r), name
    assert ref_saved - saved == b * L * d * 4


def test_node_only_where_it_applies():
    """No node without autograd, with an inference cache, or with an in_proj that is not a plain nn.Linear (a
    subclass or a hooked module: tensor parallelism's sharded in_proj); an attention block never has it."""
    block = _block("tiny-mamba2")
    assert block._norm_in_proj_node(None)
    with torch.no_grad():
        assert not block._norm_in_proj_node(None)
    assert not block._norm_in_proj_node(InferenceParams(max_seqlen=8, max_batch_size=1))
    for module in (block.mixer.in_proj, block.mixer):  # a hook on either would miss what the node skips
        handle = module.register_forward_pre_hook(lambda *a: None)
        assert not block._norm_in_proj_node(None)
        handle.remove()
    assert block._norm_in_proj_node(None)
    hybrid = get_preset("tiny-hybrid")
    attn = create_block(hybrid, hybrid.attn_layer_idx[0])
    assert not attn._norm_in_proj_node(None)


def test_mixer_refuses_in_proj_out_with_a_cache():
    block = _block("tiny-mamba2")
    with pytest.raises(ValueError, match="Mamba2: in_proj_out is for a training forward"):
        block.mixer(None, inference_params=InferenceParams(max_seqlen=8, max_batch_size=1),
                    in_proj_out=torch.zeros(1, 3, block.mixer.in_proj.out_features))
