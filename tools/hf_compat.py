"""Exports against ANOTHER transformers version than the one installed: both directions, tiny random models.

    pip install --no-deps --target /tmp/tf457 transformers==4.57.6 huggingface_hub==0.36.0 tokenizers==0.22.1 requests
    python tools/hf_compat.py --transformers /tmp/tf457

For every architecture that version has: our model (random init, perturbed) saved with save_pretrained(format="hf")
is loaded by that transformers in a subprocess (its folder first on sys.path) and its logits compared with ours;
then that transformers builds the same architecture from its own config, saves it, and we load it. Prints one line
per case and direction (max relative logit error, fp32), exits 1 when any exceeds 1e-4 or fails to load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mamba_parallel import MambaLMHeadModel, get_preset
from mamba_parallel.models.formats import load_pretrained

CASES = {  # name -> (our config, transformers class name)
    "mamba": (lambda: get_preset("tiny-mamba"), "MambaForCausalLM"),
    "mamba2": (lambda: get_preset("tiny-mamba2"), "Mamba2ForCausalLM"),
    "bamba": (lambda: get_preset("tiny-hybrid", attn_cfg={"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 8}),
              "BambaForCausalLM"),
    "nemotron_h": (lambda: get_preset("tiny-nemotron-h"), "NemotronHForCausalLM"),
}
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))

_CHILD = r"""
import json, sys, torch
import transformers
transformers.logging.set_verbosity_error()
job = json.loads(sys.argv[1])
out = {"version": transformers.__version__}
ids = torch.tensor(job["ids"])
for name, (folder, cls_name, make_dir) in job["cases"].items():
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        out[name] = {"missing": True}
        continue
    res = {}
    try:
        m = cls.from_pretrained(folder, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            res["logits_of_ours"] = m(ids).logits.tolist()
    except Exception as e:
        res["load_error"] = f"{type(e).__name__}: {e}"
    try:  # the same architecture built and saved by this version
        torch.manual_seed(1)
        mine = cls(cls.config_class.from_pretrained(folder)).eval()
        with torch.no_grad():
            for p in mine.parameters():
                p.add_(0.05 * torch.randn_like(p))
            res["own_logits"] = mine(ids).logits.tolist()
        try:
            mine.save_pretrained(make_dir)
        except RuntimeError:  # some versions refuse their own tied safetensors: the .bin form then
            mine.save_pretrained(make_dir, safe_serialization=False)
    except Exception as e:
        res["save_error"] = f"{type(e).__name__}: {e}"
    out[name] = res
print(json.dumps(out))
"""


def _old_mamba2(version: str, name: str) -> bool:
    """transformers < 4.50's PyTorch Mamba-2 path clamps dt below at time_step_min (its CUDA path and later
    versions use time_step_limit): ~1e-4 off on random weights, by its own computation."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return name == "mamba2" and (major, minor) < (4, 50)


def _tolerance(version: str, name: str) -> float:
    return 1e-3 if _old_mamba2(version, name) else 1e-4


def _note(version: str, name: str) -> str:
    return "  (this version's PyTorch Mamba-2 path clamps dt at time_step_min)" if _old_mamba2(version, name) else ""


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transformers", required=True, metavar="DIR", help="a --target folder holding transformers")
    args = ap.parse_args(argv)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        jobs, ours = {}, {}
        for name, (make, cls_name) in CASES.items():
            torch.manual_seed(0)
            model = MambaLMHeadModel(make()).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
                ours[name] = model(IDS).logits
            model.save_pretrained(Path(tmp) / name, format="hf")
            jobs[name] = (str(Path(tmp) / name), cls_name, str(Path(tmp) / f"{name}-theirs"))
        child = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({"cases": jobs, "ids": IDS.tolist()})],
                               capture_output=True, text=True, env={"PYTHONPATH": args.transformers,
                                                                    "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
        if child.returncode:
            print(child.stderr[-3000:])
            return 1
        res = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"transformers {res['version']}")
        for name, r in ((k, v) for k, v in res.items() if k != "version"):
            if r.get("missing"):
                print(f"  {name:11s} {CASES[name][1]} is not in this version")
                continue
            if "load_error" in r:
                bad += 1
                print(f"  {name:11s} ours -> theirs: FAILED to load: {r['load_error']}")
            else:
                e = _err(ours[name], torch.tensor(r["logits_of_ours"]))
                bad += e > _tolerance(res["version"], name)
                print(f"  {name:11s} ours -> theirs: max rel err {e:.1e}{_note(res['version'], name)}")
            if "save_error" in r:
                bad += 1
                print(f"  {name:11s} theirs -> ours: FAILED: {r['save_error']}")
            else:
                back = load_pretrained(Path(tmp) / f"{name}-theirs", dtype=torch.float32).eval()
                with torch.no_grad():
                    e = _err(back(IDS).logits, torch.tensor(r["own_logits"]))
                bad += e > _tolerance(res["version"], name)
                print(f"  {name:11s} theirs -> ours: max rel err {e:.1e}{_note(res['version'], name)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
