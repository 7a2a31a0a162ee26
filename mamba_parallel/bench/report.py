"""One Markdown report of every benchmark's JSON output, beside the peer figures (mamba_ssm on one H200).

    python -m mamba_parallel.bench.report RESULTS_DIR_OR_JSON ... [--anchors ANCHORS.md] [--out report.md]

Reads the JSON written by bench_ssd, bench_selective_scan, bench_ops, bench_train, bench_generate,
bench_scaling and bench_long_context (a folder is searched for *.json), recognises each by its layout, and prints
one table per area.
"x peer" columns are always "how many times better than the peer": peer time / our time, or our tokens/s /
peer tokens/s, so > 1 means we beat it. The peer figures are the table ``ANCHORS`` below (copied from the
project's ANCHORS.md); ``--anchors PATH`` reads them from such a Markdown file instead.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import re
import sys

# Peer figures: mamba_ssm 2.3.2.post1 + causal-conv1d 1.7.0, torch 2.11, Triton 3.6, bf16, one H200 (2026-11-30).
ANCHORS: dict = {
    # kernel shape -> (fwd ms, fwd+bwd ms)
    "ssd": {"b8 L4096 h64 p64 n128 g1": (1.44, 5.80), "b4 L16384 h64 p64 n128 g1": (2.62, 10.75),
            "b8 L4096 h32 p64 n64 g1": (1.21, 5.35)},
    "selective_scan": {"b8 d4096 L4096 n16": (2.44, 12.25), "b4 d5120 L8192 n16": (3.43, 15.74)},
    # one training step, seq 2048, batch 8: preset -> (tokens/s, peak GiB)
    "train": {"mamba2-130m": (91036, 17.8), "mamba2-370m": (51291, 30.2), "mamba2-1.3b": (42188, 57.4),
              "mamba2-2.7b": (22948, 97.0), "mamba-130m": (161754, 17.8), "mamba-370m": (70897, 30.0),
              "mamba-1.4b": (31631, 57.8), "mamba-2.8b": (17805, 98.1)},
    # DDP on 2 GPUs (Triton-only peer path), 8 sequences of 2048 per GPU: preset -> (1 GPU tok/s, 2 GPUs, scaling)
    "dp2": {"mamba2-370m": (44922, 75707, 1.69), "mamba2-1.3b": (25659, 49712, 1.94)},
    # generation, CUDA graphs, prompt 256 + 256 new tokens, greedy: preset -> {batch: ms/step}
    "generate": {"mamba2-130m": {1: 0.71, 64: 1.41}, "mamba2-2.7b": {1: 3.01, 64: 9.61},
                 "mamba-2.8b": {1: 3.24, 64: 4.67}},
    # longest sequence trained at batch 1 on one GPU (no activation checkpointing): preset -> (tokens, peak GiB)
    "long_context": {"mamba2-1.3b": (32768, 129.0)},
}


# ---- reading ANCHORS.md -------------------------------------------------------------------------------------------
def _num(cell: str) -> float:
    """First number of a table cell: '1.44–1.72' -> 1.44, '91,036' -> 91036, '0.71 (1,410)' -> 0.71."""
    m = re.search(r"\d[\d,]*\.?\d*", cell)
    if not m:
        raise ValueError(f"no number in table cell {cell!r}")
    return float(m.group(0).replace(",", ""))


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table of ``text`` as (header cells, body rows of cells)."""
    out, block = [], []
    for line in text.splitlines() + [""]:
        if line.strip().startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2:
            out.append((block[0], [r for r in block[2:] if len(r) == len(block[0])]))
        block = []
    return out


def parse_anchors(text: str) -> dict:
    """The ANCHORS dict from the text of an ANCHORS.md; tables it does not find keep the built-in figures."""
    anchors = copy.deepcopy(ANCHORS)
    for header, rows in _tables(text):
        h = " ".join(header).lower()
        if "fwd ms" in h:
            for op, shape, fwd, fb in (r[:4] for r in rows):
                key = "ssd" if "ssd" in op.lower() else "selective_scan"
                anchors[key][shape] = (_num(fwd), _num(fb))
        elif "peak gib" in h and "tokens/s" in h:
            anchors["train"].update({r[0].split()[0]: (_num(r[1]), _num(r[2])) for r in rows})
        elif "1 gpu tokens/s" in h:
            anchors["dp2"].update({r[0].split()[0]: (_num(r[1]), _num(r[2]), _num(r[3])) for r in rows})
        elif "ms/step" in h:
            batches = [int(re.search(r"batch (\d+)", c).group(1)) for c in header[1:]]
            anchors["generate"].update({r[0].split()[0]: {b: _num(c) for b, c in zip(batches, r[1:])}
                                        for r in rows})
    return anchors


# ---- reading results ----------------------------------------------------------------------------------------------
def load_results(paths: list[str]) -> list[tuple[str, dict]]:
    """(path, object) for every JSON object found: files, folders (their *.json), JSON-lines files."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "**", "*.json"), recursive=True))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"report: no such file or folder {p!r}")
    out = []
    for f in files:
        with open(f) as fh:
            text = fh.read()
        try:
            objs = [json.loads(text)]
        except json.JSONDecodeError:
            objs = [json.loads(line) for line in text.splitlines() if line.strip()]
        out += [(f, o) for o in objs if isinstance(o, dict)]
    return out


def kind_of(obj: dict) -> str | None:
    """Which benchmark wrote ``obj``: ssd, selective_scan, ops, train, generate, scaling (None if unknown)."""
    if obj.get("bench") in ("train", "generate", "scaling", "long_context"):
        return obj["bench"]
    if "scan" in obj and "decode" in obj:
        return "selective_scan"
    rows = obj.get("rows") or []
    if rows and isinstance(rows[0].get("shape"), dict) and "impl" in rows[0]:
        return "ssd"
    if rows and "op" in rows[0]:
        return "ops"
    return None


# ---- formatting ---------------------------------------------------------------------------------------------------
def _f(v, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def _ratio(peer, ours, higher_is_better: bool) -> str:
    if peer is None or ours is None or not peer or not ours or any(map(math.isnan, (peer, ours))):
        return "–"
    return f"{(ours / peer) if higher_is_better else (peer / ours):.2f}x"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_f(c) for c in r) + " |" for r in rows]


def section_kernels(found: dict, anchors: dict) -> list[str]:
    rows = []
    for obj in found.get("ssd", []):
        for r in obj["rows"]:
            shape = "b{b} L{L} h{h} p{p} n{n} g{g}".format(**r["shape"])
            peer = anchors["ssd"].get(shape, (None, None))
            rows.append([f"SSD chunk scan ({r['impl']})", shape, r.get("fwd_ms"), peer[0],
                         _ratio(peer[0], r.get("fwd_ms"), False), r.get("fwd_bwd_ms"), peer[1],
                         _ratio(peer[1], r.get("fwd_bwd_ms"), False)])
    for obj in found.get("selective_scan", []):
        for r in obj["scan"]:
            if "error" in r or r.get("config", "default") != "default":
                continue
            peer = anchors["selective_scan"].get(r["shape"], (None, None))
            rows.append(["selective scan", r["shape"], r["fwd_ms"], peer[0], _ratio(peer[0], r["fwd_ms"], False),
                         r["fwd_bwd_ms"], peer[1], _ratio(peer[1], r["fwd_bwd_ms"], False)])
    if not rows:
        return []
    return ["## Kernels (ms, lower is better)", ""] + _table(
        ["op", "shape", "fwd ms", "peer", "x peer", "fwd+bwd ms", "peer", "x peer"], rows) + [""]


def section_ops(found: dict) -> list[str]:
    rows = []
    for obj in found.get("ops", []):
        naive = {(r["op"], r["shape"]): r for r in obj["rows"] if r.get("impl") == "naive" and "error" not in r}
        for r in obj["rows"]:
            if "error" in r:
                rows.append([r["op"], r["shape"], r.get("impl"), "error", "", "", r["error"][:60]])
                continue
            ref = naive.get((r["op"], r["shape"]))
            vs = "" if ref is None or r.get("impl") == "naive" else \
                _ratio(ref.get("fwd_bwd_ms", ref.get("fwd_ms")), r.get("fwd_bwd_ms", r.get("fwd_ms")), False)
            frac = r.get("fwd_bwd_bw_frac", r.get("fwd_bw_frac"))
            rows.append([r["op"], r["shape"], r.get("impl"), r.get("fwd_ms"), r.get("fwd_bwd_ms"),
                         None if frac is None else f"{100 * frac:.0f}%", vs])
    if not rows:
        return []
    return ["## Other ops (no peer figure; x naive = speedup over the PyTorch reference)", ""] + _table(
        ["op", "shape", "impl", "fwd ms", "fwd+bwd ms", "of copy ceiling", "x naive"], rows) + [""]


def section_train(found: dict, anchors: dict) -> list[str]:
    rows = []
    for r in found.get("train", []):
        if r.get("world_size", 1) != 1:
            continue  # multi-GPU runs are compared in the scaling section
        peer = anchors["train"].get(r["preset"], (None, None))
        rows.append([r["preset"], r.get("batch_per_dp_rank"), str(r.get("seq_len")), r["tokens_per_s"], peer[0],
                     _ratio(peer[0], r["tokens_per_s"], True), r.get("peak_mem_gib"), peer[1], r.get("mfu")])
    if not rows:
        return []
    return ["## One training step, 1 GPU (tokens/s, higher is better)", ""] + _table(
        ["model", "batch", "seq", "tokens/s", "peer", "x peer", "peak GiB", "peer GiB", "MFU"], rows) + [""]


def section_scaling(found: dict, anchors: dict) -> list[str]:
    from mamba_parallel.bench.bench_scaling import add_efficiency

    rows = []
    for obj in found.get("scaling", []):
        for r in add_efficiency([dict(r) for r in obj["rows"]]):
            if r.get("status") != "ok":
                rows.append([r["model"], r["layout"], r["gpus"], r.get("status"), "", "", "", "", ""])
                continue
            peer, goal = "–", r.get("goal_speedup")  # issue 7's data-parallel goals, set by add_efficiency
            if r["layout"] == "dp2" and r["model"] in anchors["dp2"]:
                peer = f"{anchors['dp2'][r['model']][2]:.2f}x"
            rows.append([r["model"], r["layout"], r["gpus"], r["tokens_per_s"], r["tokens_per_s_per_gpu"],
                         r.get("peak_gib_per_gpu"), None if r.get("speedup") is None else f"{r['speedup']:.2f}x",
                         peer, None if goal is None else f">= {goal}x"])
    if not rows:
        return []
    return ["## Multi-GPU scaling (speedup over 1 GPU of the same model)", ""] + _table(
        ["model", "layout", "GPUs", "tokens/s", "tokens/s/GPU", "peak GiB/GPU", "speedup", "peer (DDP)", "goal"],
        rows) + [""]


def section_generate(found: dict, anchors: dict) -> list[str]:
    rows = []
    for obj in found.get("generate", []):
        for r in obj["rows"]:
            peer = anchors["generate"].get(r["model"], {}).get(r["batch"])
            rows.append([r["model"], r["batch"], r["mode"], r["prefill_ms"], r["decode_ms_per_step"],
                         r["decode_tokens_per_s"], peer, _ratio(peer, r["decode_ms_per_step"], False)
                         if r["mode"] == "graph" else "(eager)", r.get("peak_gib")])
    if not rows:
        return []
    return ["## Generation (decode ms/step, lower is better; the peer uses CUDA graphs)", ""] + _table(
        ["model", "batch", "mode", "prefill ms", "ms/step", "tokens/s", "peer ms/step", "x peer", "peak GiB"],
        rows) + [""]


def section_long_context(found: dict, anchors: dict) -> list[str]:
    rows = []
    for r in found.get("long_context", []):
        peer = anchors["long_context"].get(r.get("preset"), (None, None))
        status = "out of memory" if r.get("oom") else r.get("tokens_per_s")
        rows.append([r.get("preset"), str(r.get("seq_len")), r.get("world_size"), r.get("cp"),
                     "yes" if r.get("activation_checkpointing") else "no", status, r.get("peak_gib_per_gpu"),
                     None if peer[0] is None else f"{peer[0]:,} ({peer[1]} GiB, 1 GPU)"])
    if not rows:
        return []
    return ["## Long sequences, batch 1 (context parallel over the GPUs)", ""] + _table(
        ["model", "seq", "GPUs", "cp", "act. ckpt", "tokens/s", "peak GiB/GPU", "peer longest seq"], rows) + [""]


def build_report(results: list[tuple[str, dict]], anchors: dict | None = None) -> str:
    """Markdown text of the report for the (path, JSON object) pairs of ``load_results``."""
    anchors = anchors or ANCHORS
    found: dict[str, list] = {}
    unknown, devices = [], set()
    for path, obj in results:
        k = kind_of(obj)
        if k is None:
            unknown.append(path)
            continue
        found.setdefault(k, []).append(obj)
        if obj.get("device"):
            devices.add(str(obj["device"]))
    lines = ["# mamba-parallel benchmark report", "",
             f"Devices: {', '.join(sorted(devices)) or 'unknown'}. Peer: mamba_ssm 2.3.2 on one H200 (bf16). "
             "'x peer' > 1 means faster than the peer.", ""]
    lines += section_kernels(found, anchors) + section_ops(found) + section_train(found, anchors)
    lines += section_scaling(found, anchors) + section_long_context(found, anchors)
    lines += section_generate(found, anchors)
    if unknown:
        lines += ["Not recognised (skipped): " + ", ".join(unknown), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench report", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="JSON files written by the benchmarks, or folders holding them")
    ap.add_argument("--anchors", metavar="PATH", default=None,
                    help="read the peer figures from this ANCHORS.md (default: the copy built into this file)")
    ap.add_argument("--out", metavar="FILE", default=None, help="also write the report to FILE")
    a = ap.parse_args(argv)
    anchors = None
    if a.anchors:
        with open(a.anchors) as fh:
            anchors = parse_anchors(fh.read())
    text = build_report(load_results(a.paths), anchors)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
