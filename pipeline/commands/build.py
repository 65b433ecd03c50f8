"""`specpipe build`: the table of what each stage did."""
from __future__ import annotations


def print_outcomes(outcomes, store) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"specpipe build: {store.root}")
    for c in ("stage", "action", "reason", "time"):
        t.add_column(c)
    colors = {"ran": "green", "skip": "dim", "failed": "red", "blocked": "yellow", "disabled": "dim", "excluded": "dim"}
    for o in outcomes:
        t.add_row(o.name, f"[{colors.get(o.action, '')}]{o.action}[/]", o.reason,
                  f"{o.wall_s:.1f}s" if o.action in ("ran", "failed") else "")
    # emoji=False: a reason is never emoji (":name:" stays as written) and rich skips loading its emoji table
    Console(stderr=True, width=160, emoji=False).print(t)
