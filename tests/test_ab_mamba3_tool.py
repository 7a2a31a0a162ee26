"""tools/ab_mamba3.py: prepare (a revision's package renamed beside this checkout's, cut to what the scan imports) and
the launch candidates time runs as sides of their own."""

import argparse
import os
import sys
from pathlib import Path

import pytest
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


def test_a_folder_prepare_did_not_write_is_named_and_no_base_is_needed(tmp_path):
    with pytest.raises(SystemExit, match=f"--base {tmp_path}: not a prepared folder .*prepare REV --dest"):
        ab_mamba3.load_base(str(tmp_path))
    assert list(ab_mamba3.sides_for([])) == ["this checkout"]


def test_launch_option_times_one_candidate_and_names_bad_input(monkeypatch):
    entry, cand = ab_mamba3.parse_launch("chunk_bwd_dqk:warps=1,stages=1,BJ=8")
    assert entry == "chunk_bwd_dqk" and cand.num_warps == 1 and cand.kwargs == {"BJ": 8}
    for bad, words in (("nope:warps=4,stages=1", "must be one of"), ("chunk_bwd_dqk:warps=4", "stages"),
                       ("chunk_bwd_dqk:warps=4,stages=1,BJ=x", "KEY=INTEGER")):
        with pytest.raises(SystemExit, match=words):
            ab_mamba3.parse_launch(bad)

    from mamba_parallel.bench.bench_mamba3 import scan_inputs
    from mamba_parallel.ops import tuning
    from mamba_parallel.ops.mamba3 import triton_common, triton_impl

    seen, autotune = [], tuning.triton.autotune
    monkeypatch.setattr(tuning.triton, "autotune",
                        lambda configs, **kw: seen.append(configs) or autotune(configs=configs, **kw))
    table = dict(triton_common.tuned.table)
    inputs = scan_inputs(1, 150, 2, 8, 32, 1, torch.float32, "cpu")  # three chunks: every backward term is live
    dy = torch.randn(1, 150, 2, 8, generator=torch.Generator().manual_seed(0))
    # n = 32 in column blocks of 8 pairs (two blocks) against the interpreter's default: the same numbers up to
    # the order of the sums
    y0, g0 = ab_mamba3._run(triton_impl.mamba3_chunk_scan, inputs, dy)
    y1, g1 = ab_mamba3._run(ab_mamba3.Side(triton_impl.mamba3_chunk_scan, launch=(entry, cand)), inputs, dy)
    assert triton_common.tuned.table == table  # put back after the fwd+bwd
    torch.testing.assert_close(y1, y0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-4)
    # the candidate is the launch the backward ran (its launches come after the forward returns): the tuner built
    # the dq / dk part's wrapper from it
    assert any(c is cand for configs in seen for c in configs)


def test_sides_name_each_launch_and_the_peer_flag_says_why_it_cannot_run():
    sides = ab_mamba3.sides_for([], ["chunk_bwd_dqk:warps=8,stages=1,BJ=64"])
    assert list(sides) == ["this checkout", "this checkout, chunk_bwd_dqk:warps=8,stages=1,BJ=64"]
    try:
        from mamba_ssm.modules import mamba3  # noqa: F401
    except Exception:  # the CPU machines: no mamba_ssm
        with pytest.raises(SystemExit, match="--peer: mamba_ssm.* does not import"):
            ab_mamba3.sides_for([], peer=True)
    else:
        assert ab_mamba3.sides_for([], peer=True)["mamba_ssm"].raw


def test_compile_jobs_run_each_side_alone_with_the_timed_runs_arguments(monkeypatch):
    """--compile-jobs: a process per side gets the timed run's bases, shapes, dtype, launches and peer flag, and
    runs only that side's first fwd+bwd; an unknown side and a negative count are named."""
    args = ["time", "--dtype", "fp32", "--shape", "1", "150", "2", "8", "32", "1", "--launch",
            "chunk_bwd_dqk:warps=1,stages=1,BJ=8", "--compile-jobs", "3"]
    ap_args = {}
    monkeypatch.setattr(ab_mamba3, "compile_in_parallel", lambda a, names, jobs: ap_args.update(a=a, names=names,
                                                                                                jobs=jobs))
    monkeypatch.setattr(ab_mamba3, "time_all", lambda *a, **k: None)
    assert ab_mamba3.main(args) == 0
    a = ap_args["a"]
    assert ap_args["jobs"] == 3 and ap_args["names"] == ["this checkout",
                                                         "this checkout, chunk_bwd_dqk:warps=1,stages=1,BJ=8"]
    child = ab_mamba3.child_argv(a, ap_args["names"][1])
    assert child[:3] == [sys.executable, os.path.abspath(ab_mamba3.__file__), "time"]
    ran = []
    monkeypatch.setattr(ab_mamba3, "first_runs", lambda sides, shapes, dtype: ran.append((list(sides), shapes,
                                                                                          dtype)))
    assert ab_mamba3.main(child[2:]) == 0
    assert ran == [(["this checkout, chunk_bwd_dqk:warps=1,stages=1,BJ=8"], [[1, 150, 2, 8, 32, 1]], "fp32")]
    with pytest.raises(SystemExit, match="--only 'nope': no such side .*this checkout"):
        ab_mamba3.main(["time", "--only", "nope"])
    with pytest.raises(SystemExit, match="--compile-jobs -1: must be 0 or more"):
        ab_mamba3.main(["time", "--compile-jobs", "-1"])


def test_a_sides_first_run_compiles_it_on_the_inputs_the_timing_uses(capsys):
    from mamba_parallel.ops.mamba3 import triton_impl

    ab_mamba3.first_runs({"this checkout": triton_impl.mamba3_chunk_scan}, [[1, 37, 2, 8, 16, 1]], "fp32", "cpu")
    assert "b1 L37 h2 p8 n16, this checkout: first fwd+bwd" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only host makes the compile process fail")
def test_a_failed_compile_process_is_named_with_its_output_and_the_timing_goes_on(capsys):
    a = argparse.Namespace(dtype="fp32", base=[], shape=[[1, 37, 2, 8, 16, 1]], launch=[], peer=False)
    ab_mamba3.compile_in_parallel(a, ["this checkout"], 2)
    out = capsys.readouterr().out
    assert "this checkout: its compile process failed (1)" in out and "1 sides compiled in parallel" in out
