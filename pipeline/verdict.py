"""The opening of the report: what a reader came for, before any stage's tables.

Shipped or refused and why (the first failed stage's error, validate's failed gates, or the stages still to run),
the deployed pair's acceptance length per domain (validate's measurement on specpipe's runtime, and each entry an
inference engine measured where acceptance.json has `engines`), the predicted speedup on the deployment GPU
(`tune`), and the path of each artifact to deploy (`build`, `export`, the speculation profiles).
"""
from __future__ import annotations

import html
import json

from pipeline.artifacts import export as export_artifact
from pipeline.artifacts import tune as tune_artifact
from pipeline.artifacts import validate as validate_artifact
from pipeline.errors import StageError
from pipeline.store import Store

esc = html.escape


def _read(store: Store, stage: str, name: str) -> dict | None:
    art = store.artifact(stage)
    if art is None or not (art.path / name).exists():
        return None
    try:
        return json.loads((art.path / name).read_text())
    except (OSError, ValueError):
        return None


def _record(store: Store, stage: str, reader) -> dict | None:
    """The document `reader` (a `pipeline.artifacts` record reader) read from the stage's committed artifact, None
    where there is none or it breaks its contract (the report still opens; the stage's own section says why)."""
    art = store.artifact(stage)
    if art is None:
        return None
    try:
        return reader(art.path).raw
    except StageError:
        return None


def outcome(doc: dict, acc: dict | None) -> tuple[str, str]:
    """('shipped' | 'refused' | 'not built', why) from `runner.status` and validate's acceptance.json."""
    stages = doc["stages"]
    failed = [s for s in stages if s.get("last_build") == "failed"]
    if failed:
        s = failed[0]
        return "refused", f"stage {s['name']} failed: {s.get('error') or 'no error recorded'}"
    gates = (acc or {}).get("gates") or {}
    if acc is not None and gates.get("passed") is not True:
        bad = [f"{r['domain']} {r['metric']} {r['measured']} < {r['required']}" for r in gates.get("rows", [])
               if not r.get("passed")]
        return "refused", "validate's gates did not pass: " + ("; ".join(bad) or json.dumps(gates)[:300])
    missing = [s["name"] for s in stages if s["state"] != "committed"]
    if missing:
        return "not built", f"stages without a committed artifact: {', '.join(missing)}"
    n = len(gates.get("rows", []))
    lossless = ((acc or {}).get("lossless") or {}).get("passed")
    return "shipped", (f"validate's {n} gate(s) passed" + (", lossless checks passed" if lossless else "")
                       + "; every stage committed")


def al_rows(acc: dict) -> tuple[list[str], list[list]]:
    """(header, rows) of the acceptance length per domain: the deployed FP8 pair on specpipe's runtime, BF16 and
    retention, then one column per engine-measured entry (acceptance.json `engines`). For an EAGLE-3 pair validate
    measured with ModelOpt's training first layer and also with the engines' `hidden_norm(h)` (`fp8_other_norm`), the
    engines' computation leads and the gated figure stands beside it (docs/stages/validate.md)."""
    engines = sorted((acc.get("engines") or {}).items())
    runtime = "specpipe" if acc.get("runtime") == "reference" else str(acc.get("runtime"))
    domains = acc.get("domains") or {}
    served = (acc.get("draft") or {}).get("first_layer_norm") == "modelopt" and \
        any((v or {}).get("fp8_other_norm") for v in domains.values())
    lead = [f"AL deployed pair, first layer hidden_norm(h) as the engines compute it ({runtime} runtime)",
            "AL with ModelOpt's training first layer (gated)"] if served else [f"AL deployed pair ({runtime} runtime)"]
    header = ["domain", *lead, "AL BF16 pair", "retention",
              *[f"AL measured by {name}" + (f" {e.get('version')}" if e.get("version") else "") for name, e in engines]]
    rows = []
    for d, v in [*domains.items(), ("overall", acc.get("overall") or {})]:
        eng = [((e.get("domains") or {}).get(d, {}) if d != "overall" else (e.get("overall") or {})).get("acceptance_length")
               for _, e in engines]
        al = [(v.get("fp8") or {}).get("acceptance_length")]
        if served:
            other = (v.get("fp8_other_norm") or {}).get("acceptance_length")
            al = ["per domain only" if d == "overall" else "not measured" if other is None else other, *al]
        rows.append([d, *al, (v.get("bf16") or {}).get("acceptance_length"),
                     v.get("retention"), *["not measured" if x is None else x for x in eng]])
    return header, rows


def speedup_text(tuning: dict | None, metrics: dict) -> str:
    if tuning is None:
        return "no tune artifact: no prediction"
    hw = tuning.get("hardware") or {}
    sp = {int(k): v for k, v in (metrics.get("predicted_speedup") or {}).items()}
    if not tuning.get("speculation") or not sp:
        return f"{esc(str(hw.get('gpu_name') or hw.get('gpu')))}: no draft length pays (the target is served alone)"
    lo, hi = min(sp), max(sp)
    return (f"predicted speedup on <b>{esc(str(hw.get('gpu_name') or hw.get('gpu')))}</b> "
            f"(TensorRT-LLM {esc(str(metrics.get('trtllm_version')))}, {esc(str(metrics.get('draft_schedule')))}): "
            f"<b>{sp[lo]:.2f}x</b> at batch {lo}, {sp[hi]:.2f}x at batch {hi} (tune's cost model)")


def deploy_paths(store: Store, export: dict | None) -> list[list[str]]:
    """(what, path) of each artifact to deploy."""
    rows = []
    b = store.artifact("build")
    if b is not None:
        dep = b.path / "deployment"
        rows += [["TensorRT-LLM deployment (trtllm-serve / LLM API)", str(dep)],
                 ["  serve command", str(dep / "serve.sh")], ["  LLM-API options", str(dep / "llm_api_options.yaml")]]
        rows += [["  speculation profile", str(f)] for f in sorted(dep.rglob("speculation_profile.json"))]
    e = store.artifact("export")
    if e is not None and export is not None:
        rows.append(["Triton repository (TensorRT-LLM LLM-API model)", str(e.path / "triton")])
        rows.append(["  launch script", str(e.path / "triton" / "launch.sh")])
        if export.get("cpu_repository"):
            rows.append(["CPU Triton repository (specpipe serve)", str(e.path / export["cpu_repository"])])
        if export.get("speculators"):
            rows += [["vLLM draft (speculators format)", str(e.path / "speculators")],
                     ["  vllm serve command", str(e.path / "speculators" / "serve_vllm.sh")]]
        for f in (export.get("speculation_profile") or {}).get("files", []):
            rows.append(["  speculation profile", str(e.path / f)])
    return rows


def render(store: Store, doc: dict, table) -> str:
    """The report's opening section (HTML); `table` is pipeline.report.table."""
    acc = _record(store, "validate", validate_artifact.read_acceptance)
    val = next((s for s in doc["stages"] if s["name"] == "validate"), {})
    refused_pair = val.get("last_build") == "failed" and isinstance(val.get("failed_metrics"), dict) \
        and "domains" in val["failed_metrics"]
    if refused_pair:     # what the failed build measured, not the artifact committed before it
        acc = {**val["failed_metrics"], "gates": (val["failed_metrics"].get("gates") or {"passed": False})}
    export = _record(store, "export", export_artifact.read_export)
    tuning = _record(store, "tune", tune_artifact.read_tuning)
    state, why = outcome(doc, acc)
    cls = {"shipped": "pass", "refused": "fail"}.get(state, "muted")
    parts = ["<h2 id='verdict'>Verdict</h2>", f"<p><span class='{cls}'>{esc(state.upper())}</span>: {esc(why)}</p>"]
    if acc is not None:
        header, rows = al_rows(acc)
        note = " (the pair validate refused, as the failed build measured it)" if refused_pair else ""
        parts.append(f"<h3>Acceptance length per domain{note}</h3>" + table(rows, header))
    tune = store.artifact("tune")
    stale = " (from the last committed tune: not a prediction for a refused or unbuilt pair)" if state != "shipped" else ""
    parts.append(f"<p>{speedup_text(tuning, tune.metrics if tune else {})}{esc(stale)}</p>")
    paths = deploy_paths(store, export) if state == "shipped" else []
    if paths:
        parts.append("<h3>Artifacts to deploy</h3>" + table(paths, ["what", "path"]))
    return "\n".join(parts)


def safe_render(store: Store, doc: dict, table) -> str:
    try:
        return render(store, doc, table)
    except (StageError, KeyError, TypeError, ValueError) as e:   # the opening must not lose the whole report
        return f"<h2 id='verdict'>Verdict</h2><p class='fail'>could not summarise the run: {esc(type(e).__name__)}: " \
               f"{esc(str(e))}</p>"
