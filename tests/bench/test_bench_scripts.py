"""The benchmark scripts: scaling commands and table / plot writer, generation benchmark on CPU, the report, and
CUDA-graph decode (GPU only). No test asserts a timing."""

import json
import shlex

import pytest
import torch

from mamba_parallel.bench import bench_generate, bench_scaling, report


# ---- bench_scaling ------------------------------------------------------------------------------------------------
def test_parse_layout():
    assert bench_scaling.parse_layout("1gpu") == (1, 1)
    assert bench_scaling.parse_layout("dp8") == (8, 1)
    assert bench_scaling.parse_layout("tp4") == (1, 4)
    assert bench_scaling.parse_layout("dp4xtp2") == (4, 2)
    for bad in ("", "x", "dp", "pp2", "dp2-tp2"):
        with pytest.raises(ValueError, match="--layouts"):
            bench_scaling.parse_layout(bad)


def test_scaling_dry_run_commands(capsys):
    bench_scaling.main(["--dry-run", "--gpus", "2", "--models", "mamba2-1.3b", "mamba-2.8b", "--global-batch", "16",
                        "--out", "unused"])
    lines = capsys.readouterr().out.splitlines()
    cmds = [shlex.split(x) for x in lines if not x.startswith("#")]
    skipped = [x for x in lines if x.startswith("# skip")]
    assert len(cmds) == 2 * 3 and len(skipped) == 2 * 5  # 1gpu, dp2, tp2 fit on 2 GPUs; 5 layouts need more
    assert any("dp4xtp2: needs 8 GPUs" in x for x in skipped)
    for cmd in cmds:
        assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
        assert cmd[4].startswith("--nproc_per_node=")
        assert cmd[cmd.index("-m", 2) + 1] == "mamba_parallel.bench.bench_train"
        flags = dict(zip(cmd, cmd[1:]))  # each flag -> its value
        nproc = int(cmd[4].split("=")[1])
        tp = int(flags["--tp"])
        dp = nproc // tp
        assert flags["--seq-len"] == "2048" and flags["--preset"] in ("mamba2-1.3b", "mamba-2.8b")
        assert int(flags["--batch-size"]) * dp == 16  # the global batch is split over data-parallel ranks
        assert flags["--json"].endswith(".json")
    assert sorted(int(c[4].split("=")[1]) for c in cmds) == [1, 1, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="--global-batch 3"):
        bench_scaling.main(["--dry-run", "--gpus", "2", "--global-batch", "3", "--layouts", "dp2"])


def _fake_scaling(tps_1, tps_dp2, device="H200"):
    rows = [dict(model="mamba2-1.3b", layout="1gpu", dp=1, tp=1, gpus=1, status="ok", tokens_per_s=tps_1,
                 tokens_per_s_per_gpu=tps_1, peak_gib_per_gpu=50.0),
            dict(model="mamba2-1.3b", layout="dp2", dp=2, tp=1, gpus=2, status="ok", tokens_per_s=tps_dp2,
                 tokens_per_s_per_gpu=tps_dp2 / 2, peak_gib_per_gpu=51.0),
            dict(model="mamba2-1.3b", layout="tp2", dp=1, tp=2, gpus=2, status="failed", error="exit 1: boom"),
            dict(model="mamba2-1.3b", layout="dp4", dp=4, tp=1, gpus=4, status="skipped (needs 4 GPUs)")]
    return dict(bench="scaling", device=device, gpus_available=2, rows=rows,
                settings=dict(seq_len=2048, steps=10, dp_mode="fsdp", batch_desc="8 sequences per rank"))


def test_scaling_table_and_plot(tmp_path):
    res = _fake_scaling(40000.0, 76000.0)
    bench_scaling.write_outputs(res, str(tmp_path))
    md = (tmp_path / "scaling.md").read_text()
    assert "| mamba2-1.3b | dp2 | 2 | 76,000 | 38,000 | 51.0 | 1.90x | 95.0% | >= 1.94x |" in md
    assert "| mamba2-1.3b | 1gpu | 1 | 40,000 | 40,000 | 50.0 | 1.00x | 100.0% |  |" in md
    assert "Not run (need more GPUs than available): mamba2-1.3b dp4" in md
    assert "Failed: mamba2-1.3b tp2: exit 1: boom" in md
    rows = {r["layout"]: r for r in json.loads((tmp_path / "scaling.json").read_text())["rows"]}
    assert rows["dp2"]["speedup"] == pytest.approx(1.9) and rows["dp2"]["efficiency"] == pytest.approx(0.95)
    assert rows["tp2"]["speedup"] is None and rows["dp4"]["goal_speedup"] == 3.85
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "scaling.png").exists()
    else:
        assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scaling_merge_from_json(tmp_path, capsys):
    one, two = _fake_scaling(40000.0, 70000.0, "A"), _fake_scaling(40000.0, 78000.0, "B")
    two["rows"][2] = dict(two["rows"][2], status="ok", tokens_per_s=60000.0, tokens_per_s_per_gpu=30000.0)
    (tmp_path / "a.json").write_text(json.dumps(one))
    (tmp_path / "b.json").write_text(json.dumps(two))
    bench_scaling.main(["--from-json", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                        "--out", str(tmp_path / "merged")])
    merged = json.loads((tmp_path / "merged" / "scaling.json").read_text())
    rows = {r["layout"]: r for r in merged["rows"]}
    assert rows["dp2"]["tokens_per_s"] == 78000.0 and rows["tp2"]["speedup"] == pytest.approx(1.5)
    assert merged["device"] == "A, B" and "| tp2 | 2 | 60,000 |" in capsys.readouterr().out


# ---- bench_generate -----------------------------------------------------------------------------------------------
def test_bench_generate_cpu_json(tmp_path):
    path = tmp_path / "gen.json"
    bench_generate.main(["--models", "tiny-mamba2", "--batch-sizes", "1", "2", "--prompt-len", "4", "--gen-len",
                         "3", "--dtype", "fp32", "--device", "cpu", "--repeats", "1", "--json", str(path)])
    res = json.loads(path.read_text())
    assert res["bench"] == "generate" and res["device"] == "cpu"
    assert [(r["model"], r["batch"], r["mode"]) for r in res["rows"]] == [("tiny-mamba2", 1, "eager"),
                                                                          ("tiny-mamba2", 2, "eager")]
    for r in res["rows"]:
        assert r["generate_match"] is True  # the benchmark loop decodes exactly what model.generate does
        assert r["prefill_ms"] > 0 and r["decode_ms_per_step"] > 0
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["decode_ms_per_step"])
        assert r["total_ms"] >= r["prefill_ms"]
    with pytest.raises(ValueError, match="--modes graph needs a CUDA device"):
        bench_generate.run_benchmark(["tiny-mamba2"], [1], ["graph"], device="cpu")


def test_graphed_decoder_refuses_cpu_and_hybrid():
    from mamba_parallel.config import get_preset
    from mamba_parallel.inference.cuda_graph import GraphedDecoder, decode_runner
    from mamba_parallel.models.lm import MambaLMHeadModel

    model = MambaLMHeadModel(get_preset("tiny-mamba2"))
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedDecoder(model, 1, 8)
    run, cache = decode_runner(model, 2, 8)  # eager: the model itself and a fresh cache
    assert run is model and cache.max_batch_size == 2 and cache.seqlen_offset == 0
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="attention"):
            GraphedDecoder(MambaLMHeadModel(get_preset("tiny-hybrid"), device="cuda"), 1, 8)


# ---- report -------------------------------------------------------------------------------------------------------
def _write_fake_results(d):
    ssd = dict(device="H200", rows=[dict(impl="triton", shape=dict(b=8, L=4096, h=64, p=64, n=128, g=1),
                                         fwd_ms=0.72, fwd_bwd_ms=5.8)])
    scan = dict(device="H200", scan=[dict(shape="b8 d4096 L4096 n16", config="default", fwd_ms=4.88,
                                          fwd_bwd_ms=12.25)], decode=[], sweep_errors={})
    ops = dict(device="H200", rows=[dict(op="rms_norm", shape="16384x2560", impl="triton", fwd_ms=0.1,
                                         fwd_bwd_ms=0.3, fwd_bwd_bw_frac=0.5),
                                    dict(op="rms_norm", shape="16384x2560", impl="naive", fwd_ms=0.4,
                                         fwd_bwd_ms=0.9, fwd_bwd_bw_frac=0.2)])
    train = dict(bench="train", preset="mamba2-1.3b", device="H200", world_size=1, tokens_per_s=42188 * 1.1,
                 peak_mem_gib=40.0, batch_per_dp_rank=8, seq_len=2048, mfu=0.4)
    gen = dict(bench="generate", device="H200", rows=[
        dict(model="mamba2-130m", batch=1, mode="graph", prefill_ms=3.0, decode_ms_per_step=0.355,
             decode_tokens_per_s=2817.0),
        dict(model="mamba2-130m", batch=1, mode="eager", prefill_ms=3.0, decode_ms_per_step=2.0,
             decode_tokens_per_s=500.0)])
    for name, obj in dict(ssd=ssd, scan=scan, ops=ops, gen=gen, scaling=_fake_scaling(40000.0, 76000.0)).items():
        (d / f"{name}.json").write_text(json.dumps(obj))
    (d / "train.json").write_text(json.dumps(train) + "\n")  # bench_train writes one JSON line
    long = [dict(bench="long_context", preset="mamba2-1.3b", seq_len=s, cp=2, world_size=2, oom=s > 131072,
                 activation_checkpointing=True, tokens_per_s=20000.0, peak_gib_per_gpu=70.0) for s in (131072, 262144)]
    (d / "long.json").write_text("".join(json.dumps(r) + "\n" for r in long))  # appended JSON lines
    (d / "other.json").write_text(json.dumps({"something": 1}))


def test_report_on_fake_results(tmp_path, capsys):
    _write_fake_results(tmp_path)
    out = tmp_path / "report.md"
    report.main([str(tmp_path), "--out", str(out)])
    text = out.read_text()
    assert text.strip() == capsys.readouterr().out.strip()
    assert "| SSD chunk scan (triton) | b8 L4096 h64 p64 n128 g1 | 0.72 | 1.44 | 2.00x | 5.80 | 5.80 | 1.00x |" in text
    assert "| selective scan | b8 d4096 L4096 n16 | 4.88 | 2.44 | 0.50x |" in text
    assert "| rms_norm | 16384x2560 | triton | 0.10 | 0.30 | 50% | 3.00x |" in text
    assert "| mamba2-1.3b | 8 | 2048 | 46,407 | 42,188 | 1.10x | 40.00 | 57.40 | 0.40 |" in text
    assert "| mamba2-1.3b | dp2 | 2 | 76,000 | 38,000 | 51.00 | 1.90x | 1.94x | >= 1.94x |" in text
    assert "| mamba2-1.3b | dp4 | 4 | skipped (needs 4 GPUs) |" in text
    assert "| mamba2-130m | 1 | graph | 3.00 | 0.35 | 2,817 | 0.71 | 2.00x |" in text
    assert "| mamba2-1.3b | 131072 | 2 | 2 | yes | 20,000 | 70.00 | 32,768 (129.0 GiB, 1 GPU) |" in text
    assert "| mamba2-1.3b | 262144 | 2 | 2 | yes | out of memory |" in text
    assert "Not recognised (skipped): " in text and "other.json" in text


def test_report_reads_anchors_file(tmp_path):
    _write_fake_results(tmp_path)
    anchors = tmp_path / "ANCHORS.md"
    anchors.write_text("## Generation\n\n| model | batch 1: ms/step (tok/s) | batch 64: ms/step (tok/s) |\n"
                       "|---|---|---|\n| mamba2-130m | 1.42 (704) | 2.00 (32,000) |\n\n"
                       "| model (d_model / layers) | tokens/s | peak GiB |\n|---|---|---|\n"
                       "| mamba2-1.3b (2048 / 48) | 46,407 | 80.0 |\n")
    parsed = report.parse_anchors(anchors.read_text())
    assert parsed["generate"]["mamba2-130m"] == {1: 1.42, 64: 2.0}
    assert parsed["train"]["mamba2-1.3b"] == (46407.0, 80.0)
    assert parsed["ssd"] == report.ANCHORS["ssd"]  # tables the file lacks keep the built-in figures
    text = report.build_report(report.load_results([str(tmp_path)]), parsed)
    assert "| mamba2-130m | 1 | graph | 3.00 | 0.35 | 2,817 | 1.42 | 4.00x |" in text
    assert "| 46,407 | 46,407 | 1.00x |" in text


# ---- CUDA-graph decode --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("preset,dtype", [("tiny-mamba2", torch.float32), ("tiny-mamba", torch.float32),
                                          ("mamba2-130m", torch.bfloat16)])
def test_graph_decode_matches_eager(preset, dtype):
    from mamba_parallel.inference.cuda_graph import decode_runner, make_graphed_decoder, release_graphs

    model = bench_generate.build_model(preset, torch.device("cuda"), dtype)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (3, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    clock = bench_generate._Clock(torch.device("cuda"))
    with torch.inference_mode():
        run, cache = decode_runner(model, 3, 48)
        eager, _, _ = bench_generate.greedy_loop(run, cache, prompt, 32, vocab, clock)
        for _ in range(2):  # the second generation reuses the captured graph and its zeroed static cache
            run, cache = decode_runner(model, 3, 48, cuda_graph=True)
            graphed, _, _ = bench_generate.greedy_loop(run, cache, prompt, 32, vocab, clock)
            assert torch.equal(graphed, eager)
        assert make_graphed_decoder(model, 3, 48) is run
        # logits of one replayed step equal the eager step's from the same states
        run.new_cache()
        eager_cache = model.allocate_inference_cache(3, 48)
        for r, c in ((run, run.cache), (model, eager_cache)):
            r(prompt, inference_params=c, num_last_tokens=1)
            c.seqlen_offset = prompt.shape[1]
        step_g = run(prompt[:, -1:], inference_params=run.cache).logits.float()
        step_e = model(prompt[:, -1:], inference_params=eager_cache).logits.float()
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert ((step_g - step_e).norm() / step_e.norm()).item() < tol
    release_graphs(model)
