"""Where one decode step's time goes: generate's one-token step, kernel by kernel, against the bytes it must move.

A batch-1 decode step reads every weight once and every layer's recurrent state once (and writes the state back):
those bytes over the GPU's copy bandwidth are the step's lower bound. This tool times the step as ``generate`` runs
it (a CUDA graph replay on a GPU), times the same step eagerly, profiles both with torch.profiler (kernels of the
graph replay where the profiler sees them, else the eager step's), and sets the step against that bound.

    mamba-parallel bench profile_decode --preset mamba2-2.7b --batch 1 --out prof_dir [--cache-dtype bf16]

Writes ``profile.json`` and ``profile.md`` under ``--out`` (and ``trace.json``, a Chrome trace, with ``--trace``).
On a CPU the step runs eagerly and the table lists aten ops by self CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from mamba_parallel.bench.overlap import trace_events
from mamba_parallel.bench.profile_train import _cpu_ops, _gpu_kernels_of, summarize
from mamba_parallel.bench.timing import DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mamba-parallel bench profile_decode", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mamba2-2.7b", help="model preset, random weights (default: mamba2-2.7b)")
    p.add_argument("--n-layer", type=int, default=None, help="the preset cut to this many layers")
    p.add_argument("--batch", type=int, default=1, help="rows decoded at once (default: 1)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens prefilled first (default: 256)")
    p.add_argument("--steps", type=int, default=50, help="decode steps per timing / profile (default: 50)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weight dtype (default: bf16)")
    p.add_argument("--cache-dtype", choices=sorted(DTYPES), default=None,
                   help="conv-state dtype (default: the model's)")
    p.add_argument("--state-dtype", choices=sorted(DTYPES), default="fp32", help="recurrent SSM states (default: fp32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--unfused", action="store_true",
                   help="run a Mamba-2 stack's step op by op even where the fused step applies (to compare)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=30, help="kernels listed in the table (default: 30)")
    p.add_argument("--out", required=True, help="folder for profile.json / profile.md (/ trace.json)")
    p.add_argument("--trace", action="store_true", help="also keep the graph replay's Chrome trace (trace.json)")
    return p


def step_bytes(model: torch.nn.Module, cache) -> dict:
    """Bytes one decode step must move at least: every parameter read once (the LM head reads the whole tied
    embedding; an untied embedding only one row per token, counted whole here: at most a vocab x d_model
    overestimate) and every cached state tensor read and written once."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = 0
    for entry in cache.key_value_memory_dict.values():
        for t in entry if isinstance(entry, (tuple, list)) else (entry,):
            if isinstance(t, torch.Tensor):
                states += t.numel() * t.element_size()
    return {"weight_bytes": weights, "state_bytes": states, "step_bytes": weights + 2 * states}


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Measured device-to-device copy bandwidth (GB/s, read + write counted) of a ``nbytes`` buffer."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, steps: int, device: torch.device) -> tuple[float, float]:
    """(wall ms per step, host ms per step) over ``steps`` back-to-back steps; host: until the CPU has issued them."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t1 = time.perf_counter()
    _sync(device)
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3 / steps, (t1 - t0) * 1e3 / steps


def profile_steps(step, steps: int, device: torch.device, trace_path: str | None = None) -> dict:
    """torch.profiler over ``steps`` steps -> profile_train's summary (per kernel / aten op and per category)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    if not on_cuda:
        if trace_path:
            prof.export_chrome_trace(trace_path)
        per_name, busy_us = _cpu_ops(prof)
        return summarize(per_name, busy_us, steps, 10 ** 6)
    path = trace_path
    if path is None:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
    prof.export_chrome_trace(path)
    per_name, busy_us = _gpu_kernels_of(trace_events(path))
    if trace_path is None:
        os.remove(path)
    return summarize(per_name, busy_us, steps, 10 ** 6)


def _model(a: argparse.Namespace, device: torch.device):
    from mamba_parallel.config import get_preset
    from mamba_parallel.models.lm import MambaLMHeadModel

    config = get_preset(a.preset)
    if a.n_layer is not None:
        config = config.with_layers(a.n_layer)
    torch.manual_seed(a.seed)
    model = MambaLMHeadModel(config, device=device, dtype=DTYPES[a.dtype]).eval()
    model.backbone.fused_decode = not a.unfused
    return model, config


def run(a: argparse.Namespace) -> dict:
    """The profile of ``a``'s decode step as a dict (what profile.json holds)."""
    if a.batch < 1 or a.steps < 1 or a.prompt_len < 1:
        raise ValueError(f"profile_decode: --batch, --steps and --prompt-len must be >= 1, got {a.batch}, "
                         f"{a.steps}, {a.prompt_len}")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, config = _model(a, device)
    cache_dtype = DTYPES[a.cache_dtype] if a.cache_dtype else None
    max_seqlen = a.prompt_len + 4 * a.steps + 8
    gen = torch.Generator().manual_seed(a.seed)
    prompt = torch.randint(0, config.vocab_size, (a.batch, a.prompt_len), generator=gen).to(device)
    token = prompt[:, -1:].clone()
    on_cuda = device.type == "cuda"
    with torch.inference_mode():
        if on_cuda:
            from mamba_parallel.inference.cuda_graph import make_graphed_decoder

            decoder = make_graphed_decoder(model, a.batch, max_seqlen, cache_dtype, DTYPES[a.state_dtype])
            cache = decoder.new_cache()
        else:
            decoder, cache = None, model.allocate_inference_cache(a.batch, max_seqlen, dtype=cache_dtype,
                                                                  state_dtype=DTYPES[a.state_dtype])
        model(prompt, inference_params=cache, num_last_tokens=1)  # prefill: states of a real prompt
        # The states update in place at a fixed offset: every step does the same work (offsets only gate the
        # one-token path for Mamba layers), so the cache never runs out during the repeated timings.
        cache.seqlen_offset = a.prompt_len

        def eager():
            return model(token, inference_params=cache).logits

        def graphed():
            return decoder(token, inference_params=cache).logits

        steps = {"eager": eager}
        if decoder is not None:
            steps["graph"] = graphed
        timings, profiles = {}, {}
        for name, step in steps.items():
            for _ in range(3):  # warm-up: autotuning, allocator
                step()
            wall, host = time_steps(step, a.steps, device)
            timings[name] = {"ms_per_step": round(wall, 4), "host_ms_per_step": round(host, 4)}
        for name, step in steps.items():
            trace = os.path.join(a.out, "trace.json") if a.trace and name == list(steps)[-1] else None
            profiles[name] = profile_steps(step, a.steps, device, trace)
    moved = step_bytes(model, cache)
    bandwidth = copy_bandwidth_gbs(device, nbytes=(1 << 30) if on_cuda else (1 << 26))
    main = "graph" if "graph" in timings else "eager"
    bound_ms = moved["step_bytes"] / (bandwidth * 1e9) * 1e3
    table = "graph" if "graph" in profiles and profiles["graph"]["top_kernels"] else "eager"
    kinds = sorted({type(layer.mixer).__name__ for layer in model.backbone.layers})
    return {
        "bench": "profile_decode", "preset": a.preset, "n_layer": config.n_layer, "mixers": kinds,
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu", "dtype": a.dtype,
        "cache_dtype": a.cache_dtype or a.dtype, "state_dtype": a.state_dtype, "batch": a.batch, "prompt_len": a.prompt_len,
        "fused_step": model.backbone._fused_decode_ok(a.batch),
        "steps": a.steps, "timings": timings, "step": main, "ms_per_step": timings[main]["ms_per_step"],
        **moved, "copy_bandwidth_gbs": round(bandwidth, 1), "bound_ms": round(bound_ms, 4),
        "bound_fraction": round(bound_ms / timings[main]["ms_per_step"], 4),
        "kernel_table": table, "profiles": profiles, "torch": torch.__version__,
    }


def markdown(r: dict, top: int = 30) -> str:
    what = "GPU kernels" if r["device"] != "cpu" else "aten ops (CPU self time)"
    t = r["timings"]
    lines = [f"# Decode-step profile: {r['preset']} ({', '.join(r['mixers'])}, {r['n_layer']} layers) on "
             f"{r['device']}", "",
             f"{'the fused step (three kernels per block), ' if r.get('fused_step') else ''}"
             f"batch {r['batch']}, {r['dtype']} weights, {r.get('state_dtype', 'fp32')} states, after a "
             f"{r['prompt_len']}-token "
             f"prompt; {r['steps']} steps per figure.", "",
             "| per step | value |", "|---|---|"]
    for name in ("graph", "eager"):
        if name in t:
            label = "CUDA graph replay (what generate runs)" if name == "graph" else "eager step"
            lines.append(f"| {label} | {t[name]['ms_per_step']:.3f} ms (host issue {t[name]['host_ms_per_step']:.3f}"
                         f" ms) |")
    lines += [f"| weights read | {r['weight_bytes'] / 1e9:.3f} GB |",
              f"| states read + written | {2 * r['state_bytes'] / 1e6:.1f} MB |",
              f"| measured copy bandwidth | {r['copy_bandwidth_gbs']:.0f} GB/s |",
              f"| bytes / bandwidth (the bound) | {r['bound_ms']:.3f} ms |",
              f"| bound / step | {r['bound_fraction']:.0%} |", ""]
    prof = r["profiles"][r["kernel_table"]]
    source = "the graph replay" if r["kernel_table"] == "graph" else "the eager step"
    lines += [f"{what} of {source}: {prof['kernel_ms_per_step']:.3f} ms summed, {prof['busy_ms_per_step']:.3f} ms "
              f"busy, {prof['launches_per_step']:.0f} launches per step "
              f"({prof['launches_per_step'] / max(1, r['n_layer']):.1f} per layer).", "",
              "| category | ms / step | share | launches / step |", "|---|---|---|---|"]
    for c in sorted(prof["categories"], key=lambda c: -c["ms_per_step"]):
        if c["launches_per_step"]:
            lines.append(f"| {c['category']} | {c['ms_per_step']:.3f} | {c['share']:.1%} | "
                         f"{c['launches_per_step']:.0f} |")
    lines += ["", "| # | name | category | µs / step | calls / step | avg µs | share |",
              "|---|---|---|---|---|---|---|"]
    for i, k in enumerate(prof["top_kernels"][:top], 1):
        name = (k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "...").replace("|", "\\|")
        lines.append(f"| {i} | `{name}` | {k['category']} | {k['ms_per_step'] * 1e3:.1f} | "
                     f"{k['calls_per_step']:g} | {k['avg_us']:.1f} | {k['share']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    result = run(a)
    with open(os.path.join(a.out, "profile.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    md = markdown(result, a.top)
    with open(os.path.join(a.out, "profile.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
