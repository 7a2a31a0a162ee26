"""Parity with HF transformers' own classes (their pure-torch path), both directions: MambaForCausalLM,
FalconMambaForCausalLM (Mamba-1 + weightless B / C / dt norms), Mamba2ForCausalLM, BambaForCausalLM (Mamba-2 + attention with partial rotary + SwiGLU MLPs), NemotronHForCausalLM
(per-layer Mamba-2 / attention / squared-ReLU MLP blocks).

transformers is a test-only dependency. Models are built from local configs with random weights (no downloads);
without mamba_ssm / causal_conv1d installed, transformers runs its reference PyTorch code.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder only; never the hub
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from mamba_parallel.models.formats import load_pretrained, save_pretrained  # noqa: E402
from mamba_parallel.models.hf_config import config_from_hf  # noqa: E402

MAX_REL_ERR = 1e-4  # fp32, max |ours - HF| / max |HF|

SMALL = dict(hidden_size=32, num_hidden_layers=2, state_size=8)
CASES = {
    "mamba1": (transformers.MambaConfig, dict(SMALL, vocab_size=64)),
    "mamba1-bias-nocb-untied": (transformers.MambaConfig, dict(
        SMALL, vocab_size=60, use_conv_bias=False, use_bias=True, time_step_rank=3, tie_word_embeddings=False)),
    "mamba2-g1": (transformers.Mamba2Config, dict(
        SMALL, vocab_size=64, num_heads=4, head_dim=16, n_groups=1, chunk_size=8)),
    "mamba2-g2-bias-nocb-tied-dtlimit": (transformers.Mamba2Config, dict(
        SMALL, vocab_size=64, num_heads=4, head_dim=16, n_groups=2, chunk_size=8, use_conv_bias=False,
        use_bias=True, tie_word_embeddings=True, time_step_limit=(0.01, 0.05))),
    # Mamba-1 with weightless RMS norms on dt, B and C
    "falcon_mamba": (transformers.FalconMambaConfig, dict(SMALL, vocab_size=64)),
    "falcon_mamba-bias-untied-eps": (transformers.FalconMambaConfig, dict(
        SMALL, vocab_size=60, use_conv_bias=False, use_bias=True, time_step_rank=3, tie_word_embeddings=False,
        mixer_rms_eps=1e-3)),
    # layer 1 attention (GQA 4 / 2 heads, rotary on half of each head), SwiGLU MLP after every layer
    "bamba": (transformers.BambaConfig, dict(
        hidden_size=32, num_hidden_layers=3, vocab_size=64, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=8)),
    "bamba-biases-tied-dtlimit": (transformers.BambaConfig, dict(
        hidden_size=32, num_hidden_layers=2, vocab_size=60, intermediate_size=48, num_attention_heads=2,
        num_key_value_heads=2, attn_layer_indices=[0], mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=8, mamba_chunk_size=8, attention_bias=True, mlp_bias=True, mamba_conv_bias=False,
        mamba_proj_bias=True, tie_word_embeddings=True, time_step_limit=(0.0, 0.5))),
    # Mamba-2, attention (no rotary), MLP, Mamba-2, MLP
    "nemotron_h": (transformers.NemotronHConfig, dict(
        hidden_size=32, vocab_size=64, hybrid_override_pattern="M*-M-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, chunk_size=8)),
    "nemotron_h-biases-tied": (transformers.NemotronHConfig, dict(
        hidden_size=32, vocab_size=60, layers_block_type=["mlp", "linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=40, ssm_state_size=8,
        mamba_num_heads=8, mamba_head_dim=8, n_groups=1, chunk_size=8, mlp_bias=True, use_bias=True,
        use_conv_bias=False, tie_word_embeddings=True, time_step_min=0.01)),
}
GENERATE_CASES = ["mamba1", "falcon_mamba", "mamba2-g1", "bamba", "nemotron_h"]  # greedy generate and the loss


def _hf_class(config):
    return {"mamba": transformers.MambaForCausalLM, "falcon_mamba": transformers.FalconMambaForCausalLM,
            "mamba2": transformers.Mamba2ForCausalLM,
            "bamba": transformers.BambaForCausalLM, "nemotron_h": transformers.NemotronHForCausalLM,
            }[config.model_type]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random offsets on every tensor (HF starts norms at 1, conv biases at 0: parity must see them all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def _max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _ids(vocab: int, length: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_parity_both_directions(tmp_path, case):
    config_cls, kwargs = CASES[case]
    torch.manual_seed(0)
    hf = _hf_class(config_cls(**kwargs))(config_cls(**kwargs)).eval()
    _perturb(hf, 1)
    ids = _ids(kwargs["vocab_size"])

    # HF's save_pretrained -> our from_pretrained
    hf.save_pretrained(tmp_path / "from_hf")
    ours = load_pretrained(tmp_path / "from_hf").eval()
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits
        err = _max_rel_err(ours(ids).logits, ref)
    assert err <= MAX_REL_ERR, f"ours(HF weights) vs HF: max rel err {err:.2e}"

    # our save_pretrained(format="hf") -> HF's from_pretrained (new weights, so nothing carries over)
    _perturb(ours, 2)
    save_pretrained(ours, tmp_path / "to_hf", format="hf")
    hf2, info = _hf_class(hf.config).from_pretrained(tmp_path / "to_hf", dtype=torch.float32,
                                                     output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        ref = hf2.eval()(ids, use_cache=False).logits
        err = _max_rel_err(ours(ids).logits, ref)
    assert err <= MAX_REL_ERR, f"ours vs HF(our weights): max rel err {err:.2e}"


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_missing_fields_take_transformers_defaults(tmp_path, model_type):
    """A config.json with only a few fields means to us what it means to transformers (its defaults)."""
    raw = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 32}
    if model_type == "mamba2":
        raw.update(num_heads=8, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = config_from_hf(raw)
    m = ours.mixer_cfg
    assert (m["d_state"], m["d_conv"], m["expand"], m["bias"], m["conv_bias"]) == (
        hf.state_size, hf.conv_kernel, hf.expand, hf.use_bias, hf.use_conv_bias)
    assert (ours.tie_embeddings, ours.norm_epsilon, ours.residual_in_fp32, m["dt_min"], m["dt_max"]) == (
        hf.tie_word_embeddings, hf.layer_norm_epsilon, hf.residual_in_fp32, hf.time_step_min, hf.time_step_max)
    if model_type == "mamba":
        assert ours.dt_rank == hf.time_step_rank
    else:
        assert (m["ngroups"], m["chunk_size"], m["dt_limit"]) == (hf.n_groups, hf.chunk_size,
                                                                 tuple(hf.time_step_limit))


def test_bamba_rotary_base_is_read_and_an_export_transformers_4_would_misread_is_refused(tmp_path):
    kwargs = dict(CASES["bamba"][1], rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    torch.manual_seed(0)
    hf = transformers.BambaForCausalLM(transformers.BambaConfig(**kwargs)).eval()
    _perturb(hf, 5)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert ours.config.attn_params["rotary_emb_base"] == 500.0
    ids = _ids(64)
    with torch.no_grad():
        assert _max_rel_err(ours(ids).logits, hf(ids).logits) <= MAX_REL_ERR
    from mamba_parallel.models.formats import CheckpointError

    with pytest.raises(CheckpointError, match="rotary_emb_base=500.0.*hard-codes 10000"):
        save_pretrained(ours, tmp_path / "out", format="hf")


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_three_lines_of_a_transformers_user(tmp_path, case):
    """from_pretrained, model(ids, labels=ids).loss, generate(ids, max_length=...): unchanged, transformers'
    numbers (the prompt avoids the pad id, as a tokenizer's output does)."""
    config_cls, kwargs = CASES[case]
    torch.manual_seed(0)
    hf = _hf_class(config_cls(**kwargs))(config_cls(**kwargs)).eval()
    _perturb(hf, 6)
    hf.save_pretrained(tmp_path)
    from mamba_parallel import MambaLMHeadModel

    model = MambaLMHeadModel.from_pretrained(tmp_path)
    ids = torch.randint(1, kwargs["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours, ref = model(ids, labels=ids).loss, hf(ids, labels=ids).loss
    assert abs(ours.item() - ref.item()) <= MAX_REL_ERR * abs(ref.item())
    assert torch.equal(model.generate(ids, max_length=20), hf.generate(ids, max_length=20))
