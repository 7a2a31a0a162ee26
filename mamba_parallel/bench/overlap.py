"""How long each kind of collective takes in a profiled step, and how much of that time overlaps compute.

From a torch.profiler Chrome trace: every collective (an NCCL kernel on a GPU: all-gather, reduce-scatter,
all-reduce, send / receive, broadcast) is an interval on its lane (a GPU's stream); its overlapped time is the part
of it during which at least one compute event (any other kernel, memory copies and sets excluded) runs on another
lane of the same device: the length of its intersection with the union of those events' intervals. Per kind:
calls, total time and overlapped time per step, and overlapped / total. An NCCL kernel's time includes the time it
waits for the other ranks to reach the same collective, so a rank that arrives early shows a longer collective.

``lanes="cpu"`` reads a CPU run's trace the same way (c10d ops as the collectives, threads as the lanes, gloo's own
worker threads not counted as compute): on gloo the op records the host time of the call, which is what a CPU run
can show.
"""

from __future__ import annotations

import bisect
import json
import re

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv", "broadcast", "all_to_all", "other")
_KIND_RULES = (("reduce_scatter", r"reducescatter"), ("all_gather", r"allgather"), ("all_reduce", r"allreduce"),
               ("all_to_all", r"alltoall"), ("send_recv", r"sendrecv|send|recv"), ("broadcast", r"broadcast"))
_GPU_COMPUTE = ("kernel",)
_COLLECTIVE_GPU = re.compile(r"^nccl", re.IGNORECASE)
_COLLECTIVE_CPU = re.compile(r"^(c10d::|gloo:)", re.IGNORECASE)


def collective_kind(name: str) -> str:
    """'ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...)' -> 'reduce_scatter' (one of KINDS)."""
    flat = re.sub(r"[^a-z]", "", name.lower())
    for kind, pattern in _KIND_RULES:
        if re.search(pattern, flat):
            return kind
    return "other"


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(start: float, end: float, merged: list[tuple[float, float]], starts: list[float] | None = None) -> float:
    """Length of [start, end) covered by ``merged`` (sorted disjoint intervals; ``starts``: their starts)."""
    starts = [s for s, _ in merged] if starts is None else starts
    i = max(0, bisect.bisect_right(starts, start) - 1)
    total = 0.0
    while i < len(merged) and merged[i][0] < end:
        s, e = merged[i]
        total += max(0.0, min(e, end) - max(s, start))
        i += 1
    return total


def _lane_events(events: list[dict], lanes: str) -> list[tuple[object, object, str, float, float, bool]]:
    """(device, lane, name, start, end, is_collective) of the trace's timed events of interest."""
    out = []
    comm_threads = {(ev.get("pid"), ev.get("tid")) for ev in events
                    if lanes == "cpu" and ev.get("ph") == "X" and str(ev.get("name", "")).startswith("gloo:")}
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        args = ev.get("args") or {}
        if lanes == "gpu":
            if cat not in _GPU_COMPUTE:
                continue
            device, lane = args.get("device", ev.get("pid")), args.get("stream", ev.get("tid"))
            collective = bool(_COLLECTIVE_GPU.match(name))
        else:
            if cat != "cpu_op" or (ev.get("pid"), ev.get("tid")) in comm_threads:
                continue
            device, lane = ev.get("pid"), ev.get("tid")
            collective = bool(_COLLECTIVE_CPU.match(name))
        start = float(ev["ts"])
        out.append((device, lane, name, start, start + float(ev["dur"]), collective))
    return out


def collective_overlap(events: list[dict], steps: int = 1, lanes: str = "gpu") -> dict:
    """Per collective kind: calls, ms and overlapped ms per step, overlap fraction (see the module docstring).

    events: a Chrome trace's ``traceEvents``; steps: how many steps the trace holds (figures are per step);
    lanes: "gpu" (kernels by device and stream) or "cpu" (ops by process and thread)."""
    if lanes not in ("gpu", "cpu"):
        raise ValueError(f"lanes must be 'gpu' or 'cpu', got {lanes!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    timed = _lane_events(events, lanes)
    compute: dict[tuple, list[tuple[float, float]]] = {}
    for device, lane, _, s, e, coll in timed:
        if not coll:
            compute.setdefault((device, lane), []).append((s, e))
    merged_other: dict[tuple, tuple[list, list]] = {}

    def others(device, lane):
        """The union of compute on every lane of ``device`` but ``lane`` (cached per lane)."""
        key = (device, lane)
        if key not in merged_other:
            m = merge([iv for (d, ln), ivs in compute.items() if d == device and ln != lane for iv in ivs])
            merged_other[key] = (m, [s for s, _ in m])
        return merged_other[key]

    totals = {k: [0, 0.0, 0.0] for k in KINDS}  # calls, us, overlapped us
    for device, lane, name, s, e, coll in timed:
        if not coll:
            continue
        m, starts = others(device, lane)
        t = totals[collective_kind(name)]
        t[0] += 1
        t[1] += e - s
        t[2] += covered(s, e, m, starts)
    kinds = [{"kind": k, "calls_per_step": round(n / steps, 2), "ms_per_step": round(us / steps / 1e3, 4),
              "overlapped_ms_per_step": round(ov / steps / 1e3, 4),
              "overlap_fraction": round(ov / us, 4) if us > 0 else None}
             for k, (n, us, ov) in totals.items() if n]
    total_us = sum(t[1] for t in totals.values())
    total_ov = sum(t[2] for t in totals.values())
    return {"lanes": lanes, "steps": steps, "kinds": kinds,
            "total_ms_per_step": round(total_us / steps / 1e3, 4),
            "overlapped_ms_per_step": round(total_ov / steps / 1e3, 4),
            "overlap_fraction": round(total_ov / total_us, 4) if total_us > 0 else None}


def trace_events(path: str) -> list[dict]:
    """The ``traceEvents`` of a Chrome trace file (torch.profiler's ``export_chrome_trace``)."""
    with open(path) as fh:
        trace = json.load(fh)
    return trace.get("traceEvents", []) if isinstance(trace, dict) else trace


def markdown(per_rank: list[dict]) -> str:
    """A table: kind x rank -> calls, ms and overlapped ms per step, overlap share."""
    lines = ["| collective | rank | calls / step | ms / step | overlapped ms / step | overlapped |",
             "|---|---|---|---|---|---|"]
    for rank, summary in enumerate(per_rank):
        for k in summary["kinds"]:
            frac = "–" if k["overlap_fraction"] is None else f"{k['overlap_fraction']:.1%}"
            lines.append(f"| {k['kind']} | {rank} | {k['calls_per_step']:g} | {k['ms_per_step']:.3f} | "
                         f"{k['overlapped_ms_per_step']:.3f} | {frac} |")
        frac = "–" if summary["overlap_fraction"] is None else f"{summary['overlap_fraction']:.1%}"
        lines.append(f"| all | {rank} | | {summary['total_ms_per_step']:.3f} | {summary['overlapped_ms_per_step']:.3f}"
                     f" | {frac} |")
    return "\n".join(lines)
