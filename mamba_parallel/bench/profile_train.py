"""Where one training step's time goes: torch.profiler over a few steps of bench_train's step, as JSON + Markdown.

Reports the top GPU kernels by total time with a category (matmul, ssd, selective_scan, conv, norm, cross_entropy,
optimizer, copy/cast/elementwise, nccl, other), each category's share of the step, kernel launches per step, and
host (CPU) time per step against GPU busy time per step (a step whose GPU sits idle is host-bound). On CPU the
"kernels" are aten ops with their self CPU time (useful to count copies / casts; the naive backend runs there).

    python -m mamba_parallel.bench.profile_train --preset mamba2-1.3b --out prof_dir [--trace]

Writes ``profile.json`` and ``profile.md`` (and ``trace.json``, a Chrome trace, with ``--trace``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch

from mamba_parallel.bench.overlap import collective_overlap, trace_events
from mamba_parallel.ops.backend import requested_backend
from mamba_parallel.bench.overlap import markdown as collectives_markdown

CATEGORIES = ("matmul", "ssd", "selective_scan", "conv", "norm", "cross_entropy", "optimizer",
              "copy/cast/elementwise", "nccl", "other")

# First match wins, so the specific names (our Triton kernels) come before the generic ones (gemm, elementwise).
_RULES: tuple[tuple[str, str], ...] = (
    ("nccl", r"nccl|c10d::|all_reduce|allreduce|reduce_scatter|all_gather"),
    # SSD kernel names start with "_"; the look-behind keeps norm_bwd_dx_kernel out of "_dx_kernel". The last
    # two lines are mamba_ssm's SSD Triton kernels (_chunk_scan_*, _chunk_state_fwd/bwd_*, _bmm_chunk_*, ...).
    ("ssd", r"(?<![a-z0-9])(_dt_fwd_kernel|_dt_bwd_kernel|"
            r"_chunk_state_pass_fwd_kernel|_state_grad_pass_kernel|_scan_fwd_kernel|_intra_kernel|_carried_kernel|"
            r"_dx_kernel|_gate_bwd_kernel|"
            r"_chunk_cumsum_\w*kernel|_chunk_state_(fwd|bwd|varlen)\w*kernel|_chunk_scan_\w*kernel|"
            r"_state_passing_\w*kernel|_bmm_chunk_\w*kernel)|mamba2_step_kernel|ssd"),
    ("selective_scan", r"selective_scan|mamba1_step_kernel"),
    ("conv", r"conv1d|causal_conv"),
    ("norm", r"norm_(fwd|bwd)|rms_norm|layer_norm|layernorm|rmsnorm"),
    ("cross_entropy", r"ce_chunk_kernel|cross_entropy|linearce|log_softmax|nll_loss|softmax"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|clip_grad|lamb(?!da)|sgd"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|wgmma|cublas|splitk|aten::(mm|addmm|bmm|matmul|linear|baddbmm)$|dot_kernel"),
    ("copy/cast/elementwise", r"elementwise|vectorized|copy|memcpy|memset|cat|fill|reduce|index|gather|scatter|"
                              r"clone|contiguous|transpose|where|aten::"),
)
_COMPILED = tuple((cat, re.compile(pat, re.IGNORECASE)) for cat, pat in _RULES)


def categorize(name: str) -> str:
    """A kernel (or aten op) name -> one of CATEGORIES."""
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return "other"


def build_parser() -> argparse.ArgumentParser:
    """bench_train's flags (same model, batch, dtype, parallel layout) plus the profiler's own."""
    from mamba_parallel.bench import bench_train

    p = bench_train.build_parser()
    p.prog = "python -m mamba_parallel.bench.profile_train"
    p.description = __doc__.splitlines()[0]
    p.set_defaults(steps=3, warmup_steps=3)
    p.add_argument("--out", required=True, help="folder for profile.json / profile.md (/ trace.json)")
    p.add_argument("--top", type=int, default=40, help="kernels listed in the table (default: 40)")
    p.add_argument("--trace", action="store_true", help="also keep the Chrome trace (trace.json) under --out")
    p.add_argument("--host-python", action="store_true",
                   help="also run the steps under cProfile and write host_python.txt under --out: the Python "
                        "functions the host spends the step in (for host-bound steps; cProfile slows them; main "
                        "thread only: on CUDA the backward's Python runs on autograd's device thread, see the "
                        "host-ops table for it)")
    return p


def _dp_options(a: argparse.Namespace) -> dict:
    """bench_train's data-parallel speed flags, when its parser has them, as build_parallel_model's ``options``."""
    if not hasattr(a, "fsdp_param_dtype"):
        return {}
    from mamba_parallel.bench.bench_train import dp_options

    return {"options": dp_options(a)}


class _Setup:
    """bench_train's model, optimizer and synthetic batch for the parsed flags, and its training step."""

    def __init__(self, a: argparse.Namespace):
        from mamba_parallel.distributed.data_parallel import init_distributed
        from mamba_parallel.train.config import resolve_config
        from mamba_parallel.train.optim import build_optimizer
        from mamba_parallel.train.trainer import _autocast, _grad_norm, build_parallel_model, choose_dims

        self.cfg = resolve_config(preset=a.preset, seq_len=a.seq_len, batch_size=a.batch_size, dtype=a.dtype,
                                  device=a.device, dp_mode=a.dp_mode, tp=a.tp, cp=a.cp, recompute=a.recompute,
                                  activation_checkpointing=a.activation_checkpointing, compile=a.compile,
                                  out="unused")
        self.env = env = init_distributed(self.cfg.device)
        config = self.cfg.model_config()
        self.dims = dims = choose_dims(self.cfg, config, env, lambda *_: None)
        if env.world_size > 1:
            dims.build_mesh(env.device.type)
        self.model, _ = build_parallel_model(config, self.cfg, env, dims, resuming=False, **_dp_options(a))
        self.optimizer = build_optimizer(self.model, 1e-4, 0.1, fused=env.device.type == "cuda")
        self._autocast, self._grad_norm = _autocast, _grad_norm
        self.grad_clip = getattr(a, "grad_clip", 1.0)
        # as bench_train: ranks of one tp / cp group share a batch (their cp slice)
        dp_rank = env.rank // (dims.cp * dims.tp)
        gen = torch.Generator().manual_seed(1000 + dp_rank)
        tokens = torch.randint(0, config.vocab_size, (a.batch_size, a.seq_len + 1), generator=gen)
        n = a.seq_len // dims.cp
        c = (env.rank // dims.tp) % dims.cp
        self.inputs = tokens[:, c * n:(c + 1) * n].to(env.device)
        self.labels = tokens[:, 1 + c * n:1 + (c + 1) * n].to(env.device)

    def step(self) -> torch.Tensor:
        """bench_train's timed step: forward + loss, backward, grad-norm clip, optimizer step, zero grads."""
        with self._autocast(self.cfg, self.env.device):
            loss = self.model(self.inputs, targets=self.labels).loss
        loss.backward()
        if self.grad_clip > 0:
            self._grad_norm(self.model, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)


def _timed_steps(s: _Setup, n: int) -> tuple[float, float]:
    """(median wall ms, median host ms) over n unprofiled steps; host = until the CPU has issued the whole step."""
    wall, host = [], []
    for _ in range(n):
        s.sync()
        t0 = time.perf_counter()
        s.step()
        t1 = time.perf_counter()
        s.sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return sorted(wall)[n // 2], sorted(host)[n // 2]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals: GPU busy time with overlapping streams counted once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _gpu_kernels(trace_path: str) -> tuple[dict[str, list[float]], float]:
    """From a Chrome trace: {kernel name: [durations µs]} over kernels / memcpys / memsets, and their busy µs."""
    return _gpu_kernels_of(trace_events(trace_path))


def _gpu_kernels_of(events: list[dict]) -> tuple[dict[str, list[float]], float]:
    per_name: dict[str, list[float]] = {}
    intervals = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        dur = float(ev.get("dur", 0.0))
        per_name.setdefault(ev["name"], []).append(dur)
        intervals.append((float(ev["ts"]), float(ev["ts"]) + dur))
    return per_name, _union_us(intervals)


def _cpu_ops(prof) -> tuple[dict[str, list[float]], float]:
    """CPU run: {aten op: [self µs per call, spread evenly]} and the summed self time (ops run one at a time)."""
    per_name: dict[str, list[float]] = {}
    for avg in prof.key_averages():
        if avg.key.startswith("ProfilerStep") or avg.count == 0:
            continue
        self_us = float(avg.self_cpu_time_total)
        per_name[avg.key] = [self_us / avg.count] * avg.count
    return per_name, sum(sum(v) for v in per_name.values())


def summarize(per_name: dict[str, list[float]], busy_us: float, steps: int, top: int) -> dict:
    """Per-kernel and per-category totals (ms per step, share, calls per step) from {name: [durations µs]}."""
    total_us = sum(sum(v) for v in per_name.values()) or 1.0
    kernels = sorted(((name, sum(d), len(d)) for name, d in per_name.items()), key=lambda r: -r[1])
    cats = {c: [0.0, 0] for c in CATEGORIES}
    for name, t, k in kernels:
        c = cats[categorize(name)]
        c[0] += t
        c[1] += k
    return {
        "kernel_ms_per_step": round(total_us / steps / 1e3, 3),
        "busy_ms_per_step": round(busy_us / steps / 1e3, 3),
        "launches_per_step": round(sum(k for _, _, k in kernels) / steps, 1),
        "categories": [{"category": c, "ms_per_step": round(t / steps / 1e3, 3), "share": round(t / total_us, 4),
                        "launches_per_step": round(k / steps, 1)} for c, (t, k) in cats.items()],
        "top_kernels": [{"name": name, "category": categorize(name), "ms_per_step": round(t / steps / 1e3, 3),
                         "calls_per_step": round(k / steps, 2), "avg_us": round(t / k, 2),
                         "share": round(t / total_us, 4)} for name, t, k in kernels[:top]],
    }


def markdown(result: dict) -> str:
    """The Markdown report of one profile_train result."""
    r = result
    what = "GPU kernels" if r["device"] != "cpu" else "aten ops (CPU self time)"
    lines = [
        f"# Training-step profile: {r['preset']} on {r['device']}",
        "",
        f"seq {r['seq_len']} x batch {r['batch_size']}, {r['dtype']} autocast, world {r['world_size']} "
        f"(dp {r['dp']}, tp {r['tp']}, cp {r['cp']}), {r['profiled_steps']} profiled steps.",
        "",
        "| per step | ms |", "|---|---|",
        f"| wall (unprofiled, median) | {r['step_ms']:.2f} |",
        f"| host: CPU time to issue the step (unprofiled) | {r['host_ms']:.2f} |",
        f"| {what}: summed time | {r['kernel_ms_per_step']:.2f} |",
        f"| {what}: busy (union of intervals) | {r['busy_ms_per_step']:.2f} |",
        "",
        f"Launches per step: {r['launches_per_step']:.0f}. Busy / wall (profiled): {r['busy_fraction']:.1%}. "
        f"{r['verdict']}",
        "",
        "## Share of step time by category", "",
        "| category | ms / step | share | launches / step |", "|---|---|---|---|",
    ]
    for c in sorted(r["categories"], key=lambda c: -c["ms_per_step"]):
        lines.append(f"| {c['category']} | {c['ms_per_step']:.2f} | {c['share']:.1%} | {c['launches_per_step']:.0f} |")
    lines += ["", f"## Top {len(r['top_kernels'])} {what} by total time", "",
              "| # | name | category | ms / step | calls / step | avg µs | share |", "|---|---|---|---|---|---|---|"]
    for i, k in enumerate(r["top_kernels"], 1):
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        name = name.replace("|", "\\|")
        lines.append(f"| {i} | `{name}` | {k['category']} | {k['ms_per_step']:.3f} | {k['calls_per_step']:g} | "
                     f"{k['avg_us']:.1f} | {k['share']:.1%} |")
    if r.get("collectives"):
        where = "GPU kernels by stream" if r["collectives"][0]["lanes"] == "gpu" else "CPU ops by thread (gloo)"
        lines += ["", "## Collectives: time per step and the part that overlaps compute", "",
                  f"From each rank's trace ({where}): a collective's overlapped time is the part during which a "
                  "compute kernel runs on another stream of its GPU. A collective's time includes waiting for the "
                  "other ranks.", "", collectives_markdown(r["collectives"])]
    if r.get("top_host_ops"):
        lines += ["", f"## Top {len(r['top_host_ops'])} host ops by self CPU time", "",
                  "| # | op | ms / step | calls / step | avg µs |", "|---|---|---|---|---|"]
        for i, k in enumerate(r["top_host_ops"], 1):
            name = k["name"][:90].replace("|", "\\|")
            lines.append(f"| {i} | `{name}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:g} | {k['avg_us']:.1f} |")
    return "\n".join(lines) + "\n"


def _python_profile(s: "_Setup", steps: int, path: str | None) -> None:
    """cProfile over ``steps`` steps (synchronised at the end): the top Python functions by own time and by
    cumulative time, written to ``path`` (None: this rank does not write)."""
    import cProfile
    import io
    import pstats

    s.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        s.step()
    s.sync()
    prof.disable()
    if path is None:
        return
    out = io.StringIO()
    out.write(f"cProfile over {steps} training steps (times are totals over the steps, cProfile-inflated)\n")
    for key in ("tottime", "cumulative"):
        out.write(f"\n==== sorted by {key} ====\n")
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
    with open(path, "w") as fh:
        fh.write(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    from mamba_parallel.train.trainer import resolve_recompute

    a = build_parser().parse_args(argv)
    resolve_recompute(a.recompute, a.compile)  # bench_train's --recompute, checked before any work
    return _profile(a)


def _profile(a: argparse.Namespace) -> int:
    """``main`` with its flags parsed and --recompute in effect."""
    from torch.profiler import ProfilerActivity, profile

    if a.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {a.steps}")
    if getattr(a, "cuda_graph", False):
        raise SystemExit("profile_train: --cuda-graph is not supported (the profiler tables need the eager step's "
                         "launches); profile without it, time the graphed step with bench_train --cuda-graph")
    s = _Setup(a)
    on_cuda = s.env.device.type == "cuda"
    for _ in range(a.warmup_steps):  # compile / autotune / allocator warm-up
        s.step()
    step_ms, host_ms = _timed_steps(s, max(a.steps, 3))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    s.sync()
    with profile(activities=activities, record_shapes=False) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = s.step()
            prof.step()
        s.sync()
        prof_wall_us = (time.perf_counter() - t0) * 1e6

    if s.env.is_main:
        os.makedirs(a.out, exist_ok=True)
    keep = a.trace and s.env.is_main
    events = None
    if on_cuda or s.env.world_size > 1:  # the trace's events: GPU kernels, and the collectives of a parallel step
        if keep:
            path = os.path.join(a.out, "trace.json")
        else:
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
        prof.export_chrome_trace(path)
        events = trace_events(path)
        if not keep:
            os.remove(path)
    elif keep:
        prof.export_chrome_trace(os.path.join(a.out, "trace.json"))
    if on_cuda:
        per_name, busy_us = _gpu_kernels_of(events)
    else:
        per_name, busy_us = _cpu_ops(prof)
    collectives = None
    if s.env.world_size > 1:  # every rank's own trace; rank 0 reports all of them
        mine = collective_overlap(events, a.steps, lanes="gpu" if on_cuda else "cpu")
        collectives = [None] * s.env.world_size
        torch.distributed.all_gather_object(collectives, mine)
    events = None

    summary = summarize(per_name, busy_us, a.steps, a.top)
    if on_cuda:  # the host side of a GPU step: aten ops by self CPU time (dispatch + launch cost per op)
        host_ops, _ = _cpu_ops(prof)
        summary["top_host_ops"] = summarize(host_ops, 0.0, a.steps, a.top)["top_kernels"]
    busy_fraction = min(1.0, busy_us / prof_wall_us) if prof_wall_us > 0 else 0.0
    if not on_cuda:
        verdict = "CPU run: op times are host times; use the GPU run for the host-bound question."
    elif busy_fraction < 0.85 or host_ms > 0.9 * step_ms:
        verdict = (f"HOST-BOUND: the GPU idles {1 - busy_fraction:.0%} of the step; host issue time {host_ms:.1f} ms "
                   f"vs wall {step_ms:.1f} ms (fewer launches, CUDA graphs or torch.compile would help).")
    else:
        verdict = (f"GPU-bound: the GPU is busy {busy_fraction:.0%} of the step; the host issues it in "
                   f"{host_ms:.1f} ms of {step_ms:.1f} ms.")
    result = {
        "bench": "profile_train", "preset": a.preset,
        "device": torch.cuda.get_device_name(s.env.device) if on_cuda else "cpu",
        "world_size": s.env.world_size, "dp": s.dims.dp, "tp": s.dims.tp, "cp": s.dims.cp, "dtype": a.dtype,
        "seq_len": a.seq_len, "batch_size": a.batch_size, "profiled_steps": a.steps,
        "backend": requested_backend(),
        "step_ms": round(step_ms, 3), "host_ms": round(host_ms, 3),
        "profiled_step_ms": round(prof_wall_us / a.steps / 1e3, 3), "busy_fraction": round(busy_fraction, 4),
        "verdict": verdict, "final_loss": round(float(loss.detach().float().item()), 4), **summary,
    }
    if collectives is not None:
        result["collectives"] = collectives
    if a.host_python:
        _python_profile(s, a.steps, os.path.join(a.out, "host_python.txt") if s.env.is_main else None)
    if s.env.is_main:
        with open(os.path.join(a.out, "profile.json"), "w") as fh:
            json.dump(result, fh, indent=1)
        md = markdown(result)
        with open(os.path.join(a.out, "profile.md"), "w") as fh:
            fh.write(md)
        print(md)
        if collectives is not None:
            print(json.dumps({"collectives": collectives}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
