"""`specpipe monitor`: draft-drift detection on a live endpoint against `validate`'s baseline.

Active mode probes the endpoint (the CPU repository's `specpipe serve` or the production TensorRT-LLM
repository: the same LLM-API interface) with the validated per-domain prompts (`data`'s eval/<domain>.jsonl,
the first `validate.num_prompts` with prompt ids), validate's `max_new_tokens` and temperature, asking for
`sampling_param_return_perf_metrics`; each response carries `total_draft_tokens` and
`total_accepted_draft_tokens`. Passive mode reads the CPU model's Prometheus counters
(`specpipe_draft_tokens_total`, `specpipe_accepted_draft_tokens_total`, `specpipe_verification_steps_total`)
and tests the live traffic against the overall baseline.

Baseline. validate measured, per domain, the conditional acceptance p_j of draft position j (accepted given
positions < j accepted); export ships it in `speculation_profile.json` beside the draft (its first measurement's
`per_category.<domain>.conditional_accept_rates`, runtime/validate/profile.py), and the monitor reads it from there
(export.json lists the files), else from validate's acceptance.json. At the deployed draft length K (`build`'s
deployment, the batch-1 draft length; K <= validate's max_draft_len) the accepted count a of one verification
step has P(a >= j) = p_1...p_j, so mu0 = E[a] = sum_j P(a >= j) (AL0 = 1 + mu0) and sigma0^2 = sum_j (2j - 1) P(a >= j) - mu0^2.

Alternative. A drop of the acceptance length by the fraction `drop` (default 0.2): every p_j scaled by the
same c < 1 so that AL1 = (1 - drop) AL0 (mu1 = AL1 - 1), variance sigma1^2 likewise.

Sequential test. Page's one-sided CUSUM per domain on a Gaussian log-likelihood ratio. A probe of a domain
gives n verification steps (n = total_draft_tokens / K summed over its responses) and A accepted draft
tokens; with x = A / n and v = phi * max(sigma0^2, sigma1^2) / n (phi, `dispersion`, default 2, widens the
per-step variance for steps of one response not being independent),
    l = (mu0 - mu1) / v * ((mu0 + mu1) / 2 - x),      S <- max(0, S + l),      alarm when S >= h = ln(1/alpha).
For log-likelihood-ratio increments Lorden's bound gives an average run length to a false alarm of at least
e^h = 1/alpha probes (default alpha 0.001: at least 1000 probes per domain between false alarms, under the
model above and its variance bound); the decision boundary is halfway, so a live AL persistently more than
drop/2 below the baseline raises the alarm, a smaller deviation (FP8 numerics of another engine) does not.
The reported confidence 1 - e^{-S} bounds, by Ville's inequality for the likelihood-ratio martingale since the
CUSUM last restarted, the probability that an undrifted endpoint produced this much evidence.

State (the CUSUM per domain) persists in a JSON file, so `--once` from cron accumulates evidence across runs; a
changed baseline (another validate, another draft length) or `--reset` restarts it. Every round rewrites a
Prometheus text file (node-exporter textfile format) an alerting system can scrape.
"""
from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.artifacts import build as build_artifact
from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import export as export_artifact
from pipeline.artifacts import validate as validate_artifact
from pipeline.errors import StageError, UsageError
from pipeline.monitor_baseline import check_prompt_format, read_baseline
from pipeline.monitor_diagnosis import TRAFFIC
from pipeline.monitor_metrics import ProbeError, _url, perf_counts  # noqa: F401 - this module's API too

# ---------------------------------------------------------------------------------------------- baseline


def step_moments(p: list[float]) -> tuple[float, float]:
    """Mean and variance of the accepted count of one verification step with conditional acceptances p_j."""
    surv, s = [], 1.0
    for pj in p:
        s *= pj
        surv.append(s)
    mu = sum(surv)
    m2 = sum((2 * j + 1) * sj for j, sj in enumerate(surv))
    return mu, max(m2 - mu * mu, 0.0)


def scaled_for_mean(p: list[float], mu1: float) -> list[float]:
    """p scaled by one factor c in [0, 1] so that the step mean is mu1 (bisection; the mean grows with c)."""
    if mu1 <= 0:
        return [0.0] * len(p)
    lo, hi = 0.0, 1.0
    for _ in range(100):
        c = (lo + hi) / 2
        if step_moments([c * x for x in p])[0] < mu1:
            lo = c
        else:
            hi = c
    return [hi * x for x in p]


@dataclass
class DomainTest:
    """The CUSUM of one domain, with its baseline and alternative."""

    domain: str
    per_position: list[float]
    al0: float
    al1: float
    var: float                      # phi * max(sigma0^2, sigma1^2): per-step variance the test assumes
    threshold: float
    S: float = 0.0
    seg_steps: float = 0.0          # evidence since the CUSUM last restarted (what the live value reports)
    seg_accepted: float = 0.0
    probes: int = 0
    alarm: bool = False
    last_al: float | None = None
    last_steps: float = 0.0
    missing_stats: bool = False
    history: list = field(default_factory=list)

    @property
    def mu0(self) -> float:
        return self.al0 - 1

    @property
    def mu1(self) -> float:
        return self.al1 - 1

    def update(self, steps: float, accepted: float) -> float:
        """One observation (n steps, A accepted). Returns the log-likelihood-ratio increment."""
        self.probes += 1
        self.missing_stats = False
        self.last_al, self.last_steps = 1 + accepted / steps, steps
        x = accepted / steps
        v = self.var / steps
        llr = (self.mu0 - self.mu1) / v * ((self.mu0 + self.mu1) / 2 - x)
        if self.S + llr <= 0:
            self.S, self.seg_steps, self.seg_accepted = 0.0, 0.0, 0.0
        else:
            self.S += llr
            self.seg_steps += steps
            self.seg_accepted += accepted
        self.alarm = self.S >= self.threshold
        self.history = (self.history + [round(self.last_al, 4)])[-50:]
        return llr

    @property
    def live_al(self) -> float | None:
        if self.seg_steps:
            return 1 + self.seg_accepted / self.seg_steps
        return self.last_al

    @property
    def confidence(self) -> float:
        return 1 - math.exp(-self.S)


@dataclass
class Design:
    draft_len: int
    drop: float = 0.2
    false_alarm: float = 1e-3       # alpha: designed false alarms per probe and domain (ARL0 >= 1/alpha)
    dispersion: float = 2.0

    @property
    def threshold(self) -> float:
        return math.log(1 / self.false_alarm)


def make_test(domain: str, per_position: list, design: Design) -> DomainTest:
    K = design.draft_len
    if len(per_position) < K:
        raise UsageError(f"validate measured {len(per_position)} draft positions; the deployed draft length is {K}: "
                         "rerun validate with max_draft_len >= the deployed length or pass --draft-len")
    p = [0.0 if x is None else float(x) for x in per_position[:K]]
    mu0, v0 = step_moments(p)
    al0 = 1 + mu0
    al1 = max(1.0, (1 - design.drop) * al0)
    p1 = scaled_for_mean(p, al1 - 1)
    mu1, v1 = step_moments(p1)
    var = design.dispersion * max(v0, v1, 1e-6)
    return DomainTest(domain=domain, per_position=p, al0=al0, al1=1 + mu1, var=var, threshold=design.threshold)


@dataclass
class Run:
    """What the monitor reads from a pipeline run."""

    workdir: Path
    acceptance: dict
    prompts: dict[str, list[str]]
    draft_len: int
    max_new_tokens: int
    temperature: float
    model_name: str
    digest: str
    baseline: dict[str, list] = field(default_factory=dict)     # conditional acceptance per position, per domain
    baseline_overall: list | None = None
    baseline_source: str = "acceptance.json"
    prompt_format: dict | None = None     # export's triton/prompt_format.json: how clients are told to send prompts
    prompt_ids: dict[str, list[list[int]]] = field(default_factory=dict)   # the same prompts as token ids
    served_identity: dict | None = None   # export.json's: sha256 of config/tokenizer/weights per role (target, draft)


def read_run(workdir: Path, draft_len: int | None = None, prompts_per_probe: int | None = None) -> Run:
    arts = Path(workdir) / "artifacts"
    acc_f = arts / "validate" / "acceptance.json"
    if not (arts / "validate" / "manifest.json").exists() or not acc_f.exists():
        raise UsageError(f"{workdir}: no committed validate artifact (acceptance.json): the baseline comes from it; "
                         "run `specpipe build <config>` first")
    try:
        acc = validate_artifact.read_acceptance(arts / "validate")
    except StageError as e:
        raise UsageError(f"{workdir}: {e}") from None
    params = json.loads((arts / "validate" / "manifest.json").read_text()).get("fingerprint_inputs", {}).get("params", {})
    n = prompts_per_probe or params.get("num_prompts")
    try:   # the prompts validate measured
        evals = data_artifact.read_eval(arts / "data", domains=acc.domains, per_domain=n)
        prompts = {d: [p.prompt for p in ps] for d, ps in evals.items()}
    except StageError as e:
        raise UsageError(f"{workdir}: {e}") from None
    per, overall, source, digest = read_baseline(arts, acc)
    missing = sorted(set(per) - set(prompts))
    if missing:
        raise UsageError(f"{workdir}: validated domains {missing} have no prompts under artifacts/data/eval")
    if draft_len is None:
        if (arts / "build" / build_artifact.INFO).exists():
            try:   # the probe runs one request at a time: the deployed k at batch 1
                draft_len = build_artifact.read_deployment(arts / "build").schedule().k_at(1)
            except StageError as e:
                raise UsageError(f"{workdir}: {e}") from None
        else:
            draft_len = acc.measured_draft_len
    model, fmt, ident = "tensorrt_llm", None, None
    if (arts / "export" / export_artifact.INFO).exists():
        try:
            ex = export_artifact.read_export(arts / "export")
        except StageError as e:
            raise UsageError(f"{workdir}: {e}") from None
        model, fmt, ident = ex.model_name, ex.prompt_format or None, ex.served_identity
        check_prompt_format(arts, fmt)
    return Run(Path(workdir), acc.raw, prompts, draft_len, acc.max_new_tokens, acc.temperature, model, digest, per,
               overall, source, fmt,
               {d: [list(p.prompt_ids) for p in ps] for d, ps in evals.items()}, ident)


def confidence_text(S: float) -> str:
    p = math.exp(-S)
    return f"{100 * (1 - p):.2f}% (p <= {p:.2g})" if p >= 1e-4 else f"> 99.99% (p <= {p:.1e})"


# ---------------------------------------------------------------------------------------------- probing


def probe(url: str, model: str, prompt: str, *, max_tokens: int, temperature: float, timeout: float) -> dict:
    """One request over the LLM-API model's HTTP generate endpoint, asking for its perf metrics."""
    body = {"text_input": prompt, "sampling_param_max_tokens": max_tokens, "sampling_param_return_perf_metrics": True}
    if temperature > 0:
        body["sampling_param_temperature"] = temperature
    req = urllib.request.Request(f"{_url(url)}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the operator's endpoint
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ProbeError(f"{url}: HTTP {e.code} for model '{model}': {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ProbeError(f"{url}: no answer ({e})") from None
    if "total_draft_tokens" not in out:
        raise ProbeError(f"{url}: the response has no total_draft_tokens: the model does not return per-request "
                         "speculative statistics (sampling_param_return_perf_metrics)")
    return out



# ---------------------------------------------------------------------------------------------- the monitor


@dataclass(frozen=True)
class Endpoint:
    """What a monitor watches: the HTTP address (active probes), the metrics URL, passive (counters only), the timeout;
    traffic: in active mode also test the engine's counters between rounds (the live traffic, the probes left out);
    served: role (target, draft) -> the model directory the endpoint serves, compared with the export's identity."""

    url: str | None
    metrics_url: str | None = None
    passive: bool = False
    timeout: float = 120.0
    traffic: bool = False
    served: tuple = ()            # ((role, directory), ...)


class Monitor:
    def __init__(self, run: Run, design: Design, endpoint: Endpoint, *, state_path: Path, prom_path: Path,
                 reset: bool = False, echo=print):
        url, metrics_url, passive = endpoint.url, endpoint.metrics_url, endpoint.passive
        self.run, self.design, self.url, self.metrics_url, self.passive = run, design, url, metrics_url, passive
        self.state_path, self.prom_path, self.timeout, self.echo = Path(state_path), Path(prom_path), endpoint.timeout, echo
        self.traffic = endpoint.traffic and not passive and bool(metrics_url)
        self.served = dict(endpoint.served)
        if passive:
            self.tests = {"overall": make_test("overall", run.baseline_overall or [], design)}
        else:
            if TRAFFIC in run.baseline:
                raise UsageError(f"a validated domain is named '{TRAFFIC}', the monitor's name for the live traffic")
            self.tests = {d: make_test(d, p, design) for d, p in run.baseline.items()}
            if self.traffic:
                self.tests[TRAFFIC] = make_test(TRAFFIC, run.baseline_overall or [], design)
        self.key = f"{run.digest}:K{design.draft_len}:{design.drop}:{design.false_alarm}:{design.dispersion}:" \
                   f"{'passive' if passive else 'active'}{'+traffic' if self.traffic else ''}"
        self.counters: dict | None = None
        self.traffic_counters: dict | None = None
        self.identity_cache: dict = {}
        self.verdict = None
        self.changed: list[str] = []
        self.round = 0
        if not reset:
            self._load()

    # -- state
    def _load(self) -> None:
        try:
            st = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return
        if st.get("key") != self.key:
            self.echo(f"monitor state {self.state_path} was for another baseline or design: starting afresh")
            return
        for d, t in st.get("tests", {}).items():
            if d in self.tests:
                for k in ("S", "seg_steps", "seg_accepted", "probes", "alarm", "last_al", "last_steps", "history"):
                    setattr(self.tests[d], k, t.get(k, getattr(self.tests[d], k)))
        self.counters = st.get("counters")
        self.traffic_counters = st.get("traffic_counters")
        self.identity_cache = st.get("identity_cache") or {}
        self.round = st.get("round", 0)

    def _save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "round": self.round, "counters": self.counters,
                                   "traffic_counters": self.traffic_counters, "identity_cache": self.identity_cache,
                                   "diagnosis": self.verdict.to_json() if self.verdict else None,
                                   "served_changed": self.changed,
                                   "tests": {d: asdict(t) for d, t in self.tests.items()}}, indent=1))
        os.replace(tmp, self.state_path)

    # -- one round
    def step(self) -> list[str]:
        """One probe round (active: every domain; passive: the counters since the last round). Returns the
        domains in alarm."""
        self.round += 1
        traffic = self._traffic_since_last_round() if self.traffic else None
        obs = self._observe_passive() if self.passive else self._observe_active()
        if self.traffic:
            self.traffic_counters = self.read_series()       # after the probes: they are not the traffic
            obs[TRAFFIC] = traffic
        for d, (steps, accepted) in obs.items():
            t = self.tests[d]
            if steps is None:
                t.missing_stats = True
                self.echo(f"round {self.round} [{d}] NO SPECULATIVE STATISTICS: the endpoint reported 0 draft tokens "
                          "(speculation switched off: acceptance guard or max_concurrency, or an engine that does not "
                          "fill the per-request speculative-decoding metrics)")
                continue
            if steps == 0:
                self.echo(f"round {self.round} [{d}] no traffic since the last round")
                continue
            llr = t.update(steps, accepted)
            self.echo(f"round {self.round} [{d}] AL {t.last_al:.3f} over {steps:.0f} steps | baseline {t.al0:.3f} "
                      f"(alarm below ~{(t.al0 + t.al1) / 2:.3f}) | CUSUM {t.S:.2f} / {t.threshold:.2f} ({llr:+.2f})"
                      + (": DRIFT" if t.alarm else ": ok"))
        self._diagnose()
        self._save()
        self.write_prom()
        alarms = [d for d, t in self.tests.items() if t.alarm]
        for d in alarms:
            self.echo(self.alarm_line(self.tests[d]))
        if self.verdict is not None and not alarms:
            self.echo(f"round {self.round} SERVED MODEL DIFFERS FROM THE EXPORT: {self.verdict.line()}")
        return alarms

    def alarm_line(self, t: DomainTest) -> str:
        return (f"DRIFT ALARM domain={t.domain}: live acceptance length {t.live_al:.3f} vs validated baseline "
                f"{t.al0:.3f} (draft length {self.design.draft_len}, {t.seg_steps:.0f} steps since the CUSUM restarted); "
                f"one-sided CUSUM {t.S:.1f} >= {t.threshold:.2f}: confidence {confidence_text(t.S)} that the "
                f"acceptance dropped (designed false-alarm rate {self.design.false_alarm:g} per probe)"
                + (f" | {self.verdict.line()}" if self.verdict else ""))

    # -- the diagnosis (pipeline/monitor_diagnosis.py)
    def _diagnose(self) -> None:
        from pipeline.monitor_diagnosis import diagnose_round

        diagnose_round(self)

    def read_series(self) -> dict[str, dict]:
        """The endpoint's cumulative speculation counters now, {series: {"steps", "accepted", ...}}."""
        from pipeline.monitor_metrics import read_counters

        return read_counters(self.metrics_url, self.run.model_name)

    def _traffic_since_last_round(self) -> tuple[float, float]:
        """(steps, accepted) of the live traffic between the end of the last round's probes and now."""
        now = self.read_series()
        prev = self.traffic_counters or {}
        steps = accepted = 0.0
        for series, c in now.items():
            p = prev.get(series)
            if p is None or c["steps"] < p["steps"]:
                if p is None and not prev:      # the first round: no window yet
                    continue
                p = {"steps": 0.0, "accepted": 0.0}
            steps += c["steps"] - p["steps"]
            accepted += c["accepted"] - p["accepted"]
        return steps, accepted

    def _observe_active(self) -> dict:
        from runtime.serving.prompt_format import text_input_for

        K = self.design.draft_len
        out = {}
        for d, prompts in self.run.prompts.items():
            drafted = accepted = 0
            produced = 0
            for p in prompts:
                r = probe(self.url, self.run.model_name, text_input_for(p, self.run.prompt_format),
                          max_tokens=self.run.max_new_tokens, temperature=self.run.temperature, timeout=self.timeout)
                n_drafted, n_accepted = perf_counts(r, self.url)
                drafted += n_drafted
                accepted += n_accepted
                produced += bool(r.get("text_output"))
            out[d] = (None, None) if (drafted == 0 and produced) else (drafted / K, accepted)
        return out

    def _observe_passive(self) -> dict:
        from pipeline.monitor_metrics import read_counters

        now = read_counters(self.metrics_url, self.run.model_name)
        prev = self.counters or {}
        self.counters = now
        steps = accepted = 0.0
        for series, c in now.items():          # a series not seen before (first reading, reloaded model): all of it
            p = prev.get(series)
            if p is None or c["steps"] < p["steps"]:
                p = {"steps": 0.0, "accepted": 0.0}
            steps += c["steps"] - p["steps"]
            accepted += c["accepted"] - p["accepted"]
        return {"overall": (steps, accepted)}

    # -- Prometheus text file
    def write_prom(self) -> None:
        from pipeline.monitor_output import write_prom

        write_prom(self)

    def describe(self) -> str:
        from pipeline.monitor_output import describe

        return describe(self)
