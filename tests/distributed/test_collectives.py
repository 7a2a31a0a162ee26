"""Raw collectives (sync and async) and their autograd pairs, on 2 gloo ranks, against single-process math."""

import pytest
import torch

from dist_harness import spawn
from mamba_parallel.distributed import collectives as C
from mamba_parallel.distributed.tensor_parallel import get_dim_for_local_rank, local_offset


def _value(rank, shape, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _worker(rank, world):
    out = {}
    x = _value(rank, (3, 4), 0)
    for async_op in (False, True):
        y, h = C.all_gather_raw(x, async_op=async_op)
        if h is not None:
            h.wait()
        out[f"gather{async_op}"] = y
        y, h = C.reduce_scatter_raw(torch.cat([x, 2 * x]), async_op=async_op)
        if h is not None:
            h.wait()
        out[f"scatter{async_op}"] = y
        y, h = C.all_reduce_raw(x.clone(), async_op=async_op)
        if h is not None:
            h.wait()
        out[f"reduce{async_op}"] = y
    out["handle_sync"] = C.all_reduce_raw(x.clone())[1]
    # Autograd pairs: each rank's loss is sum(w_r * f(x_r)); the summed loss's gradients are checked in the test.
    for name in ("all_gather", "reduce_scatter", "all_reduce", "copy_to_group", "all_reduce_both",
                 "gather_from_group"):
        xi = _value(rank, (4, 6), 1).requires_grad_()
        fn = getattr(C, name)
        y = fn(xi, None, 1) if name in ("all_gather", "reduce_scatter", "gather_from_group") else fn(xi, None)
        replicated_use = name in ("all_reduce", "gather_from_group")  # the same loss on every rank
        w = _value(0 if replicated_use else rank, tuple(y.shape), 2)
        (y * w).sum().backward()
        out[name] = (y.detach(), xi.grad)
    try:
        C.reduce_scatter(torch.zeros(3, 3), None, 0)
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, 2)


def _x(r, shape, seed):
    return _value(r, shape, seed)


@pytest.mark.parametrize("async_op", [False, True])
def test_raw_collectives(results, async_op):
    xs = [_x(r, (3, 4), 0) for r in range(2)]
    for r in range(2):
        res = results[r]
        torch.testing.assert_close(res[f"gather{async_op}"], torch.cat(xs))
        full = sum(torch.cat([x, 2 * x]) for x in xs)
        torch.testing.assert_close(res[f"scatter{async_op}"], full[3 * r:3 * (r + 1)])
        torch.testing.assert_close(res[f"reduce{async_op}"], xs[0] + xs[1])
        assert res["handle_sync"] is None


def _reference(name):
    """Forward values and input gradients of the 2-rank computation, written out in one process."""
    xs = [_x(r, (4, 6), 1).requires_grad_() for r in range(2)]
    if name == "all_gather":
        ys = [torch.cat(xs, 1)] * 2
    elif name == "gather_from_group":
        ys = [torch.cat(xs, 1)] * 2
    elif name == "reduce_scatter":
        s = xs[0] + xs[1]
        ys = [s[:, :3], s[:, 3:]]
    elif name in ("all_reduce", "all_reduce_both"):
        ys = [xs[0] + xs[1]] * 2
    else:  # copy_to_group
        ys = list(xs)
    ws = [_x(r, tuple(ys[r].shape), 2) for r in range(2)]
    if name in ("all_reduce", "gather_from_group"):
        # The result is used identically on every rank (same loss everywhere): one copy of it, not a sum.
        loss = (ys[0] * ws[0]).sum()
    elif name == "copy_to_group":
        # A replicated input: every rank's x is the same tensor, its gradient the sum of both ranks' uses.
        loss = (xs[0] * (ws[0] + ws[1])).sum() + (xs[1] * (ws[0] + ws[1])).sum()
    else:
        loss = sum((y * w).sum() for y, w in zip(ys, ws))
    loss.backward()
    return [y.detach() for y in ys], [x.grad for x in xs]


@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter", "all_reduce", "copy_to_group", "all_reduce_both",
                                  "gather_from_group"])
def test_autograd_pairs(results, name):
    ys, gs = _reference(name)
    for r in range(2):
        y, g = results[r][name]
        torch.testing.assert_close(y, ys[r])
        torch.testing.assert_close(g, gs[r], msg=f"{name} rank {r} gradient")


def test_bad_shape_error(results):
    assert "not divisible by the group size 2" in results[0]["error"]


def test_get_dim_for_local_rank():
    assert [get_dim_for_local_rank(1024, 4, r, 16) for r in range(4)] == [256] * 4
    sizes = [get_dim_for_local_rank(80, 3, r, 16) for r in range(3)]
    assert sizes == [32, 32, 16] and sum(sizes) == 80
    assert [local_offset(80, 3, r, 16) for r in range(3)] == [0, 32, 64]
    with pytest.raises(ValueError, match="multiple_of=16"):
        get_dim_for_local_rank(100, 2, 0, 16)
    with pytest.raises(ValueError, match="local_rank=2"):
        get_dim_for_local_rank(100, 2, 2)
