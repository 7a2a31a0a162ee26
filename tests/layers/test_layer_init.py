"""Weight init as in the papers: A_log, D, dt bias (softplus log-uniform in [dt_min, dt_max]), dt_proj,
out_proj / fc2 rescaling, embedding std; no-weight-decay marks."""

import math

import torch
import torch.nn.functional as F

from mamba_parallel import get_preset
from mamba_parallel.layers import Mamba, Mamba2
from mamba_parallel.models import MambaLMHeadModel


def _check_dt(dt_bias: torch.Tensor, dt_min: float, dt_max: float):
    dt = F.softplus(dt_bias.detach().double())
    assert dt.min() >= dt_min * (1 - 1e-5) and dt.max() <= dt_max * (1 + 1e-5), (dt.min(), dt.max())
    # log-uniform: the mean of log(dt) sits mid-way (n >= 128 draws: 4 sigma ~ 0.5) and both ends are reached.
    mid = (math.log(dt_min) + math.log(dt_max)) / 2
    assert abs(dt.log().mean().item() - mid) < 0.5
    assert dt.min() < dt_min * 2 and dt.max() > dt_max / 2


def test_mamba1_init():
    torch.manual_seed(0)
    m = Mamba(64, d_state=8, dt_min=0.002, dt_max=0.05)
    assert torch.equal(m.A_log, torch.log(torch.arange(1, 9.0)).expand(128, 8))
    assert torch.equal(m.D, torch.ones(128))
    _check_dt(m.dt_proj.bias, 0.002, 0.05)
    std = m.dt_rank ** -0.5
    assert m.dt_proj.weight.abs().max() <= std and m.dt_proj.weight.abs().max() > 0.9 * std
    c = Mamba(64, d_state=8, dt_init="constant", dt_scale=2.0)
    assert torch.allclose(c.dt_proj.weight, torch.full_like(c.dt_proj.weight, 2.0 * c.dt_rank ** -0.5))
    assert all(getattr(getattr(m, n), "_no_weight_decay", False) for n in ("A_log", "D"))


def test_mamba2_init():
    torch.manual_seed(0)
    m = Mamba2(256, d_state=16, headdim=4, A_init_range=(2, 8))  # 128 heads
    A = torch.exp(m.A_log.detach())
    assert A.min() >= 2 - 1e-5 and A.max() <= 8 + 1e-5 and A.std() > 1.0
    assert torch.equal(m.D, torch.ones(128)) and torch.equal(m.norm.weight, torch.ones(512))
    _check_dt(m.dt_bias, 0.001, 0.1)
    assert all(getattr(getattr(m, n), "_no_weight_decay", False) for n in ("A_log", "D", "dt_bias"))
    assert Mamba2(64, d_state=8, headdim=16, D_has_hdim=True).D.shape == (128,)


def test_model_init_rescales_residual_writers_and_is_deterministic():
    cfg = get_preset("tiny-hybrid", n_layer=8, attn_layer_idx=[3])
    torch.manual_seed(3)
    model = MambaLMHeadModel(cfg)
    scale = 1 / math.sqrt(2 * cfg.n_layer)  # two residual writes per layer (mixer + MLP)
    for block in model.backbone.layers:
        for lin in (block.mixer.out_proj, block.mlp.fc2):
            bound = scale / math.sqrt(lin.weight.shape[1])
            assert lin.weight.abs().max() <= bound * (1 + 1e-6)
            assert lin.weight.abs().max() > 0.9 * bound
    assert model.backbone.layers[3].mixer.in_proj.bias.abs().max() == 0  # attention biases start at zero
    emb = model.backbone.embedding.weight
    assert abs(emb.std().item() - cfg.initializer_range) < 0.002
    torch.manual_seed(3)
    again = MambaLMHeadModel(cfg)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    torch.manual_seed(4)
    other = MambaLMHeadModel(cfg)
    assert not torch.equal(other.backbone.embedding.weight, emb)
