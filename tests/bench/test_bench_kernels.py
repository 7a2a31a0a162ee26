"""bench/kernels.py: a side that breaks the CUDA context (an illegal memory access) is named in its row, and the
run goes on to the end with every later row saying why it did not run. Simulated on a CPU: the failing side raises
what CUDA raises, and the device synchronisation after it fails as a poisoned context does."""

import torch

from mamba_parallel.bench import kernels

ILLEGAL = "CUDA error: an illegal memory access was encountered"


def test_a_side_that_breaks_cuda_is_named_and_the_run_still_ends(monkeypatch):
    monkeypatch.setattr(kernels, "_lost", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    broken = []

    def synchronize(*a):
        if broken:
            raise RuntimeError(ILLEGAL)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: synchronize())
    monkeypatch.setattr(kernels, "time_calls", lambda fn, device, warmup, reps: (fn(), [1.0])[1])

    def peer(x):
        broken.append(1)
        raise RuntimeError(ILLEGAL)

    sides = {"ours": lambda x: x * 2, "peer": peer}
    rows = kernels.time_shapes("demo", [1, 2], lambda s: {"x": torch.ones(3)}, lambda s: f"case {s}", sides,
                               ("x",), "cuda", 0, 1, log=lambda *a: None)
    assert [r["case"] for r in rows] == ["case 1"] * 3 + ["case 2"] * 3
    first = rows[0]
    assert first["ours"] == 1.0 and ILLEGAL in first["errors"]["peer"]
    lost = "not run: the CUDA context was lost after the peer side failed"
    for r in rows[1:]:
        assert r["ours"] is None and all(e.startswith(lost) for e in r["errors"].values()), r
    assert kernels.not_startable(None).startswith(lost)
