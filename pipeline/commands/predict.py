"""`specpipe predict FILE`: the cost model applied to published runs (runtime/cost/published.py's schema), each run's
predicted plain and speculative tokens/s and speedup beside the published ones, and the error.

`--overheads fitted` (default) adds the per-step engine overheads fitted on the record's fit set
(runtime/cost/engine_fit.py FITTED; an engine without fitted constants is priced by the model alone); `none` prices
every run as `tune` does; `refit` fits them on FILE's own fit set first. The summary lines are the mean and worst
|error| over the runs held out of the fit (engine_fit.held_out) and over all runs.
"""
from __future__ import annotations

import sys

from pipeline.commands.table import render, use_color

OVERHEADS = ("fitted", "none", "refit")


def compare(path: str, overheads: str = "fitted") -> dict:
    """Every run priced: {"overheads": {engine: constants}, "runs": [...], "summary": {...}} (RuntimeUsageError on a
    malformed record: the CLI exits 2 naming the run and field)."""
    from dataclasses import asdict

    from pipeline.hardware import GPUS
    from runtime.cost import engine_fit, published

    rec = published.load_record(path, GPUS)
    ov = {"fitted": engine_fit.FITTED, "none": {}}.get(overheads)
    if ov is None:
        ov = engine_fit.fit(rec, GPUS)
    rows = []
    for run in rec.runs:
        pred = published.predict(run, published.deployment(run, rec.shapes, GPUS), ov.get(run.engine))
        m = run.measured
        rows.append({"id": run.id, "engine": run.engine, "gpu": run.gpu, "tp": run.tp, "batch": run.batch,
                     "spec": _spec(run), "al": m.get("al"), "held_out": engine_fit.held_out(run),
                     "predicted": {"plain_tokens_per_s": pred.plain_tokens_per_s, "spec_tokens_per_s": pred.spec_tokens_per_s,
                                   "speedup": pred.speedup},
                     "published": {"plain_tokens_per_s": m.get("base_tokens_per_s"),
                                   "spec_tokens_per_s": m.get("spec_tokens_per_s"), "speedup": run.published_speedup()},
                     "error": published.errors(run, pred)})
    summary = {scope: {q: asdict(s) for q, s in engine_fit.evaluate(rec, GPUS, ov, only_held_out=scope == "held_out").items()}
               for scope in ("held_out", "all")}
    agree, n, _ = engine_fit.best_k_agreement(rec, GPUS, ov)
    summary["best_k"] = {"agree": agree, "sweeps": n}
    return {"record": path, "overheads_mode": overheads, "overheads": {e: asdict(o) for e, o in ov.items()},
            "runs": rows, "summary": summary, "excluded": len(rec.excluded)}


def _spec(run) -> str:
    if not run.steps:
        return "-"
    return f"chain k={run.steps}" if not run.is_tree else f"tree {run.steps}x{run.topk}, {run.nodes} nodes"


def _num(v, fmt: str = "{:.1f}") -> str:
    return "" if v is None else fmt.format(v)


def _err(v) -> str:
    return "" if v is None else f"{v * 100:+.1f} %"


def print_table(doc: dict) -> None:
    rows = [[r["id"], r["engine"], f"{r['gpu']} x{r['tp']}", str(r["batch"]), r["spec"], _num(r["al"], "{:.2f}"),
             _num(r["predicted"]["plain_tokens_per_s"]), _num(r["published"]["plain_tokens_per_s"]),
             _err(r["error"]["plain_tokens_per_s"]),
             _num(r["predicted"]["spec_tokens_per_s"]), _num(r["published"]["spec_tokens_per_s"]),
             _err(r["error"]["spec_tokens_per_s"]),
             _num(r["predicted"]["speedup"], "{:.2f}x"), _num(r["published"]["speedup"], "{:.2f}x"), _err(r["error"]["speedup"]),
             "held out" if r["held_out"] else "fit"] for r in doc["runs"]]
    head = ["run", "engine", "gpu", "B", "speculation", "AL", "plain tok/s", "published", "error", "spec tok/s",
            "published", "error", "speedup", "published", "error", "set"]
    sys.stdout.write(render(f"specpipe predict: {doc['record']} (overheads: {doc['overheads_mode']})", head, rows,
                            width=230, wrap=0, color=use_color(sys.stdout)))
    for line in summary_lines(doc):
        sys.stdout.write(line + "\n")


def summary_lines(doc: dict) -> list[str]:
    out = []
    for scope in ("held_out", "all"):
        parts = []
        for q, s in doc["summary"][scope].items():
            if s["n"]:
                parts.append(f"{q.replace('_', ' ')}: mean |error| {s['mean_abs'] * 100:.1f} %, worst {s['max_abs'] * 100:.1f} % "
                             f"({s['worst']}), {s['n']} runs")
        out.append(f"{scope.replace('_', '-')}: " + ("; ".join(parts) or "nothing to compare"))
    bk = doc["summary"]["best_k"]
    out.append(f"fastest chain depth: the model picks the published one in {bk['agree']} of {bk['sweeps']} sweeps")
    for e, o in doc["overheads"].items():
        out.append(f"overheads {e}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" if k not in ("scale", "spec_scale") else f"{k} {v:.3f}"
                                                   for k, v in o.items()))
    if doc["excluded"]:
        out.append(f"{doc['excluded']} source(s) read and kept out of the comparison (the record's 'excluded' list says why)")
    return out
