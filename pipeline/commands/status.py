"""`specpipe status`: each stage's state, fingerprint, timings and metrics (optionally re-verified), as a table."""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.commands.table import render, use_color
from pipeline.keep import describe


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
    rows = []
    for st in doc["stages"]:
        metrics = ", ".join(f"{k}={_short(v)}" for k, v in list(st["metrics"].items())[:4] if not isinstance(v, (dict, list)))
        state = st["state"] + (" (kept)" if st.get("kept") else "")
        rows.append([st["name"], state, (st["fingerprint"] or "")[:12],
                     f"{st['wall_time_s']:.1f}s" if st["wall_time_s"] is not None else "",
                     f"{st['peak_rss_mb']:.0f} MB" if st["peak_rss_mb"] is not None else "", metrics])
    sys.stdout.write(render(f"specpipe status: {wd}", ["stage", "state", "fingerprint", "wall", "peak RSS", "key metrics"],
                            rows, width=180, wrap=5, color=use_color(sys.stdout)))
    for st in doc["stages"]:        # --keep (pipeline/keep.py): an artifact accepted across code changes
        for k in st.get("kept") or []:
            sys.stdout.write(f"{st['name']}: {describe(k)}\n")


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
