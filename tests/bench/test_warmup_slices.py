"""The compile warm-up's candidate slices (candidates.py, precompile.py) and bench mamba3's row-by-row evidence, on a
CPU: a tiny autotuned kernel in Triton's interpreter (which compiles nothing, so what is checked is which
candidates an autotuner would compile and time), the warm-up job lists, and the partial result file. No timing
asserted."""

import argparse
import json
from functools import partial

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources

from mamba_parallel.bench import bench_all, bench_mamba3, candidates, precompile
from mamba_parallel.bench.candidates import Slice
from mamba_parallel.bench.peer import load_peer


@triton.jit
def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _configs(n=7, pre_hook=None):
    return [triton.Config({"BLOCK": 16}, num_warps=w, num_stages=1 + i, pre_hook=pre_hook)
            for i, w in enumerate([1, 2, 4, 8, 1, 2, 4, 8][:n])]


def _tuned(configs, prune=None):
    """A fresh autotuner over ``configs`` (its benchmark: every candidate launched once, all equally fast)."""
    def bench(kernel_call, quantiles):
        kernel_call()
        return [1.0, 1.0, 1.0]
    return triton.autotune(configs=configs, key=["n"], do_bench=bench,
                           prune_configs_by={"early_config_prune": prune} if prune else None)(_double)


def _launch(kernel):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA, conftest runs Triton's interpreter
    x = torch.arange(10, dtype=torch.float32, device=device)
    y = torch.zeros(10, device=device)
    kernel[(1,)](x, y, 10)
    torch.testing.assert_close(y, 2 * x)  # the kernel ran


@pytest.fixture
def sliced():
    """``sliced(i, k)`` installs the slice for the rest of the test; Triton's autotuner is restored after it."""
    yield lambda i, k: candidates.install(Slice(i, k))
    candidates.uninstall()


def test_a_slice_tries_exactly_every_kth_candidate(sliced):
    cfgs = _configs(7)
    original = (Autotuner.prune_configs, Autotuner.run)
    seen = []
    for i in range(3):
        sliced(i, 3)
        kernel = _tuned(cfgs)
        _launch(kernel)
        timed = list(kernel.configs_timings)  # what the autotuner compiled and timed
        assert timed == cfgs[i::3], (i, timed)
        assert kernel.prune_configs({}) == cfgs[i::3] and kernel.configs == cfgs  # the full list is kept
        seen += timed
    assert sorted(map(id, seen)) == sorted(map(id, cfgs))  # disjoint, and together every candidate
    # slice 2/3: the launch's sweep and the call above, two of the seven candidates each
    assert candidates.stats() == {"sweeps": 2, "candidates": 14, "kept": 4, "fallbacks": 0}
    assert "2 autotune sweeps, 4 of their 14 candidates" in candidates.summary(Slice(2, 3))
    candidates.uninstall()
    assert (Autotuner.prune_configs, Autotuner.run) == original
    kernel = _tuned(cfgs)
    _launch(kernel)
    assert list(kernel.configs_timings) == cfgs  # uninstalled: every candidate again


def test_an_empty_slice_keeps_the_first_candidate(sliced):
    cfgs = _configs(4)
    sliced(9, 10)
    kernel = _tuned(cfgs)
    _launch(kernel)
    assert kernel.best_config is cfgs[0]


def test_a_slice_whose_candidates_are_all_pruned_or_fail_falls_back(sliced):
    cfgs = _configs(6)

    def fits(configs, nargs, **kwargs):  # like ours: the candidates that fit, OutOfResources when none does
        out = [c for c in configs if c is cfgs[3]]
        if not out:
            raise OutOfResources(1, 0, "shared memory")
        return out

    sliced(1, 3)  # candidates 1 and 4: both pruned away
    kernel = _tuned(cfgs, prune=fits)
    _launch(kernel)
    assert kernel.best_config is cfgs[3] and candidates.stats()["fallbacks"] == 1

    def fails(nargs):  # a candidate that does not compile (the autotuner times it inf, its launch raises)
        raise OutOfResources(1, 0, "shared memory")

    cfgs = _configs(6, pre_hook=fails)
    cfgs[2].pre_hook = None
    sliced(0, 3)  # candidates 0 and 3 fail: the first other one that runs is 2
    kernel = _tuned(cfgs)
    _launch(kernel)
    assert kernel.best_config is cfgs[2]


def test_slice_flag():
    assert candidates.parse("3/12") == Slice(3, 12) and str(Slice(3, 12)) == "3/12"
    for bad in ("12/12", "-1/3", "1/0", "a/b", "3"):
        with pytest.raises(argparse.ArgumentTypeError):
            candidates.parse(bad)
    args = bench_all.build_parser().parse_args(["--warmup-candidates", "2/5"])
    assert args.warmup_candidates == Slice(2, 5)
    with pytest.raises(SystemExit):
        bench_all.build_parser().parse_args(["--warmup-candidates", "5/5"])


def _args(*extra):
    return bench_all.build_parser().parse_args(["--peer-impl", "reference", "--device", "cpu", "--no-fla", *extra])


def test_the_mamba3_warm_up_is_split_between_the_free_workers():
    a = _args("--only", "mamba3")
    jobs = precompile.jobs_for(a, ["mamba3"], [], [], out="/scratch", workers=16)
    assert len(jobs) == precompile.MAX_SLICES == 12
    assert {j.name for j in jobs} == {"mamba3"} and {j.family for j in jobs} == {"mamba3"}
    parsed = [bench_all.build_parser().parse_args(j.argv) for j in jobs]
    assert [p.warmup_candidates for p in parsed] == [Slice(i, 12) for i in range(12)]
    assert all(p.only == "mamba3" and p.out == "/scratch" and p.kernel_reps == 1 for p in parsed)
    assert [j.label for j in jobs[:2]] == ["mamba3 [0/12]", "mamba3 [1/12]"]
    assert len(precompile.jobs_for(a, ["mamba3"], [], [], out="/s", workers=5)) == 5
    whole = precompile.jobs_for(a, ["mamba3"], [], [], out="/s", workers=1)  # too few workers: not sliced
    assert len(whole) == 1 and whole[0].part is None and "--warmup-candidates" not in whole[0].argv
    assert precompile.jobs_for(a, ["mamba3"], [], [], out="/s")[0].part is None  # no workers given


def test_only_the_first_job_of_a_sliced_family_is_sliced_and_other_families_keep_a_worker():
    a = _args("--train-presets", "tiny-mamba2")
    ssd = [(1, 37, 2, 8, 8, 1), (1, 64, 2, 8, 8, 1)]  # one family: the second starts from the first's binaries
    jobs = precompile.jobs_for(a, ["ssd", "train", "mamba3"], ssd, [], out="/s", workers=9)
    # 9 workers, one for the training family: 8 for the two sliced first jobs, 4 slices each
    assert [j.label for j in jobs] == ([f"ssd 1 37 2 8 8 1 [{i}/4]" for i in range(4)] + ["ssd 1 64 2 8 8 1"]
                                       + [f"mamba3 [{i}/4]" for i in range(4)] + ["train tiny-mamba2"])
    leads = precompile._leads(jobs)
    assert [j.label for j in leads["ssd p8 n8 g1"]] == [f"ssd 1 37 2 8 8 1 [{i}/4]" for i in range(4)]
    assert all(j.part is None for j in jobs if j.name.startswith("train"))


def test_the_slices_of_a_job_start_together_and_its_family_after_them(tmp_path):
    jobs = precompile.slice_leads([precompile.Job("a1", ["--only", "nope"], family="a", sliceable=True),
                                   precompile.Job("a2", ["--only", "nope"], family="a", sliceable=True),
                                   precompile.Job("b1", ["--only", "nope"], family="b")], workers=4)
    assert [j.label for j in jobs] == ["a1 [0/3]", "a1 [1/3]", "a1 [2/3]", "a2", "b1"]
    lines = []
    precompile.run(jobs, 4, 300.0, str(tmp_path), lines.append, poll_s=0.05)
    slices, a2, b1 = jobs[:3], jobs[3], jobs[4]
    assert all(j.status.startswith("failed") for j in jobs)  # "--only nope": a fast exit
    first_end = min(j.started + j.seconds for j in slices)
    assert all(j.started < first_end for j in slices) and b1.started < first_end  # one pass started them all
    assert a2.started >= max(j.started + j.seconds for j in slices) - 0.01
    assert "a1: autotune candidates split" in lines[0]
    assert "a1 in 3 candidate slices" in lines[-1] and "[3 not done: failed (exit" in lines[-1]


def test_bench_all_warms_up_in_slices_that_report_their_sweeps(tmp_path, capsys):
    argv = ["--peer-impl", "reference", "--device", "cpu", "--no-fla", "--only", "ssd", "--ssd-shape", "1", "37",
            "2", "8", "8", "1", "--ssd-chunk", "16", "--kernel-warmup", "0", "--kernel-reps", "1", "--out",
            str(tmp_path / "r"), "--report", "", "--precompile-workers", "2", "--precompile-only"]
    assert bench_all.main(argv) == 0
    out = capsys.readouterr().out
    assert "ssd 1 37 2 8 8 1 in 2 candidate slices " in out and "s (0 autotune sweeps of 0 candidates)" in out, out
    assert "not done" not in out  # the interpreter has one candidate a kernel: nothing to slice, but both ran


# ---- bench mamba3: evidence as it goes --------------------------------------------------------------------------
SMALL = dict(scan_shapes=[(1, 24, 2, 8, 16, 1), (1, 16, 2, 8, 16, 2)], step_shapes=[(2, 2, 8, 16)],
             layer_shapes=[(32, 1, 16)], warmup=0, reps=1)


def test_bench_mamba3_logs_and_writes_every_row_as_it_is_measured(tmp_path):
    peer, lines, sizes = load_peer("reference"), [], []
    partial_file = bench_mamba3.ResultFile("cpu", peer, tmp_path / "r")

    def save(result):
        partial_file(result)
        on_disk = json.loads(partial_file.path.read_text())
        assert on_disk["partial"] is True and len(on_disk["rows"]) == len(result["rows"])
        sizes.append(len(result["rows"]))
        lines.append("<saved>")

    res = bench_mamba3.run(peer, "cpu", "fp32", log=lines.append, save=save, **SMALL)
    assert sizes == list(range(1, len(res["rows"]) + 1))  # a write after every row
    first = lines.index("mamba3 scan b1 L24 h2 p8 n16: timing ours, peer (a new shape compiles and autotunes "
                        "first)")
    assert lines[first + 1].startswith("mamba3 scan b1 L24 h2 p8 n16 fwd, grad enabled: ours ")
    assert lines[first + 2] == "<saved>"  # logged, then written, before the next mode starts
    for r in res["rows"]:
        assert any(line.startswith("mamba3 ") and r["case"] in line and r.get("ours") is not None
                   and str(r["ours"]) in line for line in lines), r
    assert any(line.startswith("mamba3 step b2 h2 p8 n16: timing") for line in lines)
    assert any(line.startswith("mamba3 layer d_model 32 b1 L16: timing") for line in lines)
    from mamba_parallel.bench.results import publish

    publish(res, "cpu", peer, None, partial_file.final(), log=lambda _: None)
    files = list((tmp_path / "r").glob("*/*.json"))
    assert files == [partial_file.path]  # the whole result replaced the partial one
    whole = json.loads(files[0].read_text())
    assert "partial" not in whole and len(whole["rows"]) == len(res["rows"])


class _PassesAfter:
    """A deadline that passes once it has been asked ``n`` times."""

    def __init__(self, n):
        self.n = n

    def passed(self):
        self.n -= 1
        return self.n < 0


def test_bench_mamba3_rows_not_started_in_the_budget_are_skipped():
    lines = []
    res = bench_mamba3.run(load_peer("reference"), "cpu", "fp32", log=lines.append, deadline=_PassesAfter(2),
                           **SMALL)
    rows = res["rows"]
    assert len(rows) == 2 * 3 + 1 + 2  # every row is listed
    assert rows[0]["ours"] > 0 and rows[0]["peer"] > 0  # the first shape's first mode ran
    assert all(r["errors"] == {"ours": "skipped: time budget spent", "peer": "skipped: time budget spent"}
               for r in rows[1:]), rows[1:]
    assert "mamba3 scan b1 L24 h2 p8 n16 fwd+bwd: skipped: time budget spent" in lines


def test_bench_all_mamba3_section_writes_one_whole_result(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_mamba3, "run", partial(bench_mamba3.run, **{k: v for k, v in SMALL.items()
                                                                           if k.endswith("shapes")}))
    out = tmp_path / "r"
    assert bench_all.main(["--peer-impl", "reference", "--device", "cpu", "--only", "mamba3", "--out", str(out),
                           "--report", "", "--kernel-warmup", "0", "--kernel-reps", "1"]) == 0
    files = list(out.glob("*/*.json"))
    assert [f.name for f in files] == ["mamba3.json"]
    result = json.loads(files[0].read_text())
    assert "partial" not in result and len(result["rows"]) == 2 * 3 + 1 + 2
