"""Multi-GPU scaling table: tokens/s, tokens/s per GPU, peak memory per GPU and efficiency vs 1 GPU, per layout.

    python -m mamba_parallel.bench.bench_scaling [--models mamba2-1.3b mamba2-2.7b mamba-2.8b]
        [--layouts 1gpu dp2 dp4 dp8 tp2 tp4 dp2xtp2 dp4xtp2 pp2 pp2-zbv] [--seq-len 2048] [--steps 10] [--out DIR]
        [--dry-run]
    python -m mamba_parallel.bench.bench_scaling --from-json A/scaling.json B/scaling.json --out DIR

Each model x layout is one run of bench_train (one training step timed: synthetic tokens, fp32 master weights +
bf16 autocast, fused AdamW) under the official launcher, ``python -m torch.distributed.run`` (torchrun), with
N = dp * tp processes. Layouts needing more GPUs than this machine has are skipped and listed as such. Batch:
``--batch-per-dp-rank`` sequences (default 8: weak scaling) or a fixed ``--global-batch``
split over the data-parallel ranks. A pipeline layout ``ppN`` (``ppN-<schedule>``, e.g. ``pp2-zbv``; default schedule
``--pp-schedule``) is one run of bench_pipeline on N GPUs instead: the rank's batch in ``--microbatches``
micro-batches, with the MEASURED bubble (the share of the step each rank waits on its neighbours) beside the
schedule's textbook value. speedup = tokens/s / tokens/s of the same model on 1 GPU; efficiency =
speedup / GPUs. Writes DIR/scaling.json (after every run, so a killed sweep keeps its rows), DIR/scaling.md and
DIR/scaling.png (needs matplotlib; without it the PNG is skipped with a message — re-render it anywhere with
``--from-json``, which also merges the results of several machines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

DEFAULT_MODELS = ["mamba2-1.3b", "mamba2-2.7b", "mamba-2.8b"]
DEFAULT_LAYOUTS = ["1gpu", "dp2", "dp4", "dp8", "tp2", "tp4", "dp2xtp2", "dp4xtp2"]


def parse_layout(name: str) -> tuple[int, int]:
    """'1gpu' -> (1, 1), 'dp4' -> (4, 1), 'tp2' -> (1, 2), 'dp2xtp2' -> (2, 2): (data parallel, tensor parallel)."""
    if name in ("1", "1gpu"):
        return 1, 1
    m = re.fullmatch(r"(?:dp(\d+))?(?:x?tp(\d+))?", name)
    if not name or m is None or not any(m.groups()):
        raise ValueError(f"--layouts: cannot read layout {name!r}; use 1gpu, dpN, tpM, dpNxtpM (e.g. dp2xtp2) or "
                         f"ppN[-schedule]")
    dp, tp = int(m.group(1) or 1), int(m.group(2) or 1)
    if dp < 1 or tp < 1:
        raise ValueError(f"--layouts: degrees must be >= 1 in {name!r}")
    return dp, tp


def parse_pipeline_layout(name: str, default_schedule: str = "1f1b") -> tuple[int, str] | None:
    """'pp2' -> (2, default_schedule), 'pp2-zbv' -> (2, 'zbv'); None for a layout without pipeline stages."""
    from mamba_parallel.distributed.pipeline import PP_SCHEDULES

    m = re.fullmatch(r"pp(\d+)(?:-(.+))?", name)
    if m is None:
        return None
    pp, schedule = int(m.group(1)), m.group(2) or default_schedule
    if pp < 2:
        raise ValueError(f"--layouts: {name!r} needs at least 2 pipeline stages")
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"--layouts: {name!r}: the schedule must be one of {', '.join(PP_SCHEDULES)}")
    return pp, schedule


def batch_per_rank(dp: int, global_batch: int, per_rank: int) -> int:
    """Sequences per data-parallel rank: ``global_batch / dp`` when a global batch is fixed, else ``per_rank``."""
    if global_batch <= 0:
        return per_rank
    if global_batch % dp:
        raise ValueError(f"--global-batch {global_batch} is not divisible by the data-parallel degree {dp}")
    return global_batch // dp


def train_command(model: str, dp: int, tp: int, seq_len: int, batch: int, steps: int, warmup: int, dp_mode: str,
                  json_path: str, extra: list[str] | None = None) -> list[str]:
    """The torchrun command line of one bench_train run on dp * tp GPUs."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={dp * tp}",
            "-m", "mamba_parallel.bench.bench_train", "--preset", model, "--seq-len", str(seq_len),
            "--batch-size", str(batch), "--steps", str(steps), "--warmup-steps", str(warmup), "--tp", str(tp),
            "--dp-mode", dp_mode, "--json", json_path, *(extra or [])]


def pipeline_command(model: str, pp: int, schedule: str, seq_len: int, microbatches: int, micro_batch: int,
                     steps: int, warmup: int, json_path: str) -> list[str]:
    """The torchrun command line of one bench_pipeline run on ``pp`` GPUs."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={pp}",
            "-m", "mamba_parallel.bench.bench_pipeline", "--preset", model, "--pp", str(pp), "--schedule", schedule,
            "--microbatches", str(microbatches), "--batch-size", str(micro_batch), "--seq-len", str(seq_len),
            "--steps", str(steps), "--warmup", str(warmup), "--json", json_path]


def micro_batch(layout: str, batch: int, microbatches: int) -> int:
    """Sequences per micro-batch of a pipeline layout whose step takes ``batch`` sequences."""
    if microbatches < 1 or batch % microbatches:
        raise ValueError(f"--microbatches {microbatches} does not divide the {batch} sequences of a {layout} step")
    return batch // microbatches


def plan(models: list[str], layouts: list[str], gpus_available: int, pp_schedule: str = "1f1b",
         dp_modes: tuple[str, ...] = ("fsdp",)) -> list[dict]:
    """One entry per model x layout: model, layout, dp, tp, pp (and schedule), dp_mode, gpus, runnable (fits here).

    With several ``dp_modes`` a pure data-parallel layout runs once per mode, named ``<layout>-<mode>`` (e.g.
    dp2-ddp); the other layouts run once, in the first mode (DDP replicates whole models: no tp / pp with it)."""
    out = []
    for model in models:
        for layout in layouts:
            pipe = parse_pipeline_layout(layout, pp_schedule)
            if pipe is not None:
                (pp, schedule), dp, tp = pipe, 1, 1
            else:
                (dp, tp), pp, schedule = parse_layout(layout), 1, None
            several = len(dp_modes) > 1 and dp > 1 and tp == 1 and pp == 1
            for mode in (dp_modes if several else dp_modes[:1]):
                entry = dict(model=model, layout=f"{layout}-{mode}" if several else layout, dp=dp, tp=tp, pp=pp,
                             dp_mode=mode, gpus=dp * tp * pp, runnable=dp * tp * pp <= gpus_available)
                if schedule is not None:
                    entry["schedule"] = schedule
                out.append(entry)
    return out


def add_efficiency(rows: list[dict]) -> list[dict]:
    """Fill speedup / efficiency of every finished row from the 1-GPU row of its model (None without one)."""
    base = {r["model"]: r["tokens_per_s"] for r in rows if r.get("status") == "ok" and r["gpus"] == 1}
    for r in rows:
        b = base.get(r["model"])
        ok = r.get("status") == "ok" and b
        r["speedup"] = r["tokens_per_s"] / b if ok else None
        r["efficiency"] = r["speedup"] / r["gpus"] if ok else None
    return rows


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def markdown_table(result: dict) -> str:
    """scaling.md: one row per model x layout (skipped / failed ones say so), then the settings."""
    lines = ["| model | layout | GPUs | tokens/s | tokens/s per GPU | peak GiB per GPU | speedup | efficiency vs 1 GPU"
             " |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r.get('status', '?')} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['layout']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {_f(r.get('peak_gib_per_gpu'), '.1f')} | "
                     f"{_f(r.get('speedup'), '.2f')}x | {_f(r.get('efficiency'), '.1%')} |")
    s = result.get("settings", {})
    recompute = f"recompute {s['recompute']}, " if s.get("recompute") else ""
    micro = f"{s['microbatches']} micro-batches per pipeline step (mean step time), " if s.get("microbatches") else ""
    lines += ["", f"seq {s.get('seq_len')}, {s.get('batch_desc', '')}, {s.get('steps')} timed steps (median), "
              f"{micro}dp mode {s.get('dp_mode')}, {recompute}device {result.get('device', '?')}, "
              f"{result.get('gpus_available', '?')} GPUs available."]
    piped = [r for r in result["rows"] if r.get("status") == "ok" and r.get("pp", 1) > 1]
    if piped:
        lines += ["", "Pipeline bubble: the share of the step a rank waits on its neighbours, measured (stage busy "
                  "time per rank against the step time; mean / max over ranks) beside the schedule's textbook value.",
                  "",
                  "| model | layout | schedule | micro-batches | bubble mean | bubble max | textbook |",
                  "|---|---|---|---|---|---|---|"]
        for r in piped:
            lines.append(f"| {r['model']} | {r['layout']} | {r.get('schedule')} | {r.get('microbatches')} | "
                         f"{_f(r.get('bubble_mean'), '.1%')} | {_f(r.get('bubble_max'), '.1%')} | "
                         f"{_f(r.get('bubble_theory'), '.1%')} |")
    skipped = [f"{r['model']} {r['layout']}" for r in result["rows"] if str(r.get("status", "")).startswith("skip")]
    if skipped:
        lines.append(f"Not run (need more GPUs than available): {', '.join(skipped)}.")
    failed = [r for r in result["rows"] if r.get("status") == "failed"]
    for r in failed:
        lines.append(f"Failed: {r['model']} {r['layout']}: {r.get('error', '')[:300]}")
    return "\n".join(lines) + "\n"


def write_plot(result: dict, path: str) -> bool:
    """scaling.png: speedup vs GPUs (ideal line dashed) and tokens/s per GPU per layout. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"bench_scaling: matplotlib is not installed, {path} not written (pip install matplotlib, then "
              f"re-render with --from-json)", file=sys.stderr)
        return False
    rows = [r for r in result["rows"] if r.get("status") == "ok"]
    if not rows:
        print(f"bench_scaling: no finished run, {path} not written", file=sys.stderr)
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    max_gpus = max([r["gpus"] for r in rows] + [2])
    ax1.plot([1, max_gpus], [1, max_gpus], "k--", lw=1, label="ideal")
    for model in models:
        mine = sorted((r for r in rows if r["model"] == model and r.get("speedup")), key=lambda r: r["gpus"])
        dp_rows = [r for r in mine if r["tp"] == 1 and r.get("pp", 1) == 1]
        line = ax1.plot([r["gpus"] for r in dp_rows], [r["speedup"] for r in dp_rows], "o-", label=f"{model} DP")
        other = [r for r in mine if r["tp"] > 1 or r.get("pp", 1) > 1]
        ax1.scatter([r["gpus"] for r in other], [r["speedup"] for r in other], marker="s",
                    color=line[0].get_color(), label=f"{model} TP / PP / DPxTP" if other else None)
        for r in other:
            ax1.annotate(r["layout"], (r["gpus"], r["speedup"]), fontsize=7, xytext=(3, -8),
                         textcoords="offset points")
    ax1.set_xticks(sorted({1, *(r["gpus"] for r in rows)}))
    ax1.set(xlabel="GPUs", ylabel="speedup over 1 GPU", title="Training throughput scaling")
    ax1.legend(fontsize=7)
    width = 0.8 / max(len(models), 1)
    for i, model in enumerate(models):
        by_layout = {r["layout"]: r["tokens_per_s_per_gpu"] for r in rows if r["model"] == model}
        xs = [j + i * width for j, lay in enumerate(layouts) if lay in by_layout]
        ax2.bar(xs, [by_layout[lay] for lay in layouts if lay in by_layout], width, label=model)
    ax2.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(layouts))], layouts)
    ax2.set(ylabel="tokens/s per GPU", title=f"seq {result.get('settings', {}).get('seq_len')}")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(result: dict, out_dir: str, plot: bool = True) -> None:
    """scaling.json, scaling.md and (``plot``) scaling.png in ``out_dir``, efficiency recomputed first."""
    os.makedirs(out_dir, exist_ok=True)
    add_efficiency(result["rows"])
    with open(os.path.join(out_dir, "scaling.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    with open(os.path.join(out_dir, "scaling.md"), "w") as fh:
        fh.write(markdown_table(result))
    if plot:
        write_plot(result, os.path.join(out_dir, "scaling.png"))


def merge_results(results: list[dict]) -> dict:
    """Rows of several scaling.json files; a later file's finished row replaces an earlier one of the same
    model and layout (e.g. a 1-GPU machine's rows merged with a 2-GPU machine's)."""
    merged: dict[tuple[str, str], dict] = {}
    for res in results:
        for r in res["rows"]:
            key = (r["model"], r["layout"])
            if key not in merged or r.get("status") == "ok" or merged[key].get("status") != "ok":
                merged[key] = r
    out = dict(results[-1])
    out["rows"] = list(merged.values())
    out["gpus_available"] = max(r.get("gpus_available", 0) for r in results)
    out["device"] = ", ".join(sorted({str(r.get("device")) for r in results}))
    return out


def read_run_json(text: str) -> dict:
    """A run's result: bench_train's one JSON line (the last line of the file) or bench_pipeline's JSON object."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return json.loads(text.splitlines()[-1])


def run_one(entry: dict, cmd: list[str], json_path: str, log_path: str, timeout: float) -> dict:
    """Runs one torchrun command; -> the row (status ok with bench_train's figures, or failed with the reason)."""
    row = dict(entry, command=shlex.join(cmd))
    row.pop("runnable", None)
    if os.path.exists(json_path):
        os.remove(json_path)
    t0 = time.time()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row["wall_s"] = round(time.time() - t0, 1)
    if rc == 0 and os.path.exists(json_path):
        with open(json_path) as fh:
            res = read_run_json(fh.read())
        tps = res["tokens_per_s"]
        step_ms = res.get("step_ms_median", res["step_s"] * 1e3 if "step_s" in res else None)
        row.update(status="ok", tokens_per_s=tps, tokens_per_s_per_gpu=res.get("tokens_per_s_per_gpu",
                                                                                tps / entry["gpus"]),
                   peak_gib_per_gpu=res.get("peak_mem_gib"), step_ms=step_ms, mfu=res.get("mfu"), train=res)
        if "bubble_fraction_mean" in res:
            row.update(bubble_mean=res["bubble_fraction_mean"], bubble_max=res["bubble_fraction_max"],
                       bubble_theory=res["bubble_fraction_theory"], microbatches=res.get("microbatches"))
        return row
    with open(log_path, errors="replace") as fh:
        text = fh.read()
    oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
    row.update(status="failed", error=("out of memory: " if oom else f"exit {rc}: ") + failure_reason(text),
               log=log_path)
    return row


def failure_reason(log: str) -> str:
    """The line of a failed run's log that names the error (the last ``SomeError: ...`` a rank raised, not
    torchrun's own summary), else the log's last lines."""
    found = [ln.strip() for ln in log.splitlines()
             if re.match(r"\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception): ", ln) and "ChildFailedError" not in ln]
    return found[-1][:600] if found else log[-600:].strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help=f"presets (default: {DEFAULT_MODELS})")
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS,
                    help="1gpu, dpN, tpM, dpNxtpM (default: all eight); 1gpu is the efficiency baseline")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: 2048)")
    ap.add_argument("--global-batch", type=int, default=0,
                    help="fixed sequences per step, split over data-parallel ranks (default 0: use "
                         "--batch-per-dp-rank, weak scaling)")
    ap.add_argument("--batch-per-dp-rank", type=int, default=8, help="sequences per data-parallel rank (default 8)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run (default: 10)")
    ap.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (default: 3)")
    ap.add_argument("--dp-mode", choices=["fsdp", "ddp"], nargs="+", default=["fsdp"],
                    help="data parallel mode (default fsdp); two modes (fsdp ddp): every dpN layout once in each, "
                         "named dpN-fsdp / dpN-ddp, beside one 1-GPU baseline")
    ap.add_argument("--pp-schedule", default="1f1b",
                    help="schedule of a ppN layout without its own (ppN-<schedule>): gpipe, 1f1b, interleaved-1f1b, "
                         "interleaved-zb, zbv (default: 1f1b)")
    ap.add_argument("--microbatches", type=int, default=8,
                    help="micro-batches per step of a ppN layout: its batch split into this many (default: 8)")
    ap.add_argument("--recompute", default="", metavar="ITEMS",
                    help="bench_train --recompute for every run: comma list of conv, dt, gate, states (activations "
                         "rebuilt in the backward instead of kept; docs/memory.md). Default: keep everything")
    ap.add_argument("--train-args", default="", help="extra bench_train flags, quoted (e.g. '--compile')")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to assume (default: torch.cuda.device_count())")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run (default: 900)")
    ap.add_argument("--out", default="bench_results/scaling", metavar="DIR", help="output folder")
    ap.add_argument("--dry-run", action="store_true", help="print the torchrun commands, run nothing")
    ap.add_argument("--from-json", nargs="+", metavar="JSON", default=None,
                    help="do not run: merge these scaling.json files and rewrite the table and plot in --out")
    a = ap.parse_args(argv)
    if a.recompute:  # refused here, not once per torchrun run
        from mamba_parallel.layers.recompute import RECOMPUTE_ITEMS, parse_items

        unknown = parse_items(a.recompute)[1]
        if unknown:
            ap.error(f"--recompute: unknown item(s) {', '.join(unknown)}; expected a comma list of "
                     f"{', '.join(RECOMPUTE_ITEMS)}")

    if a.from_json:
        results = []
        for path in a.from_json:
            with open(path) as fh:
                results.append(json.load(fh))
        write_outputs(merge_results(results), a.out)
        print(open(os.path.join(a.out, "scaling.md")).read())
        return 0

    if a.gpus is None:
        import torch

        gpus, device = torch.cuda.device_count(), (torch.cuda.get_device_name() if torch.cuda.is_available()
                                                   else "cpu")
    else:
        gpus, device = a.gpus, f"{a.gpus} GPUs (assumed)"
    dp_modes = tuple(dict.fromkeys(a.dp_mode))
    entries = plan(a.models, a.layouts, gpus, a.pp_schedule, dp_modes)
    for e in entries:  # check every layout's batch before running anything
        e["batch_per_dp_rank"] = batch_per_rank(e["dp"], a.global_batch, a.batch_per_dp_rank)
        if e["pp"] > 1:
            e["micro_batch"] = micro_batch(e["layout"], e["batch_per_dp_rank"], a.microbatches)
    extra = shlex.split(a.train_args) + (["--recompute", a.recompute] if a.recompute else [])
    run_dir = os.path.join(a.out, "runs")
    result = dict(bench="scaling", device=device, gpus_available=gpus, rows=[],
                  settings=dict(seq_len=a.seq_len, steps=a.steps, warmup_steps=a.warmup_steps,
                                dp_mode=" / ".join(dp_modes),
                                microbatches=a.microbatches if any(e["pp"] > 1 for e in entries) else None,
                                global_batch=a.global_batch, batch_per_dp_rank=a.batch_per_dp_rank,
                                train_args=a.train_args, recompute=a.recompute,
                                batch_desc=f"global batch {a.global_batch}" if a.global_batch > 0 else
                                f"{a.batch_per_dp_rank} sequences per data-parallel rank"))
    if not a.dry_run:
        os.makedirs(run_dir, exist_ok=True)
    for e in entries:
        stem = f"{e['model']}_{e['layout']}"
        json_path = os.path.join(run_dir, stem + ".json")
        if e["pp"] > 1:  # bench_pipeline's own flags (--train-args / --recompute are bench_train's)
            cmd = pipeline_command(e["model"], e["pp"], e["schedule"], a.seq_len, a.microbatches, e["micro_batch"],
                                   a.steps, a.warmup_steps, json_path)
        else:
            cmd = train_command(e["model"], e["dp"], e["tp"], a.seq_len, e["batch_per_dp_rank"], a.steps,
                                a.warmup_steps, e["dp_mode"], json_path, extra)
        if not e["runnable"]:
            print(f"# skip {stem}: needs {e['gpus']} GPUs, {gpus} available")
            row = {k: v for k, v in e.items() if k != "runnable"}
            row.update(status=f"skipped (needs {e['gpus']} GPUs)", command=shlex.join(cmd))
        elif a.dry_run:
            print(shlex.join(cmd))
            continue
        else:
            print(f"# run {stem}: {shlex.join(cmd)}", flush=True)
            row = run_one(e, cmd, os.path.join(run_dir, stem + ".json"), os.path.join(run_dir, stem + ".log"),
                          a.timeout)
            print(f"#   {row['status']}" + (f": {row['tokens_per_s']:,.0f} tokens/s" if row["status"] == "ok"
                                           else f": {row.get('error', '')[:300]}"), flush=True)
        result["rows"].append(row)
        if not a.dry_run:
            write_outputs(result, a.out, plot=False)  # after every run: a killed sweep keeps its rows
    if not a.dry_run:
        write_outputs(result, a.out)
        print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
