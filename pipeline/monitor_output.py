"""What `specpipe monitor` says: its opening description, and the Prometheus text file it rewrites every round
(node-exporter textfile format; docs/serving.md lists the series): the CUSUM per domain, the diagnosis, the
served-files comparison."""
from __future__ import annotations

import os
import time


def write_prom(mon) -> None:
    """Write the state of `mon` (a pipeline.monitor.Monitor) to its prom_path, atomically."""
    src = (mon.metrics_url if mon.passive else mon.url or "").replace("\\", "").replace('"', "")
    lab = lambda d: f'{{domain="{d}",model="{mon.run.model_name}",source="{src}"}}'  # noqa: E731
    lines = []

    def gauge(name, help_, values):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f"{name}{lab(d)} {v}" for d, v in values)

    ts = mon.tests.items()
    gauge("specpipe_monitor_drift_alarm", "1 while the CUSUM of the domain is at or above its threshold",
          [(d, int(t.alarm)) for d, t in ts])
    gauge("specpipe_monitor_acceptance_length", "Live acceptance length since the CUSUM restarted (or the last probe)",
          [(d, round(t.live_al, 6)) for d, t in ts if t.live_al is not None])
    gauge("specpipe_monitor_baseline_acceptance_length", "validate's acceptance length at the deployed draft length",
          [(d, round(t.al0, 6)) for d, t in ts])
    gauge("specpipe_monitor_cusum", "One-sided CUSUM statistic (log-likelihood ratio)", [(d, round(t.S, 6)) for d, t in ts])
    gauge("specpipe_monitor_threshold", "CUSUM threshold ln(1/false_alarm)", [(d, round(t.threshold, 6)) for d, t in ts])
    gauge("specpipe_monitor_confidence", "1 - exp(-CUSUM): confidence that the acceptance dropped",
          [(d, round(t.confidence, 8)) for d, t in ts])
    gauge("specpipe_monitor_probes", "Observations tested", [(d, t.probes) for d, t in ts])
    gauge("specpipe_monitor_missing_statistics", "1 when the last round returned no speculative statistics",
          [(d, int(t.missing_stats)) for d, t in ts])
    from pipeline.monitor_diagnosis import CAUSES

    v = mon.verdict
    base = f'model="{mon.run.model_name}",source="{src}"'
    lines.append("# HELP specpipe_monitor_diagnosis 1 for the cause diagnosed this round (target_changed: rebuild; "
                 "engine_state: restart; traffic_drift: retrain the draft), 0 for the others")
    lines.append("# TYPE specpipe_monitor_diagnosis gauge")
    for c in CAUSES:
        act = (v.action if v and v.cause == c else "").replace("\\", "").replace('"', "'")
        lines.append(f'specpipe_monitor_diagnosis{{cause="{c}",action="{act}",{base}}} {int(bool(v) and v.cause == c)}')
    lines.append("# HELP specpipe_monitor_served_mismatch Parts of the served model that differ from the export")
    lines.append("# TYPE specpipe_monitor_served_mismatch gauge")
    lines.append(f"specpipe_monitor_served_mismatch{{{base}}} {len(mon.changed)}")
    lines.append("# HELP specpipe_monitor_last_round_timestamp_seconds When the monitor last ran a round")
    lines.append("# TYPE specpipe_monitor_last_round_timestamp_seconds gauge")
    lines.append(f'specpipe_monitor_last_round_timestamp_seconds{{model="{mon.run.model_name}",source="{src}"}} '
                 f'{time.time():.3f}')
    mon.prom_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = mon.prom_path.with_name(mon.prom_path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, mon.prom_path)                   # atomic: a scraper never reads half a file



def describe(mon) -> str:
    """The monitor's opening lines: endpoint, baseline, design, per-domain boundaries."""
    d = mon.design
    rows = [f"  {t.domain}: baseline AL {t.al0:.3f}, alternative AL {t.al1:.3f}, alarm boundary "
            f"{(t.al0 + t.al1) / 2:.3f}" for t in mon.tests.values()]
    src = f"metrics {mon.metrics_url}" if mon.passive else f"{mon.url} model {mon.run.model_name}"
    fmt = mon.run.prompt_format
    if not mon.passive and fmt is not None:     # the probes are sent as export's README tells clients to
        kinds = ", ".join(f"{d} {k}" for d, k in sorted((fmt.get("domains") or {}).items()))
        src += (f", prompts as triton/README.md tells clients to send them ({kinds}; chat = rendered with "
                f"triton/{fmt['chat_template']}" + (", minus the BOS the tokenizer adds" if fmt.get("tokenizer_adds_bos")
                                                    else "") + ")")
    if mon.traffic:
        src += f"; live traffic from {mon.metrics_url} between rounds (the probes left out)"
    if mon.served:
        src += "; served files " + ", ".join(f"{r} {d}" for r, d in mon.served.items()) + " vs export.json"
    return (f"monitoring {src} against {mon.run.workdir} (baseline {mon.run.baseline_source}, "
            f"{mon.run.digest}), draft length {d.draft_len}: "
            f"one-sided CUSUM, drop {100 * d.drop:.0f}%, threshold {d.threshold:.2f} (false alarms <= {d.false_alarm:g} "
            f"per probe and domain), dispersion {d.dispersion:g}\n" + "\n".join(rows))
