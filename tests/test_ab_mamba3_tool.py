"""tools/ab_mamba3.py prepare: a revision's package renamed beside this checkout's, cut to what the scan imports."""

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import ab_mamba3  # noqa: E402


def test_prepared_revision_imports_beside_this_checkout(tmp_path):
    dest = tmp_path / "base"
    name = ab_mamba3.prepare("HEAD", str(dest))
    assert sorted(os.listdir(dest / name)) == sorted(ab_mamba3.KEPT)
    rev, scan = ab_mamba3.load_base(str(dest))
    assert scan.__module__ == f"{name}.ops.mamba3.triton_impl" and len(rev) == 12

    from mamba_parallel.bench.bench_mamba3 import scan_inputs
    from mamba_parallel.ops.mamba3 import triton_impl

    inputs = scan_inputs(1, 37, 2, 16, 32, 1, torch.float32, "cpu")
    dy = torch.randn(1, 37, 2, 16, generator=torch.Generator().manual_seed(0))
    (y0, g0), (y1, g1) = (ab_mamba3._run(op, inputs, dy) for op in (scan, triton_impl.mamba3_chunk_scan))
    assert torch.equal(y0, y1) and g0.keys() == g1.keys()
    assert all(torch.equal(g0[k], g1[k]) for k in g0)  # the same revision's kernels: the same numbers
