"""``docs/performance.md`` (and one PNG of ratios per benchmark) from the newest side-by-side results.

    mamba-parallel bench report [--results benchmarks/results] [--out docs/performance.md] [--plots DIR]

Reads every result JSON under ``--results`` (``<date>-<device>/<bench>.json``, as the benchmarks write them), takes
the newest run of each benchmark (by its timestamp) and fills the rows it did not measure from earlier runs on the
same device with the same settings (a table split over several device calls), and writes one section per
benchmark: the command, device, commit and versions of each run it draws on, its settings, the side-by-side table,
its checks and its ratio plot; then, as tables of their own, the cases only runs on another device or with other
settings measured. The PNGs need
matplotlib (the ``bench`` extra); without it the report says so and still writes the tables.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mamba_parallel.bench.results import format_table, ratio_rule, sides_present

ORDER = ("ssd", "selective_scan", "train", "train_dp", "generate", "generate_bf16_states", "long_context")
DEFAULT_RESULTS = "benchmarks/results"
DEFAULT_OUT = "docs/performance.md"


def load_results(root: str | os.PathLike) -> list[tuple[Path, dict]]:
    """(path, result) for every side-by-side result file under ``root`` (other JSON is skipped)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"--results {root}: no such folder")
    files = [root] if root.is_file() else sorted(root.rglob("*.json"))
    out = []
    for f in files:
        try:
            obj = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict) and "bench" in obj and isinstance(obj.get("rows"), list) and "meta" in obj:
            out.append((f, obj))
    return out


def _comparable(a: dict, b: dict) -> bool:
    """Two runs of one benchmark whose rows may share a table: the same device and the same settings."""
    def settings(obj):
        return {k: v for k, v in (obj.get("settings") or {}).items() if k != "sides"}
    return a["meta"].get("device") == b["meta"].get("device") and settings(a) == settings(b)


def _merge(objs: list[dict]) -> dict:
    """Comparable runs of one benchmark, newest first -> the newest run's rows, completed by the earlier ones: a row
    the newest run did not measure (absent, or skipped: ours is None) is taken from the newest earlier run that
    measured it. Each row stays one run's same-process measurement; ``runs`` lists the metadata of every run the
    table draws on."""
    base = objs[0]
    rows = [dict(r) for r in base["rows"]]
    index = {(r["case"], r["metric"]): i for i, r in enumerate(rows)}
    checks = list((base.get("checks") or {}).get("step1_loss") or [])
    runs = [base["meta"]]
    for older in objs[1:]:
        used = False
        for r in older["rows"]:
            key = (r["case"], r["metric"])
            if r.get("ours") is None or (key in index and rows[index[key]].get("ours") is not None):
                continue
            if key in index:
                rows[index[key]] = dict(r)
            else:
                index[key] = len(rows)
                rows.append(dict(r))
            used = True
        if used:
            runs.append(older["meta"])
            have = {c.get("preset") for c in checks}
            checks += [c for c in (older.get("checks") or {}).get("step1_loss") or [] if c.get("preset") not in have]
    merged = {**base, "rows": rows, "runs": runs}
    if checks:
        merged["checks"] = {**(base.get("checks") or {}), "step1_loss": checks}
    return merged


def combine(results: list[tuple[Path, dict]]) -> dict[str, dict]:
    """Per benchmark, one table from the newest run and the earlier runs comparable with it (same device, same
    settings; see _merge). Runs on another device or with other settings are never mixed into it: the newest of
    them that measured cases no table before shows gives a table of those cases under ``earlier`` (e.g. the
    Mamba-3 presets trained on one GPU, the Mamba-2 ones on another), newest first."""
    by_bench: dict[str, list[dict]] = {}
    for _, obj in results:
        by_bench.setdefault(obj["bench"], []).append(obj)
    out = {}
    for bench, objs in by_bench.items():
        left = sorted(objs, key=lambda o: o["meta"].get("timestamp", ""), reverse=True)
        tables, shown = [], set()
        while left:
            group = [o for o in left if _comparable(left[0], o)]
            left = [o for o in left if not _comparable(left[0], o)]
            merged = _merge(group)
            if tables:  # a later table: only the measured cases no table before shows, and their presets' checks
                merged["rows"] = [r for r in merged["rows"]
                                  if (r["case"], r["metric"]) not in shown and r.get("ours") is not None]
                if not merged["rows"]:
                    continue
                if "checks" in merged:
                    presets = {r.get("preset") for r in merged["rows"]}
                    merged["checks"] = {**merged["checks"], "step1_loss": [
                        c for c in merged["checks"]["step1_loss"] if c.get("preset") in presets]}
            shown |= {(r["case"], r["metric"]) for r in merged["rows"]}
            tables.append(merged)
        out[bench] = {**tables[0], "earlier": tables[1:]}
    return dict(sorted(out.items(), key=lambda kv: (ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0])))


def _provenance(meta: dict) -> str:
    versions = [f"torch {meta.get('torch')}", f"Triton {meta.get('triton')}"]
    versions += [f"{k} {v}" for k, v in (meta.get("peer") or {}).items() if v]
    sha, plus, dirty = (meta.get("git_commit") or "unknown").partition("+")
    commit = sha[:12] + plus + dirty  # "+dirty": the tree had changes the commit does not hold
    return (f"`{meta.get('command')}` on {meta.get('device')}, {meta.get('timestamp')}, commit {commit}; "
            + ", ".join(versions))


def _checks(obj: dict) -> list[str]:
    losses = (obj.get("checks") or {}).get("step1_loss") or []
    lines = []
    for c in losses:
        if c.get("peer_step1_loss") is None or c.get("ours_step1_loss") is None:
            continue
        verdict = "agree" if c.get("agree") else "DIFFER"
        what = c["preset"] + (f" (ours {c['dp_mode']})" if c.get("dp_mode") else "")
        lines.append(f"- {what}: step-1 loss ours {c['ours_step1_loss']:.4f}, peer {c['peer_step1_loss']:.4f} "
                     f"({verdict}, relative difference {c.get('rel_diff', 0):.1e}, tolerance {c.get('rtol')})")
    return (["Same initial weights, same batch; the step-1 losses (before any update):", ""] + lines + [""]) \
        if lines else []


def _noise(rows: list[dict]) -> list[str]:
    """The largest round-to-round spread of a table's timings (the sides took turns, several rounds)."""
    worst = [(v, side, r) for r in rows for side, v in (r.get("spread") or {}).items() if v]
    if not worst:
        return []
    v, side, r = max(worst, key=lambda t: t[0])
    return [f"Each side was timed in turns, several rounds; the medians of its rounds differ by at most "
            f"{100 * (v - 1):.1f} % ({side}, {r['case']}, {r['metric']}): a ratio nearer 1 than that is noise.", ""]


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_ratios(obj: dict, path: Path) -> Path | None:
    """A horizontal bar per row: ours vs each other side (1 = equal). None when matplotlib or ratios are missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    others = [s for s in sides_present(obj["rows"]) if s != "ours"]
    rows = [r for r in obj["rows"] if any(r.get(f"x_{s}") is not None for s in others)]
    if not rows:
        return None
    names = {**obj.get("side_names", {})}
    labels = [f"{r['case']} · {r['metric']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) * max(1, len(others)) + 1.2))
    height = 0.8 / len(others)
    for i, side in enumerate(others):
        vals = [r.get(f"x_{side}") or 0.0 for r in rows]
        pos = [j + i * height for j in range(len(rows))]
        ax.barh(pos, vals, height=height, label=f"ours vs {names.get(side, side)}")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks([j + height * (len(others) - 1) / 2 for j in range(len(rows))])
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (> 1: ours faster / smaller)")
    ax.set_title(f"{obj.get('title', obj['bench'])} — {obj['meta'].get('device')}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(obj: dict) -> list[str]:
    """A table's provenance, settings, rows, noise and checks."""
    runs = obj.get("runs") or [obj["meta"]]
    if len(runs) > 1:
        lines = [f"Rows from {len(runs)} runs on the same device and settings (each row one run's "
                 "same-process measurement):", ""] + [f"- {_provenance(m)}" for m in runs] + [""]
    else:
        lines = [_provenance(runs[0]) + ".", ""]
    settings = {k: v for k, v in (obj.get("settings") or {}).items() if k != "sides"}
    if settings:
        lines += ["Settings: " + "; ".join(f"{k} {v}" for k, v in settings.items()) + ".", ""]
    return lines + [format_table(obj["rows"], obj.get("side_names")), ""] + _noise(obj["rows"]) + _checks(obj)


def build_report(found: dict[str, dict], out: Path, plots: Path | None, results_label: str) -> str:
    lines = ["# Performance", "",
             f"Generated by `mamba-parallel bench report` from the newest runs of each benchmark under "
             f"`{results_label}`; do not edit by hand. Every ratio compares ours with the peer (mamba_ssm + "
             "causal-conv1d; fla for the SSD) measured in the same process, on the same inputs, with the same grad "
             "mode and the same timer (CUDA events, median after warm-up). Reproduce on one GPU with the peer "
             "installed: `tools/side_by_side.sh` (or `mamba-parallel bench all`).", ""]
    if not found:
        return "\n".join(lines + ["No results yet: run `tools/side_by_side.sh` on a GPU machine, then "
                                  "`mamba-parallel bench report`.", ""])
    lines += [ratio_rule([r for obj in found.values() for r in obj["rows"]]), ""]
    if plots is not None and not _have_matplotlib():
        lines += ["(The ratio plots need matplotlib: `pip install mamba-parallel[bench]`.)", ""]
    for bench, obj in found.items():
        lines += [f"## {obj.get('title', bench)}", ""] + _table(obj)
        if plots is not None and _have_matplotlib():
            png = plot_ratios(obj, plots / f"{bench}.png")
            if png is not None:
                lines += [f"![{bench} ratios]({os.path.relpath(png, out.parent)})", ""]
        for older in obj.get("earlier") or []:
            lines += [f"### {obj.get('title', bench)}: cases measured only in earlier runs", ""] + _table(older)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mamba-parallel bench report", description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=DEFAULT_RESULTS, metavar="DIR",
                    help=f"folder of result JSON (default: {DEFAULT_RESULTS})")
    ap.add_argument("--out", default=DEFAULT_OUT, metavar="FILE", help=f"the Markdown to write (default: {DEFAULT_OUT})")
    ap.add_argument("--plots", default=None, metavar="DIR",
                    help="folder of the PNGs (default: a folder named after --out beside it, e.g. docs/performance/)")
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    a = ap.parse_args(argv)
    out = Path(a.out)
    plots = None if a.no_plots else Path(a.plots) if a.plots else out.with_suffix("")
    found = combine(load_results(a.results))
    text = build_report(found, out, plots, a.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + ("" if text.endswith("\n") else "\n"))
    print(f"wrote {out} ({len(found)} benchmarks{', plots in ' + str(plots) if plots and found else ''})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
