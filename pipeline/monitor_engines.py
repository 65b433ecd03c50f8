"""`specpipe monitor --engine trtllm | trtllm-json | sglang --passive`: the Monitor on a production engine's own
speculative-decoding metrics, read by pipeline/monitor_metrics.py (its docstring: names and semantics from the engines'
source)."""
from __future__ import annotations

import json

from pipeline.monitor import Monitor
from pipeline.monitor_metrics import (
    SGLANG_GAUGES,
    SGLANG_VERIFY,
    ProbeError,
    _url,
    get_text,
    sglang_prometheus,
    trtllm_iterations,
    trtllm_prometheus,
)


class EngineMonitor(Monitor):
    """The Monitor on a production engine's own metrics (`engine`: trtllm, trtllm-json or sglang; module docstring).
    Passive only: the live traffic against the overall baseline."""

    ENGINES = ("trtllm", "trtllm-json", "sglang")

    def __init__(self, *args, engine: str, **kwargs):
        if engine not in self.ENGINES:
            raise ValueError(engine)
        self.engine = engine
        super().__init__(*args, **kwargs)
        self.gauges: dict[str, float] = {}

    def read_series(self) -> dict[str, dict]:
        """Cumulative {"steps", "accepted"} per series now (trtllm-json: accumulated across rounds in the state)."""
        url, K = _url(self.metrics_url), self.design.draft_len
        if self.engine == "trtllm-json":
            try:
                doc = json.loads(get_text(url, self.timeout))
            except ValueError:
                raise ProbeError(f"{self.metrics_url}: not JSON: trtllm-serve's /metrics returns the iteration stats "
                                 "as a JSON list (start it with enable_iter_perf_stats: true)") from None
            prev = (self.counters or {}).get("iterations") or {"steps": 0.0, "accepted": 0.0, "last_iter": None}
            steps, accepted, last, skipped = trtllm_iterations(doc, prev["last_iter"])
            if skipped:
                self.echo(f"round {self.round} [overall] {skipped} iteration(s) without draft tokens left out")
            return {"iterations": {"steps": prev["steps"] + steps, "accepted": prev["accepted"] + accepted,
                                   "last_iter": last}}
        text = get_text(url, self.timeout)
        if self.engine == "trtllm":
            series = trtllm_prometheus(text, K)
            if not series:
                raise ProbeError(f"{self.metrics_url}: no trtllm_spec_decode_* counters (a trtllm-serve without "
                                 "speculative decoding or iteration stats, or a version before them; "
                                 "docs/serving.md names the versions)")
            return series
        series, self.gauges = sglang_prometheus(text)
        if not series:
            raise ProbeError(f"{self.metrics_url}: no {SGLANG_VERIFY} counter (an SGLang server without "
                             "--enable-metrics or speculative decoding, or a version without the counter: its "
                             f"{'/'.join(SGLANG_GAUGES)} gauges alone cannot be tested)")
        return series

    def _observe_passive(self) -> dict:
        now = self.read_series()
        prev = self.counters or {}
        self.counters = now
        steps = accepted = 0.0
        for series, c in now.items():          # a series not seen before, or one that went down (restart): all of it
            p = prev.get(series)
            if p is None or c["steps"] < p["steps"]:
                p = {"steps": 0.0, "accepted": 0.0}
            steps += c["steps"] - p["steps"]
            accepted += c["accepted"] - p["accepted"]
        if self.gauges:
            self.echo(f"round {self.round} [overall] engine gauges: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.gauges.items())))
        return {"overall": (steps, accepted)}
