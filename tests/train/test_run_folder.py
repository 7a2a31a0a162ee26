"""One run per output folder (a lock), and a run touches only what it wrote (ownership)."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from mamba_parallel import cli
from mamba_parallel import manifest as mf
from mamba_parallel.train import run_folder
from mamba_parallel.train.data import prepare_data
from mamba_parallel.train.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    (root / "corpus.txt").write_text(inspect.getsource(json) * 2)
    prepare_data(str(root / "corpus.txt"), str(root / "tokens"), ByteTokenizer(), val_fraction=0.05)
    return str(root / "tokens")


def _flags(out, data, *extra):
    return ["train", "--preset", "tiny-mamba2", "--data", data, "--out", str(out), "--seq-len", "16",
            "--batch-size", "2", "--warmup", "1", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--device", "cpu", "--no-progress", *extra]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(tmp_path, data, capsys):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "mamba_parallel.cli", *_flags(out, data, "--steps", "100000",
                                                                                 "--save-every", "0")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and first.poll() is None and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.2)
    try:
        assert first.poll() is None, first.stdout.read()
        holder = json.loads((out / run_folder.LOCK).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        assert cli.main(_flags(out, data, "--steps", "3")) == 2
        err = _err(capsys)
        assert f"is in use by another run: pid {first.pid} on {socket.gethostname()}" in err, err
        assert cli.main(_flags(out, data, "--steps", "3", "--resume")) == 2  # --resume is no way around it
        _err(capsys)
    finally:
        first.send_signal(signal.SIGTERM)
        output, _ = first.communicate(timeout=120)
    assert first.returncode == 0, output
    assert not (out / run_folder.LOCK).exists()  # released at the end
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # one run's records only


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, data, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / run_folder.LOCK).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(),
                                                   "started": "earlier", "command": "mamba-parallel train"}))
    assert cli.main(_flags(out, data, "--steps", "1")) == 0
    assert "took over the stale lock of a run that is gone" in capsys.readouterr().out
    assert not (out / run_folder.LOCK).exists()


def test_a_lock_of_another_host_is_refused_saying_how_to_remove_it(tmp_path):
    (tmp_path / run_folder.LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "now"}))
    with pytest.raises(run_folder.FolderError, match=r"pid 1 on elsewhere.*if that run is gone, delete"):
        run_folder.acquire_lock(str(tmp_path))
    # a pid that now belongs to another process (same host, other start time) is stale too
    (tmp_path / run_folder.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                        "start_time": "-1"}))
    notes = []
    run_folder.acquire_lock(str(tmp_path), notes.append)
    assert notes and "stale" in notes[0]
    run_folder.release_lock(str(tmp_path))
    assert not (tmp_path / run_folder.LOCK).exists()


def test_files_we_did_not_write_are_never_replaced(tmp_path, data, capsys):
    out = tmp_path / "mine"
    (out / "final").mkdir(parents=True)
    (out / "config.toml").write_text("# my own config\n")
    (out / "final" / "model.bin").write_bytes(b"my model")
    (out / "notes.md").write_text("notes")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert cli.main(_flags(out, data, "--steps", "1")) == 2
    err = _err(capsys)
    assert "holds config.toml, final, which this run would write but did not write" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing changed
    (out / "config.toml").unlink()
    (out / "final" / "model.bin").unlink()
    (out / "final").rmdir()
    assert cli.main(_flags(out, data, "--steps", "1")) == 0  # the user's other files stay
    assert (out / "notes.md").read_text() == "notes"
    assert {"config.toml", "metrics.jsonl", "checkpoints", "final"} <= mf.owned_names(str(out))


def test_a_fresh_start_in_our_own_folder_replaces_only_the_old_attempts_records(tmp_path, data):
    out = tmp_path / "run"
    assert cli.main(_flags(out, data, "--steps", "2", "--save-every", "0")) == 0
    first = (out / "metrics.jsonl").read_text()
    shutil.rmtree(out / "checkpoints")  # as if the earlier attempt had died before its first checkpoint
    shutil.rmtree(out / "final")
    assert cli.main(_flags(out, data, "--steps", "2", "--save-every", "0")) == 0
    assert (out / "metrics.jsonl").read_text().count('"step": 1,') == first.count('"step": 1,')  # not appended


def test_a_final_model_of_an_earlier_run_is_not_replaced_by_a_fresh_start(tmp_path, data, capsys):
    out = tmp_path / "run"
    assert cli.main(_flags(out, data, "--steps", "1")) == 0
    shutil.rmtree(out / "checkpoints")
    weights = (out / "final" / "pytorch_model.bin").read_bytes()
    assert cli.main(_flags(out, data, "--steps", "1", "--resume")) == 2
    assert "holds final/, the model of an earlier run" in _err(capsys)
    assert (out / "final" / "pytorch_model.bin").read_bytes() == weights


def test_a_run_folder_of_an_older_version_resumes(tmp_path, data, capsys):
    out = tmp_path / "run"
    assert cli.main(_flags(out, data, "--steps", "1")) == 0
    (out / mf.MANIFEST).unlink()  # as written before run folders had a manifest
    assert cli.main(_flags(out, data, "--steps", "2", "--resume")) == 0
    assert "a run folder of an older version" in capsys.readouterr().out
