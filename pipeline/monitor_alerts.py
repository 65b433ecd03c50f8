"""What export ships under `monitoring/` for the tools platform teams already alert with: Prometheus alerting rules and
a Grafana dashboard per serving engine, built from the exported pair's validated acceptance (docs/serving.md).

- `prometheus_rules_specpipe_monitor.yml`: alerts on what `specpipe monitor` writes (its text file, scraped through
  node-exporter's textfile collector): the drift alarm per domain, the diagnosis (target changed / engine state /
  traffic drift, with the action), a served model that differs from the export, a monitor that stopped running.
- `prometheus_rules_<engine>.yml`: a recording rule for the live acceptance length computed from the engine's own
  counters over 10 minutes (idle windows give no sample: the ratio of two zero rates is not a number, and the alert
  also requires drafting to have happened), and an alert when it stays below the alarm boundary of the validated band
  (halfway between the baseline AL and the designed drop, the monitor's boundary) for 30 minutes.
- `grafana_dashboard_<engine>.json`: the per-domain AL of the canary against its validated band, the engine's live AL
  and acceptance per draft position, the CUSUM statistics against their threshold, the diagnosis.

Engines and their counters (names from their source; pipeline/monitor_engines.py, pipeline/monitor_vllm.py):
  triton  specpipe's CPU model (specpipe_*_total); vllm (vllm:spec_decode_*_total); trtllm (trtllm-serve,
  trtllm_spec_decode_*_total); sglang (sglang:spec_verify_calls_total, sglang:generation_tokens_total).
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

WINDOW = "10m"
ENGINES = ("triton", "vllm", "trtllm", "sglang")


def al_expr(engine: str, draft_len: int, window: str = WINDOW) -> str:
    """PromQL: the engine's live acceptance length (1 + accepted draft tokens per verification step) over `window`."""
    r = lambda m: f"sum(rate({m}[{window}]))"  # noqa: E731
    if engine == "triton":
        return f"1 + {r('specpipe_accepted_draft_tokens_total')} / {r('specpipe_verification_steps_total')}"
    if engine == "vllm":
        return f"1 + {r('vllm:spec_decode_num_accepted_tokens_total')} / {r('vllm:spec_decode_num_drafts_total')}"
    if engine == "trtllm":   # steps = drafted tokens / K, as the monitor counts them
        return (f"1 + {r('trtllm_spec_decode_num_accepted_tokens_total')} / "
                f"({r('trtllm_spec_decode_num_draft_tokens_total')} / {draft_len})")
    if engine == "sglang":
        return f"{r('sglang:generation_tokens_total')} / {r('sglang:spec_verify_calls_total')}"
    raise ValueError(engine)


def drafting_expr(engine: str, window: str = WINDOW) -> str:
    """PromQL that is > 0 when the engine verified drafts in the window (idle periods excluded)."""
    m = {"triton": "specpipe_verification_steps_total", "vllm": "vllm:spec_decode_num_drafts_total",
         "trtllm": "trtllm_spec_decode_num_draft_tokens_total", "sglang": "sglang:spec_verify_calls_total"}[engine]
    return f"sum(rate({m}[{window}]))"


def position_expr(engine: str, window: str = WINDOW) -> str | None:
    """PromQL: acceptance per draft position (legend: the position), where the engine publishes it."""
    if engine == "vllm":
        return (f"sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total[{window}])) / "
                f"scalar(sum(rate(vllm:spec_decode_num_drafts_total[{window}])))")
    if engine == "trtllm":
        return (f"sum by (token_position) (rate(trtllm_spec_decode_accepted_tokens_total[{window}])) / "
                f"sum by (token_position) (rate(trtllm_spec_decode_drafted_tokens_total[{window}]))")
    return None


def boundary(al0: float, drop: float = 0.2) -> float:
    """The alarm boundary of the monitor's test: halfway between AL0 and the designed drop (1 - drop) AL0."""
    return round((al0 + max(1.0, (1 - drop) * al0)) / 2, 4)


def monitor_rules(model: str) -> dict:
    m = f'model="{model}"'
    alert = lambda name, expr, for_, sev, summary, desc: {  # noqa: E731
        "alert": name, "expr": expr, "for": for_, "labels": {"severity": sev},
        "annotations": {"summary": summary, "description": desc}}
    return {"groups": [{"name": "specpipe-monitor", "rules": [
        alert("SpecpipeDraftDrift", f"specpipe_monitor_drift_alarm{{{m}}} == 1", "0m", "warning",
              "Draft acceptance dropped (domain {{ $labels.domain }})",
              "specpipe monitor's CUSUM for domain {{ $labels.domain }} of {{ $labels.source }} crossed its threshold: "
              "the live acceptance length is below the validated band. See specpipe_monitor_diagnosis for the cause."),
        alert("SpecpipeDiagnosisTargetChanged", f'specpipe_monitor_diagnosis{{cause="target_changed",{m}}} == 1', "0m",
              "critical", "The served model is not the exported one",
              "{{ $labels.action }} (specpipe monitor compared the served files with export.json)"),
        alert("SpecpipeDiagnosisDraftChanged", f'specpipe_monitor_diagnosis{{cause="draft_changed",{m}}} == 1', "0m",
              "critical", "The served draft is not the exported one", "{{ $labels.action }}"),
        alert("SpecpipeDiagnosisEngineState", f'specpipe_monitor_diagnosis{{cause="engine_state",{m}}} == 1', "0m",
              "warning", "Acceptance dropped on the validated prompts and on the traffic: engine state",
              "{{ $labels.action }}"),
        alert("SpecpipeDiagnosisTrafficDrift", f'specpipe_monitor_diagnosis{{cause="traffic_drift",{m}}} == 1', "0m",
              "warning", "Live traffic accepts less than validated while the canary holds: traffic drift",
              "{{ $labels.action }}"),
        alert("SpecpipeServedModelMismatch", f"specpipe_monitor_served_mismatch{{{m}}} > 0", "0m", "critical",
              "Served files differ from the export", "{{ $value }} part(s) of the served model differ from export.json"),
        alert("SpecpipeMonitorStale", f"time() - specpipe_monitor_last_round_timestamp_seconds{{{m}}} > 3600", "10m",
              "warning", "specpipe monitor has not run for an hour", "No monitoring round since {{ $value }} s."),
    ]}]}


def engine_rules(engine: str, draft_len: int, al0: float, drop: float = 0.2) -> dict:
    rec = f"specpipe:{engine}_acceptance_length:rate{WINDOW}"
    b = boundary(al0, drop)
    return {"groups": [{"name": f"specpipe-{engine}", "rules": [
        {"record": rec, "expr": al_expr(engine, draft_len)},
        {"alert": "SpecpipeEngineAcceptanceBelowBand",
         "expr": f"{rec} < {b} and {drafting_expr(engine)} > 0",
         "for": "30m", "labels": {"severity": "warning", "engine": engine},
         "annotations": {"summary": f"{engine}: live acceptance length below the validated band",
                         "description": f"The engine's own counters give an acceptance length of {{{{ $value }}}} over "
                                        f"{WINDOW} for 30 minutes; validated {al0:.3f} at draft length {draft_len}, "
                                        f"alarm boundary {b}. Run `specpipe monitor --traffic` for the cause."}},
    ]}]}


def _panel(pid: int, title: str, targets: list[tuple[str, str]], y: int, x: int = 0, w: int = 12, kind: str = "timeseries",
           unit: str = "none") -> dict:
    return {"id": pid, "type": kind, "title": title, "gridPos": {"h": 8, "w": w, "x": x, "y": y},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": leg,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for i, (e, leg) in enumerate(targets)]}


def dashboard(engine: str, model: str, draft_len: int, al0: float, domains: dict[str, float], drop: float = 0.2) -> dict:
    m = f'model="{model}"'
    panels = [
        _panel(1, "Canary: acceptance length per domain vs validated",
               [(f"specpipe_monitor_acceptance_length{{{m}}}", "live {{domain}}"),
                (f"specpipe_monitor_baseline_acceptance_length{{{m}}}", "validated {{domain}}")], 0),
        _panel(2, f"{engine}: live acceptance length ({WINDOW}) vs validated band",
               [(al_expr(engine, draft_len), "live"), (f"vector({al0})", "validated"),
                (f"vector({boundary(al0, drop)})", "alarm boundary")], 0, x=12),
        _panel(3, "CUSUM statistic per domain vs threshold",
               [(f"specpipe_monitor_cusum{{{m}}}", "{{domain}}"), (f"max(specpipe_monitor_threshold{{{m}}})", "threshold")], 8),
        _panel(4, "Diagnosis", [(f"specpipe_monitor_diagnosis{{{m}}} == 1", "{{cause}}: {{action}}"),
                                (f"specpipe_monitor_served_mismatch{{{m}}}", "served parts differing")], 8, x=12,
               kind="stat"),
    ]
    pos = position_expr(engine)
    if pos:
        panels.append(_panel(5, f"{engine}: acceptance per draft position ({WINDOW})",
                             [(pos, "position {{position}}{{token_position}}")], 16, unit="percentunit"))
    return {"uid": f"specpipe-{engine}"[:40], "title": f"specpipe draft drift: {model} on {engine}",
            "description": "Validated acceptance per domain: " + ", ".join(f"{d} {v:.3f}" for d, v in sorted(domains.items())),
            "tags": ["specpipe", "speculative-decoding", engine], "timezone": "browser", "editable": True,
            "schemaVersion": 39, "time": {"from": "now-24h", "to": "now"}, "refresh": "1m",
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "label": "Prometheus"}]},
            "panels": panels}


def write(out_dir, *, model: str, draft_len: int, al0: float, domains: dict[str, float], drop: float = 0.2) -> list[str]:
    """Write monitoring/ (rules and dashboards for every engine); returns the files, relative to out_dir's parent."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    files = {"prometheus_rules_specpipe_monitor.yml": yaml.safe_dump(monitor_rules(model), sort_keys=False, width=200)}
    for e in ENGINES:
        files[f"prometheus_rules_{e}.yml"] = yaml.safe_dump(engine_rules(e, draft_len, al0, drop), sort_keys=False,
                                                            width=200)
        files[f"grafana_dashboard_{e}.json"] = json.dumps(dashboard(e, model, draft_len, al0, domains, drop), indent=2)
    for name, text in files.items():
        (d / name).write_text(text)
    return [f"{d.name}/{n}" for n in files]


def export(out_dir, profile_file, *, model: str, draft_len: int, log) -> dict:
    """export's monitoring/ (stages/export.py): rules and dashboards from the baseline `specpipe monitor` tests, the
    exported speculation profile at the deployed (batch-1) draft length. Returns export.json's `monitoring`."""
    from pipeline.monitor import Design, make_test
    from runtime.validate import profile as P

    per, overall, _ = P.baseline(P.read_profile(profile_file), profile_file)
    design = Design(draft_len=draft_len)
    al0 = make_test("overall", overall or [], design).al0
    domains = {d: make_test(d, p, design).al0 for d, p in per.items()}
    files = write(Path(out_dir) / "monitoring", model=model, draft_len=draft_len, al0=al0, domains=domains)
    log.info("monitoring/: Prometheus rules and Grafana dashboards for %s (AL %.3f at k=%d, alarm boundary %.3f)",
             ", ".join(ENGINES), al0, draft_len, boundary(al0))
    return {"files": files, "engines": list(ENGINES), "acceptance_length": round(al0, 4), "draft_len": draft_len,
            "alarm_boundary": boundary(al0)}
