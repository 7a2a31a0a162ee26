"""One rich progress bar for the long commands (prepare-data, convert, eval), shown on a terminal only.

    with progress_bar("converting", total=n) as advance:
        for item in items:
            ...
            advance(1, note="layer 3")   # note: optional text after the bar
"""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def progress_bar(description: str, total: int | None = None, enabled: bool | None = None, unit: str = ""):
    """Yields ``advance(n=1, note="")``; a no-op unless ``enabled`` (default: stderr is a terminal). ``total`` None:
    a counter without a bar (a stream of unknown length)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield lambda n=1, note="": None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    else:
        columns += [TextColumn("{task.completed:,.0f}" + (f" {unit}" if unit else "")), TimeElapsedColumn()]
    columns.append(TextColumn("{task.fields[note]}"))
    bar = Progress(*columns, console=Console(stderr=True), transient=True)
    task = bar.add_task(description, total=total, note="")
    with bar:
        yield lambda n=1, note="": bar.update(task, advance=n, note=note)
