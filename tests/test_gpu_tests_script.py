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


def test_a_broken_cuda_context_ends_only_its_worker(tmp_path):
    """A test that leaves the CUDA context broken fails; its worker process ends and a fresh one runs the rest
    (the CUDA check is simulated: a synchronize that raises as torch's does after an illegal address)."""
    (tmp_path / "test_sample.py").write_text(
        "import os, pytest\n"
        "from conftest import end_process_if_cuda_broke\n\n"
        "def broken():\n"
        "    raise RuntimeError('CUDA error: an illegal memory access was encountered')\n\n"
        "@pytest.fixture\n"
        "def faults():\n"
        "    yield\n"
        "    end_process_if_cuda_broke(broken, os._exit, print)\n\n"
        "def test_faults(faults):\n"
        "    assert False, 'illegal memory access'\n\n"
        "def test_after_1():\n    pass\n\n"
        "def test_after_2():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-n", "1",
                          "-p", "no:randomly", str(tmp_path / "test_sample.py"), "--rootdir", str(tmp_path)],
                         env=_env(), capture_output=True, text=True, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 passed" in out and "crashed while running" in out and "test_faults" in out, out


def test_a_healthy_cuda_context_is_left_alone():
    from conftest import end_process_if_cuda_broke

    exits, logs = [], []
    end_process_if_cuda_broke(lambda: None, exits.append, logs.append)
    assert exits == [] and logs == []

    def broken():
        raise RuntimeError("CUDA error: invalid program counter\nmore")

    end_process_if_cuda_broke(broken, exits.append, logs.append)
    assert exits == [70] and "invalid program counter" in logs[0] and "more" not in logs[0]
