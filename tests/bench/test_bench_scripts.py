"""bench_scaling: layouts (pipeline ones, several dp modes), commands, table / plot writer, merging; the textbook
bubble, loss_match; CUDA-graph decode (GPU only); tools/recompute_trade.sh. The side-by-side benchmarks and the
report: test_side_by_side.py; tools/two_gpu.sh: test_two_gpu_script.py. No test asserts a timing."""

import json
import shlex
import sys

import pytest
import torch

from mamba_parallel.bench import bench_scaling


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
    assert "| mamba2-1.3b | dp2 | 2 | 76,000 | 38,000 | 51.0 | 1.90x | 95.0% |" in md
    assert "| mamba2-1.3b | 1gpu | 1 | 40,000 | 40,000 | 50.0 | 1.00x | 100.0% |" in md
    assert "Not run (need more GPUs than available): mamba2-1.3b dp4" in md
    assert "Failed: mamba2-1.3b tp2: exit 1: boom" in md
    rows = {r["layout"]: r for r in json.loads((tmp_path / "scaling.json").read_text())["rows"]}
    assert rows["dp2"]["speedup"] == pytest.approx(1.9) and rows["dp2"]["efficiency"] == pytest.approx(0.95)
    assert rows["tp2"]["speedup"] is None and rows["dp4"]["speedup"] is None
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


# ---- CUDA-graph decode ----------------------------------------------------------------------------------------
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


def _greedy(run, cache, prompt, gen_len, vocab):
    """prompt (b, L) -> (b, gen_len) greedy tokens through ``run`` (the model or a graphed decoder)."""
    logits = run(prompt, inference_params=cache, num_last_tokens=1).logits[:, -1, :vocab]
    cache.seqlen_offset = prompt.shape[1]
    tokens = [logits.argmax(dim=-1)]
    for _ in range(gen_len - 1):
        logits = run(tokens[-1][:, None], inference_params=cache).logits[:, -1, :vocab]
        cache.seqlen_offset += 1
        tokens.append(logits.argmax(dim=-1))
    return torch.stack(tokens, dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,dtype", [("tiny-mamba2", torch.float32), ("tiny-mamba", torch.float32),
                                          ("mamba2-130m", torch.bfloat16)])
def test_graph_decode_matches_eager(preset, dtype):
    from mamba_parallel.config import get_preset
    from mamba_parallel.inference.cuda_graph import decode_runner, make_graphed_decoder, release_graphs
    from mamba_parallel.models.lm import MambaLMHeadModel

    torch.manual_seed(0)
    model = MambaLMHeadModel(get_preset(preset), device="cuda", dtype=dtype).eval()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (3, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.inference_mode():
        run, cache = decode_runner(model, 3, 48)
        eager = _greedy(run, cache, prompt, 32, vocab)
        for _ in range(2):  # the second generation reuses the captured graph and its zeroed static cache
            run, cache = decode_runner(model, 3, 48, cuda_graph=True)
            graphed = _greedy(run, cache, prompt, 32, vocab)
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


# ---- pipeline layouts and several dp modes in the scaling table --------------------------------------------------
def test_pipeline_layouts_and_dp_modes_plan():
    assert bench_scaling.parse_pipeline_layout("pp2") == (2, "1f1b")
    assert bench_scaling.parse_pipeline_layout("pp4-interleaved-1f1b") == (4, "interleaved-1f1b")
    assert bench_scaling.parse_pipeline_layout("pp2", "zbv") == (2, "zbv")
    assert bench_scaling.parse_pipeline_layout("dp2") is None
    for bad, why in (("pp1", "at least 2"), ("pp2-2f2b", "schedule must be one of")):
        with pytest.raises(ValueError, match=why):
            bench_scaling.parse_pipeline_layout(bad)
    plan = bench_scaling.plan(["m"], ["1gpu", "dp2", "tp2", "pp2-gpipe"], 2, dp_modes=("fsdp", "ddp"))
    assert [(e["layout"], e["dp_mode"], e["gpus"]) for e in plan] == [
        ("1gpu", "fsdp", 1), ("dp2-fsdp", "fsdp", 2), ("dp2-ddp", "ddp", 2), ("tp2", "fsdp", 2),
        ("pp2-gpipe", "fsdp", 2)]
    assert plan[-1]["pp"] == 2 and plan[-1]["schedule"] == "gpipe" and "schedule" not in plan[0]
    with pytest.raises(ValueError, match="--microbatches 3 does not divide the 8 sequences of a pp2 step"):
        bench_scaling.micro_batch("pp2", 8, 3)


def test_scaling_dry_run_pipeline_and_dp_modes(capsys):
    from mamba_parallel.bench import bench_pipeline, bench_train

    bench_scaling.main(["--dry-run", "--gpus", "2", "--models", "mamba2-2.7b", "--layouts", "1gpu", "dp2", "pp2-zbv",
                        "--dp-mode", "fsdp", "ddp", "--global-batch", "8", "--microbatches", "4", "--out", "unused"])
    cmds = [shlex.split(x) for x in capsys.readouterr().out.splitlines() if x and not x.startswith("#")]
    assert len(cmds) == 4
    modules = [c[c.index("-m", 2) + 1] for c in cmds]
    assert modules == ["mamba_parallel.bench.bench_train"] * 3 + ["mamba_parallel.bench.bench_pipeline"]
    trains = [bench_train.build_parser().parse_args(c[c.index("-m", 2) + 2:]) for c in cmds[:3]]
    assert [(t.dp_mode, t.batch_size) for t in trains] == [("fsdp", 8), ("fsdp", 4), ("ddp", 4)]
    pipe = bench_pipeline.build_parser().parse_args(cmds[3][cmds[3].index("-m", 2) + 2:])
    assert (pipe.pp, pipe.schedule, pipe.microbatches, pipe.batch_size) == (2, "zbv", 4, 2)
    assert cmds[3][4] == "--nproc_per_node=2"


def test_scaling_reads_pipeline_runs_and_names_the_error(tmp_path):
    entry = dict(model="m", layout="pp2", dp=1, tp=1, pp=2, gpus=2, schedule="1f1b")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-c", "import json, sys; json.dump({'tokens_per_s': 1000.0, 'step_s': 0.5, "
           "'peak_mem_gib': 3.0, 'bubble_fraction_mean': 0.2, 'bubble_fraction_max': 0.25, "
           "'bubble_fraction_theory': 0.1111, 'microbatches': 8}, open(sys.argv[1], 'w'), indent=2)", str(out)]
    row = bench_scaling.run_one(entry, cmd, str(out), str(tmp_path / "r.log"), 60)
    assert row["status"] == "ok" and row["tokens_per_s_per_gpu"] == 500.0 and row["step_ms"] == 500.0
    assert (row["bubble_mean"], row["bubble_max"], row["microbatches"]) == (0.2, 0.25, 8)
    base = dict(entry, layout="1gpu", pp=1, gpus=1, status="ok", tokens_per_s=600.0, tokens_per_s_per_gpu=600.0)
    res = dict(bench="scaling", rows=bench_scaling.add_efficiency([base, row]),
               settings=dict(seq_len=2048, microbatches=8))
    md = bench_scaling.markdown_table(res)
    assert "| m | pp2 | 1f1b | 8 | 20.0% | 25.0% | 11.1% |" in md and "8 micro-batches per pipeline step" in md
    assert row["speedup"] == pytest.approx(1000 / 600)
    log = ("Traceback (most recent call last):\n[rank0]: mamba_parallel.config.ConfigError: --pp 2: pp=2 needs at "
           "least 4 layers\n  raise ChildFailedError(\ntorch.distributed.elastic.multiprocessing.errors."
           "ChildFailedError: \nmore torchrun noise\n")
    assert bench_scaling.failure_reason(log) == "[rank0]: mamba_parallel.config.ConfigError: --pp 2: pp=2 needs " \
                                                "at least 4 layers"


def test_textbook_bubble():
    from mamba_parallel.bench.bench_pipeline import textbook_bubble

    assert textbook_bubble("1f1b", 2, 8) == pytest.approx(1 / 9) and textbook_bubble("gpipe", 4, 4) == 3 / 7
    assert textbook_bubble("interleaved-1f1b", 2, 8, 2) == pytest.approx(1 / 17)
    assert textbook_bubble("zbv", 2, 8, 2) == 0.0 and textbook_bubble("1f1b", 1, 8) == 0.0


# ---- loss_match: the losses of two runs step by step -------------------------------------------------------------
def _metrics(path, losses, tps=1000.0, mem=40.0):
    recs = [{"step": i + 1, "loss": v, "tokens_per_s": tps, "mem_gib": mem} for i, v in enumerate(losses)]
    path.write_text("\n".join(json.dumps(r) for r in recs + [{"step": len(losses), "eval_loss": 9.0}]) + "\n")
    return str(path)


def test_loss_match(tmp_path, capsys):
    from mamba_parallel.bench import loss_match

    ref = _metrics(tmp_path / "ref.jsonl", [10.0, 9.0, 8.0])
    near = _metrics(tmp_path / "fsdp2.jsonl", [10.0, 9.01, 8.004], tps=2000.0)
    far = _metrics(tmp_path / "tp2.jsonl", [10.0, 9.5])
    assert loss_match.main([ref, near]) == 0
    text = capsys.readouterr().out
    assert "fsdp2: 3 steps, largest relative loss difference 1.11e-03 at step 2 (equal" in text
    assert "2,000 tokens/s, peak 40.0 GiB" in text and "| 2 | 9.0000 | 9.0100 (1.1e-03) |" in text
    assert loss_match.main([ref, near, far]) == 1
    assert "tp2: 2 steps, largest relative loss difference 5.56e-02 at step 2 (DIFFERENT" in capsys.readouterr().out
    assert loss_match.main([ref, near, "--rtol", "1e-4"]) == 1
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit, match="line 1 is not JSON"):
        loss_match.main([ref, str(tmp_path / "bad.jsonl")])


# ---- tools/recompute_trade.sh -------------------------------------------------------------------------------------
def test_recompute_trade_runs_every_choice_and_tabulates(tmp_path):
    """The script's loop and table, with bench_train replaced by a stub that writes its JSON (the real one is a GPU
    run): one run per preset x choice, the items passed as --recompute, tokens/s relative to keeping everything."""
    import os
    import subprocess

    stub = tmp_path / "python"
    stub.write_text(f"""#!{sys.executable}
import json, subprocess, sys
args = sys.argv[1:]
if args[:2] != ["-m", "mamba_parallel.bench.bench_train"]:
    sys.exit(subprocess.call([{sys.executable!r}, *args]))
flags = dict(zip(args, args[1:]))
tps = {{"": 100.0, "states": 95.0, "conv,states": 90.0}}[flags["--recompute"]]
json.dump({{"tokens_per_s": tps, "peak_mem_gib": tps / 10, "final_loss": 2.5}}, open(flags["--json"], "w"))
""")
    stub.chmod(0o755)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(["bash", os.path.join(root, "tools", "recompute_trade.sh"), "mamba2-1.3b", "mamba-2.8b"],
                         env={**os.environ, "OUT": str(tmp_path), "PYTHON": str(stub)}, cwd=root,
                         capture_output=True, text=True, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| mamba")]
    assert len(rows) == 6
    assert "| mamba-2.8b | conv,states | 90 | 0.900 | 9.0 | 2.5 |" in rows
    assert "| mamba2-1.3b | none | 100 | 1.000 | 10.0 | 2.5 |" in rows
