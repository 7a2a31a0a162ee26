"""Test setup. TRITON_INTERPRET must be set before any @triton.jit runs, so it is set here, first.

On a machine without CUDA, Triton kernels run in the interpreter (fp32/fp16 exact, bf16 wrong, tiny shapes).
GPU tests carry ``@pytest.mark.gpu`` and are skipped without CUDA.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

import pytest  # noqa: E402

import fast_interpreter  # noqa: E402

fast_interpreter.install()


@pytest.fixture(autouse=True, scope="session")
def _no_autotuning():
    """GPU test runs check results, not speed: the SSD kernels take their first launch candidate (no tuning sweeps
    on first use, which cost minutes)."""
    from mamba_parallel.ops import use_autotune

    with use_autotune(False):
        yield


def end_process_if_cuda_broke(synchronize, exit_process, log) -> None:
    """After a test: a device fault (an illegal address, an invalid program counter) leaves the process's CUDA
    context unusable and every later test in it would fail with the same error. The faulting test has already
    failed and been reported; the process ends here, and under xdist a fresh worker takes the remaining tests."""
    try:
        synchronize()
    except RuntimeError as e:  # torch.AcceleratorError is one: errors that survive to a synchronize are sticky
        log(f"conftest: the CUDA context is broken ({str(e).splitlines()[0]}); ending this test process\n")
        exit_process(70)


@pytest.fixture(autouse=True)
def _cuda_context_check():
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        import sys

        def log(msg):
            sys.stderr.write(msg)
            sys.stderr.flush()

        end_process_if_cuda_broke(torch.cuda.synchronize, os._exit, log)


@pytest.fixture
def ops_backend():
    """``ops_backend(name)``: the ops run on ``name`` ("naive" | "triton" | "auto", ops.use_backend) for the rest
    of the test; a later call replaces the earlier choice."""
    import contextlib

    from mamba_parallel.ops import use_backend

    stack = contextlib.ExitStack()

    def choose(name: str) -> None:
        stack.close()
        stack.enter_context(use_backend(name))

    yield choose
    stack.close()


def pytest_addoption(parser):
    parser.addoption("--failure-log", metavar="PATH", default=None,
                     help="append each failure (test id and traceback) to PATH the moment it happens, so a run cut "
                          "short by a time limit still leaves every failure seen so far")


def pytest_runtest_logreport(report):
    path = getattr(pytest_runtest_logreport, "path", None)
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_configure(config):
    # the controller of an xdist run receives every worker's reports, so it alone writes the file
    if config.getoption("--failure-log") and not hasattr(config, "workerinput"):
        pytest_runtest_logreport.path = config.getoption("--failure-log")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nan_poison(monkeypatch):
    """Fill fresh CUDA allocations with NaN so a kernel that reads memory it never wrote fails its test."""
    if not torch.cuda.is_available():
        yield
        return
    orig_empty, orig_empty_like = torch.empty, torch.empty_like

    def empty(*a, **k):
        t = orig_empty(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    def empty_like(*a, **k):
        t = orig_empty_like(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield
