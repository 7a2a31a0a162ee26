"""The op dispatch contract: a missing triton_impl means "no kernel", a broken one raises; forced / naive
backends route a public op to the kernel module or the reference with the validated arguments."""

import sys

import pytest
import torch

import mamba_parallel.ops.norm as norm_pkg
from mamba_parallel.ops import rms_norm, use_backend
from mamba_parallel.ops._common import kernel_module


def _make_pkg(root, name, impl_source):
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if impl_source is not None:
        (pkg / "triton_impl.py").write_text(impl_source)


def test_kernel_module_missing_broken_present(tmp_path, monkeypatch):
    _make_pkg(tmp_path, "mp_test_nokernel", None)
    _make_pkg(tmp_path, "mp_test_broken", "import a_module_that_does_not_exist_anywhere\n")
    _make_pkg(tmp_path, "mp_test_kernel", "VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert kernel_module("mp_test_nokernel") is None
        with pytest.raises(ImportError, match="a_module_that_does_not_exist_anywhere"):
            kernel_module("mp_test_broken")
        assert kernel_module("mp_test_kernel").VALUE == 7
        assert kernel_module("mp_test_kernel") is kernel_module("mp_test_kernel")
    finally:
        for name in [m for m in sys.modules if m.startswith("mp_test_")]:
            del sys.modules[name]


class _FakeKernel:
    def __init__(self):
        self.calls = []

    def rms_norm(self, x, weight, eps):
        self.calls.append((x, weight, eps))
        return torch.full_like(x, 3.0)


def test_public_op_routes_by_backend(monkeypatch):
    fake = _FakeKernel()
    monkeypatch.setattr(norm_pkg, "_kernel", lambda: fake)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w = torch.randn(2, 4), torch.randn(4)
    with use_backend("triton"):
        assert torch.equal(rms_norm(x, w, 1e-3), torch.full_like(x, 3.0))
        assert fake.calls[0][0] is x and fake.calls[0][2] == 1e-3
        with pytest.raises(ValueError, match="weight"):  # validation runs before any kernel
            rms_norm(x, torch.randn(5))
        assert len(fake.calls) == 1
        with use_backend("naive"):  # the innermost block wins
            assert not torch.equal(rms_norm(x, w), torch.full_like(x, 3.0))
        assert len(fake.calls) == 1
        assert torch.equal(rms_norm(x, w, 1e-3), torch.full_like(x, 3.0))  # back to the outer block's choice
    assert len(fake.calls) == 2


def test_backend_default_and_bad_names(monkeypatch):
    """Outside any use_backend block the process default MAMBA_PARALLEL_BACKEND applies (auto when unset); an
    unknown name is refused, naming where it came from."""
    from mamba_parallel.ops.backend import BackendError, requested_backend

    monkeypatch.delenv("MAMBA_PARALLEL_BACKEND", raising=False)
    assert requested_backend() == "auto"
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    assert requested_backend() == "naive"
    with use_backend("triton"):
        assert requested_backend() == "triton"
    assert requested_backend() == "naive"
    with pytest.raises(BackendError, match="use_backend='cuda'"):
        with use_backend("cuda"):
            pass
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "fast")
    with pytest.raises(BackendError, match="MAMBA_PARALLEL_BACKEND='fast'"):
        requested_backend()


def test_int32_span_guard_names_the_tensor():
    from mamba_parallel.ops._common import check_int32_span

    big = torch.empty(1, 2 ** 20, 2049, dtype=torch.int8, device="meta")[:, :, :2048]  # a channels slice of a wide row
    with pytest.raises(ValueError, match=r"ssd_chunk_scan: x of shape \(1, 1048576, 2048\).*int32"):
        check_int32_span("ssd_chunk_scan", x=big)
    check_int32_span("ssd_chunk_scan", x=big[:, :1000], z=None)  # within the limit: no error


def test_int32_span_guard_per_row_skips_the_batch_stride():
    from mamba_parallel.ops._common import check_int32_span

    rows = torch.empty(2 ** 12, 1, 2 ** 20, dtype=torch.int8, device="meta")  # 4096 rows of 2^20
    check_int32_span("selective_scan", per_row=True, u=rows)  # each row is small: fine
    with pytest.raises(ValueError, match="selective_scan: u"):
        check_int32_span("selective_scan", u=rows)
