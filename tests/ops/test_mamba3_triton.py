"""Triton Mamba-3 scan and decode step (SISO and MIMO) vs the float64 reference: outputs, final states and every gradient.

CPU: the kernels run in the Triton interpreter (fp32 / fp16, tiny shapes). GPU tests (bf16 / fp16 / fp32,
realistic shapes, NaN-poisoned allocations) carry the ``gpu`` mark.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_close, rel_err
from mamba3_cases import grads, leaves, make_inputs, random_loss
from mamba_parallel.ops.mamba3 import Mamba3State, mamba3_chunk_scan, mamba3_state_update, naive, triton_impl

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(fn, args, kw):
    lv = leaves(args)
    y, final = fn(**lv, **kw, return_final_states=True)
    random_loss(y, final).backward()
    return y.detach(), Mamba3State(*(s.detach() for s in final)), grads(lv)


def as_double(args):
    out = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in args.items() if k != "initial_states"}
    if args.get("initial_states") is not None:
        out["initial_states"] = Mamba3State(*(s.double() for s in args["initial_states"]))
    return out


def check_against_reference(args, kw, dtype, factor=1.0):
    y, final, g = run(triton_impl.mamba3_chunk_scan, args, kw)
    y_ref, final_ref, g_ref = run(naive.mamba3_chunk_scan, as_double(args), kw)
    assert y.dtype == dtype and final.ssm.dtype == final.angle.dtype == torch.float32
    assert_close(y, y_ref, dtype, name="y", factor=factor)
    for name, a, b in zip(Mamba3State._fields, final, final_ref):
        assert_close(a, b.to(a.dtype), dtype, name=f"final {name}", factor=factor)
    assert set(g) == set(g_ref)
    leaf_dtype = {k: v.dtype for k, v in args.items() if isinstance(v, torch.Tensor)}
    if args.get("initial_states") is not None:
        leaf_dtype.update({f"init.{n}": s.dtype for n, s in zip(Mamba3State._fields, args["initial_states"])})
    for k in g_ref:
        assert g[k].dtype == leaf_dtype[k], k
        assert_close(g[k], g_ref[k], dtype, grad=True, name=f"d{k}", factor=factor)


CASES = {
    # name: (make_inputs kwargs, scan kwargs); odd lengths, a partial last chunk
    "plain": (dict(b=2, L=37, h=2, p=16, n=32), dict(chunk_size=16)),
    "groups_halved_bare": (dict(b=1, L=21, h=4, p=8, n=16, g=2, a=8, init=False, z=False, D=False, bias=False),
                           dict(chunk_size=16, rope="halved")),
    # MIMO: rank 2 with every projection; rank 4 keeping the rank axis (no mimo_o), no gate, groups
    "mimo_r2": (dict(b=1, L=21, h=2, p=16, n=32, R=2), dict(chunk_size=8, rope="halved")),
    "mimo_r4_unfolded": (dict(b=2, L=13, h=4, p=8, n=16, g=2, R=4, mimo_o=False, z=False),
                         dict(chunk_size=4, rope="halved")),
    # d_state 64: the backward takes the state's pairs in more than one block (in the interpreter)
    "pair_blocks": (dict(b=1, L=21, h=2, p=8, n=64), dict(chunk_size=16)),
    "mimo_pair_blocks": (dict(b=1, L=11, h=2, p=8, n=64, R=2, a=24), dict(chunk_size=8, rope="halved")),
}


# fp32 for every case, fp16 for one SISO and one MIMO case (the interpreter is slow)
@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in CASES] +
                         [("plain", torch.float16), ("mimo_r2", torch.float16)])
def test_matches_reference(case, dtype):
    mk, kw = CASES[case]
    check_against_reference(make_inputs(**mk, dtype=dtype, device=DEV), kw, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_seq_idx(dtype):
    args = make_inputs(2, 30, 2, 8, 16, dtype=dtype, device=DEV, expand_angles=True)
    seq_idx = torch.tensor([[0] * 5 + [1] * 16 + [2] * 9, [0] * 16 + [3] * 14], dtype=torch.int32, device=DEV)
    check_against_reference(args, dict(chunk_size=16, seq_idx=seq_idx), dtype)


def test_mimo_packed_sequences():
    args = make_inputs(2, 30, 2, 8, 16, R=2, dtype=torch.float32, device=DEV)
    seq_idx = torch.tensor([[0] * 5 + [1] * 16 + [2] * 9, [0] * 16 + [3] * 14], dtype=torch.int32, device=DEV)
    check_against_reference(args, dict(chunk_size=8, rope="halved", seq_idx=seq_idx), torch.float32)


def test_cu_seqlens_with_an_empty_sequence():
    args = make_inputs(1, 40, 2, 8, 16, dtype=torch.float32, device=DEV, nstates=4)
    cu = torch.tensor([0, 7, 7, 23, 40], dtype=torch.int32, device=DEV)
    check_against_reference(args, dict(chunk_size=16, cu_seqlens=cu), torch.float32)


def test_strided_inputs_as_the_layer_passes_them():
    """x, z, B, C as views into one projection output, angles an expanded head-shared view."""
    b, L, h, p, n = 1, 19, 2, 8, 16
    base = make_inputs(b, L, h, p, n, dtype=torch.float32, device=DEV)
    proj = torch.cat([base["z"].flatten(2), base["x"].flatten(2), base["B"].flatten(2), base["C"].flatten(2)], -1)
    d = h * p
    args = dict(base, z=proj[..., :d].unflatten(-1, (h, p)), x=proj[..., d:2 * d].unflatten(-1, (h, p)),
                B=proj[..., 2 * d:2 * d + n].unflatten(-1, (1, n)), C=proj[..., 2 * d + n:].unflatten(-1, (1, n)),
                angles=base["angles"][:, :, :1].expand(b, L, h, base["angles"].shape[-1]))
    assert not args["x"].is_contiguous() and args["angles"].stride(2) == 0
    check_against_reference(args, dict(chunk_size=16), torch.float32)


@pytest.mark.parametrize("mk", [dict(), dict(R=2), dict(R=2, z=False)], ids=["siso", "mimo", "mimo_no_gate"])
def test_inference_matches_reference(mk):
    """Without gradients the forward keeps nothing for a backward (no y before the gate / the fold)."""
    args = make_inputs(1, 21, 2, 8, 16, **mk, dtype=torch.float32, device=DEV)
    check_inference(args, dict(chunk_size=16 // mk.get("R", 1), rope="halved"), torch.float32)


def check_inference(args, kw, dtype):
    """The no-grad forward's outputs and final states against the reference."""
    kw = dict(kw, return_final_states=True)
    with torch.no_grad():
        y, final = triton_impl.mamba3_chunk_scan(**args, **kw)
    y_ref, final_ref = naive.mamba3_chunk_scan(**as_double(args), **kw)
    assert_close(y, y_ref, dtype, name="y")
    for name, a, b in zip(Mamba3State._fields, final, final_ref):
        assert_close(a, b.to(a.dtype), dtype, name=f"final {name}")


def test_steep_decay_no_nan():
    """The decay across a chunk underflows fp32; the padded tail must not turn exp(+big) * 0 into NaN. (The
    decay's log is a difference of large cumulative sums there: fp32 keeps ~1e-5 of it, hence the factor.)"""
    args = make_inputs(1, 29, 2, 8, 16, dtype=torch.float32, device=DEV, A_scale=200.0)
    check_against_reference(args, dict(chunk_size=16), torch.float32, factor=10.0)


def test_public_function_dispatches_here(monkeypatch):
    calls = []
    real = triton_impl._Mamba3Scan.apply
    monkeypatch.setattr(triton_impl._Mamba3Scan, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "triton")
    args = make_inputs(1, 16, 2, 8, 16, dtype=torch.float32, device=DEV)
    y = mamba3_chunk_scan(**args, chunk_size=16)
    assert calls and y.shape == args["x"].shape
    odd_rank = make_inputs(1, 8, 2, 8, 16, R=3, dtype=torch.float32, device=DEV)
    assert not triton_impl.supports(*(odd_rank[k] for k in ("x", "dt", "A", "B")))  # the reference runs it
    mimo = make_inputs(1, 8, 2, 8, 16, R=2, dtype=torch.float32, device=DEV)
    parts = [mimo[k] for k in ("x", "dt", "A", "B")]
    assert triton_impl.supports(*parts)  # MIMO inference: the kernels
    parts[0] = parts[0].clone().requires_grad_(True)
    assert triton_impl.supports(*parts)  # MIMO with gradients: the kernels too


def test_rejects_bad_chunk_size():
    args = make_inputs(1, 16, 2, 8, 16, dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        triton_impl.mamba3_chunk_scan(**args, chunk_size=24)


@pytest.mark.parametrize("dtype,rope,R", [(torch.float32, "interleaved", None), (torch.float16, "halved", None),
                                          (torch.float32, "halved", 2), (torch.float16, "halved", 4)])
@pytest.mark.parametrize("rows", [None, 4], ids=["one_block", "blocks"])
def test_decode_step_matches_reference(dtype, rope, R, rows, monkeypatch):
    """rows: headdim rows per program (4 of 8: two programs per head, the cached phase and k written after)."""
    if rows:
        monkeypatch.setattr(triton_impl, "step_launch", lambda b, H, P: (rows, 1))
    args = make_inputs(3, 1, 4, 8, 16, g=2, R=R, mimo_o=R != 4, dtype=dtype, device=DEV)
    step = {k: (v[:, 0] if k in ("x", "dt", "A", "B", "C", "trap", "angles", "z") else v)
            for k, v in args.items() if k != "initial_states"}
    state = Mamba3State(*(s.float().clone() for s in args["initial_states"]))
    state = state._replace(v=state.v.to(dtype))
    ref_state = Mamba3State(*(s.double().clone() for s in state))
    y = triton_impl.mamba3_state_update(state, **step, rope=rope)
    y_ref = naive.mamba3_state_update(ref_state, **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                                    for k, v in step.items()}, rope=rope)
    assert_close(y, y_ref, dtype, name="y")
    for name, a, b in zip(Mamba3State._fields, state, ref_state):
        assert_close(a, b.to(a.dtype), dtype, name=f"state {name}")


@pytest.mark.parametrize("dtype,rope,R", [(torch.float32, "interleaved", None), (torch.float16, "halved", 4)])
@pytest.mark.parametrize("rows", [None, 4], ids=["one_block", "blocks"])
def test_decode_step_discretizes_raw_projections(dtype, rope, R, rows, monkeypatch):
    """discretize=...: the kernel takes a layer's raw dt / A / trap / angles (views of one projection, as the layer
    passes them) and gives what naive.discretize followed by the reference step gives."""
    if rows:
        monkeypatch.setattr(triton_impl, "step_launch", lambda b, H, P: (rows, 1))
    check_raw_step(3, 4, 8, 16, 4, R, dtype, rope, DEV, g=2)


def check_raw_step(b, h, p, n, a, R, dtype, rope, device, g=1):
    from mamba_parallel.ops.mamba3 import Mamba3Discretization, discretize

    args = make_inputs(b, 1, h, p, n, g=g, R=R, a=a, mimo_o=R != 4, dtype=dtype, device=device)
    step = {k: (v[:, 0] if k in ("x", "B", "C", "z") else v) for k, v in args.items()
            if k not in ("initial_states", "dt", "A", "trap", "angles")}
    gen = torch.Generator().manual_seed(5)
    proj = (torch.randn(b, 3 * h + a, generator=gen) * 2).to(device, dtype)  # one projection, split as the layer does
    proj[0, :3] = torch.tensor([30.0, -30.0, 1e-3])  # softplus's threshold, a tiny softplus, a tiny tanh
    dt, A, trap, ang = proj.split([h, h, h, a], dim=-1)
    angles = ang[:, None].expand(b, h, a)
    disc = Mamba3Discretization(torch.randn(h, generator=gen).to(device) - 3, 1e-2)
    state = Mamba3State(*(s.float().clone() for s in args["initial_states"]))
    state = state._replace(v=state.v.to(dtype))
    ref_state = Mamba3State(*(s.double().clone() for s in state))
    y = triton_impl.mamba3_state_update(state, **step, dt=dt, A=A, trap=trap, angles=angles, rope=rope,
                                        discretize=disc)
    d = discretize(dt.double(), A.double(), trap.double(), angles.double(),
                   Mamba3Discretization(disc.dt_bias.double(), disc.A_floor))
    y_ref = naive.mamba3_state_update(ref_state, **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                                    for k, v in step.items()},
                                      **dict(zip(("dt", "A", "trap", "angles"), (t.double() for t in d))), rope=rope)
    assert_close(y, y_ref, dtype, name="y")
    for name, a_, b_ in zip(Mamba3State._fields, state, ref_state):
        assert_close(a_, b_.to(a_.dtype), dtype, name=f"state {name}")


def test_decode_step_rejects_a_bad_discretization():
    from mamba_parallel.ops.mamba3 import Mamba3Discretization

    args = make_inputs(1, 1, 2, 8, 16, dtype=torch.float32, device=DEV)
    step = {k: v[:, 0] for k, v in args.items() if k in ("x", "dt", "A", "B", "C", "trap", "angles")}
    state = Mamba3State(*(s.float().clone() for s in args["initial_states"]))
    with pytest.raises(ValueError, match="discretize.dt_bias"):
        mamba3_state_update(state, **step, discretize=Mamba3Discretization(torch.zeros(3), 1e-4))
    with pytest.raises(ValueError, match="A_floor must be > 0"):
        mamba3_state_update(state, **step, discretize=Mamba3Discretization(torch.zeros(2), 0.0))


def test_decode_continues_a_prefill():
    """Prefill with the kernel scan, decode two tokens with the kernel step: the full scan's outputs."""
    args = make_inputs(2, 20, 2, 8, 16, dtype=torch.float32, device=DEV)
    y_all, fin_all = triton_impl.mamba3_chunk_scan(**args, chunk_size=16, return_final_states=True)
    seqwise = ("x", "dt", "A", "B", "C", "trap", "angles", "z")
    pre = {k: (v[:, :18] if k in seqwise else v) for k, v in args.items()}
    _, state = triton_impl.mamba3_chunk_scan(**pre, chunk_size=16, return_final_states=True)
    state = Mamba3State(*(s.clone() for s in state))
    for t in (18, 19):
        step = {k: (v[:, t] if k in seqwise else v) for k, v in args.items() if k != "initial_states"}
        assert_close(mamba3_state_update(state, **step), y_all[:, t], torch.float32, name=f"y[{t}]")
    for name, a, b in zip(Mamba3State._fields, state, fin_all):
        assert_close(a, b, torch.float32, name=f"state {name}")


@pytest.mark.parametrize("mk,kw", [(dict(), dict(chunk_size=32)), (dict(R=2), dict(chunk_size=32, rope="halved"))],
                         ids=["siso", "mimo"])
def test_phase_gradients_are_as_exact_as_the_others(mk, kw):
    """Turning every phase of a sequence together leaves the scores q . k unchanged: the initial phase's gradient
    is only what the initial and final states and the final phase feel, and what the phases after a chunk add to
    each earlier token's phase gradient is what the state leaving the chunk and the final states feel. Summed from
    per-token phase gradients both were differences of large terms, their fp16 rounding left over: at L = 256 the
    initial phase's error was 3.1e-3 (SISO) and 1.9e-3 (MIMO), the angles' 1.7e-3 and 1.0e-3, against a median
    of the other gradients' of 4.0e-4 and 3.8e-4; on the GPU (L = 1000) the initial phase was 6e-3 off in fp16,
    5e-2 in bf16. From the states (_init_angle_grad, the token kernel's carry): 3.9e-4 / 1.4e-4 and 7.5e-4 / 5.3e-4 (what is
    left of the angles' is the sums within a chunk)."""
    import statistics

    args = make_inputs(1, 256, 1, 16, 32, **mk, dtype=torch.float16, device=DEV, expand_angles=True)
    _, _, g = run(triton_impl.mamba3_chunk_scan, args, kw)
    _, _, g_ref = run(naive.mamba3_chunk_scan, as_double(args), kw)
    errs = {k: rel_err(g[k], g_ref[k]) for k in g_ref}
    others = statistics.median(v for k, v in errs.items() if k not in ("init.angle", "angles"))
    assert errs["init.angle"] <= 2 * others and errs["angles"] <= 2.5 * others, errs
    assert_close(g["init.angle"], g_ref["init.angle"], torch.float16, grad=True, name="dinit.angle")


# ---------------------------------------------------------------- GPU

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_realistic(dtype, nan_poison):
    args = make_inputs(2, 1000, 8, 64, 128, dtype=dtype, device="cuda", expand_angles=True)
    check_against_reference(args, dict(chunk_size=64), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_groups_halved_varlen(dtype, nan_poison):
    args = make_inputs(1, 700, 8, 64, 64, g=2, a=32, dtype=dtype, device="cuda", nstates=4)
    cu = torch.tensor([0, 100, 100, 380, 700], dtype=torch.int32, device="cuda")
    check_against_reference(args, dict(chunk_size=32, rope="halved", cu_seqlens=cu), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("R, chunk", [(4, 16), (2, 32), (4, 8)], ids=["r4c16", "r2c32", "r4c8"])
def test_gpu_mimo(dtype, R, chunk, nan_poison):
    """Mamba-3's MIMO defaults (rank 4, chunk 16: 64 rows), another 64-row tile (rank 2, chunk 32) and a 32-row one;
    headdim 64, d_state 128, halved rotary. 64-row MIMO tiles are where Triton 3.6 on an H200 miscompiles the
    backward with two blocks of 32 pairs (wrong gradients, or an out-of-bounds shared-memory read)."""
    args = make_inputs(2, 700, 8, 64, 128, R=R, dtype=dtype, device="cuda", expand_angles=True)
    check_against_reference(args, dict(chunk_size=chunk, rope="halved"), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [None, 4])
def test_gpu_inference(R, nan_poison):
    """Without gradients (the forward keeps nothing for a backward), bf16, the default chunks, with final states."""
    args = make_inputs(2, 700, 8, 64, 128, R=R, dtype=torch.bfloat16, device="cuda", expand_angles=True)
    check_inference(args, dict(chunk_size=16 if R else 64, rope="halved" if R else "interleaved"), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_seq_idx_chunk128_no_gate(nan_poison):
    args = make_inputs(2, 500, 4, 64, 128, dtype=torch.bfloat16, device="cuda", z=False, init=False)
    seq_idx = torch.zeros(2, 500, dtype=torch.int32, device="cuda")
    seq_idx[0, 130:] = 1
    seq_idx[0, 333:] = 2
    seq_idx[1, 64:] = 5
    check_against_reference(args, dict(chunk_size=128, seq_idx=seq_idx), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("R, rope", [(None, "interleaved"), (4, "halved")], ids=["siso", "mimo"])
def test_gpu_decode_step_discretizes_raw_projections(dtype, R, rope, nan_poison):
    check_raw_step(16, 32, 64, 128, 32, R, dtype, rope, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("R", [None, 4])
@pytest.mark.parametrize("launch", [None, (64, 4), (32, 4), (8, 1)], ids=["default", "one_block", "p32", "p8"])
def test_gpu_decode_step(dtype, R, launch, nan_poison, monkeypatch):
    if launch:
        monkeypatch.setattr(triton_impl, "step_launch", lambda b, H, P: launch)
    args = make_inputs(16, 1, 32, 64, 128, R=R, dtype=dtype, device="cuda")
    step = {k: (v[:, 0] if k in ("x", "dt", "A", "B", "C", "trap", "angles", "z") else v)
            for k, v in args.items() if k != "initial_states"}
    state = Mamba3State(*(s.float().clone() for s in args["initial_states"]))
    ref_state = Mamba3State(*(s.double().clone() for s in state))
    rope = "halved" if R else "interleaved"
    y = triton_impl.mamba3_state_update(state, **step, rope=rope)
    y_ref = naive.mamba3_state_update(ref_state, **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                                    for k, v in step.items()}, rope=rope)
    assert_close(y, y_ref, dtype, name="y")
    for name, a, b in zip(Mamba3State._fields, state, ref_state):
        assert_close(a, b.float(), dtype, name=f"state {name}")


def _every_candidate():
    from mamba_parallel.ops.mamba3.triton_common import tuned
    for name, entry in tuned.table.items():
        for dtype in (torch.bfloat16, torch.float32):
            for i, c in enumerate(tuned.candidates(name, dtype)):
                if dtype == torch.float32 and len(entry) <= 3:
                    continue  # one list for both widths: the bf16 run covers it
                yield pytest.param(name, dtype, i, id=f"{name}-{str(dtype)[6:]}-{i}")


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype, index", list(_every_candidate()))
def test_gpu_every_candidate_alone(name, dtype, index, monkeypatch, nan_poison):
    """Each launch candidate that autotuning may pick, run alone (the kernel's table cut to it, the others at
    their first): outputs, final states and every gradient against the reference on a partial last chunk. A
    candidate Triton miscompiles shows up here by name, not as a fault inside the autotuner's timing loop."""
    from mamba_parallel.ops import use_autotune
    from mamba_parallel.ops.mamba3.triton_common import tuned

    entry = list(tuned.table[name])
    slot = 3 if dtype == torch.float32 and len(entry) > 3 else 0
    entry[slot] = [entry[slot][index]]
    monkeypatch.setattr(tuned, "table", {**tuned.table, name: tuple(entry)})
    monkeypatch.setattr(tuned, "_cache", {})
    mimo = "_mimo" in name  # MIMO's own launch tables (chunk_bwd_mimo_dx, ...): rank 4, 64-row tiles
    args = make_inputs(1, 300, 2, 64, 128, R=4 if mimo else None, dtype=dtype, device="cuda", expand_angles=True)
    with use_autotune(False):
        check_against_reference(args, dict(chunk_size=16, rope="halved") if mimo else dict(chunk_size=64), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("autotune", [False, True], ids=["untuned", "tuned"])
def test_gpu_launches_fit_a_smaller_device(autotune, monkeypatch, nan_poison):
    """As if the GPU gave a program 100,000 bytes of shared memory (an H200 gives 232,448): the candidates that
    need more (the bf16 forward's 64-column ones, 133,892 bytes on sm_90) are skipped, compiled but never
    launched, and the rest give the right result, untuned (the first that fits) and tuned."""
    from mamba_parallel.ops import tuning, use_autotune
    from mamba_parallel.ops.mamba3.triton_common import tuned

    limit, needs = 100_000, []
    shared_of = tuning._shared_of

    def recording(kernel, nargs, kwargs):
        need = shared_of(kernel, nargs, kwargs)
        return lambda c: needs.append(need(c)) or needs[-1]

    monkeypatch.setattr(tuning, "_current_limit", lambda: limit)
    monkeypatch.setattr(tuning, "_shared_of", recording)
    monkeypatch.setattr(tuned, "_cache", {})  # fresh wrappers: none chosen under the real limit yet
    args = make_inputs(1, 300, 2, 64, 128, dtype=torch.bfloat16, device="cuda", expand_angles=True)
    with use_autotune(autotune):
        check_against_reference(args, dict(chunk_size=64), torch.bfloat16)
    assert any(n > limit for n in needs) and any(n <= limit for n in needs), needs


@pytest.fixture
def nan_empty(monkeypatch):
    """Fresh floating torch.empty allocations are NaN (on any device): a slot no program writes fails the test."""
    orig_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: orig_empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype", torch.get_default_dtype()).is_floating_point else orig_empty(*a, **k))


def test_backward_writes_every_turn_slot_whatever_block_ran_before(monkeypatch, nan_empty):
    """The dstates kernel keeps one slot per headdim block and the caller sums them all: with wider blocks than an
    earlier launch (an autotuner's trial) the slots past them must be zeroed, not left to the trial. Fresh
    allocations are NaN here, so a slot no program writes fails the gradients."""
    from mamba_parallel.ops.mamba3.triton_common import _c, tuned

    entry = list(tuned.table["dstates"])
    entry[1] = _c(1, 1, BLOCK_P=32)  # two blocks of headdim 64: slots 3 and 4 (of 16 columns) not its own
    monkeypatch.setattr(tuned, "table", {**tuned.table, "dstates": tuple(entry)})
    monkeypatch.setattr(tuned, "_cache", {})
    launches = tuned.launches  # as if a GPU candidate of 16 columns could have run before: four slots
    monkeypatch.setattr(tuned, "launches", lambda name, dtype=None: [entry[1], _c(1, 1, BLOCK_P=16)]
                        if name == "dstates" else launches(name, dtype))
    args = make_inputs(1, 37, 1, 64, 32, a=6, init=False)
    check_against_reference(args, dict(chunk_size=16), torch.float32)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_backward_sums_only_the_decay_slots_its_launch_wrote(split, monkeypatch, nan_empty):
    """chunk_bwd's dq / dk part leaves its share of the decay's gradient in one slot per program: one slot when a
    program walks every column block, one per block when split. Two blocks of 16 pairs here (d_state 64), fresh
    allocations NaN: a slot neither written nor zeroed fails the gradients. The other form could have run before,
    so the slots are counted for the split one."""
    from mamba_parallel.ops.mamba3.triton_common import _c, tuned

    entry = list(tuned.table["chunk_bwd_dqk"])
    entry[1] = _c(1, 1, BJ=16, SPLIT=split)
    monkeypatch.setattr(tuned, "table", {**tuned.table, "chunk_bwd_dqk": tuple(entry)})
    monkeypatch.setattr(tuned, "_cache", {})
    launches = tuned.launches
    monkeypatch.setattr(tuned, "launches", lambda name, dtype=None: [entry[1], _c(1, 1, BJ=16, SPLIT=not split)]
                        if name == "chunk_bwd_dqk" else launches(name, dtype))
    args = make_inputs(1, 37, 1, 64, 64, init=False)
    check_against_reference(args, dict(chunk_size=16), torch.float32)


def test_large_chunk_sizes_are_split_into_kernel_chunks():
    """chunk_size 128 (or MIMO 64 x rank 4) is more rows than one tile: the kernels split it, same result."""
    args = make_inputs(1, 70, 2, 8, 16, dtype=torch.float32, device=DEV, init=False)
    assert_close(triton_impl.mamba3_chunk_scan(**args, chunk_size=128),
                 naive.mamba3_chunk_scan(**as_double(args), chunk_size=128), torch.float32, name="y")


# ---------------------------------------------------------------- out-of-bounds accesses (CPU)

GUARD = 256  # NaN elements before and after every guarded tensor


def _in_nan_frame(t):
    """t copied into the middle of a NaN-filled buffer, same shape and strides: a read past it reads NaN."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    buf = torch.full((span + 2 * GUARD,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf.as_strided(t.shape, t.stride(), GUARD)
    view.copy_(t)
    return view, buf


@pytest.fixture
def guarded_allocations(monkeypatch):
    """Fresh floating tensors (torch.empty / empty_like, as the kernels' wrappers allocate) become NaN-filled views
    into buffers with NaN margins: a kernel reading memory it never wrote, or past a tensor, gets NaN; ``check()``
    asserts no margin was written."""
    orig_empty, orig_empty_like = torch.empty, torch.empty_like
    frames = []

    def framed(shape, dtype, device):
        numel = 1
        for s in shape:
            numel *= s
        buf = torch.full((numel + 2 * GUARD,), float("nan"), dtype=dtype, device=device)
        frames.append(buf)
        return buf[GUARD:GUARD + numel].view(shape)

    def empty(*size, dtype=None, device=None, **k):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
        dtype = dtype or torch.get_default_dtype()
        if k or not dtype.is_floating_point:
            return orig_empty(*size, dtype=dtype, device=device, **k)
        return framed(shape, dtype, device)

    def empty_like(t, dtype=None, device=None, **k):
        dtype = dtype or t.dtype
        if k or not dtype.is_floating_point or not t.is_contiguous():
            return orig_empty_like(t, dtype=dtype, device=device, **k)
        return framed(tuple(t.shape), dtype, device or t.device)

    def check():
        for buf in frames:
            assert torch.isnan(buf[:GUARD]).all() and torch.isnan(buf[-GUARD:]).all(), \
                f"a kernel wrote past a tensor of {buf.numel() - 2 * GUARD} elements"

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield check


@pytest.mark.parametrize("shape,chunk", [((2, 32, 3, 16, 32, 1), 16), ((2, 16, 3, 16, 32, 2), 8)],
                         ids=["siso", "mimo"])
def test_bench_arguments_stay_in_bounds(shape, chunk, guarded_allocations):
    """The benchmark's argument set (bench_mamba3.scan_inputs through peer_mamba3.ours_scan: fp32 dt / A / trap,
    head-shared angles as a stride-0 view, D, biases, the gate, no initial states, no final states) at a length
    that is a whole number of chunks, with a head count that is not a power of two. Every input is a view into a
    NaN-margined buffer and every kernel output is NaN until written: a stray read shows up as a non-finite
    output or gradient, a stray write in a margin."""
    from mamba_parallel.bench.bench_mamba3 import grad_names, scan_inputs
    from mamba_parallel.bench.peer_mamba3 import ours_scan

    raw = scan_inputs(*shape, torch.float16, "cpu", chunk=chunk)
    names = grad_names(raw)
    ours, ref, keep = {}, {}, []
    for k, v in raw.items():
        if isinstance(v, torch.Tensor):
            framed, buf = _in_nan_frame(v)
            keep.append(buf)
            ours[k] = framed.requires_grad_(k in names)
            ref[k] = v.double().requires_grad_(k in names)
        else:
            ours[k] = ref[k] = v
    y = ours_scan(**ours, op=triton_impl.mamba3_chunk_scan)
    y_ref = ours_scan(**ref, op=naive.mamba3_chunk_scan)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g = torch.autograd.grad(y, [ours[k] for k in names], dy.to(y.dtype))
    g_ref = torch.autograd.grad(y_ref, [ref[k] for k in names], dy)
    guarded_allocations()
    assert_close(y, y_ref, torch.float16, name="y")
    for k, a, b in zip(names, g, g_ref):
        assert_close(a, b, torch.float16, grad=True, name=f"d{k}")
    for buf in keep:  # nothing wrote into an input's margins either
        assert torch.isnan(buf[:GUARD]).all() and torch.isnan(buf[-GUARD:]).all()
