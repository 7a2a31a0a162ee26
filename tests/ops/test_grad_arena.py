"""split_with_grad_arena: same gradients as a plain split in every case, and no copy when the consumers write
their gradient into the arena."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import assert_close, rel_err
from mamba_parallel.ops import grad_arena
from mamba_parallel.ops.grad_arena import grad_slot, split_with_grad_arena, tag_view

SIZES = [3, 5, 2]


class _Scale(torch.autograd.Function):
    """y = x * w, an op that writes dx into its grad slot (records where it wrote)."""

    written: list = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.w, ctx.slot = w, grad_slot(x)
        return x * w

    @staticmethod
    def backward(ctx, gy):
        dx = ctx.slot.get() if ctx.slot is not None else torch.empty_like(gy)
        torch.mul(gy, ctx.w, out=dx)
        _Scale.written.append(dx)
        return dx, None


@pytest.fixture
def copies(monkeypatch):
    """Counts the split's fallback copies (one per piece whose gradient was not written in place)."""
    count = []
    orig = grad_arena._copy_into

    def counting(dest, g):
        count.append(tuple(dest.shape))
        orig(dest, g)

    monkeypatch.setattr(grad_arena, "_copy_into", counting)
    _Scale.written.clear()
    return count


def _grads(fn, t, seed=0):
    """d(sum(fn(t) * fixed noise))/dt, and the gradient that arrived at t (a hook, t a non-leaf)."""
    leaf = t.detach().clone().requires_grad_(True)
    src = leaf * 1.0  # a non-leaf, as in_proj's output
    seen = []
    src.register_hook(lambda g: seen.append(g))
    outs = fn(src)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return leaf.grad, seen[0]


def test_consumers_write_in_place_no_copy(copies):
    t = torch.randn(2, 4, 10)

    def fn(split):
        return lambda src: [_Scale.apply(p, float(i + 1)) for i, p in enumerate(split(src))]

    ref, _ = _grads(fn(lambda s: s.split(SIZES, -1)), t)
    _Scale.written.clear()
    got, arrived = _grads(fn(lambda s: split_with_grad_arena(s, SIZES, -1)), t)
    assert_close(got, ref, grad=True, name="dt")
    assert copies == []
    # every consumer wrote into the buffer that arrived as t's gradient, at its piece's offset
    offsets = sorted((dx.data_ptr() - arrived.data_ptr()) // arrived.element_size() for dx in _Scale.written)
    assert offsets == [0, 3, 8]


def test_views_between_split_and_op(copies):
    """transpose / unflatten between the split and the op keep the in-place path (tag_view)."""
    t = torch.randn(2, 4, 10)

    def fn(arena):
        def run(src):
            a, b, c = split_with_grad_arena(src, [4, 4, 2], -1) if arena else src.split([4, 4, 2], -1)
            at = tag_view(a.transpose(1, 2), a, lambda g: g.transpose(1, 2)) if arena else a.transpose(1, 2)
            bu = tag_view(b.unflatten(-1, (2, 2)), b, lambda g: g.unflatten(-1, (2, 2))) if arena else \
                b.unflatten(-1, (2, 2))
            return [_Scale.apply(at, 2.0), _Scale.apply(bu, 3.0), _Scale.apply(c, 4.0)]
        return run

    ref, _ = _grads(fn(False), t)
    got, _ = _grads(fn(True), t)
    assert_close(got, ref, grad=True, name="dt")
    assert copies == []


def test_ignoring_consumer_unused_piece_and_double_use(copies):
    """Piece 0: plain op (copied); piece 1: used twice by slot-aware ops (summed -> copied); piece 2: unused
    (zeros, although the arena buffer is uninitialised memory)."""
    t = torch.randn(3, 10)

    def fn(split):
        def run(src):
            a, b, c = split(src)
            return [a.sin(), _Scale.apply(b, 2.0), _Scale.apply(b, -5.0)]
        return run

    ref, _ = _grads(fn(lambda s: s.split(SIZES, -1)), t)
    _Scale.written.clear()
    got, _ = _grads(fn(lambda s: split_with_grad_arena(s, SIZES, -1)), t)
    assert_close(got, ref, grad=True, name="dt")
    assert torch.equal(got[:, 8:], torch.zeros(3, 2))
    assert sorted(copies) == [(3, 3), (3, 5)]
    # the second user of piece 1 got a private buffer, not the arena slice the first one writes
    assert _Scale.written[0].data_ptr() != _Scale.written[1].data_ptr()


def test_piece_used_by_slot_op_and_a_plain_op(copies):
    t = torch.randn(2, 10)

    def fn(split):
        def run(src):
            a, b, c = split(src)
            return [_Scale.apply(a, 2.0), a.exp(), _Scale.apply(b, 1.5), c * 1.0]
        return run

    ref, _ = _grads(fn(lambda s: s.split(SIZES, -1)), t)
    got, _ = _grads(fn(lambda s: split_with_grad_arena(s, SIZES, -1)), t)
    assert_close(got, ref, grad=True, name="dt")
    assert sorted(copies) == [(2, 2), (2, 3)]  # a (summed) and c (plain op) copied; b written in place


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(copies, reentrant):
    t = torch.randn(2, 10)

    def body(split):
        def run(src):
            a, b, c = split(src)
            return torch.cat([_Scale.apply(a, 2.0), _Scale.apply(b.unflatten(-1, (5, 1)), 3.0).flatten(-2),
                              c.cos()], -1)
        return run

    ref, _ = _grads(lambda s: [body(lambda x: x.split(SIZES, -1))(s)], t)
    arena_body = body(lambda x: split_with_grad_arena(x, SIZES, -1))
    got, _ = _grads(lambda s: [checkpoint(arena_body, s, use_reentrant=reentrant)], t)
    assert_close(got, ref, grad=True, name="dt")


def test_retained_graph_second_backward_fresh_arena():
    src = torch.randn(2, 10, requires_grad=True)
    a, b, c = split_with_grad_arena(src * 1.0, SIZES, -1)
    loss = (_Scale.apply(a, 2.0).sum() + _Scale.apply(b, 3.0).square().sum() + c.sum())
    loss.backward(retain_graph=True)
    first = src.grad.clone()
    src.grad = None
    loss.backward()
    assert_close(src.grad, first, grad=True, name="second backward")
    expect = torch.cat([torch.full((2, 3), 2.0), 18.0 * b.detach(), torch.ones(2, 2)], -1)
    assert_close(first, expect, grad=True, name="dt")


def test_leaf_input_gradient():
    src = torch.randn(2, 10, requires_grad=True)
    a, b, c = split_with_grad_arena(src, SIZES, -1)
    (_Scale.apply(a, 2.0).sum() + _Scale.apply(b, 3.0).sum() + _Scale.apply(c, 4.0).sum()).backward()
    expect = torch.cat([torch.full((2, 3), 2.0), torch.full((2, 5), 3.0), torch.full((2, 2), 4.0)], -1)
    assert torch.equal(src.grad, expect)


def test_split_along_middle_dim_and_dense_layout_kept(copies):
    """A transposed (dense, non-contiguous) input: the arena takes its layout, slices along dim 1."""
    t = torch.randn(2, 4, 10)  # split as s.transpose(1, 2): (2, 10, 4) with unit stride on dim 1
    ref, _ = _grads(lambda s: [_Scale.apply(p, 2.0) for p in s.transpose(1, 2).split(SIZES, 1)], t)
    got, arrived = _grads(lambda s: [_Scale.apply(p, 2.0) for p in
                                     split_with_grad_arena(s.transpose(1, 2), SIZES, 1)], t)
    assert_close(got, ref, grad=True, name="dt")
    assert copies == []
    assert arrived.is_contiguous()  # the arena kept the transposed layout: transposed back it is s's


def test_no_grad_compile_and_no_requires_grad_are_plain_splits(monkeypatch):
    t = torch.randn(2, 10, requires_grad=True)
    with torch.no_grad():
        parts = split_with_grad_arena(t, SIZES, -1)
    assert all(grad_slot(p) is None and p.grad_fn is None for p in parts)
    parts = split_with_grad_arena(t.detach(), SIZES, -1)
    assert all(grad_slot(p) is None for p in parts)
    monkeypatch.setattr(grad_arena, "_compiling", lambda: True)
    parts = split_with_grad_arena(t, SIZES, -1)
    assert all(grad_slot(p) is None for p in parts)
    assert all(type(p.grad_fn).__name__.startswith("Split") for p in parts)


def test_under_torch_compile_matches():
    t = torch.randn(2, 10)

    def fn(src):
        a, b, c = split_with_grad_arena(src, SIZES, -1)
        return (a * 2).sum() + (b * 3).sum() + (c * c).sum()

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    leaf = t.clone().requires_grad_(True)
    compiled(leaf * 1.0).backward()
    expect = torch.cat([torch.full((2, 3), 2.0), torch.full((2, 5), 3.0), 2 * t[:, 8:]], -1)
    assert_close(leaf.grad, expect, grad=True, name="dt")


def test_errors_name_the_fault():
    t = torch.randn(2, 10, requires_grad=True)
    with pytest.raises(ValueError, match="sizes"):
        split_with_grad_arena(t, [3, 3], -1)
    a, b, c = split_with_grad_arena(t * 1.0, SIZES, -1)
    bad = tag_view(b.unflatten(-1, (5, 1)), b, lambda g: g)  # to_view does not reproduce the view
    with pytest.raises(RuntimeError, match="tag_view"):
        _Scale.apply(bad, 2.0).sum().backward()


# ---- the Mamba-2 layer: both splits through the arena ------------------------------------------------------------

def _layer_grads(monkeypatch, arena: bool, rmsnorm: bool, packed: bool):
    from mamba_parallel.layers import mamba2

    with monkeypatch.context() as m:
        if not arena:
            m.setattr(mamba2, "split_with_grad_arena", lambda t, sizes, dim=-1: t.split(sizes, dim))
        torch.manual_seed(0)
        layer = mamba2.Mamba2(32, d_state=8, d_conv=4, expand=2, headdim=16, ngroups=2, chunk_size=16,
                              rmsnorm=rmsnorm)
        hidden = torch.randn(2, 24, 32, requires_grad=True)
        seq_idx = torch.tensor([[0] * 10 + [1] * 14, [0] * 24], dtype=torch.int32) if packed else None
        out = layer(hidden, seq_idx=seq_idx)
        (out * torch.linspace(-1, 1, 32)).sum().backward()
    return {"hidden": hidden.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("backend,rmsnorm,packed", [
    ("triton", True, False), ("triton", False, True),
    ("naive", True, False), ("naive", True, True), ("naive", False, False), ("naive", False, True)])
def test_mamba2_layer_gradients_match_plain_split(monkeypatch, ops_backend, copies, backend, rmsnorm, packed):
    """Same gradients as the plain split; with the Triton kernels (conv, SSD: dx, ddt, dB, dC, dz; gated norm:
    dz) every piece's gradient is written in place: no copy at all. The naive ops (autograd) are all copied."""
    ops_backend(backend)
    ref = _layer_grads(monkeypatch, False, rmsnorm, packed)
    assert copies == []  # the plain split never reaches the arena

    got = _layer_grads(monkeypatch, True, rmsnorm, packed)
    for name in ref:
        assert_close(got[name], ref[name], grad=True, name=name)
    if backend == "triton":
        assert copies == []
    else:  # z, xBC, dt from the first split; x, B, C from the second
        assert len(copies) == 6


def test_double_backward_through_the_split():
    """create_graph=True: the split's backward stays differentiable (second-order gradients as a plain split)."""
    def second_order(split):
        src = torch.linspace(-1, 1, 20).reshape(2, 10).requires_grad_(True)
        a, b, c = split(src * 1.0)
        (g,) = torch.autograd.grad(a.pow(3).sum() + (b * b.sin()).sum(), src, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), src)
        return g.detach(), gg

    ref = second_order(lambda t: t.split(SIZES, -1))
    got = second_order(lambda t: split_with_grad_arena(t, SIZES, -1))
    for a, b in zip(got, ref):
        assert_close(a, b, grad=True, name="double backward")


def test_mamba2_layer_under_torch_compile(ops_backend):
    """torch.compile traces both splits as plain splits (no graph break) and gives the eager gradients."""
    from mamba_parallel.layers.mamba2 import Mamba2

    ops_backend("naive")
    torch.manual_seed(0)
    layer = Mamba2(32, d_state=8, d_conv=4, expand=2, headdim=16, ngroups=2, chunk_size=16)
    hidden = torch.randn(2, 24, 32)
    grads = []
    for fn in (layer, torch.compile(layer, backend="eager", fullgraph=True)):
        layer.zero_grad()
        h = hidden.clone().requires_grad_(True)
        fn(h).square().sum().backward()
        grads.append([h.grad] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        assert_close(a, b, grad=True, name="compiled gradient")


# ---- context parallel (its sequence ops installed) and tensor parallel (local split sizes), 2 gloo ranks ------

def _parallel_ranks(rank: int, world: int) -> dict:
    """Per parallel mode: (max relative gradient difference arena vs plain split, fallback copies) of one rank,
    every op on its Triton kernel."""
    from mamba_parallel.ops import use_backend

    with use_backend("triton"):
        return _parallel_modes(rank, world)


def _parallel_modes(rank: int, world: int) -> dict:
    import dataclasses

    from mamba_parallel import get_preset
    from mamba_parallel.distributed.context_parallel import apply_context_parallel
    from mamba_parallel.distributed.parallel_dims import ParallelDims
    from mamba_parallel.distributed.tp_plan import apply_tensor_parallel
    from mamba_parallel.layers import mamba2
    from mamba_parallel.models import MambaLMHeadModel

    cfg = dataclasses.replace(get_preset("tiny-mamba2"), n_layer=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 16), generator=g)
    labels = torch.randint(0, 256, (1, 16), generator=g)
    seq = torch.tensor([[0] * 6 + [1] * 10], dtype=torch.int32)
    copies, orig_copy, orig_split = [], grad_arena._copy_into, mamba2.split_with_grad_arena
    grad_arena._copy_into = lambda dest, gr: (copies.append(tuple(dest.shape)), orig_copy(dest, gr))
    out = {}
    for mode in ("cp", "tp"):
        dims = ParallelDims(dp_shard=1, world_size=world, **{mode: world})
        dims.build_mesh("cpu")
        sl = slice(rank * 8, (rank + 1) * 8) if mode == "cp" else slice(None)
        grads = []
        for arena in (False, True):
            mamba2.split_with_grad_arena = orig_split if arena else (lambda t, s, dim=-1: t.split(s, dim))
            torch.manual_seed(0)
            model = MambaLMHeadModel(cfg)
            if mode == "cp":
                apply_context_parallel(model, dims.submesh("cp"))
            else:
                apply_tensor_parallel(model, dims.submesh("tp"))
            copies.clear()
            model(ids[:, sl], targets=labels[:, sl], seq_idx=seq[:, sl]).loss.backward()
            grads.append({n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                          for n, p in model.named_parameters()})
        diff = max(rel_err(grads[1][n], grads[0][n]) for n in grads[0])
        out[mode] = (diff, list(copies))
    mamba2.split_with_grad_arena = orig_split
    return out


def test_arena_under_context_and_tensor_parallel():
    """CP: the overridden conv / scan also use the pieces elsewhere (halo, initial-state term): those gradients
    are summed by autograd and copied. TP: in_proj's local shard is split with the local sizes; the kernels write
    in place. Both: the plain split's gradients."""
    from dist_harness import spawn

    for rank, res in enumerate(spawn(_parallel_ranks, 2)):
        for mode, (diff, copied) in res.items():
            assert diff <= 1e-6, f"rank {rank} {mode}: arena gradients differ from the plain split's by {diff:.2e}"
            if mode == "tp":  # only z: TPGatedRMSNorm (ngroups = 1 spans the ranks) has its own backward
                assert copied == [(1, 16, 64)], f"rank {rank} tp: copies {copied}"
            else:  # xBC (conv halo), dt (decay of the slice) and on rank 1 C (initial-state term): used twice
                assert set(copied) <= {(1, 8, 160), (1, 8, 8), (1, 8, 16)}, f"rank {rank} cp: copies {copied}"


@pytest.mark.parametrize("gated", [True, False])
def test_gated_norm_writes_dx_and_dz_in_place(ops_backend, copies, gated):
    """The Triton gated RMSNorm takes both x and z from one split: dx and dz land in the arena; the third piece
    (a plain op) is copied."""
    from mamba_parallel import ops

    ops_backend("triton")
    t = torch.randn(2, 5, 24)
    w = torch.linspace(0.5, 1.5, 8)

    def fn(split):
        def run(src):
            x, z, c = split(src)
            return [ops.gated_rms_norm(x, z if gated else None, w, group_size=4), c.exp()]
        return run

    ref, _ = _grads(fn(lambda s: s.split([8, 8, 8], -1)), t)
    got, _ = _grads(fn(lambda s: split_with_grad_arena(s, [8, 8, 8], -1)), t)
    assert_close(got, ref, grad=True, name="dt")
    assert copies == [(2, 5, 8)]  # c only (an unused z gets zeros, no copy)
    if not gated:
        assert torch.equal(got[..., 8:16], torch.zeros(2, 5, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_layer_gpu_no_concatenation(monkeypatch, copies, dtype):
    """On CUDA (Triton kernels): the arena's gradients equal the plain split's, no piece is copied, and the
    backward launches no concatenation kernel (the plain split's backward launches them: the profiler sees it)."""
    from torch.profiler import ProfilerActivity, profile

    from mamba_parallel.layers import mamba2

    def run(arena):
        with monkeypatch.context() as m:
            if not arena:
                m.setattr(mamba2, "split_with_grad_arena", lambda t, sizes, dim=-1: t.split(sizes, dim))
            torch.manual_seed(0)
            layer = mamba2.Mamba2(256, d_state=64, headdim=64, ngroups=2, chunk_size=64, device="cuda",
                                  dtype=dtype)
            hidden = torch.randn(2, 512, 256, device="cuda", dtype=dtype, requires_grad=True)
            seq_idx = torch.zeros(2, 512, dtype=torch.int32, device="cuda")
            seq_idx[0, 200:] = 1
            layer(hidden, seq_idx=seq_idx).float().square().mean().backward()  # packed (its setup concatenates)
            out = layer(hidden)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out.float().square().mean().backward()
                torch.cuda.synchronize()
            cats = sum(e.count for e in prof.key_averages() if "CatArrayBatchedCopy" in e.key)
            return cats, [hidden.grad] + [p.grad for p in layer.parameters()]

    cats_ref, ref = run(False)
    cats, got = run(True)
    for a, b in zip(got, ref):
        assert_close(a.float(), b.float(), dtype, grad=True, name="gradient")
    assert cats_ref > 0 and cats == 0, (cats_ref, cats)
    assert copies == []
