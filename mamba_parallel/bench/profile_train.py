"""Where one training step's time goes: torch.profiler over a few steps of bench_train's step, as JSON + Markdown.

Reports the top GPU kernels by total time with a category (matmul, ssd, selective_scan, conv, norm, cross_entropy,
optimizer, copy/cast/elementwise, nccl, other), each category's share of the step, kernel launches per step, and
host (CPU) time per step against GPU busy time per step (a step whose GPU sits idle is host-bound). On CPU the
"kernels" are aten ops with their self CPU time (useful to count copies / casts; the naive backend runs there).

    python -m mamba_parallel.bench.profile_train --preset mamba2-1.3b --out prof_dir [--trace] [--peer]

Writes ``profile.json`` and ``profile.md`` (and ``trace.json``, a Chrome trace, with ``--trace``) under ``--out``.
``--peer`` then profiles the peer's step (mamba_ssm, built as ``bench train --peer`` builds it) in the same process,
on the same batch, both steps without gradient clipping; the report puts the two side by side by category.
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
from mamba_parallel.train.config import DEFAULT_RECOMPUTE

CATEGORIES = ("matmul", "ssd", "selective_scan", "conv", "norm", "cross_entropy", "optimizer",
              "copy/cast/elementwise", "nccl", "other")

# First match wins, so the specific names (our Triton kernels) come before the generic ones (gemm, elementwise).
_RULES: tuple[tuple[str, str], ...] = (
    ("nccl", r"nccl|c10d::|all_reduce|allreduce|reduce_scatter|all_gather"),
    # SSD kernel names start with "_"; the look-behind keeps norm_bwd_dx_kernel out of "_dx_kernel". The last
    # two lines are mamba_ssm's SSD Triton kernels (_chunk_scan_*, _chunk_state_fwd/bwd_*, _bmm_chunk_*, ...).
    ("ssd", r"(?<![a-z0-9])(_dt_fwd_kernel|_dt_bwd_kernel|"
            r"_chunk_state_pass_fwd_kernel|_chunk_states_kernel|_state_grad_pass_kernel|_scan_fwd_kernel|_intra_kernel|_carried_kernel|"
            r"_dx_kernel|_gate_bwd_kernel|"
            r"_chunk_cumsum_\w*kernel|_chunk_state_(fwd|bwd|varlen)\w*kernel|_chunk_scan_\w*kernel|"
            r"_state_passing_\w*kernel|_bmm_chunk_\w*kernel)|mamba2_step_kernel|ssd"),
    # with the Mamba-1 scan: its backward's carry pass and finishing sums, and the gate around it (gate_fwd /
    # gate_bwd: mamba_ssm's scan kernels gate inside), so that both sides' scans are compared whole
    ("selective_scan", r"selective_scan|mamba1_step_kernel|adjoint_carry_kernel|finish_bwd_kernel|"
                       r"(?<!_)gate_(fwd|bwd)_kernel"),
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


class _Steps:
    """One side's training step: forward + loss under the run's autocast, backward, grad-norm clip (when
    ``grad_clip`` > 0), optimizer step, zero grads. A side sets model, optimizer, cfg, env, grad_clip and ``loss``."""

    def loss(self) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> torch.Tensor:
        from mamba_parallel.train.trainer import _autocast, _grad_norm

        with _autocast(self.cfg, self.env.device):
            loss = self.loss()
        loss.backward()
        if self.grad_clip > 0:
            _grad_norm(self.model, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)


class _Setup(_Steps):
    """bench_train's model, optimizer and synthetic batch for the parsed flags, and its training step."""

    def __init__(self, a: argparse.Namespace):
        from mamba_parallel.distributed.data_parallel import init_distributed
        from mamba_parallel.train.config import resolve_config
        from mamba_parallel.train.optim import build_optimizer
        from mamba_parallel.train.trainer import build_parallel_model, choose_dims

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
        # beside the peer, as the side-by-side benchmark runs both steps: no clipping
        self.grad_clip = 0.0 if getattr(a, "peer", None) else getattr(a, "grad_clip", 1.0)
        # as bench_train: ranks of one tp / cp group share a batch (their cp slice)
        dp_rank = env.rank // (dims.cp * dims.tp)
        gen = torch.Generator().manual_seed(1000 + dp_rank)
        tokens = torch.randint(0, config.vocab_size, (a.batch_size, a.seq_len + 1), generator=gen)
        n = a.seq_len // dims.cp
        c = (env.rank // dims.tp) % dims.cp
        self.inputs = tokens[:, c * n:(c + 1) * n].to(env.device)
        self.labels = tokens[:, 1 + c * n:1 + (c + 1) * n].to(env.device)

    def loss(self) -> torch.Tensor:
        return self.model(self.inputs, targets=self.labels).loss

    def free(self) -> None:
        """Drop the model and optimizer (the batch stays), so that the peer's side does not add to their memory."""
        from mamba_parallel.bench.train_side_by_side import _free

        self.model = self.optimizer = None
        _free(self.env.device)


class _PeerSetup(_Steps):
    """The peer's model, optimizer and loss as the side-by-side benchmark (train_side_by_side.py) builds them, on
    our side's batch, under the same autocast; no gradient clipping there."""

    def __init__(self, peer, ours: _Setup, seed: int = 0):
        from mamba_parallel.bench.peer import PeerUnavailable
        from mamba_parallel.bench.train_side_by_side import side_optimizer

        self.peer, self.cfg, self.env, self.grad_clip = peer, ours.cfg, ours.env, 0.0
        self.inputs, self.labels = ours.inputs, ours.labels
        torch.manual_seed(seed)
        try:
            self.model = peer.build_lm(ours.cfg.model_config(), self.env.device)
        except PeerUnavailable as e:
            raise SystemExit(f"profile_train --peer: {e}") from None
        self.model.train()
        self.optimizer = side_optimizer(self.model, self.env.device)

    def loss(self) -> torch.Tensor:
        return self.peer.loss(self.model, self.inputs, self.labels)


def _check_peer_flags(a: argparse.Namespace):
    """The peer adapter for ``--peer`` (None without it), after checking the run is one the peer can match: one
    process, without the parallel / memory / compile options only our model has."""
    if not a.peer:
        return None
    from mamba_parallel.bench.peer import resolve_peer

    other = [flag for flag, on in (("torchrun (one process only)", torch.distributed.is_torchelastic_launched()),
                                   ("--tp", a.tp > 1), ("--cp", a.cp > 1), ("--compile", a.compile),
                                   ("--recompute", a.recompute != DEFAULT_RECOMPUTE),
                                   ("--activation-checkpointing", a.activation_checkpointing)) if on]
    if other:
        raise SystemExit(f"profile_train: --peer profiles the one-process step without {', '.join(other)}: drop "
                         f"{'it' if len(other) == 1 else 'them'} (or drop --peer)")
    return resolve_peer(True, a.peer_impl)


def _timed_steps(s: _Steps, n: int) -> tuple[float, float]:
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
        f"(dp {r['dp']}, tp {r['tp']}, cp {r['cp']}), {r['profiled_steps']} profiled steps."
        + (" No gradient clipping (as the side-by-side benchmark runs both steps; the peer's step follows below)."
           if "peer" in r else ""),
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
    lines += ["", f"## Top {len(r['top_kernels'])} {what} by total time", "", *_kernel_table(r["top_kernels"])]
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
    if r.get("peer"):
        lines += ["", *_peer_markdown(r, what)]
    return "\n".join(lines) + "\n"


def _kernel_table(top_kernels: list[dict]) -> list[str]:
    """The Markdown rows of a top-kernels table."""
    lines = ["| # | name | category | ms / step | calls / step | avg µs | share |", "|---|---|---|---|---|---|---|"]
    for i, k in enumerate(top_kernels, 1):
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        name = name.replace("|", "\\|")
        lines.append(f"| {i} | `{name}` | {k['category']} | {k['ms_per_step']:.3f} | {k['calls_per_step']:g} | "
                     f"{k['avg_us']:.1f} | {k['share']:.1%} |")
    return lines


def _peer_markdown(r: dict, what: str) -> list[str]:
    """The "Beside the peer" section: both steps by category and overall, then the peer's top kernels."""
    p = r["peer"]
    versions = ", ".join(f"{k} {v}" for k, v in (p.get("versions") or {}).items() if v)
    ours_cat = {c["category"]: c["ms_per_step"] for c in r["categories"]}
    peer_cat = {c["category"]: c["ms_per_step"] for c in p["categories"]}
    cats = sorted((c for c in CATEGORIES if ours_cat.get(c) or peer_cat.get(c)),
                  key=lambda c: -max(ours_cat.get(c, 0.0), peer_cat.get(c, 0.0)))
    lines = [f"## Beside the peer: {p['name']}" + (f" ({versions})" if versions else ""), "",
             "The peer's step as the side-by-side benchmark (`bench train --peer`) runs it: its model built and "
             "initialised by the peer, `F.cross_entropy` on its logits, AdamW (fused on CUDA), no gradient clipping; "
             "the same batch, autocast, warm-up and profiled steps as ours, profiled after ours in this process "
             f"(ours freed first). Categories: {what}, summed time.", "",
             "| category | ours ms / step | peer ms / step | ours - peer |", "|---|---|---|---|"]

    def row(label, ours, peer, fmt=".2f"):
        lines.append(f"| {label} | {ours:{fmt}} | {peer:{fmt}} | {ours - peer:+{fmt}} |")

    for c in cats:
        row(c, ours_cat.get(c, 0.0), peer_cat.get(c, 0.0))
    row("wall step (unprofiled, median)", r["step_ms"], p["step_ms"])
    row("host: CPU time to issue the step", r["host_ms"], p["host_ms"])
    row("busy (union of intervals)", r["busy_ms_per_step"], p["busy_ms_per_step"])
    row("launches per step (count)", r["launches_per_step"], p["launches_per_step"], ".0f")
    lines += ["", f"Peer: busy / wall (profiled) {p['busy_fraction']:.1%}. {p['verdict']}",
              "", f"### The peer's top {len(p['top_kernels'])} {what} by total time", "",
              *_kernel_table(p["top_kernels"])]
    return lines


def _python_profile(s: _Steps, steps: int, path: str | None) -> None:
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
    if a.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {a.steps}")
    if getattr(a, "cuda_graph", False):
        raise SystemExit("profile_train: --cuda-graph is not supported (the profiler tables need the eager step's "
                         "launches); profile without it, time the graphed step with bench_train --cuda-graph")
    peer = _check_peer_flags(a)
    s = _Setup(a)
    if peer is not None:  # a model the peer cannot build stops the run now, before ours is profiled
        from mamba_parallel.bench.peer import PeerUnavailable

        try:
            peer.config(s.cfg.model_config())
        except PeerUnavailable as e:
            raise SystemExit(f"profile_train --peer: {e}") from None
    on_cuda = s.env.device.type == "cuda"
    result = {
        "bench": "profile_train", "preset": a.preset,
        "device": torch.cuda.get_device_name(s.env.device) if on_cuda else "cpu",
        "world_size": s.env.world_size, "dp": s.dims.dp, "tp": s.dims.tp, "cp": s.dims.cp, "dtype": a.dtype,
        "seq_len": a.seq_len, "batch_size": a.batch_size, "profiled_steps": a.steps,
        "backend": requested_backend(),
        **_profile_steps(s, a, ""),
    }
    if peer is not None:
        s.free()  # ours' weights, gradients and optimizer state go before the peer's are made
        side = _PeerSetup(peer, s)
        versions = peer.versions() if hasattr(peer, "versions") else {}
        result["grad_clip"] = s.grad_clip  # 0: neither side clips
        result["peer"] = {"name": peer.name, "versions": versions, **_profile_steps(side, a, "_peer")}
        side = None
    if s.env.is_main:
        with open(os.path.join(a.out, "profile.json"), "w") as fh:
            json.dump(result, fh, indent=1)
        md = markdown(result)
        with open(os.path.join(a.out, "profile.md"), "w") as fh:
            fh.write(md)
        print(md)
        if result.get("collectives") is not None:
            print(json.dumps({"collectives": result["collectives"]}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _profile_steps(s: _Steps, a: argparse.Namespace, suffix: str) -> dict:
    """One side's profile: ``--warmup-steps`` steps, then the median of unprofiled steps (wall and host time),
    then torch.profiler over ``--steps`` steps (and cProfile with ``--host-python``) -> its summary: times, busy
    fraction, verdict, last loss, per-kernel and per-category tables (and the collectives of a parallel step).
    ``suffix`` names this side's files under ``--out`` (trace{suffix}.json, host_python{suffix}.txt)."""
    from torch.profiler import ProfilerActivity, profile

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
    trace = os.path.join(a.out, f"trace{suffix}.json")
    events = None
    if on_cuda or s.env.world_size > 1:  # the trace's events: GPU kernels, and the collectives of a parallel step
        if keep:
            path = trace
        else:
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
        prof.export_chrome_trace(path)
        events = trace_events(path)
        if not keep:
            os.remove(path)
    elif keep:
        prof.export_chrome_trace(trace)
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
        "step_ms": round(step_ms, 3), "host_ms": round(host_ms, 3),
        "profiled_step_ms": round(prof_wall_us / a.steps / 1e3, 3), "busy_fraction": round(busy_fraction, 4),
        "verdict": verdict, "final_loss": round(float(loss.detach().float().item()), 4), **summary,
    }
    if collectives is not None:
        result["collectives"] = collectives
    if a.host_python:
        _python_profile(s, a.steps, os.path.join(a.out, f"host_python{suffix}.txt") if s.env.is_main else None)
    return result


if __name__ == "__main__":
    sys.exit(main())
