"""The core install (`pip install -e .`: torch, safetensors, rich, numpy) must work without the optional packages:
no Triton (ops fall back to their references), no tokenizers / pyarrow / tensorboard / NVML. Each check runs in a
fresh interpreter where those imports are blocked."""

import os
import subprocess
import sys

BLOCK = "import sys\nfor m in ('triton', 'tokenizers', 'pyarrow', 'tensorboard', 'pynvml', 'transformers'):\n" \
        "    sys.modules[m] = None\n"

# A checkout that is not the installed copy (a worktree, an uninstalled clone) is found through PYTHONPATH.
_PYTHONPATH = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **_PYTHONPATH})


def test_models_run_without_triton(tmp_path):
    code = """
import torch
from mamba_parallel import MambaLMHeadModel, get_preset
for name in ("tiny-mamba", "tiny-mamba2", "tiny-hybrid"):
    model = MambaLMHeadModel(get_preset(name))
    ids = torch.randint(0, 256, (2, 21))
    loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
    loss.backward()
    assert model.generate(ids[:, :4], max_new_tokens=3, temperature=0).shape == (2, 7)
print("ok")
"""
    r = _run(code, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_train_command_runs_without_optional_packages(tmp_path):
    code = f"""
from mamba_parallel.cli import main
rc = main(["train", "--out", {str(tmp_path / 'run')!r}, "--steps", "3", "--seq-len", "32", "--batch-size", "2",
           "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "4",
           "--no-progress"])
sys.exit(rc)
"""
    r = _run(code, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "run" / "final" / "config.json").is_file()
