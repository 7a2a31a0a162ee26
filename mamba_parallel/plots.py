"""The loss curve of a training run: ``<run>/loss.png`` drawn from ``<run>/metrics.jsonl`` (train loss per logged
step, eval loss where measured). The trainer draws it at the end of a run; ``mamba-parallel plot RUN`` redraws it.
matplotlib is optional (``pip install matplotlib``); without it the trainer says so in one line and goes on.
"""

from __future__ import annotations

import json
from pathlib import Path

METRICS = "metrics.jsonl"
PLOT = "loss.png"


class PlotError(ValueError):
    """No metrics to draw, or no matplotlib; the message says which."""


def read_losses(metrics: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """metrics.jsonl -> (train (step, loss) pairs, eval (step, eval_loss) pairs); a later record of a step wins
    (a resumed run logs the steps after its checkpoint again)."""
    train, evals = {}, {}
    with open(metrics) as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise PlotError(f"{metrics}:{line_no}: not a JSON record ({e})") from e
            step = rec.get("step")
            if not isinstance(step, int):
                continue
            if isinstance(rec.get("loss"), (int, float)):
                train[step] = float(rec["loss"])
            if isinstance(rec.get("eval_loss"), (int, float)):
                evals[step] = float(rec["eval_loss"])
    return sorted(train.items()), sorted(evals.items())


def plot_loss_curve(run: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run``'s loss curve (run: a run folder or its metrics.jsonl) to ``out`` (default <run>/loss.png)."""
    run = Path(run)
    metrics = run if run.is_file() else run / METRICS
    if not metrics.is_file():
        raise PlotError(f"{run}: no {METRICS} (a training run folder has one)")
    train, evals = read_losses(metrics)
    if not train and not evals:
        raise PlotError(f"{metrics}: no loss records to draw")
    try:
        from matplotlib.figure import Figure  # no pyplot: the caller's backend stays as it is
    except ImportError:
        raise PlotError("matplotlib is not installed: no loss plot (pip install matplotlib)") from None
    out = Path(out) if out is not None else metrics.parent / PLOT
    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(metrics.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp)
    tmp.replace(out)
    return out


def plot_after_run(run: str | Path) -> str:
    """The trainer's end-of-run call: draw the curve; one line saying what happened (never raises a PlotError)."""
    try:
        return f"loss curve: {plot_loss_curve(run)}"
    except PlotError as e:
        return f"no loss curve: {e}"


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a training run's loss curve (loss.png beside metrics.jsonl)",
                       description="Redraw <RUN>/loss.png from <RUN>/metrics.jsonl (needs matplotlib).")
    p.add_argument("run", metavar="RUN", help="training run folder (or its metrics.jsonl)")
    p.add_argument("--out", default=None, metavar="FILE", help="image file to write (default: <RUN>/loss.png)")


def cmd_plot(args) -> int:
    from mamba_parallel.config import ConfigError

    try:
        print(plot_loss_curve(args.run, args.out))
    except PlotError as e:
        raise ConfigError(str(e)) from None
    return 0
