"""`specpipe monitor`: a drift monitor (pipeline/monitor.py) opened on a run and an endpoint, and its rounds of
probes: once (for cron) or until a round limit or Ctrl-C."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Outcome:
    rounds: int
    raised: bool                    # a drift alarm was raised in some round
    once_ok: bool | None = None     # --once: the round probed every domain without an alarm; None otherwise


@dataclass(frozen=True)
class MonitorOptions:
    """`specpipe monitor`'s command line (pipeline/cli.py documents each option)."""

    workdir: str | None = None
    url: str | None = None
    model: str | None = None
    passive: bool = False
    metrics_url: str | None = None
    once: bool = False
    interval: float = 300.0
    probes: int | None = None
    draft_len: int | None = None
    drop: float = 0.2
    false_alarm: float = 1e-3
    dispersion: float = 2.0
    prompts_per_probe: int | None = None
    timeout: float = 120.0
    prom_file: str | None = None
    state_file: str | None = None
    reset: bool = False
    engine: str = "triton"
    traffic: bool = False
    served_target: str | None = None
    served_draft: str | None = None


def open_monitor(wd: Path, o: MonitorOptions, echo):
    """The Monitor of `wd`'s validated pair for the endpoint (state and Prometheus files named after it);
    engine vllm: pipeline/monitor_vllm.VllmMonitor (vLLM's spec-decode counters, its served model, its draft length)."""
    from pipeline import monitor as M
    from pipeline.errors import UsageError

    draft_len, metrics_url, url, engine = o.draft_len, o.metrics_url, o.url, o.engine
    if engine in ("trtllm", "trtllm-json", "sglang") and not o.passive:
        raise UsageError(f"--engine {engine} reads the engine's own metrics: give --passive --metrics-url URL "
                         "(active probes: --engine vllm for an OpenAI-compatible server, triton for the LLM-API model)")
    if o.traffic and (o.passive or not (metrics_url or engine == "vllm")):
        raise UsageError("--traffic tests the engine's counters beside the active probes: give --url and --metrics-url "
                         "(not --passive)")
    for r, d in (("target", o.served_target), ("draft", o.served_draft)):
        if d and not Path(d).is_dir():
            raise UsageError(f"--served-{r} {d}: not a directory (the {r} directory the endpoint serves)")
    if engine == "vllm":
        from pipeline import monitor_vllm as MV
        from pipeline.commands.serve_vllm import exported_draft_len

        draft_len = draft_len or exported_draft_len(wd)
        metrics_url = metrics_url or (f"{M._url(url)}/metrics" if url else None)
    run = M.read_run(wd, draft_len=draft_len, prompts_per_probe=o.prompts_per_probe)
    if o.model:
        run.model_name = o.model
    elif engine == "vllm" and not o.passive:
        run.model_name = MV.served_model(url, timeout=min(o.timeout, 30))
    design = M.Design(draft_len=run.draft_len, drop=o.drop, false_alarm=o.false_alarm, dispersion=o.dispersion)
    target = metrics_url if o.passive else url
    tag = hashlib.sha256(f"{target}|{run.model_name}{'|vllm' if engine == 'vllm' else ''}".encode()).hexdigest()[:10]
    served = _served_dirs(o, engine, url)
    endpoint = M.Endpoint(url, metrics_url=metrics_url, passive=o.passive, timeout=o.timeout, traffic=o.traffic,
                          served=tuple(served.items()))
    kw = dict(state_path=Path(o.state_file) if o.state_file else wd / "monitor" / f"state-{tag}.json",
              prom_path=Path(o.prom_file) if o.prom_file else wd / "monitor" / f"specpipe_monitor-{tag}.prom",
              reset=o.reset, echo=echo)
    if engine in ("trtllm", "trtllm-json", "sglang"):
        from pipeline.monitor_engines import EngineMonitor

        return EngineMonitor(run, design, endpoint, engine=engine, **kw)
    cls = MV.VllmMonitor if engine == "vllm" else M.Monitor
    return cls(run, design, endpoint, **kw)


def _served_dirs(o: MonitorOptions, engine: str, url: str | None) -> dict[str, str]:
    """role -> the directory the endpoint serves: --served-target/--served-draft, else (vLLM) the `root` its
    /v1/models names when that is a directory this machine can read."""
    served = {r: d for r, d in (("target", o.served_target), ("draft", o.served_draft)) if d}
    if "target" not in served and engine == "vllm" and url:
        from pipeline import monitor_vllm as MV

        root = MV.served_root(url, timeout=min(o.timeout, 30))
        if root and Path(root).is_dir():
            served["target"] = root
    return served


def watch(mon, *, once: bool, probes: int | None, interval: float, echo) -> Outcome:
    """Rounds of probes: with `once` one round (a failed probe, a domain without statistics or served files that differ
    from the export is not ok), else
    until `probes` rounds or Ctrl-C; a failed probe is reported and the next round runs."""
    import time

    from pipeline import monitor as M

    raised = False
    n = 0
    try:
        while True:
            try:
                alarms = mon.step()
            except M.ProbeError as e:
                echo(f"probe failed: {e}", err=True)
                if once:
                    return Outcome(n, raised, once_ok=False)
                alarms = []
            raised = raised or bool(alarms)
            n += 1
            if once:
                missing = [d for d, t in mon.tests.items() if t.missing_stats]
                served_differs = getattr(mon, "verdict", None) is not None      # a diagnosis without an alarm yet
                return Outcome(n, raised, once_ok=not (alarms or missing or served_differs))
            if probes is not None and n >= probes:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        echo("stopped", err=True)
    return Outcome(n, raised)
