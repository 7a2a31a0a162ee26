"""bench_scaling: layouts, commands, table / plot writer, merging; and CUDA-graph decode (GPU only). The
side-by-side benchmarks and the report: test_side_by_side.py. No test asserts a timing."""

import json
import shlex

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
