"""tools/gpu_tests.sh and the suite's --failure-log: a failure's traceback is on disk the moment it happens."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'tests'}"
    return env


def test_failure_log_holds_each_failure(tmp_path):
    (tmp_path / "test_sample.py").write_text("def test_fails():\n    assert 1 == 2, 'boom'\n\n"
                                             "def test_passes():\n    pass\n")
    log = tmp_path / "failures.txt"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          str(tmp_path / "test_sample.py"), "--failure-log", str(log), "--rootdir", str(tmp_path)],
                         env=_env(), capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    assert text.count("==== ") == 1 and "test_fails (call)" in text and "boom" in text


def test_gpu_tests_script_leaves_its_files(tmp_path):
    out, tree = tmp_path / "out", tmp_path / "tree"  # the tree without a .peer folder: nothing to install
    tree.mkdir()
    for name in ("tools", "tests", "mamba_parallel"):
        (tree / name).symlink_to(ROOT / name)
    run = subprocess.run(["bash", "tools/gpu_tests.sh", "tests/ops/test_kernel_globals.py"],
                         env=dict(_env(), OUT=str(out), WORKERS="0", LIMIT="300"), capture_output=True, text=True,
                         cwd=tree)
    # that file has no GPU test: every test is deselected and pytest exits 5
    assert run.returncode in (0, 5), run.stdout + run.stderr
    assert (out / "gpu.log").exists() and (out / "gpu.xml").exists() and (out / "failures.txt").read_text() == ""
    assert "0 failure reports" in run.stdout
