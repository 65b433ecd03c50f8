"""`specpipe build`: the table of what each stage did."""
from __future__ import annotations

import sys

from pipeline.commands.table import render, use_color

ACTION_STYLES = {"ran": "green", "kept": "yellow", "skip": "dim",
                 "failed": "red", "blocked": "yellow", "disabled": "dim", "excluded": "dim"}


def print_outcomes(outcomes, store, stream=None) -> None:
    """One row a stage (action, why, wall time of what ran), on stderr: stdout stays free for what a caller pipes."""
    stream = stream or sys.stderr
    rows = [[o.name, o.action, o.reason, f"{o.wall_s:.1f}s" if o.action in ("ran", "failed") else ""] for o in outcomes]
    styles = [["", ACTION_STYLES.get(o.action, ""), "", ""] for o in outcomes]
    stream.write(render(f"specpipe build: {store.root}", ["stage", "action", "reason", "time"], rows, width=160,
                        wrap=2, styles=styles, color=use_color(stream)))
    stream.flush()
