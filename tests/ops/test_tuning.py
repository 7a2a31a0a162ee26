"""Launch candidates and the shared-memory check (ops/tuning.py), and tools/compile_check.py's report of it.

On the GPU a candidate whose compiled kernel needs more shared memory than the device has is dropped before
tuning, and an untuned launch takes the first one that fits; here the choice is checked with given sizes, and
compile_check compiles a tiny Mamba-3 scan for sm_90 (Triton's compiler runs without a GPU)."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import triton

from mamba_parallel.ops.mamba3.triton_common import tuned
from mamba_parallel.ops.tuning import config, fitting

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fitting_keeps_the_candidates_that_fit_in_order():
    cands = [config(8, 2, BLOCK=64), config(4, 2, BLOCK=64), config(8, 1, BLOCK=64), config(4, 1, BLOCK=32)]
    need = {id(c): n for c, n in zip(cands, (300_000, 200_000, 120_000, 90_000))}
    asked = []

    def shared_of(c):
        asked.append(c)
        return need[id(c)]

    assert fitting(cands, shared_of, 232448) == cands[1:]
    asked.clear()
    assert fitting(cands, shared_of, 101376, first_only=True) == [cands[3]]
    assert fitting(cands, shared_of, 232448, first_only=True) == [cands[1]]
    assert asked[-2:] == cands[:2]  # the first fit ends the search: later candidates are not compiled
    with pytest.raises(triton.runtime.errors.OutOfResources, match="no launch candidate fits.*300000 bytes"):
        fitting(cands, shared_of, 50_000)


def test_fp32_scan_forward_has_its_own_candidates():
    """fp32 operands double the forward's tile bytes: its candidates do without the prefetch stage."""
    half = tuned.candidates("scan_fwd", torch.bfloat16)
    assert tuned.candidates("scan_fwd", torch.float16) == half and all(c.num_stages == 2 for c in half)
    assert all(c.num_stages == 1 for c in tuned.candidates("scan_fwd", torch.float32))
    assert tuned.candidates("chunk_bwd_dx", torch.float16) == tuned.candidates("chunk_bwd_dx", torch.bfloat16)


def test_compile_check_reports_shared_memory_and_fails_past_the_limit():
    """The tiny scan's fp32 forward on sm_90: 11 KB with 64 headdim columns per program, 7 KB with 32; a 9 KB
    limit fails the two 64-column candidates and names them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_check.py"), "--workloads", "tiny",
                          "--kernels", "scan_fwd_kernel[scan_fwd]", "--max-shared", "9000"],
                         capture_output=True, text=True, env=env, timeout=600)
    out = run.stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("scan_fwd_kernel[scan_fwd] float32")]
    assert len(lines) == 4 and all("shared" in ln and "registers" in ln for ln in lines), out + run.stderr
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    assert run.returncode == 1 and len(failed) == 2, out
    assert all("BLOCK_P=64" in ln and "sm_90 has 9000 B" in ln for ln in failed), out


def test_compile_check_counts_sass_instructions():
    """--sass: every compiled launch's line carries its SASS counts (the whole kernel, barriers, shuffles, spills)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_check.py"), "--workloads", "tiny",
                          "--kernels", "token_bwd", "--sass"], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("token_bwd_kernel")]
    assert run.returncode == 0 and lines, run.stdout + run.stderr
    for ln in lines:
        found = dict(re.findall(r"\b(all|bar|shfl|local|gmem) (\d+)", ln.split("sass", 1)[1]))
        assert set(found) == {"all", "bar", "shfl", "local", "gmem"} and int(found["all"]) > 0, ln
        assert int(found["gmem"]) > 0 and int(found["local"]) == 0, ln  # it loads and stores; nothing spills


def test_compile_check_plans_the_selective_scan_for_a_gpu():
    """The scan's launches are recorded as a 132-SM GPU plans them (16-token chunks, the row-per-thread layout, the
    unrolled states, bf16 checkpoints apart under bf16) and compiled for sm_90, with a PTX hash per launch."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_check.py"), "--ops", "selective_scan",
                          "--workloads", "tiles", "--kernels", "selective_scan_fwd", "--ptx-hash"],
                         capture_output=True, text=True, env=env, timeout=900)
    fwd = [ln for ln in run.stdout.splitlines() if ln.startswith("selective_scan_fwd_kernel bfloat16")]
    assert run.returncode == 0 and len(fwd) == 6, run.stdout + run.stderr
    # the Mamba-1 layer's forward gates inside on one row per channel (batch 8: z and y through channel-contiguous
    # views) and stores y token-major on two (batch 2); the op's launches all gate
    assert [ln for ln in fwd if "HAS_Z=False" in ln] == [ln for ln in fwd if "R=2" in ln and "HAS_Z=False" in ln], fwd
    assert sum("HAS_Z=False" in ln for ln in fwd) == 1, fwd
    # batch 2: two rows, the op's and the layer's
    assert sum("NS=16" in ln and "CK=1 CKPT_APART=True" in ln for ln in fwd) == 2, fwd
    assert sum("CK=8 CKPT_APART=False" in ln for ln in fwd) == 2, fwd
    hashes = [ln.rsplit("ptx ", 1)[1] for ln in fwd]
    assert len(set(hashes)) == 6 and all(len(h) == 12 for h in hashes), fwd


class _FakeKernel:
    """Stands in for a compiled-on-demand kernel: shared memory = 1000 x BLOCK; records compiles and launches."""

    arg_names = ["X", "n", "BLOCK"]

    def __init__(self):
        self.compiled, self.launched = [], []

    def warmup(self, *, grid, **kwargs):
        self.compiled.append(kwargs)
        return SimpleNamespace(metadata=SimpleNamespace(shared=kwargs["BLOCK"] * 1000))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(kwargs)


def test_untuned_and_tuned_launches_skip_what_the_device_cannot_hold(monkeypatch):
    from mamba_parallel.ops import tuning

    monkeypatch.setattr(tuning, "_jit", lambda k: k)
    monkeypatch.setattr(tuning, "_current_limit", lambda: 100_000)
    cands = [config(4, 2, BLOCK=256), config(4, 2, BLOCK=64), config(8, 2, BLOCK=32)]
    fake = _FakeKernel()
    first_fit = tuning._FirstFit(fake, cands, ["n"])
    x = torch.zeros(3)
    first_fit[(1,)](x, 5, T=2)
    first_fit[(1,)](x, 5, T=2)
    assert [c["BLOCK"] for c in fake.compiled] == [256, 64]  # until the first fit, once per key
    assert [k["BLOCK"] for k in fake.launched] == [64, 64] and fake.launched[0]["T"] == 2
    assert fake.compiled[0]["X"] is x and fake.compiled[0]["n"] == 5 and fake.compiled[0]["num_warps"] == 4

    fake = _FakeKernel()
    kept = tuning._fit_pruner(fake)(cands, {"X": x, "n": 5}, grid=(1,), warmup=False, T=2)
    assert kept == cands[1:] and len(fake.compiled) == 3


def test_the_ssd_state_pass_tuner_puts_its_final_states_back(monkeypatch):
    """The SSD forward state pass may write the final states over the initial states it reads (a cache continued
    in place), so its GPU autotuner restores that buffer after each trial run; the other kernels restore nothing."""
    from mamba_parallel.ops import tuning
    from mamba_parallel.ops.ssd import triton_states
    from mamba_parallel.ops.ssd.triton_tuning import tuned as ssd_tuned

    monkeypatch.setattr(tuning, "interpret_mode", lambda: False)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(ssd_tuned, "_cache", {})
    state_fwd = ssd_tuned(triton_states._chunk_state_pass_fwd_kernel, "state_fwd", torch.bfloat16)
    state_bwd = ssd_tuned(triton_states._state_grad_pass_kernel, "state_bwd", torch.bfloat16)
    assert state_fwd.restore_value == ["final_ptr"] and state_bwd.restore_value == []
