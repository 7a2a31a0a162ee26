"""GPU: the same Mamba-3 weights give mamba_ssm's logits (its Triton SISO kernels, which compute in bf16) within
bf16 error, measured against our float64 CPU reference. Skips without CUDA or without the peer importable
(``eval "$(bash .peer/install.sh .peer)"``, see ../shared/peer/README.md). mamba_ssm ships Mamba3 as a module only:
its LM class builds Mamba1 / Mamba2 blocks, so the peer model here is its LM with every mixer replaced by its
Mamba3, which keeps mamba_ssm's state-dict names (the layout ``save_pretrained(format="mamba_ssm")`` writes)."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from mamba_parallel.config import MambaConfig
from mamba_parallel.models import MambaLMHeadModel
from mamba_parallel.models.formats import load_pretrained, save_pretrained

pytestmark = pytest.mark.gpu

BF16_LOGITS = 0.05  # relative RMS error of bf16 logits against float64 (mamba_ssm's own Mamba-2: ~0.02)


def _peer_classes(mimo: bool):
    try:
        from mamba_ssm.models.config_mamba import MambaConfig as PeerConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel as PeerLM
        from mamba_ssm.modules import mamba3 as peer_mamba3
    except Exception as e:  # not installed, or its compiled extensions do not load here
        pytest.skip(f"mamba_ssm's Mamba-3 is not importable: {type(e).__name__}: {e}")
    if mimo and peer_mamba3.mamba3_mimo_combined is None:
        pytest.skip("mamba_ssm's Mamba-3 MIMO kernels need TileLang, which is not installed")
    return PeerConfig, PeerLM, peer_mamba3.Mamba3


def peer_model(config: MambaConfig, state_dict: dict, mimo: bool = False):
    """mamba_ssm's LM with mamba_ssm Mamba3 mixers, holding ``state_dict`` (strict load)."""
    PeerConfig, PeerLM, PeerMamba3 = _peer_classes(mimo)
    c = config
    scaffold = PeerConfig(d_model=c.d_model, d_intermediate=c.d_intermediate, n_layer=c.n_layer,
                          vocab_size=c.vocab_size, ssm_cfg={"layer": "Mamba2"}, rms_norm=c.rms_norm,
                          residual_in_fp32=c.residual_in_fp32, fused_add_norm=True,
                          pad_vocab_size_multiple=c.pad_vocab_size_multiple, tie_embeddings=c.tie_embeddings)
    peer = PeerLM(scaffold, device="cuda", dtype=torch.float32)
    for i, block in enumerate(peer.backbone.layers):
        block.mixer = PeerMamba3(c.d_model, layer_idx=i, device="cuda", dtype=torch.float32, **c.mixer_cfg)
    peer.load_state_dict(state_dict, strict=True)
    return peer.eval()


CASES = {
    "siso": {},
    "siso_outproj_norm_groups": {"is_outproj_norm": True, "ngroups": 2},
    "mimo": {"is_mimo": True, "mimo_rank": 4, "chunk_size": 16},
}


@pytest.mark.parametrize("case", CASES)
def test_same_weights_give_the_peers_logits(case, tmp_path):
    ssm = dict(layer="Mamba3", d_state=128, headdim=64, **CASES[case])
    cfg = MambaConfig(d_model=256, n_layer=2, vocab_size=1000, ssm_cfg=ssm, pad_vocab_size_multiple=16)
    torch.manual_seed(0)
    ours = MambaLMHeadModel(cfg, device="cuda").eval()
    with torch.no_grad():  # biases and norm weights start at 1: move every tensor
        for p in ours.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_pretrained(ours, tmp_path, format="mamba_ssm")  # the peer reads the file we write
    peer = peer_model(cfg, torch.load(tmp_path / "pytorch_model.bin", map_location="cuda"), "mimo" in case)
    ids = torch.randint(0, 1000, (2, 512), generator=torch.Generator().manual_seed(1)).cuda()

    reference = load_pretrained(tmp_path, device="cpu", dtype=torch.float64).eval()
    with torch.no_grad():
        ref = reference(ids.cpu()).logits.float()
        peer_logits = peer(ids).logits.float().cpu()
        ours_fp32 = ours(ids).logits.float().cpu()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours_bf16 = ours(ids).logits.float().cpu()
    e_peer, e_bf16, e_fp32 = rel_err(peer_logits, ref), rel_err(ours_bf16, ref), rel_err(ours_fp32, ref)
    print(f"{case}: error vs float64 logits: peer {e_peer:.4f}, ours bf16 {e_bf16:.4f}, ours fp32 {e_fp32:.2e}")
    assert e_peer <= BF16_LOGITS, "the peer computes a different function from the same weights"
    assert e_bf16 <= BF16_LOGITS and e_fp32 <= 1e-3
    agree = (peer_logits.argmax(-1) == ours_bf16.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"only {agree:.1%} of the next-token choices agree with the peer's"
