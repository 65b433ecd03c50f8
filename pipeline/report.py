"""Self-contained HTML report: the verdict first (pipeline/verdict.py: shipped or refused and why, AL per domain,
predicted speedup, the artifacts to deploy), then the stage table, then each stage's own section (its
`report(artifact)`).

Stages build their sections with the helpers here: `table(rows)`, `figure(fig)` (a matplotlib figure
embedded as a PNG data URI), `esc(text)`.
"""
from __future__ import annotations

import base64
import html
import io
import json
from datetime import datetime, timezone
from pathlib import Path

from pipeline import keep, registry, runner, verdict
from pipeline.store import Store, atomic_write_text

esc = html.escape

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:1100px;color:#222}
h1{font-size:1.6rem} h2{font-size:1.25rem;border-bottom:1px solid #ddd;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;margin:.5rem 0 1rem}
td,th{border:1px solid #ddd;padding:.25rem .6rem;text-align:left;font-size:.9rem}
th{background:#f5f5f5} .committed,.ran{color:#137333;font-weight:600} .failed{color:#c5221f;font-weight:600}
.muted{color:#777} code{background:#f5f5f5;padding:0 .2rem} img{max-width:100%}
.pass{color:#137333;font-weight:600} .fail{color:#c5221f;font-weight:600}
"""


def table(rows: list[dict] | list[list], header: list[str] | None = None) -> str:
    if rows and isinstance(rows[0], dict):
        header = header or list(rows[0].keys())
        rows = [[r.get(h, "") for h in header] for r in rows]  # type: ignore[union-attr]
    head = "".join(f"<th>{esc(str(h))}</th>" for h in (header or []))
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return f"<code>{esc(json.dumps(v))[:200]}</code>"
    return esc(str(v))


def figure(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def write_report(store: Store, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    doc = runner.status(store)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>specpipe report: {esc(str(store.root))}</title>",
             f"<style>{CSS}</style></head><body>",
             f"<h1>specpipe report</h1><p class='muted'>workdir <code>{esc(str(store.root))}</code> · config "
             f"<code>{esc(str(doc.get('config')))}</code> · last build {esc(str(doc.get('last_finished')))} · "
             f"written {datetime.now(timezone.utc).isoformat(timespec='seconds')}</p>",
             verdict.safe_render(store, doc, table),
             "<h2>Stages</h2>"]
    rows = []
    for st in doc["stages"]:
        state = st["state"] + (" (kept)" if st.get("kept") else "")
        rows.append([st["name"], f"<span class='{st['state'].replace(' ', '-')}'>{esc(state)}</span>",
                     esc(st.get("last_reason") or ""), (st["fingerprint"] or "")[:12],
                     f"{st['wall_time_s']:.1f}s" if st["wall_time_s"] is not None else "",
                     f"{st['peak_rss_mb']:.0f} MB" if st["peak_rss_mb"] is not None else "",
                     esc(st.get("error") or "")])
    head = "".join(f"<th>{h}</th>" for h in ("stage", "state", "last build", "fingerprint", "wall time", "peak RSS", "error"))
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    parts.append(f"<table><tr>{head}</tr>{body}</table>")
    for spec, st in zip(registry.stages(), doc["stages"], strict=True):
        art = store.artifact(spec.name)
        if st.get("failed_metrics") and st.get("last_build") == "failed":
            parts.append(f"<h2>{esc(spec.name)} <span class='fail'>failed</span></h2><p "
                         f"class='fail'>{esc(st.get('error') or '')}</p>")
            fm = st["failed_metrics"]
            if spec.report is not None and hasattr(spec.module, "report_failed"):
                parts.append(spec.module.report_failed(fm))
            else:
                parts.append(table([[k, v] for k, v in fm.items()], ["metric", "value"]))
        if art is None:
            continue
        parts.append(f"<h2>{esc(spec.name)}</h2>")
        section = None
        if spec.report is not None:
            try:
                section = spec.report(art)
            except Exception as e:  # a broken section must not lose the whole report
                section = f"<p class='fail'>could not render this section: {esc(type(e).__name__)}: {esc(str(e))}</p>"
        if section:
            parts.append(section)
        flat = {k: v for k, v in art.metrics.items() if not isinstance(v, (dict, list))}
        if flat:
            parts.append("<details><summary>all "
                         "metrics</summary>" + table([[k, v] for k, v in flat.items()], ["metric", "value"]) + "</details>")
        prov = art.manifest.get("provenance", {})
        parts.append(f"<p class='muted'>command <code>{esc(str(prov.get('command')))}</code> · git "
                     f"{esc(str(prov.get('git_commit')))} · "
                     f"{esc(str(prov.get('started')))}</p>")
        for k in art.manifest.get("kept", []):      # --keep: the artifact is older than the code (pipeline/keep.py)
            parts.append(f"<p class='fail'>{esc(keep.describe(k))} (command <code>{esc(str(k.get('command')))}</code>)</p>")
    parts.append("</body></html>")
    path = out or store.root / "report.html"
    atomic_write_text(Path(path), "\n".join(parts))
    return Path(path)
