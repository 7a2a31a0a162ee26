"""profile_train: kernel-name categories, the summary arithmetic, and a CPU run of a tiny preset end to end."""

import json

import pytest

from mamba_parallel.bench import profile_train
from mamba_parallel.bench.profile_train import CATEGORIES, categorize, summarize
from mamba_parallel.ops.layout.triton_impl import gate_fwd_kernel
from mamba_parallel.ops.selective_scan.triton_bwd import selective_scan_bwd_kernel
from mamba_parallel.ops.selective_scan.triton_bwd_carry import adjoint_carry_kernel
from mamba_parallel.ops.selective_scan.triton_finish import finish_bwd_kernel
from mamba_parallel.ops.selective_scan.triton_fwd import selective_scan_fwd_kernel


@pytest.mark.parametrize("name, cat", [
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("aten::mm", "matmul"),
    ("_scan_fwd_kernel", "ssd"), ("_dt_bwd_kernel", "ssd"), ("_intra_kernel", "ssd"), ("_chunk_states_kernel", "ssd"),
    (selective_scan_fwd_kernel.fn.__name__, "selective_scan"),  # the Mamba-1 scan kernels as they are named now
    (selective_scan_bwd_kernel.fn.__name__, "selective_scan"),
    # its backward's carry pass and finishing sums, and the Mamba-1 gate that mamba_ssm's scan does inside
    (adjoint_carry_kernel.fn.__name__, "selective_scan"), (finish_bwd_kernel.fn.__name__, "selective_scan"),
    (gate_fwd_kernel.fn.__name__, "selective_scan"), ("_gate_bwd_kernel", "ssd"),
    ("conv1d_fwd_kernel", "conv"), ("conv1d_bwd_kernel", "conv"),
    ("norm_fwd_kernel", "norm"), ("norm_bwd_dx_kernel", "norm"),
    # the peer's (mamba_ssm + causal-conv1d) kernels, so that its step's table is by the same categories
    *[(name, "ssd") for name in (
        "_chunk_cumsum_fwd_kernel", "_chunk_state_fwd_kernel", "_state_passing_fwd_kernel", "_chunk_scan_fwd_kernel",
        "_bmm_chunk_fwd_kernel", "_chunk_scan_chunk_state_bwd_dx_kernel", "_chunk_scan_bwd_dstates_kernel",
        "_chunk_scan_bwd_dC_kernel", "_chunk_scan_bwd_dc_kernel", "_chunk_state_bwd_db_kernel",
        "_chunk_state_bwd_ddAcs_stable_kernel", "_chunk_scan_bwd_ddAcs_stable_kernel", "_state_passing_bwd_kernel",
        "_chunk_cumsum_bwd_kernel", "_bmm_chunk_bwd_kernel")],
    ("_layer_norm_fwd_1pass_kernel", "norm"), ("_layer_norm_bwd_kernel", "norm"),
    ("void causal_conv1d_fwd_kernel<Causal_conv1d_fwd_kernel_traits<128, 4, true, c10::BFloat16>>", "conv"),
    ("causal_conv1d_bwd_kernel", "conv"), ("causal_conv1d_channellast_fwd_kernel", "conv"),
    ("causal_conv1d_channellast_bwd_kernel", "conv"),
    ("void selective_scan_fwd_kernel<Selective_Scan_fwd_kernel_traits<32, 16, 1, true>>", "selective_scan"),
    ("selective_scan_bwd_kernel", "selective_scan"),
    ("ce_chunk_kernel", "cross_entropy"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BFloat16Copy>", "copy/cast/elementwise"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", "copy/cast/elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copy/cast/elementwise"),
    ("some_unknown_thing", "other"),
])
def test_categorize(name, cat):
    assert categorize(name) == cat


def test_summarize_shares_and_per_step():
    per_name = {"nvjet_gemm": [100.0, 300.0], "_scan_fwd_kernel": [200.0, 200.0], "elementwise_kernel": [100.0] * 4}
    s = summarize(per_name, busy_us=900.0, steps=2, top=2)
    assert s["kernel_ms_per_step"] == pytest.approx(0.6)
    assert s["busy_ms_per_step"] == pytest.approx(0.45)
    assert s["launches_per_step"] == 4.0
    cats = {c["category"]: c for c in s["categories"]}
    assert set(cats) == set(CATEGORIES)
    assert cats["matmul"]["share"] == pytest.approx(400 / 1200, abs=1e-4)
    assert cats["ssd"]["ms_per_step"] == pytest.approx(0.2)
    assert cats["copy/cast/elementwise"]["launches_per_step"] == 2
    assert [k["name"] for k in s["top_kernels"]] == ["nvjet_gemm", "_scan_fwd_kernel"]  # ties keep insertion order
    assert s["top_kernels"][0]["avg_us"] == 200.0 and s["top_kernels"][0]["calls_per_step"] == 1


def test_union_of_intervals():
    assert profile_train._union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def test_cpu_run_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    out = tmp_path / "prof"
    assert profile_train.main(["--preset", "tiny-mamba", "--seq-len", "16", "--batch-size", "2", "--steps", "1",
                               "--warmup-steps", "1", "--dtype", "fp32", "--device", "cpu", "--top", "10",
                               "--out", str(out)]) == 0
    r = json.loads((out / "profile.json").read_text())
    assert r["device"] == "cpu" and r["preset"] == "tiny-mamba" and r["profiled_steps"] == 1
    assert r["launches_per_step"] > 0 and r["step_ms"] > 0 and r["kernel_ms_per_step"] > 0
    assert len(r["top_kernels"]) == 10
    assert sum(c["share"] for c in r["categories"]) == pytest.approx(1.0, abs=1e-3)
    cats = {c["category"]: c for c in r["categories"]}
    assert cats["matmul"]["launches_per_step"] > 0 and cats["optimizer"]["launches_per_step"] > 0
    md = (out / "profile.md").read_text()
    assert "| matmul |" in md and "Top 10" in md
    # the table lists the JSON's top kernels (which ops rank there depends on the machine's timings)
    assert all(f"`{k['name']}`" in md for k in r["top_kernels"])
    assert not (out / "trace.json").exists()


def test_cpu_run_beside_the_peer(tmp_path, monkeypatch):
    """--peer (here the reference stand-in, which runs on CPU) profiles the peer's step after ours, on the same
    batch: its summary under "peer" in profile.json, and a "Beside the peer" section in profile.md."""
    monkeypatch.setenv("MAMBA_PARALLEL_BACKEND", "naive")
    out = tmp_path / "prof"
    assert profile_train.main(["--preset", "tiny-mamba", "--seq-len", "16", "--batch-size", "2", "--steps", "1",
                               "--warmup-steps", "1", "--dtype", "fp32", "--device", "cpu", "--top", "5",
                               "--peer", "--peer-impl", "reference", "--out", str(out)]) == 0
    r = json.loads((out / "profile.json").read_text())
    assert r["step_ms"] > 0 and r["grad_clip"] == 0.0
    p = r["peer"]
    assert p["name"] == "reference" and "reference" in p["versions"]
    assert p["step_ms"] > 0 and p["host_ms"] > 0 and p["launches_per_step"] > 0 and len(p["top_kernels"]) == 5
    assert p["final_loss"] > 0 and p["verdict"]
    cats = {c["category"]: c for c in p["categories"]}
    assert set(cats) == set(CATEGORIES) and cats["matmul"]["ms_per_step"] > 0
    md = (out / "profile.md").read_text()
    assert "Beside the peer: reference" in md and "| category | ours ms / step | peer ms / step | ours - peer |" in md
    assert "No gradient clipping" in md and "The peer's top 5" in md


@pytest.mark.parametrize("flags, named", [(["--tp", "2"], "--tp"), (["--compile"], "--compile"),
                                          (["--recompute", "none"], "--recompute")])
def test_peer_refuses_what_only_ours_has(tmp_path, flags, named):
    """--peer with an option the peer's step cannot match stops before any work, naming the option."""
    with pytest.raises(SystemExit, match=f"--peer .*without {named}"):
        profile_train.main(["--preset", "tiny-mamba", "--device", "cpu", "--peer", "--peer-impl", "reference",
                            "--out", str(tmp_path), *flags])
    assert not any(tmp_path.iterdir())


@pytest.mark.gpu
def test_cuda_run_finds_our_kernels(tmp_path):
    """On a GPU the Chrome trace is parsed: our SSD / conv / norm / cross-entropy kernels and the matmuls appear."""
    out = tmp_path / "prof"
    profile_train.main(["--preset", "tiny-mamba2", "--seq-len", "256", "--batch-size", "2", "--steps", "2",
                        "--warmup-steps", "2", "--out", str(out), "--trace"])
    r = json.loads((out / "profile.json").read_text())
    assert r["device"] != "cpu" and (out / "trace.json").exists()
    cats = {c["category"]: c for c in r["categories"]}
    for cat in ("matmul", "ssd", "conv", "norm", "cross_entropy", "optimizer"):
        assert cats[cat]["launches_per_step"] > 0, cat
    assert 0 < r["busy_ms_per_step"] <= r["kernel_ms_per_step"] + 1e-6
    assert 0 < r["busy_fraction"] <= 1 and r["verdict"]


def test_recompute_flag_applies_to_the_profiled_run(monkeypatch, tmp_path):
    """--recompute (inherited from bench_train's parser) reaches the layers of the profiled model."""
    from mamba_parallel.bench import profile_train
    from mamba_parallel.train import trainer

    seen, build = [], trainer.build_parallel_model

    def built(*args, **kwargs):
        model = build(*args, **kwargs)[1]
        seen.append({block.mixer.recompute for block in model.backbone.layers})
        raise SystemExit(0)  # the model is what this test is about: stop before profiling it

    monkeypatch.setattr(trainer, "build_parallel_model", built)
    with pytest.raises(SystemExit):
        profile_train.main(["--preset", "tiny-mamba2", "--device", "cpu", "--recompute", "conv,gate",
                            "--out", str(tmp_path)])
    assert seen == [{frozenset({"conv", "gate"})}]
