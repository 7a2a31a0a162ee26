"""tools/two_gpu.sh, the two-GPU figures as commands, checked without a GPU.

- Every part's commands (full sizes, DRY_RUN=1) call flags their programs have, with values those programs accept
  (the scaling sweeps expand to bench_train / bench_pipeline commands that are checked too), test paths that exist,
  and results written where the device tool brings files back ($OUT/<part>/..., two folders deep at most).
- Parts run end to end at tiny sizes on 2 gloo ranks (SIZE=tiny), each within the device tool's limits (8 files,
  two folders, plain names); their results are read back: the peer in DDP beside ours on every rank (same weights,
  rank batches averaged), the collective overlap of a TP=2 step, the pipeline rows of the scaling table, the CP
  lengths, a pipelined training run's losses.
No test asserts a timing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "two_gpu.sh"
PARTS = ["dp", "peer", "tp", "pp", "7b-fsdp", "7b-tp", "7b-pp", "cp", "tests-tp", "tests-dp"]
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def run_script(part: str, out: Path, work: Path, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "WORK": str(work), "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO), **env}
    return subprocess.run(["bash", str(SCRIPT), part], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=900)


def commands(text: str) -> list[list[str]]:
    """The commands a DRY_RUN printed ('+ cmd ...'), with the interpreter and torchrun's own flags taken off."""
    out = []
    for line in text.splitlines():
        if not line.startswith("+ "):
            continue
        cmd = shlex.split(line[2:])
        assert cmd[0] == sys.executable, line
        cmd = cmd[1:]
        if cmd[:2] == ["-m", "torch.distributed.run"]:
            assert cmd[2:5] == ["--standalone", "--nproc_per_node", "2"], line  # two processes on one host
            cmd = cmd[5:]
        assert cmd[0] == "-m", line
        out.append(cmd[1:])
    return out


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def check_command(module: str, args: list[str], out: Path) -> None:
    """Parse ``args`` with ``module``'s own parser (SystemExit on an unknown flag or a bad value)."""
    if module == "mamba_parallel.bench.bench_scaling":
        from mamba_parallel.bench import bench_scaling

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            bench_scaling.main(args + ["--dry-run", "--gpus", "2"])
        lines = buf.getvalue().splitlines()
        assert not [ln for ln in lines if ln.startswith("# skip")], lines  # every layout fits two GPUs
        inner = [shlex.split(ln) for ln in lines if ln and not ln.startswith("#")]
        assert inner, lines
        for cmd in inner:
            assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
            check_command(cmd[cmd.index("-m", 2) + 1], cmd[cmd.index("-m", 2) + 2:], out)
    elif module == "mamba_parallel.bench.bench_train":
        from mamba_parallel.bench import bench_train

        bench_train.build_parser().parse_args(args)
    elif module == "mamba_parallel.bench.bench_pipeline":
        from mamba_parallel.bench import bench_pipeline
        from mamba_parallel.distributed.pipeline import PP_SCHEDULES

        a = bench_pipeline.build_parser().parse_args(args)
        assert a.schedule in PP_SCHEDULES
    elif module == "mamba_parallel.bench.bench_train_dp":
        from mamba_parallel.bench import bench_train_dp

        a = bench_train_dp.build_parser().parse_args(args)
        assert a.peer is True  # the figure needs the peer: a missing one is an error, not a silent "ours alone"
        bench_train_dp.parse_modes(a.dp_modes)
    elif module == "mamba_parallel.bench.profile_train":
        from mamba_parallel.bench import profile_train

        a = profile_train.build_parser().parse_args(args)
        assert a.tp == 2
    elif module == "mamba_parallel.bench.bench_long_context":
        from mamba_parallel.bench import bench_long_context

        a = bench_long_context._parser().parse_args(args)
        assert a.cp == 2 and a.seq_len % 2 == 0
    elif module == "mamba_parallel.cli":
        from mamba_parallel.cli import build_parser
        from mamba_parallel.train.batching import resolve_micro_steps
        from mamba_parallel.train.config import resolve_config

        parsed, unknown = build_parser().parse_known_args(args)
        assert not unknown, unknown
        if parsed.command == "train":
            cfg = resolve_config(parsed)
            dp = 2 // (cfg.tp * cfg.cp * cfg.pp)
            resolve_micro_steps(cfg, dp, cfg.pp)
            assert cfg.global_batch_size == 4  # every layout at the one-GPU offload run's batch
    elif module == "pytest":
        paths = [a for a in args if not a.startswith("-") and "/" in a and not a.startswith(str(out))]
        assert paths and all((REPO / p).exists() for p in paths), paths
        assert args[args.index("-m") + 1] == "gpu"
    else:
        raise AssertionError(f"two_gpu.sh calls a module this test does not know: {module}")
    for flag in ("--json", "--junitxml"):  # results under $OUT/<part>/, at most two folders down
        value = _flag(args, flag)
        if value is not None and value.startswith(str(out)):
            assert len(Path(value).relative_to(out).parts) <= 2, value


@pytest.mark.parametrize("part", PARTS)
def test_dry_run_commands_use_real_flags(part, tmp_path):
    out = tmp_path / "out"
    res = run_script(part, out, tmp_path / "work", DRY_RUN="1")
    assert res.returncode == 0, res.stdout + res.stderr
    cmds = commands(res.stdout)
    assert cmds, res.stdout
    for cmd in cmds:
        check_command(cmd[0], cmd[1:], out)
    for line in res.stdout.splitlines():
        if line.startswith("keep "):
            dest = Path(line.split(" -> ")[1])
            assert dest.parent == out / part and NAME.match(dest.name), line
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in SCRIPT.read_text()


def test_unknown_part_prints_the_usage(tmp_path):
    res = run_script("nope", tmp_path / "out", tmp_path / "work")
    assert res.returncode == 1 and "bash tools/two_gpu.sh dp" in res.stdout


# ---- the parts end to end, tiny -----------------------------------------------------------------------------------
def _returned(out: Path) -> list[Path]:
    """What the device tool would bring back of $OUT, checked against its limits."""
    files = [p for p in out.rglob("*") if p.is_file()]
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3, f"{rel}: more than two folders down"
        assert all(NAME.match(x) for x in rel.parts), rel
        assert p.stat().st_size <= 16 * 2**20, rel
    assert len(files) <= 8, files
    return files


def _tiny(part: str, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    res = run_script(part, out, tmp_path / "work", SIZE="tiny")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    _returned(out)
    assert (out / part / "log.txt").exists()
    return out / part


def test_peer_part_runs_the_peer_in_ddp_beside_ours(tmp_path):
    from mamba_parallel.bench import bench_train_dp
    from mamba_parallel.bench.peer import load_peer
    from mamba_parallel.config import get_preset

    (path,) = (_tiny("peer", tmp_path)).glob("*-cpu/train_dp.json")
    res = json.loads(path.read_text())
    assert res["bench"] == "train_dp" and res["settings"]["world_size"] == 2
    assert [r["dp_mode"] for r in res["rows"]] == ["fsdp"] * 3 + ["ddp"] * 3
    for r in res["rows"][::3]:  # tokens/s: both sides ran on both ranks
        assert r["ours"] > 0 and r["peer"] > 0 and r["x_peer"] == pytest.approx(r["ours"] / r["peer"])
    # The step-1 loss is the mean over the two ranks' own batches, from the peer's seeded init.
    ref = load_peer("reference")
    torch.manual_seed(0)
    model = ref.build_lm(get_preset("tiny-mamba2"), "cpu")
    want = sum(ref.loss(model, *bench_train_dp.rank_batch(256, 2, 32, 0, r, "cpu")).item() for r in (0, 1)) / 2
    for check in res["checks"]["step1_loss"]:
        assert check["agree"] and check["peer_step1_loss"] == pytest.approx(want, rel=1e-5)
        assert check["ours_step1_loss"] == pytest.approx(want, rel=1e-5)
    from mamba_parallel.bench import report

    md = tmp_path / "performance.md"
    assert report.main(["--results", str(path.parent.parent), "--out", str(md), "--no-plots"]) == 0
    text = md.read_text()
    assert "## One data-parallel training step on 2 GPUs" in text and "tiny-mamba2 (ours ddp): step-1 loss" in text


def test_tp_part_reports_collectives_and_their_overlap(tmp_path):
    part = _tiny("tp", tmp_path)
    rows = {r["layout"]: r for r in json.loads((part / "scaling.json").read_text())["rows"]}
    # a failed layout's row and log say why (as text: pytest cuts the repr of any other message to a line)
    assert rows["1gpu"]["status"] == "ok" and rows["tp2"]["status"] == "ok" and rows["tp2"]["speedup"] > 0, \
        f"rows: {json.dumps(rows)[:3000]}\nlog:\n{(part / 'log.txt').read_text()[-3000:]}"
    prof = json.loads((part / "profile-tiny-mamba2.json").read_text())
    assert len(prof["collectives"]) == 2  # both ranks' traces
    for summary in prof["collectives"]:
        kinds = {k["kind"]: k for k in summary["kinds"]}
        # sequence parallel: each of the 2 layers all-gathers its input and reduce-scatters its output (x2 backward)
        assert kinds["all_gather"]["calls_per_step"] >= 2 and kinds["reduce_scatter"]["calls_per_step"] >= 2
        assert all(0 <= k["overlap_fraction"] <= 1 for k in summary["kinds"])
    assert "## Collectives" in (part / "profile-tiny-mamba2.md").read_text()


def test_pp_part_folds_the_measured_bubble_into_the_scaling_table(tmp_path):
    part = _tiny("pp", tmp_path)
    rows = {r["layout"]: r for r in json.loads((part / "scaling.json").read_text())["rows"]}
    pp = rows["pp2-gpipe"]
    assert pp["status"] == "ok" and pp["schedule"] == "gpipe" and pp["gpus"] == 2 and pp["speedup"] > 0, \
        f"rows: {json.dumps(rows)[:3000]}\nlog:\n{(part / 'log.txt').read_text()[-3000:]}"
    assert 0 <= pp["bubble_mean"] <= pp["bubble_max"] <= 1 and pp["microbatches"] == 2
    assert pp["bubble_theory"] == pytest.approx(1 / 3, abs=1e-4)  # (p - 1) / (m + p - 1), p = m = 2
    assert "| tiny-mamba2 | pp2-gpipe | gpipe | 2 |" in (part / "scaling.md").read_text()


def test_cp_part_records_each_length(tmp_path):
    part = _tiny("cp", tmp_path)
    (record,) = [json.loads(x) for x in (part / "cp.jsonl").read_text().splitlines()]
    assert record["seq_len"] == 64 and record["cp"] == 2 and record["activation_checkpointing"] and not record["oom"]


def test_7b_pp_part_trains_at_the_offload_runs_batch(tmp_path):
    part = _tiny("7b-pp", tmp_path)
    recs = [json.loads(x) for x in (part / "tiny-mamba2-pp2.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["tokens"] % (4 * 32) == 0 for r in steps)
    assert (part / "logs.tar.gz").exists()
