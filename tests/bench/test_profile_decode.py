"""profile_decode: the bytes a decode step must move, and a run of tiny presets end to end (CPU; GPU: the graph)."""

from __future__ import annotations

import json

import pytest
import torch

from mamba_parallel.bench import profile_decode
from mamba_parallel.config import get_preset
from mamba_parallel.models.lm import MambaLMHeadModel


def test_step_bytes_counts_every_weight_once_and_every_state_twice():
    model = MambaLMHeadModel(get_preset("tiny-hybrid"))
    cache = model.allocate_inference_cache(3, 16)
    moved = profile_decode.step_bytes(model, cache)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for entry in cache.key_value_memory_dict.values()
                 for t in (entry if isinstance(entry, tuple) else (entry,)))
    assert moved == {"weight_bytes": weights, "state_bytes": states, "step_bytes": weights + 2 * states}
    assert states > 0


@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2", "tiny-mamba3"])
def test_cpu_run_writes_the_report(preset, tmp_path, capsys):
    assert profile_decode.main(["--preset", preset, "--device", "cpu", "--steps", "2", "--prompt-len", "5",
                                "--batch", "2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "profile.json").read_text())
    assert r["step"] == "eager" and r["kernel_table"] == "eager" and set(r["timings"]) == {"eager"}
    assert r["profiles"]["eager"]["top_kernels"] and r["ms_per_step"] > 0
    assert r["step_bytes"] == r["weight_bytes"] + 2 * r["state_bytes"]
    assert 0 < r["bound_fraction"]
    md = (tmp_path / "profile.md").read_text()
    assert md.startswith(f"# Decode-step profile: {preset}") and "bytes / bandwidth (the bound)" in md
    assert md in capsys.readouterr().out


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="--batch"):
        profile_decode.main(["--preset", "tiny-mamba2", "--device", "cpu", "--batch", "0", "--out", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-mamba", "tiny-mamba2"])
def test_gpu_run_times_the_graph_replay(preset, tmp_path):
    profile_decode.main(["--preset", preset, "--steps", "5", "--prompt-len", "16", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "profile.json").read_text())
    assert r["step"] == "graph" and set(r["timings"]) == {"graph", "eager"}
    assert r["profiles"][r["kernel_table"]]["launches_per_step"] > 0
