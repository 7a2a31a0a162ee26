"""The parallel seam (layers/seq_ops.py): every mixer runs its conv / scan / attention only through
``mixer.seq_ops``, the model its loss only through ``model.loss_fn``; a strategy that delegates to the local ops
gives bit-identical results, and the layer reads only the strategy's declared capabilities."""

import pytest
import torch

from mamba_parallel import get_preset
from mamba_parallel.layers import MHA, Mamba, Mamba2
from mamba_parallel.layers.attention import AttentionOps
from mamba_parallel.layers.mamba1 import Mamba1Ops
from mamba_parallel.layers.mamba2 import Mamba2Ops
from mamba_parallel.models import MambaLMHeadModel


def _recording(base: type, local_conv: bool = True):
    """A subclass of ``base`` that records each seam call and then runs the local op."""
    calls = []

    def record(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            return getattr(base, name)(self, *args, **kwargs)
        return method

    names = [n for n in ("conv", "scan", "channel_sum", "positions", "attention") if hasattr(base, n)]
    cls = type("Recording" + base.__name__, (base,), {n: record(n) for n in names} | {"local_conv": local_conv})
    return cls(), calls


def _mixers():
    torch.manual_seed(0)
    return {"mamba": Mamba(16, d_state=4, use_fused_path=False),
            "mamba2": Mamba2(32, d_state=8, headdim=8, ngroups=1, chunk_size=8),
            "mha": MHA(32, 4, num_heads_kv=2, rotary_emb_dim=4)}


@pytest.mark.parametrize("kind,ops_cls,expected", [
    ("mamba", Mamba1Ops, ["conv", "channel_sum", "scan"]),
    ("mamba2", Mamba2Ops, ["conv", "scan"]),
    ("mha", AttentionOps, ["positions", "attention"]),
])
@pytest.mark.parametrize("packed", [False, True])
def test_mixers_run_their_sequence_ops_through_the_seam(kind, ops_cls, expected, packed):
    m = _mixers()[kind]
    assert type(m.seq_ops) is ops_cls and m.seq_ops.local and m.seq_ops.local_conv
    h = torch.randn(2, 11, m.d_model if kind != "mha" else m.embed_dim, generator=torch.Generator().manual_seed(1))
    kw = {"seq_idx": torch.tensor([[0] * 4 + [1] * 7] * 2, dtype=torch.int32)} if packed else {}
    ref = m(h, **kw)
    m.seq_ops, calls = _recording(ops_cls)
    assert torch.equal(m(h, **kw), ref)
    assert calls == expected


def test_a_communicating_conv_is_not_recomputed():
    """recompute "conv" reruns the conv in the backward only where ``local_conv`` says it may."""
    m = _mixers()["mamba2"]
    m.recompute = frozenset({"conv"})
    for local_conv, runs in ((True, 2), (False, 1)):
        m.seq_ops, calls = _recording(Mamba2Ops, local_conv=local_conv)
        m(torch.randn(1, 9, 32, requires_grad=True)).sum().backward()
        assert calls.count("conv") == runs, (local_conv, calls)


def test_the_model_loss_goes_through_loss_fn():
    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset("tiny-mamba2"))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = model(ids, labels=ids).loss
    seen = []

    def loss_fn(hidden, weight, targets, reduction="mean"):
        seen.append((tuple(hidden.shape), tuple(weight.shape), tuple(targets.shape)))
        return torch.ops.aten.mul(model_loss(hidden, weight, targets, reduction=reduction), 1.0)

    model_loss, model.loss_fn = model.loss_fn, loss_fn
    assert torch.equal(model(ids, labels=ids).loss, ref)
    assert seen == [((24, model.config.d_model), (model.config.padded_vocab_size, model.config.d_model), (24,))]
