"""Side-by-side results: one row per measured figure, the ratio rule, run metadata, the table and the JSON file.

A row holds one figure of ours and, when they ran in the same process on the same inputs, the peer's (and other
implementations', e.g. ``fla``). The ratio ``x_<side>`` is always "how much better ours is": the other side's
time over ours for times, ours over theirs for throughput (so > 1 means ours is faster / smaller). A side that did
not run has no value and no ratio; a side that failed records its error in the row and the table goes on.

Result files: ``benchmarks/results/<YYYY-MM-DD>-<device>/<bench>.json``, each with the command, git commit,
torch / Triton / peer versions, device name and a timestamp (``run_metadata``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

SIDES = ("ours", "peer", "fla")  # table column order; "ours" is the reference of every ratio
SIDE_NAMES = {"ours": "ours", "peer": "mamba_ssm", "fla": "fla"}


def advantage(ours: float | None, other: float | None, better: str) -> float | None:
    """How much better ours is than ``other`` (> 1: ours better); None when either figure is missing."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    if ours is None or other is None or not all(map(math.isfinite, (ours, other))) or ours <= 0 or other <= 0:
        return None
    return other / ours if better == "lower" else ours / other


def make_row(case: str, metric: str, unit: str, better: str, values: dict, errors: dict | None = None,
             **extra) -> dict:
    """A table row: ``values`` maps a side ("ours", "peer", "fla") to its figure (None: did not run)."""
    row = {"case": case, "metric": metric, "unit": unit, "better": better}
    for side in SIDES:
        if side in values:
            row[side] = values[side]
    for side in SIDES[1:]:
        if side in values:
            row[f"x_{side}"] = advantage(values.get("ours"), values[side], better)
    if errors:
        row["errors"] = {k: v for k, v in errors.items() if v}
    row.update(extra)
    return row


def say(text: str) -> None:
    """Progress lines: printed at once (a device log is read while the run goes on)."""
    print(text, flush=True)


def error_text(e: BaseException) -> str:
    """One line naming an exception, short enough for a table cell."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


# ---- metadata ----------------------------------------------------------------------------------------------------
def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def add_git_commit_flag(ap) -> None:
    """--git-commit: the commit a result records, for a copy of the tree whose .git is missing or not its own."""
    ap.add_argument("--git-commit", default=None, metavar="SHA",
                    help="the commit to record in the results (default: the checkout's, when it has .git)")


def device_name(device) -> str:
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (a folder name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def side_versions(peer, fla_fn=None) -> dict | None:
    """Versions of the other sides that ran (the peer's adapter, and fla when it took part)."""
    out = dict(peer.versions()) if peer is not None else {}
    if fla_fn is not None and "fla" not in out:
        try:
            import fla
            out["fla"] = getattr(fla, "__version__", "unknown")
        except Exception:
            out["fla"] = "unknown"
    if fla_fn is None:
        out.pop("fla", None)
    return out or None


def command_line() -> str:
    """This process's command as a user would type it."""
    prog = Path(sys.argv[0]).name
    if prog in ("mamba-parallel", "cli.py", "__main__.py", ""):
        prog = "mamba-parallel"
    elif prog.endswith(".py"):
        prog = f"python -m mamba_parallel.bench.{prog[:-3]}"
    return " ".join([prog] + sys.argv[1:])


def run_metadata(device, peer_versions: dict | None, command: str | None = None,
                 git_commit: str | None = None) -> dict:
    """What a reader needs to trust a result: the command, commit (``git_commit``, else the checkout's own),
    versions, device and time."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {
        "command": command if command is not None else command_line(),
        "git_commit": git_commit or _git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "peer": peer_versions or None,
        "device": device_name(device),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def result_dir(root: str | os.PathLike, meta: dict) -> Path:
    """``root/<YYYY-MM-DD>-<device>`` for a run described by ``meta`` (created)."""
    day = meta["timestamp"][:10]
    path = Path(root) / f"{day}-{device_slug(meta['device'])}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_result(result: dict, path: str | os.PathLike | None) -> Path | None:
    """Write ``result`` as JSON to ``path``: a file, or a folder (then ``<date>-<device>/<bench>.json`` in it, or
    ``<bench>-<HHMMSS>.json`` beside an earlier run's)."""
    if not path:
        return None
    path = Path(path)
    if path.suffix != ".json":  # a results folder: never over an earlier run (the report combines them)
        folder, bench = result_dir(path, result["meta"]), result["bench"]
        path = folder / f"{bench}.json"
        if path.exists():
            stamp = result["meta"]["timestamp"][11:19].replace(":", "")
            path = folder / f"{bench}-{stamp}.json"
            n = 2
            while path.exists():
                path, n = folder / f"{bench}-{stamp}-{n}.json", n + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    return path


def _json_default(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


# ---- the table ---------------------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "–"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def sides_present(rows: list[dict]) -> list[str]:
    """The sides that have at least one figure (or error) in ``rows``, in table order."""
    return [s for s in SIDES if s == "ours" or any(s in r or s in r.get("errors", {}) for r in rows)]


def side_names(peer=None) -> dict:
    """Column names of the sides: the peer's adapter name (mamba_ssm, or reference for a stand-in run)."""
    return {**SIDE_NAMES, **({"peer": peer.name} if peer is not None else {})}


def format_table(rows: list[dict], names: dict | None = None) -> str:
    """A Markdown table: case | metric | ours | <side> | ours vs <side> ... (errors in the cells)."""
    names = {**SIDE_NAMES, **(names or {})}
    sides = sides_present(rows)
    header = ["case", "metric", "ours"]
    for s in sides[1:]:
        header += [names[s], f"ours vs {names[s]}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        errors = r.get("errors", {})

        def cell(side):
            return f"error: {_short(errors[side])}" if side in errors and r.get(side) is None else _fmt(r.get(side))

        unit = r.get("unit")
        cells = [r["case"], f"{r['metric']} ({unit})" if unit and unit != r["metric"] else r["metric"], cell("ours")]
        for s in sides[1:]:
            x = r.get(f"x_{s}")
            cells += [cell(s), "–" if x is None else f"{x:.2f}x"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def _short(error: str, limit: int = 110) -> str:
    """A table cell's error: its first sentence, capped (the JSON keeps the whole line)."""
    first = error.split(". ", 1)[0].rstrip(".")
    return first if len(first) <= limit else first[:limit - 1] + "…"


def ratio_rule(rows: list[dict]) -> str:
    """The sentence that says how to read the ratio columns."""
    if len(sides_present(rows)) == 1:
        return "Ours alone (no peer in this run: no ratios)."
    return ("'ours vs X' = X's time / ours (or ours / X's throughput, X's memory / ours): > 1 means ours is "
            "faster or smaller. Both sides ran in the same process (in a data-parallel run: the same processes) on the "
            "same inputs.")


def publish(result: dict, device, peer, fla_fn=None, path=None, command: str | None = None,
            git_commit: str | None = None, log=say) -> Path | None:
    """Add the run's metadata and side names to ``result``, print its table, write its JSON (``path``)."""
    result["meta"] = run_metadata(device, side_versions(peer, fla_fn), command, git_commit)
    result["side_names"] = side_names(peer)
    log(f"\n## {result.get('title', result['bench'])}\n")
    log(format_table(result["rows"], result["side_names"]))
    log(ratio_rule(result["rows"]))
    written = write_result(result, path)
    if written is not None:
        log(f"wrote {written}")
    return written
