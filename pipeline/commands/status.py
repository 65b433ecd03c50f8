"""`specpipe status`: each stage's state, fingerprint, timings and metrics (optionally re-verified), as a table."""
from __future__ import annotations

from pathlib import Path


def collect(wd: Path, verify: bool) -> dict:
    """runner.status of the workdir; with `verify`, every committed stage re-hashed against its manifest."""
    from pipeline import runner
    from pipeline.store import Store

    store = Store(wd)
    doc = runner.status(store)
    if verify:
        for st in doc["stages"]:
            if st["state"] == "committed":
                st["verify"] = store.verify(st["name"]) or "ok"
    return doc


def print_table(doc: dict, wd: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"specpipe status: {wd}")
    for c in ("stage", "state", "fingerprint", "wall", "peak RSS", "key metrics"):
        t.add_column(c)
    for st in doc["stages"]:
        metrics = ", ".join(f"{k}={_short(v)}" for k, v in list(st["metrics"].items())[:4] if not isinstance(v, (dict, list)))
        t.add_row(st["name"], st["state"], (st["fingerprint"] or "")[:12],
                  f"{st['wall_time_s']:.1f}s" if st["wall_time_s"] is not None else "",
                  f"{st['peak_rss_mb']:.0f} MB" if st["peak_rss_mb"] is not None else "", metrics)
    Console(width=180).print(t)


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
