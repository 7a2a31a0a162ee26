"""The side-by-side benchmarks on a CPU, with this package's reference ops and model in the peer's place: the ratio
rule, the tables, failing sides, the fla mapping, the weight hand-over, the step-1 loss check, generation, the
long-context probe, `bench all`, the result files and the report. No test asserts a timing."""

import json

import pytest
import torch

from mamba_parallel.bench import (bench_all, bench_generate, bench_long_context, bench_selective_scan, bench_ssd,
                                  bench_train, long_context_probe, report, train_side_by_side)
from mamba_parallel.bench import peer as peer_mod
from mamba_parallel.bench.results import advantage, format_table, make_row, ratio_rule
from mamba_parallel.config import ConfigError

TINY_SSD = (1, 37, 2, 8, 8, 1)  # odd length, two chunks of 16 plus a partial one
TINY_SCAN = (1, 6, 19, 4)


@pytest.fixture
def ref():
    return peer_mod.load_peer("reference")


# ---- the ratio rule and the table ---------------------------------------------------------------------------------
def test_advantage_is_how_much_better_ours_is():
    assert advantage(2.0, 3.0, "lower") == pytest.approx(1.5)  # our time 2 ms vs 3 ms: 1.5x faster
    assert advantage(300.0, 200.0, "higher") == pytest.approx(1.5)  # throughput
    assert advantage(None, 3.0, "lower") is None and advantage(2.0, None, "lower") is None
    assert advantage(0.0, 3.0, "lower") is None and advantage(2.0, float("nan"), "lower") is None
    with pytest.raises(ValueError, match="better"):
        advantage(1.0, 1.0, "faster")


def test_table_shows_errors_and_only_sides_that_ran():
    rows = [make_row("b1", "fwd", "ms", "lower", {"ours": 1.0, "peer": 2.0}),
            make_row("b2", "fwd", "ms", "lower", {"ours": 1.0, "peer": None}, {"peer": "OutOfMemoryError: x"})]
    text = format_table(rows, {"peer": "mamba_ssm"})
    assert "| b1 | fwd (ms) | 1.00 | 2.00 | 2.00x |" in text
    assert "| b2 | fwd (ms) | 1.00 | error: OutOfMemoryError: x | – |" in text
    alone = [make_row("b1", "fwd", "ms", "lower", {"ours": 1.0})]
    assert "mamba_ssm" not in format_table(alone) and "x_peer" not in alone[0]
    assert ratio_rule(alone).startswith("Ours alone")


# ---- kernels ------------------------------------------------------------------------------------------------------
def test_fla_mapping_equals_the_ssd_reference():
    """g = dt A, k = dt B, q = C, v = x, scale 1, + D x: the simple-GLA recurrence is the SSD (fp32, two groups)."""
    from mamba_parallel.ops.ssd import naive

    inputs = bench_ssd.make_inputs(2, 21, 4, 8, 6, 2, torch.float32, "cpu", chunk=8)
    want = naive.ssd_chunk_scan(**inputs)
    got = peer_mod.fla_ssd(peer_mod.reference_simple_gla)(**inputs)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_ssd_rows_every_side_and_mode(ref):
    res = bench_ssd.run([TINY_SSD], "fp32", "cpu", ref, peer_mod.reference_simple_gla, chunk=16, warmup=0, reps=1,
                        log=lambda _: None)
    assert [r["mode"] for r in res["rows"]] == ["fwd", "fwd+bwd", "inference"]
    for r in res["rows"]:
        assert r["case"] == "b1 L37 h2 p8 n8 g1" and r["unit"] == "ms"
        assert all(r[s] > 0 for s in ("ours", "peer", "fla")), r
        assert r["x_peer"] == pytest.approx(r["peer"] / r["ours"]) and r["x_fla"] == pytest.approx(r["fla"] / r["ours"])
    assert res["settings"]["sides"] == ["ours", "peer", "fla"]


def test_a_failing_side_keeps_its_error_and_the_rest_runs(ref):
    class Broken(peer_mod.ReferencePeer):
        def selective_scan(self, *a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")

    res = bench_selective_scan.run([TINY_SCAN, (1, 4, 11, 2)], "fp32", "cpu", Broken(), warmup=0, reps=1,
                                   log=lambda _: None)
    assert len(res["rows"]) == 6
    for r in res["rows"]:
        assert r["ours"] > 0 and r["peer"] is None and r["x_peer"] is None
        assert r["errors"]["peer"].startswith("OutOfMemoryError: CUDA out of memory")


def test_kernel_main_without_peer_prints_ours_alone(tmp_path, capsys):
    out = tmp_path / "scan.json"
    bench_selective_scan.main(["--no-peer", "--shape", *map(str, TINY_SCAN), "--device", "cpu", "--dtype", "fp32",
                               "--warmup", "0", "--reps", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert "Ours alone" in text and "ours vs" not in text
    res = json.loads(out.read_text())
    assert res["bench"] == "selective_scan" and res["meta"]["peer"] is None
    assert all("peer" not in r for r in res["rows"])


def test_peer_required_but_missing_is_one_clear_error():
    try:
        peer_mod.load_peer("mamba_ssm")
    except peer_mod.PeerUnavailable:
        with pytest.raises(SystemExit, match="--peer: mamba_ssm does not import"):
            peer_mod.resolve_peer(True, "mamba_ssm")
        assert peer_mod.resolve_peer(None, "mamba_ssm", log=lambda _: None) is None
    else:
        pytest.skip("mamba_ssm imports here")


# ---- training -----------------------------------------------------------------------------------------------------
def test_hand_over_gives_ours_the_peers_weights(ref):
    from mamba_parallel.config import get_preset

    torch.manual_seed(3)
    theirs = ref.build_lm(get_preset("tiny-mamba2"), "cpu")
    ours = peer_mod.ours_from_peer(ref, theirs, "cpu")
    a, b = theirs.model.state_dict(), ours.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_same_weights_same_step1_loss(ref):
    res = train_side_by_side.run(["tiny-mamba", "tiny-mamba2"], ref, "cpu", seq_len=16, batch=2, warmup=1, steps=1,
                                 log=lambda _: None)
    checks = res["checks"]["step1_loss"]
    assert [c["preset"] for c in checks] == ["tiny-mamba", "tiny-mamba2"]
    for c in checks:
        assert c["agree"] and c["rel_diff"] < 1e-5  # same weights, same batch, the same reference model
    metrics = [(r["case"], r["metric"]) for r in res["rows"]]
    assert metrics[:3] == [("tiny-mamba b2 L16", "tokens/s"), ("tiny-mamba b2 L16", "step"),
                           ("tiny-mamba b2 L16", "peak memory")]
    tps = res["rows"][0]
    assert tps["ours"] > 0 and tps["peer"] > 0 and tps["x_peer"] == pytest.approx(tps["ours"] / tps["peer"])


def test_train_flags_a_loss_that_differs():
    class Off(peer_mod.ReferencePeer):
        def loss(self, model, input_ids, targets):
            return super().loss(model, input_ids, targets) * 1.1

    _, check = train_side_by_side.run_preset("tiny-mamba2", Off(), "cpu", seq_len=16, batch=2, warmup=0, steps=1,
                                             log=lambda _: None)
    assert check["agree"] is False and check["rel_diff"] == pytest.approx(0.1 / 1.1, rel=1e-3)


def test_bench_train_cli_side_by_side(tmp_path):
    out = tmp_path / "results"
    assert bench_train.main(["--peer", "--peer-impl", "reference", "--preset", "tiny-mamba", "--device", "cpu",
                             "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--warmup-steps", "0",
                             "--json", str(out)]) == 0
    (path,) = out.glob("*/train.json")
    assert path.parent.name.endswith("-cpu")
    res = json.loads(path.read_text())
    assert res["side_names"]["peer"] == "reference" and res["checks"]["step1_loss"][0]["agree"]
    with pytest.raises(SystemExit, match="without --tp"):
        bench_train.main(["--peer", "--peer-impl", "reference", "--preset", "tiny-mamba", "--tp", "2"])


def test_bench_train_side_by_side_with_our_recompute(tmp_path, monkeypatch):
    """--recompute beside --peer: ours rebuilds those activations (less memory), the peer runs as it is; same
    weights, so the same step-1 loss; the case names what ours recomputed."""
    from mamba_parallel.layers import recompute as recompute_mod

    applied = []
    real = recompute_mod.apply_recompute
    monkeypatch.setattr(recompute_mod, "apply_recompute", lambda m, items: applied.append(items) or real(m, items))
    out = tmp_path / "results"
    assert bench_train.main(["--peer", "--peer-impl", "reference", "--preset", "tiny-mamba", "--device", "cpu",
                             "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--warmup-steps", "0",
                             "--recompute", "conv,states", "--json", str(out)]) == 0
    (path,) = out.glob("*/train.json")
    res = json.loads(path.read_text())
    assert applied == ["conv,states"]
    assert {r["case"] for r in res["rows"]} == {"tiny-mamba b2 L16 recompute conv,states"}
    assert res["checks"]["step1_loss"][0]["agree"] and "recompute conv,states" in res["settings"]["ours"]
    from mamba_parallel.config import ConfigError

    with pytest.raises(ConfigError, match=r"--recompute: unknown item\(s\) nope"):
        bench_train.main(["--peer", "--peer-impl", "reference", "--preset", "tiny-mamba", "--recompute", "conv,nope"])
    monkeypatch.setattr(bench_train.dist, "is_torchelastic_launched", lambda: True)
    with pytest.raises(SystemExit, match="without --recompute under torchrun"):  # the default is not refused
        bench_train.main(["--peer", "--peer-impl", "reference", "--preset", "tiny-mamba", "--recompute", "none"])


def test_bench_train_side_by_side_with_our_cuda_graph(ref, monkeypatch):
    """--cuda-graph beside --peer: our step goes through GraphedTrainStep (its replays timed; the loss it returns
    is a static buffer, so each step's is copied), the peer's eager; the case and settings say so. On the CPU the
    flag is refused by name (a graph needs CUDA)."""
    from mamba_parallel.train import cuda_graph

    calls = []

    class FakeGraphed:  # a CPU stand-in: eager steps, the loss returned in one reused buffer like a graph's
        def __init__(self, model, optimizer, grad_clip, autocast_dtype):
            assert grad_clip is None and autocast_dtype == torch.bfloat16
            self.model, self.optimizer, self.out = model, optimizer, torch.zeros(())

        def __call__(self, ids, targets):
            calls.append(ids.shape)
            loss = self.model(ids, targets=targets).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.out.copy_(loss.detach())
            return self.out, None

    monkeypatch.setattr(cuda_graph, "GraphedTrainStep", FakeGraphed)
    res = train_side_by_side.run(["tiny-mamba"], ref, "cpu", seq_len=16, batch=2, warmup=1,
                                 steps=2, log=lambda _: None, cuda_graph=True)
    assert len(calls) == 3  # our side only: warm-up + timed steps
    assert {r["case"] for r in res["rows"]} == {"tiny-mamba b2 L16 cuda graph (ours)"}
    assert "CUDA graph" in res["settings"]["ours"]
    check = res["checks"]["step1_loss"][0]
    assert check["agree"], check  # the first graphed step's loss is step 1's: the same weights, the same batch
    with pytest.raises(ConfigError, match="--cuda-graph needs a CUDA device; this run is on cpu"):
        bench_train.main(["--peer", "--peer-impl", "reference", "--preset", "tiny-mamba", "--device", "cpu",
                          "--cuda-graph"])
    monkeypatch.setattr(bench_train.dist, "is_torchelastic_launched", lambda: True)
    with pytest.raises(SystemExit, match="without --cuda-graph under torchrun"):
        bench_train.main(["--peer", "--peer-impl", "reference", "--preset", "tiny-mamba", "--cuda-graph"])


def test_bench_train_under_torchrun_compares_only_with_peer(monkeypatch):
    """torchrun + --peer: the data-parallel side by side (bench_train_dp); torchrun alone: ours alone (scaling)."""
    from mamba_parallel.bench import bench_train_dp

    monkeypatch.setattr(bench_train.dist, "is_torchelastic_launched", lambda: True)
    seen = []
    monkeypatch.setattr(bench_train_dp, "run_launched", lambda *a, **k: seen.append((a, k)) or 0)
    base = ["--preset", "tiny-mamba", "--device", "cpu", "--seq-len", "16", "--batch-size", "2"]
    assert bench_train._side_by_side_peer(bench_train.build_parser().parse_args(base)) is None
    assert bench_train.main(base + ["--peer", "--peer-impl", "reference", "--json", "out", "--git-commit", "0a1"]) == 0
    ((args, kwargs),) = seen
    assert kwargs == {"git_commit": "0a1"}
    assert args[:5] == (["tiny-mamba"], True, "reference", "cpu", 16) and args[-2:] == (("fsdp", "ddp"), "out")
    with pytest.raises(SystemExit, match="bench train_dp: --dp-modes 'fsdp,zero'"):
        bench_train_dp.parse_modes("fsdp,zero")
    assert bench_train_dp.parse_modes("ddp, ddp,fsdp") == ["ddp", "fsdp"]


# ---- generation and long sequences --------------------------------------------------------------------------------
def test_generate_same_weights_same_tokens(ref):
    res = bench_generate.run(["tiny-mamba2"], ref, "cpu", batch_sizes=(2,), prompt_len=5, new_tokens=3, repeats=1,
                             dtype="fp32", log=lambda _: None)
    decode, prefill = res["rows"]
    assert (decode["metric"], decode["unit"], prefill["metric"]) == ("decode", "ms/step", "prefill 5 tokens")
    assert decode["tokens_match"] == 1.0  # greedy on the same weights: the same tokens
    assert prefill["ours"] > 0 and prefill["peer"] > 0
    with pytest.raises(ValueError, match="--new-tokens >= 2"):
        bench_generate.run(["tiny-mamba2"], ref, "cpu", new_tokens=1)


def test_long_context_probe_stops_at_the_first_out_of_memory():
    from mamba_parallel.config import get_preset
    from mamba_parallel.models.lm import MambaLMHeadModel

    cfg = get_preset("tiny-mamba2")

    def loss_of(model, ids, targets):
        if ids.shape[1] > 32:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return train_side_by_side.our_loss(model, ids, targets)

    found = long_context_probe.probe(lambda: MambaLMHeadModel(cfg), loss_of, "cpu", [16, 32, 64, 128],
                                     cfg.vocab_size, log=lambda _: None)
    assert list(found) == [16, 32, 64] and found[64] == {"error": "out of memory"}
    assert found[32]["tokens_per_s"] > 0


def test_long_context_probe_with_our_memory_options(ref, tmp_path, monkeypatch):
    """--activation-checkpointing / --recompute apply to our side only (every block wrapped, the layers' items
    set; the peer as it ships); the result is a table of its own whose case and title name them."""
    import importlib

    from mamba_parallel.layers import recompute as recompute_mod

    # the module: the package exports a function of the same name
    par = importlib.import_module("mamba_parallel.distributed.parallelize")

    wrapped, applied = [], []
    real_ac, real_rc = par.apply_activation_checkpointing, recompute_mod.apply_recompute
    monkeypatch.setattr(par, "apply_activation_checkpointing", lambda m: wrapped.append(m) or real_ac(m))
    monkeypatch.setattr(recompute_mod, "apply_recompute", lambda m, items: applied.append(items) or real_rc(m, items))
    out = tmp_path / "results"
    assert bench_long_context.main(["--peer-impl", "reference", "--preset", "tiny-mamba2", "--device", "cpu",
                                    "--start", "16", "--max-len", "32", "--activation-checkpointing",
                                    "--recompute", "states,conv", "--json", str(out)]) == 0
    (path,) = out.glob("*/long_context_options.json")
    res = json.loads(path.read_text())
    assert len(wrapped) == 1 and applied == ["conv,states"]
    assert all(type(b).__name__ == "CheckpointWrapper" for b in wrapped[0].backbone.layers)
    assert res["settings"]["activation_checkpointing"] and res["settings"]["recompute"] == "conv,states"
    assert res["rows"][0]["case"] == "tiny-mamba2 b1 (ours: activation checkpointing, recompute conv,states)"
    assert res["rows"][0]["ours"] == res["rows"][0]["peer"] == 32
    with pytest.raises(SystemExit, match="--recompute is the probe's"):
        bench_long_context.main(["--seq-len", "16", "--recompute", "conv", "--device", "cpu"])


def test_a_given_git_commit_is_recorded(tmp_path):
    """--git-commit names the tree that ran where the checkout's .git is missing or another tree's."""
    out = tmp_path / "generate.json"
    assert bench_generate.main(["--peer-impl", "reference", "--device", "cpu", "--models", "tiny-mamba2",
                                "--batch-sizes", "1", "--prompt-len", "3", "--new-tokens", "2", "--repeats", "1",
                                "--git-commit", "0123abc", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["git_commit"] == "0123abc"


# ---- bench all, the result files, the report ----------------------------------------------------------------------
TINY_ALL = ["--peer-impl", "reference", "--device", "cpu", "--ssd-shape", *map(str, TINY_SSD), "--ssd-chunk", "16",
            "--selective-scan-shape", *map(str, TINY_SCAN), "--kernel-warmup", "0", "--kernel-reps", "1",
            "--train-presets", "tiny-mamba2", "--train-seq-len", "16", "--train-batch", "2", "--train-warmup", "0",
            "--train-steps", "1", "--generate-models", "tiny-mamba", "--generate-batches", "1", "--prompt-len", "3",
            "--new-tokens", "2", "--generate-repeats", "1", "--long-preset", "tiny-mamba2", "--long-start", "16",
            "--long-max", "16"]


def test_bench_all_writes_results_and_the_report(tmp_path):
    results, md = tmp_path / "results", tmp_path / "docs" / "performance.md"
    assert bench_all.main(TINY_ALL + ["--out", str(results), "--report", str(md)]) == 0
    files = sorted(p.name for p in results.glob("*/*.json"))
    assert files == ["generate.json", "long_context.json", "selective_scan.json", "ssd.json", "train.json"]
    for f in results.glob("*/*.json"):
        meta = json.loads(f.read_text())["meta"]
        assert {"command", "git_commit", "torch", "triton", "peer", "device", "timestamp"} <= set(meta)
        assert meta["device"] == "cpu" and meta["peer"]["reference"]
    text = md.read_text()
    for title in ("Mamba-2 SSD chunked scan", "Mamba-1 selective scan", "One training step", "Generation",
                  "Longest trainable sequence"):
        assert f"## {title}" in text
    assert "ours vs reference" in text and "step-1 loss ours" in text and "bench all" in text
    pngs = sorted(p.name for p in (tmp_path / "docs" / "performance").glob("*.png"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert pngs == [] and "need matplotlib" in text
    else:
        assert "long_context.png" in pngs and "ssd.png" in pngs and "![ssd ratios](performance/ssd.png)" in text


def test_bench_all_only_and_budget(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--only 'nope'"):
        bench_all.main(["--only", "kernels,nope"])
    assert bench_all.parse_only("kernels,train") == ["ssd", "selective_scan", "train"]
    results = tmp_path / "r"
    # a budget already spent: every section is skipped, the run says so and still exits (non-zero)
    assert bench_all.main(TINY_ALL + ["--only", "train", "--out", str(results), "--report", "", "--budget-s",
                                      "-1"]) == 1
    assert "not completed: train" in capsys.readouterr().out


def test_a_table_split_over_runs_is_combined_and_no_run_overwrites_another(tmp_path):
    """Two calls of one benchmark on one device, the first out of time after one preset: both files are kept, and
    the report's table takes the second run's rows and the first run's measured one (each a same-process row)."""
    from mamba_parallel.bench.results import write_result

    def result(stamp, rows, settings):
        return {"bench": "train", "title": "train", "settings": settings, "rows": rows,
                "meta": {"timestamp": stamp, "device": "GPU", "command": f"run at {stamp}"}}

    skipped = make_row("big", "tokens/s", "tokens/s", "higher", {"ours": None}, {"ours": "skipped: time budget spent"})
    first = result("2026-01-01T10:00:00", [make_row("small", "tokens/s", "tokens/s", "higher", {"ours": 3.0, "peer": 1.0}),
                                           skipped], {"seq_len": 2048})
    second = result("2026-01-01T11:00:00", [make_row("small", "tokens/s", "tokens/s", "higher", {"ours": None},
                                                     {"ours": "skipped: not asked"}),
                                            make_row("big", "tokens/s", "tokens/s", "higher", {"ours": 2.0, "peer": 1.0})],
                    {"seq_len": 2048})
    other = result("2026-01-01T09:00:00", [make_row("extra", "tokens/s", "tokens/s", "higher", {"ours": 9.0}),
                                           make_row("small", "tokens/s", "tokens/s", "higher", {"ours": 7.0})],
                   {"seq_len": 512})  # other settings: never mixed in; its case the newer runs lack, a table below
    root = tmp_path / "results"
    paths = [write_result(r, root) for r in (first, second, other)]
    assert len({p.name for p in paths}) == 3 and all(p.is_file() for p in paths)
    assert paths[0].name == "train.json" and paths[1].name == "train-110000.json"
    out = tmp_path / "perf.md"
    assert report.main(["--results", str(root), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "| small | tokens/s | 3.00 | 1.00 | 3.00x |" in text and "| big | tokens/s | 2.00 | 1.00 | 2.00x |" in text
    assert "Rows from 2 runs" in text and "run at 2026-01-01T10:00:00" in text and "run at 2026-01-01T11:00:00" in text
    main, below = text.split("cases measured only in earlier runs")
    assert "extra" not in main and "skipped" not in text and "7.00" not in text
    assert "| extra | tokens/s | 9.00 |" in below and "run at 2026-01-01T09:00:00" in below and "seq_len 512" in below


def test_report_keeps_the_newest_run_of_each_benchmark(tmp_path):
    def result(bench, stamp, value):
        return {"bench": bench, "title": bench, "meta": {"timestamp": stamp, "device": "GPU", "command": "c",
                                                         "git_commit": "0123456789abcdef0123+dirty"},
                "rows": [make_row("case", "fwd", "ms", "lower", {"ours": value, "peer": 2.0})]}

    for day, value in (("2026-01-01", 4.0), ("2026-02-01", 1.0)):
        d = tmp_path / "results" / f"{day}-gpu"
        d.mkdir(parents=True)
        (d / "ssd.json").write_text(json.dumps(result("ssd", day + "T00:00:00", value)))
    (tmp_path / "results" / "notes.json").write_text("[1, 2]")  # not a result: skipped
    out = tmp_path / "perf.md"
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "| case | fwd (ms) | 1.00 | 2.00 | 2.00x |" in text and "4.00" not in text
    assert "commit 0123456789ab+dirty;" in text  # a run of uncommitted changes says so
    empty = tmp_path / "empty"
    empty.mkdir()
    report.main(["--results", str(empty), "--out", str(out)])
    assert "No results yet" in out.read_text()


def test_train_cuda_graph_reaches_the_train_table(monkeypatch, tmp_path):
    """--train-cuda-graph: our step as one CUDA graph in the train table's run (its own settings, so its own table);
    refused by name without a CUDA device, before anything runs."""
    from mamba_parallel.bench import train_side_by_side

    with pytest.raises(SystemExit, match="--train-cuda-graph .* --device cpu"):
        bench_all.main(TINY_ALL + ["--only", "train", "--train-cuda-graph", "--out", str(tmp_path)])
    seen = {}

    def fake_run(*args, **kwargs):  # records what the table's run was asked, then stops the section
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(train_side_by_side, "run", fake_run)
    monkeypatch.setattr(bench_all.torch.cuda, "is_available", lambda: True)
    args = [a for a in TINY_ALL if a not in ("--device", "cpu")]
    assert bench_all.main(args + ["--only", "train", "--train-cuda-graph", "--out", str(tmp_path),
                                  "--report", ""]) == 1
    assert seen["cuda_graph"] is True


# ---- the compile warm-up -------------------------------------------------------------------------------------------
def test_precompile_jobs_cover_every_shape_preset_and_model():
    from mamba_parallel.bench import precompile

    a = bench_all.build_parser().parse_args(TINY_ALL + ["--train-presets", "tiny-mamba2", "tiny-mamba",
                                                        "--no-fla"])
    sections = bench_all.parse_only("ssd,selective_scan,train,generate,long_context,mamba3")
    jobs = precompile.jobs_for(a, sections, [TINY_SSD, TINY_SSD], [TINY_SCAN], out="/scratch")
    names = [j.name for j in jobs]
    assert names[:3] == ["ssd 1 37 2 8 8 1", "ssd 1 37 2 8 8 1", "mamba3"]  # the slowest compiles first
    assert names[3:] == ["train tiny-mamba2", "train tiny-mamba", "selective_scan 1 6 19 4", "generate tiny-mamba",
                         "long_context tiny-mamba2"]
    for j in jobs:  # every warm-up writes to the scratch folder, writes no report, times one repeat
        args = bench_all.build_parser().parse_args(j.argv)
        assert args.out == "/scratch" and args.report == "" and args.kernel_reps == 1 and args.no_fla
        assert args.peer_impl == "reference" and args.device == "cpu"
        if "--n-layer" in j.argv:
            assert args.n_layer == precompile.WARM_LAYERS
    assert bench_all.build_parser().parse_args(jobs[3].argv).train_steps == 1
    families = [j.family for j in jobs]  # the two SSD shapes share their kernels; the two models do not
    assert families[:2] == ["ssd p8 n8 g1"] * 2 and len(set(families[2:])) == len(families) - 2, families
    other = precompile.jobs_for(a, ["ssd"], [TINY_SSD, (1, 37, 2, 8, 16, 1)], [], out="/scratch")
    assert other[0].family != other[1].family  # another d_state: other tiles, its own compile
    m3 = bench_all.build_parser().parse_args(TINY_ALL + ["--train-presets", "tiny-mamba3", "tiny-mamba"])
    sliced = precompile.jobs_for(m3, ["train"], [], [], out="/scratch", workers=4)
    parts = [j for j in sliced if j.name == "train tiny-mamba3"]  # the peer's Mamba-3 autotunes: split it
    assert len(parts) == 3 and [j.name for j in sliced].count("train tiny-mamba") == 1
    assert [bench_all.build_parser().parse_args(j.argv).warmup_candidates for j in parts] == [j.part for j in parts]
    env = precompile.child_env()
    assert env["FLA_CACHE_RESULTS"] == "0" and "TRITON_CACHE_AUTOTUNING" not in env
    assert bench_all.build_parser().parse_args(["--precompile-workers", "auto"]).precompile_workers >= 1
    with pytest.raises(SystemExit):
        bench_all.build_parser().parse_args(["--precompile-workers", "many"])


def test_precompile_compiles_fla_beside_the_peer_not_after_it():
    from mamba_parallel.bench import precompile

    a = bench_all.build_parser().parse_args(TINY_ALL + ["--peer-impl", "reference", "--peer"])
    jobs = precompile.jobs_for(a, ["ssd"], [TINY_SSD], [], out="/scratch")
    assert [j.name for j in jobs] == ["ssd 1 37 2 8 8 1", "ssd 1 37 2 8 8 1 fla"]
    parsed = [bench_all.build_parser().parse_args(j.argv) for j in jobs]
    assert (parsed[0].no_fla, parsed[0].peer) == (True, True)  # ours + the peer
    assert (parsed[1].no_fla, parsed[1].peer) == (False, False)  # ours + fla: the job's own flags win over --peer


def test_bench_all_precompiles_then_times_and_keeps_only_the_timed_results(tmp_path, capsys):
    results = tmp_path / "r"
    argv = TINY_ALL + ["--only", "ssd,train", "--out", str(results), "--report", "", "--precompile-workers", "2"]
    assert bench_all.main(argv) == 0
    out = capsys.readouterr().out
    assert "precompile: 2 warm-ups in 2 processes" in out and "[failed" not in out and "[stopped" not in out
    assert sorted(p.name for p in results.glob("*/*.json")) == ["ssd.json", "train.json"]
    assert "n_layer" not in json.loads(next(results.glob("*/train.json")).read_text())["settings"]


def test_precompile_stops_what_the_budget_does_not_hold(tmp_path):
    from mamba_parallel.bench import precompile

    jobs = [precompile.Job("sleep", ["--only", "nope"]), precompile.Job("never", ["--only", "nope"])]
    lines = []
    precompile.run(jobs, 1, 0.0, str(tmp_path), lines.append)
    assert [j.status for j in jobs] == ["stopped", "stopped"] and "[stopped]" in lines[-1]
    with pytest.raises(ValueError, match="--precompile-workers"):
        precompile.run(jobs, 0, 1.0, str(tmp_path), lines.append)


def test_precompile_starts_a_family_after_its_first_job(tmp_path):
    """The first job of a family runs alone (the rest would compile the same kernels again beside it); the other
    families' first jobs start at once."""
    from mamba_parallel.bench import precompile

    jobs = [precompile.Job("a1", ["--only", "nope"], family="a"), precompile.Job("a2", ["--only", "nope"], family="a"),
            precompile.Job("b1", ["--only", "nope"], family="b")]
    precompile.run(jobs, 3, 300.0, str(tmp_path), lambda s: None, poll_s=0.05)
    a1, a2, b1 = jobs
    assert all(j.status.startswith("failed") for j in jobs)  # "--only nope": a fast exit
    assert b1.started < a2.started and a2.started >= a1.started + a1.seconds - 0.01


def test_n_layer_cuts_the_models_and_is_recorded(ref):
    from mamba_parallel.config import get_preset

    cut = get_preset("tiny-mamba2").with_layers(1)
    assert cut.n_layer == 1 and cut.d_model == get_preset("tiny-mamba2").d_model
    result = train_side_by_side.run(["tiny-mamba2"], ref, "cpu", seq_len=16, batch=2, warmup=0, steps=1,
                                    log=lambda s: None, n_layer=1)
    assert result["settings"]["n_layer"] == 1
    with pytest.raises(Exception, match="n_layer must be an integer >= 1"):
        cut.with_layers(0)


def test_kernel_benchmarks_list_the_shapes_a_spent_budget_skipped(ref):
    from mamba_parallel.bench.timing import Deadline

    result = bench_ssd.run([TINY_SSD, TINY_SSD], "fp32", "cpu", ref, None, chunk=16, warmup=0, reps=1,
                           log=lambda s: None, deadline=Deadline(-1))
    assert len(result["rows"]) == 6 and all(r["errors"]["ours"] == "skipped: time budget spent"
                                            for r in result["rows"])
    assert "skipped: time budget spent" in format_table(result["rows"], {"ours": "ours", "peer": "reference"})


def test_precompile_only_times_nothing(tmp_path, capsys):
    results = tmp_path / "r"
    argv = TINY_ALL + ["--only", "selective_scan", "--out", str(results), "--report", ""]
    with pytest.raises(SystemExit, match="--precompile-only needs --precompile-workers"):
        bench_all.main(argv + ["--precompile-only"])
    assert bench_all.main(argv + ["--precompile-only", "--precompile-workers", "1"]) == 0
    assert "nothing timed" in capsys.readouterr().out and not list(results.glob("*/*.json"))


def test_kernel_sides_take_turns_and_the_report_states_the_noise(tmp_path):
    from mamba_parallel.bench import kernels
    from mamba_parallel.bench.report import _noise

    order = []

    def side(name):
        def fn(x):
            order.append(name)
            return x * 2
        return fn

    inputs = {"x": torch.randn(5)}
    timed = kernels.time_sides({"ours": side("ours"), "peer": side("peer")}, inputs, ("x",), "cpu",
                               modes=("fwd",), warmup=0, reps=2, rounds=2)
    # round 1 of each side, then round 2 (one untimed call first: the other side ran in between)
    assert order == ["ours"] * 2 + ["peer"] * 2 + ["ours"] * 3 + ["peer"] * 3
    times, errors, spread = timed["fwd"]
    assert set(times) == {"ours", "peer"} and all(v is not None and v >= 1.0 for v in spread.values())
    row = kernels.rows_for_case("case", timed)[0]
    assert set(row["spread"]) == {"ours", "peer"}
    row["spread"] = {"ours": 1.031, "peer": 1.2}
    assert "at most 20.0 % (peer, case, fwd, grad enabled)" in _noise([row])[0]
    assert _noise([{"case": "c", "metric": "m"}]) == []
