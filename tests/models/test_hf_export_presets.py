"""A model TRAINED HERE, of every preset's configuration (its non-default fields kept, only sizes shrunk), exports
with save_pretrained(format="hf") and reloads in transformers' own class with the same logits and greedy tokens.

The models start from our init (rescale_prenorm_residual on, as every preset has it) and take two AdamW steps:
an export must not depend on transformers' defaults or on its init rules (transformers re-applies
rescale_prenorm_residual to out_proj AFTER loading, so exports write it False).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from mamba_parallel.config import PRESETS, MambaConfig  # noqa: E402
from mamba_parallel.models import MambaLMHeadModel  # noqa: E402
from mamba_parallel.models.formats import CheckpointError, save_pretrained  # noqa: E402

MAX_REL_ERR = 1e-4
CLASSES = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM", "bamba": "BambaForCausalLM",
           "nemotron_h": "NemotronHForCausalLM", "falcon_mamba": "FalconMambaForCausalLM"}


def shrunk(name: str) -> MambaConfig:
    """The preset with small sizes; every other field (mixer options, biases, tying, padding, eps) kept."""
    d = json.loads(json.dumps(PRESETS[name], default=list))
    d.update(vocab_size=61)  # odd: exercises the padded vocabulary
    ssm = d.setdefault("ssm_cfg", {})
    if ssm.get("layer") == "Mamba2":
        groups = ssm.get("ngroups", 1)
        ssm.update(d_state=min(ssm.get("d_state", 128), 16), headdim=16, chunk_size=8)
        d["d_model"] = max(32, 8 * groups)  # 2 * d_model / 16 heads, a multiple of ngroups
    else:
        d["d_model"] = 32
        ssm["d_state"] = min(ssm.get("d_state", 16), 8)
    if "dt_limit" in ssm:
        ssm["dt_limit"] = tuple(ssm["dt_limit"])
    if d.get("mlp_layer_idx") or d.get("attn_layer_idx"):
        kinds = ["attention" if i in d.get("attn_layer_idx", []) else "mlp" if i in d.get("mlp_layer_idx", [])
                 else "ssm" for i in range(d["n_layer"])]
        keep = sorted({kinds.index(k) for k in set(kinds)} | {len(kinds) - 1})  # one of each kind, and the last
        d["attn_layer_idx"] = [j for j, i in enumerate(keep) if kinds[i] == "attention"]
        d["mlp_layer_idx"] = [j for j, i in enumerate(keep) if kinds[i] == "mlp"]
        d["n_layer"] = len(keep)
        if d.get("attn_layer_idx"):
            from mamba_parallel.config import get_preset

            full = get_preset(name).attn_params  # the same share of each head rotated, at head_dim 16
            d["attn_cfg"].update(num_heads=4, num_heads_kv=2, head_dim=16,
                                 rotary_emb_dim=16 * (full["rotary_emb_dim"] or 0) // full["head_dim"])
        if d.get("d_intermediate"):
            d["d_intermediate"] = 64
    else:
        d["n_layer"] = 2
    return MambaConfig.from_dict(d)


def _trained(config: MambaConfig) -> MambaLMHeadModel:
    torch.manual_seed(0)
    model = MambaLMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def _distinct_configs() -> dict[str, str]:
    """One preset per distinct shrunk config (the Mamba-1 sizes 130m .. 2.8b shrink to one config), id = all of
    their names."""
    groups: dict[str, list[str]] = {}
    for n in PRESETS:
        # transformers has no Mamba-3 class (test_mamba3_model.py checks that export is refused with the reason)
        if n != "tiny-hybrid" and PRESETS[n]["ssm_cfg"].get("layer") != "Mamba3":
            groups.setdefault(shrunk(n).to_json(), []).append(n)
    return {"+".join(names): names[0] for names in groups.values()}


EXPORTABLE = _distinct_configs()


@pytest.mark.parametrize("names", list(EXPORTABLE))
def test_trained_model_reloads_in_transformers(tmp_path, names):
    name = EXPORTABLE[names]
    model = _trained(shrunk(name))
    save_pretrained(model, tmp_path, format="hf")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rescale_prenorm_residual"] is False
    hf = getattr(transformers, CLASSES[raw["model_type"]]).from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, ref = model(ids).logits, hf(ids).logits
    err = ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    assert err <= MAX_REL_ERR, f"{name} ({raw['model_type']}): max rel err {err:.2e}"
    prompt = ids[:, :4]
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=6), want)


def test_full_rotary_hybrid_says_why_it_cannot_export(tmp_path):
    with pytest.raises(CheckpointError, match=r"BambaForCausalLM: attn_cfg.rotary_emb_dim=16: Bamba rotates half"):
        save_pretrained(MambaLMHeadModel(shrunk("tiny-hybrid")), tmp_path, format="hf")
