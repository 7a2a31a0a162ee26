"""The selective-scan backward's finishing kernel (triton_finish.finish_bwd: every reduction in one launch) vs the
torch expressions it replaces, and ``scan_backward``'s caller-given outputs (dB_out / dC_out, dA_scale) vs the
custom op's body ``_scan_bwd``.

CPU runs use the Triton interpreter with tiny tiles (64 elements), so odd L = 19 crosses several token tiles and a
group's 3 partial rows are a masked (4, 16) tile.
"""

import pytest
import torch
from helpers import assert_close

from mamba_parallel.ops.selective_scan import triton_impl
from mamba_parallel.ops.selective_scan.triton_finish import finish_bwd
from mamba_parallel.ops.selective_scan.triton_impl import _scan_bwd, scan_backward, scan_forward

SENTINEL = 7.0  # fills the parts of a shared output buffer the kernel must not touch


def _parts(b, nblk, n, L, d, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    return dict(dBp=rnd(b, nblk, n, L), dCp=rnd(b, nblk, n, L), dA_part=rnd(b, n, d), dD_part=rnd(b, d),
                ddtb_part=rnd(b, d), scale=-(torch.rand(d, n, generator=gen) + 0.2).to(device))


def _strided_outputs(b, G, n, L, d, r, dtype, device="cpu"):
    """dB / dC: slices of one (b, G, r + 2n, L) buffer (the layer's x_proj-gradient layout, G = 1 as (b, r + 2n,
    L)); dA: a transposed (d, n) view; dD / ddtb: every other element of a longer vector."""
    shape = (b, r + 2 * n, L) if G == 1 else (b, G, r + 2 * n, L)
    buf = torch.full(shape, SENTINEL, dtype=dtype, device=device)
    dB, dC = buf[..., r:r + n, :], buf[..., r + n:, :]
    if G == 1:
        dB, dC = dB.unsqueeze(1), dC.unsqueeze(1)
    f32 = dict(dtype=torch.float32, device=device)
    return dict(buf=buf, dB=dB, dC=dC, dA=torch.empty((n, d), dtype=dtype, device=device).t(),
                dD=torch.empty(2 * d, **f32)[::2], ddtb=torch.empty(2 * d, dtype=dtype, device=device)[1::2])


def _run_finish(p, o, G, scale, with_D, with_dtb):
    finish_bwd(p["dBp"], p["dCp"], p["dA_part"], p["dD_part"] if with_D else None,
               p["ddtb_part"] if with_dtb else None, G, o["dB"], o["dC"], o["dA"],
               o["dD"] if with_D else None, o["ddtb"] if with_dtb else None,
               dA_scale=p["scale"] if scale else None)


def _check_out(actual, expected_fp32, name):
    """actual holds expected_fp32 rounded to its dtype (the sums' order differs from torch's: fp32 rounding)."""
    assert_close(actual.float(), expected_fp32.to(actual.dtype).float(), dtype=actual.dtype, name=name)


OPTIONS = {"all": (True, True, True), "none": (False, False, False), "D_only": (False, True, False)}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_finish_matches_torch(dtype, G, b, options):
    scale, with_D, with_dtb = OPTIONS[options]
    n, L, d, r = 4, 19, 8, 3
    nblk = 3 * G
    p = _parts(b, nblk, n, L, d)
    o = _strided_outputs(b, G, n, L, d, r, dtype)
    o["dD"].fill_(SENTINEL)
    o["ddtb"].fill_(SENTINEL)
    _run_finish(p, o, G, scale, with_D, with_dtb)
    _check_out(o["dB"], p["dBp"].view(b, G, nblk // G, n, L).sum(2), "dB")
    _check_out(o["dC"], p["dCp"].view(b, G, nblk // G, n, L).sum(2), "dC")
    dA = p["dA_part"].sum(0).t()
    _check_out(o["dA"], dA * p["scale"] if scale else dA, "dA")
    for name, on in (("dD", with_D), ("ddtb", with_dtb)):
        if on:
            _check_out(o[name], p[f"{name}_part"].sum(0), name)
        else:  # skipped: untouched
            assert (o[name] == SENTINEL).all(), name
    untouched = o["buf"][..., :r, :]  # the buffer's other rows
    assert (untouched == SENTINEL).all()


def test_finish_sums_parts_past_the_batch():
    """dA / dD / d delta_bias partials with more rows than sequences (the backward's b x segments) are summed
    over all of them; dB / dC keep their per-sequence rows."""
    b, G, n, L, d = 2, 1, 4, 19, 8
    p = _parts(b, 3, n, L, d)
    gen = torch.Generator().manual_seed(2)
    p.update(dA_part=torch.randn(5 * b, n, d, generator=gen), dD_part=torch.randn(5 * b, d, generator=gen),
             ddtb_part=torch.randn(5 * b, d, generator=gen))
    o = _strided_outputs(b, G, n, L, d, 2, torch.float32)
    _run_finish(p, o, G, False, True, True)
    _check_out(o["dB"], p["dBp"].sum(1, keepdim=True), "dB")
    _check_out(o["dA"], p["dA_part"].sum(0).t(), "dA")
    _check_out(o["dD"], p["dD_part"].sum(0), "dD")
    _check_out(o["ddtb"], p["ddtb_part"].sum(0), "ddtb")


def test_finish_is_deterministic():
    p = _parts(3, 4, 4, 19, 8, seed=1)
    outs = []
    for _ in range(2):
        o = _strided_outputs(3, 2, 4, 19, 8, 2, torch.float32)
        _run_finish(p, o, 2, True, True, True)
        outs.append(o)
    for k in ("buf", "dA", "dD", "ddtb"):
        assert torch.equal(outs[0][k], outs[1][k]), k


def test_finish_rejects_bad_arguments():
    p = _parts(2, 4, 4, 19, 8)
    o = _strided_outputs(2, 2, 4, 19, 8, 0, torch.float32)
    with pytest.raises(ValueError, match="groups=3"):
        _run_finish(p, o, 3, False, True, True)
    with pytest.raises(ValueError, match="dB_out"):
        finish_bwd(p["dBp"], p["dCp"], p["dA_part"], None, None, 2, o["dB"][:, :1], o["dC"], o["dA"], None, None)
    with pytest.raises(ValueError, match="dD_part and dD_out"):
        finish_bwd(p["dBp"], p["dCp"], p["dA_part"], p["dD_part"], None, 2, o["dB"], o["dC"], o["dA"], None, None)
    with pytest.raises(ValueError, match="dA_part must be a contiguous fp32"):
        finish_bwd(p["dBp"], p["dCp"], p["dA_part"].half(), None, None, 2, o["dB"], o["dC"], o["dA"], None, None)


def test_bc32_keeps_fp32_grouped_tensors():
    """B / C a caller already converted to fp32 (b, g, n, L) reach the kernels without a copy."""
    t = torch.randn(2, 1, 4, 19)
    assert triton_impl._bc32(t) is t
    assert triton_impl._bc32(t.half()[:, 0]).shape == (2, 1, 4, 19)


def _scan_args(b=2, d=8, L=19, n=4, g=None, dtype=torch.float32, seed=0):
    """Inputs of the forward / backward ops (u, delta, A, B, C, D, z, delta_bias, initial_state) and dy."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0, dt=dtype: (torch.randn(*s, generator=gen) * scale).to(dt)  # noqa: E731
    bc = (b, g, n, L) if g else (b, n, L)
    args = [rnd(b, d, L), rnd(b, d, L, scale=0.5), -(torch.rand(d, n, generator=gen) + 0.2), rnd(*bc), rnd(*bc),
            rnd(d, dt=torch.float32), rnd(b, d, L), rnd(d, scale=0.3, dt=torch.float32),
            rnd(b, d, n, dt=torch.float32)]
    return args, rnd(b, d, L)


def _forward_for(args, path):
    """The custom op's leading arguments (inputs, sid, checkpoints) after a forward on ``path`` that saved
    checkpoints."""
    u, delta, A, B, C, D, z, dtb, h0 = args
    _, _, ckpt = scan_forward(u, delta, A, B, C, D, z, dtb, h0, None, True, False, u.shape[0], True, path)
    return (u, delta, A, B, C, D, z, dtb, h0, None, ckpt)


def _backward_both(args, dy, **outs):
    """(_scan_bwd's gradients, scan_backward's with the given outputs) after one forward that saved checkpoints."""
    common = (*_forward_for(args, "generic"), dy, None, True, False, "generic")
    return _scan_bwd(*common), scan_backward(*common, **outs)


@pytest.mark.parametrize("g", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_scan_backward_writes_into_caller_outputs(dtype, g):
    """dB / dC land in slices of the caller's buffer (the list holds empty placeholders), dA comes back times
    dA_scale; every other gradient as the custom op's body returns it."""
    b, d, L, n, r = 2, 8, 19, 4, 3
    args, dy = _scan_args(b, d, L, n, g, dtype)
    A = args[2]
    buf = torch.full((b, *((g,) if g else ()), r + 2 * n, L), SENTINEL, dtype=dtype)
    dB_out, dC_out = buf[..., r:r + n, :], buf[..., r + n:, :]
    ref, ours = _backward_both(args, dy, dB_out=dB_out, dC_out=dC_out, dA_scale=A)
    assert ours[3].numel() == 0 and ours[4].numel() == 0
    assert torch.equal(dB_out, ref[3]) and torch.equal(dC_out, ref[4])
    assert (buf[..., :r, :] == SENTINEL).all()
    torch.testing.assert_close(ours[2], ref[2] * A)
    for i in (0, 1, 5, 6, 7, 8):
        assert torch.equal(ours[i], ref[i]), i


@pytest.mark.parametrize("path", ["generic", "row_per_thread"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_scan_backward_gate_into_caller_outputs(dtype, path, monkeypatch):
    """The fused layer's way: z and the gated output's gradient as channel-contiguous views of (b, L, .) buffers,
    y's gradient dgated * silu(z) formed before (token-major), dz written into the z half of a token-major buffer,
    the gate's output y * silu(z), rebuilt from the states, into another and du channels-last into a third (the
    conv's backward reads it so); every gradient as with the gate
    applied inside the kernel. The channel-contiguous z must not cost the row-per-thread backward its layout (the
    plan is the forward's, without z); L = 32: two chunks of the interpreter's tiles, as the layout needs."""
    from mamba_parallel.ops.layout.triton_impl import _gate_into
    from mamba_parallel.ops.selective_scan import launch

    b, d, L, n = 2, 32, 32, 4
    args, dout = _scan_args(b, d, L, n, None, dtype)
    u, delta, A, B, C, D, z, dtb, h0 = args
    ref = _scan_bwd(*_forward_for(args, path), dout, None, True, False, path)
    xz = torch.empty(b, L, 2 * d, dtype=dtype)
    xz[..., d:] = z.transpose(1, 2)
    targs = list(args)
    targs[6] = zt = xz[..., d:].transpose(1, 2)
    dgated = dout.transpose(1, 2).contiguous().transpose(1, 2)
    dy = _gate_into(dgated, zt, torch.empty(b, d, L, dtype=dtype))
    dxz = torch.full((b, L, 2 * d), SENTINEL, dtype=dtype)
    gated = torch.full((b, L, d), SENTINEL, dtype=dtype)
    _, _, ckpt = scan_forward(*targs[:6], None, *targs[7:], None, True, False, b, True, path)
    dxc = torch.full((b, L, d + 1), SENTINEL, dtype=dtype)  # du channels-last, in a wider buffer
    plans, real_plan = [], triton_impl._plan
    monkeypatch.setattr(triton_impl, "_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    ours = scan_backward(*targs, None, ckpt, dy, None, True, False, path, dz_out=dxz[..., d:].transpose(1, 2),
                         gated_out=gated.transpose(1, 2), dgated=dgated, du_out=dxc[..., :d].transpose(1, 2))
    assert (plans[0].bwd.path == launch.ROW_PER_THREAD) == (path == "row_per_thread")
    assert ours[0].data_ptr() == dxc.data_ptr() and (dxc[..., d] == SENTINEL).all()
    assert ours[6].numel() == 0
    assert torch.equal(dxz[..., d:].transpose(1, 2), ref[6])  # from the same rebuilt y and the same inputs
    assert (dxz[..., :d] == SENTINEL).all()
    y = scan_forward(*args, None, True, False, b, False, path)[0]  # gated: y * silu(z)
    assert_close(gated.transpose(1, 2), y, dtype)
    for i in (0, 1, 2, 3, 4, 5, 7, 8):  # through y's gradient, rounded to the inputs' dtype here
        assert_close(ours[i], ref[i], dtype, grad=True, name=str(i))


@pytest.mark.parametrize("path,K,mode,n", [("generic", 1, None, 4), ("generic", 2, None, 4),
                                           ("row_per_thread", 2, None, 4), ("generic", 1, "seq_idx", 4),
                                           ("generic", 2, "cu_seqlens", 4), ("generic", 1, "seq_idx", 12),
                                           ("generic", 2, "cu_seqlens", 12)])
def test_scan_backward_segments(path, K, mode, n):
    """The sequence walked in segments (each from the carry of the later ones, triton_bwd_carry.py): every
    gradient, d(last state) and d(initial state) included, as the walk in one piece gives them, for segment
    counts that split 5 chunks evenly, unevenly and into single chunks (K = 2: whole groups of 2 chunks).
    Restarts (seq_idx, or packed sequences with their own initial and last states) at a segment's first token
    (16, with 3 segments of 16 tokens) and inside one (21). n 12: the carry pass takes the states in groups of a
    chunk's token slots (8 in the interpreter), the last group part-filled."""
    b, d, L = (1 if mode == "cu_seqlens" else 2), 32 if path == "row_per_thread" else 8, 37
    args, dy = _scan_args(b, d, L, n)
    sid, varlen, nstates = None, mode == "cu_seqlens", b
    if mode is not None:
        sid = torch.tensor([0] * 16 + [1] * 5 + [2] * 16, dtype=torch.int32).expand(b, L).contiguous()
        nstates = 3 if varlen else b
        args[8] = torch.randn(nstates, d, n, generator=torch.Generator().manual_seed(2))
    dlast = torch.randn(nstates, d, n, generator=torch.Generator().manual_seed(1))
    _, _, ckpt = scan_forward(*args, sid, True, varlen, nstates, True, path, K)
    run = lambda segments: scan_backward(*args, sid, ckpt, dy, dlast, True, varlen, path,  # noqa: E731
                                         checkpoint_every=K, segments=segments)
    whole = run(1)
    for segments in (2, 3, 9):
        for i, (g, ref) in enumerate(zip(run(segments), whole)):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{segments} segments, {i}: {m}")
    with pytest.raises(ValueError, match="segments=0"):
        run(0)


def test_scan_backward_fp32_grouped_bc():
    """B / C converted once by the caller (fp32 (b, 1, n, L)) give the gradients of the fp16 (b, n, L) views,
    dB / dC written into fp16 slices of the caller's buffer."""
    args, dy = _scan_args(dtype=torch.float16)
    ref = _backward_both(args, dy)[0]
    args32 = list(args)
    args32[3], args32[4] = args[3].float().unsqueeze(1), args[4].float().unsqueeze(1)
    n, L = args[3].shape[1:]
    buf = torch.empty((2, 2 * n, L), dtype=torch.float16)
    dB_out, dC_out = buf[:, :n].unsqueeze(1), buf[:, n:].unsqueeze(1)
    ours = _backward_both(args32, dy, dB_out=dB_out, dC_out=dC_out)[1]
    assert torch.equal(dB_out[:, 0], ref[3]) and torch.equal(dC_out[:, 0], ref[4])
    for i in (0, 1, 2, 5, 6, 7, 8):
        assert torch.equal(ours[i], ref[i]), i


def test_scan_backward_rejects_misshapen_outputs():
    args, dy = _scan_args()
    with pytest.raises(ValueError, match="dC_out"):
        _backward_both(args, dy, dC_out=torch.empty(2, 4, 18))
    with pytest.raises(ValueError, match="gated_out"):
        _backward_both(args, dy, gated_out=torch.empty(2, 8, 18))
    with pytest.raises(ValueError, match="du_out is torch.float16"):
        _backward_both(args, dy, du_out=torch.empty(2, 8, 19, dtype=torch.float16))
    args[6] = None
    with pytest.raises(ValueError, match="need z"):
        _backward_both(args, dy, dgated=dy)


@pytest.mark.parametrize("path", ["generic", "row_per_thread", "two_rows_per_channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gated_forward_through_strides(dtype, path):
    """The fused layer's forward: z a channel-contiguous view of in_proj's (b, L, 2d) output, y * silu(z) written
    into out_proj's (b, L, d) input; the prefill's ``scan_into`` with the same z and output. Both give what
    scan_forward gives with a token-major z, bit for bit, and the training form the same checkpoints; nothing
    outside the views is written. L = 32: two chunks of the interpreter's tiles, as the row layouts need."""
    b, d, L, n = 2, 32, 32, 4
    (u, delta, A, B, C, D, z, dtb, h0), _ = _scan_args(b, d, L, n, None, dtype)
    y_ref, last_ref, ck_ref = scan_forward(u, delta, A, B, C, D, z, dtb, None, None, True, False, b, True, path)
    xz = torch.full((b, L, 2 * d), SENTINEL, dtype=dtype)
    xz[..., d:] = z.transpose(1, 2)
    zv = xz[..., d:].transpose(1, 2)
    for form in ("training", "prefill"):
        out = torch.full((b, L, d + 1), SENTINEL, dtype=dtype)
        if form == "training":
            ck = triton_impl.gated_forward(u, delta, A, B, C, D, zv, dtb, None, path, out[..., :d].transpose(1, 2))
            assert torch.equal(ck, ck_ref)
        else:
            run = triton_impl.forward_launch(u, delta, A, B)
            last = torch.empty(b, d, n)
            triton_impl.scan_into(run, u, delta, A, B, C, D, dtb, None, None, last, z=zv,
                                  y_out=out[..., :d].transpose(1, 2))
            if run.path == triton_impl.scan_path(u, delta, z, A, B, path=path):  # the same kernel as the reference
                assert torch.equal(last, last_ref)
        if form == "training" or run.path == path:
            assert torch.equal(out[..., :d].transpose(1, 2), y_ref), form
        else:  # the prefill runs the default path: the same values to rounding
            assert_close(out[..., :d].transpose(1, 2), y_ref, dtype)
        assert (out[..., d] == SENTINEL).all() and (xz[..., :d] == SENTINEL).all()
    with pytest.raises(ValueError, match="gated_out"):
        triton_impl.gated_forward(u, delta, A, B, C, D, zv, dtb, None, path, out[..., :d - 1].transpose(1, 2))


@pytest.mark.gpu
def test_gpu_realistic_bf16(nan_poison):
    """mamba-130m's backward at b8 L2048: d1536, n16, 48 partial rows (one per warp of 32 channels), bf16 dB / dC
    slices of a (b, r + 2n, L) buffer, bf16 dA times A, against the torch expressions."""
    b, d, L, n, nblk, r = 8, 1536, 2048, 16, 48, 48
    p = _parts(b, nblk, n, L, d, device="cuda")
    o = _strided_outputs(b, 1, n, L, d, r, torch.bfloat16, device="cuda")
    _run_finish(p, o, 1, True, True, True)
    for name, part in (("dB", "dBp"), ("dC", "dCp")):
        ref = p[part].sum(1, keepdim=True)
        torch.testing.assert_close(o[name].float(), ref, rtol=2 ** -7, atol=1e-4 * ref.abs().max().item())
    torch.testing.assert_close(o["dA"].float(), p["dA_part"].sum(0).t() * p["scale"], rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(o["dD"], p["dD_part"].sum(0))
    torch.testing.assert_close(o["ddtb"].float(), p["ddtb_part"].sum(0), rtol=2 ** -7, atol=1e-5)
    assert (o["buf"][:, :r] == SENTINEL).all()
