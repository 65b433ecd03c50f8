"""`specpipe monitor` on the production engines' own metrics, its diagnosis, and the monitoring files export ships.

Readers (pipeline/monitor_engines.py) on the metric texts as the engines' source writes them (monitor_metrics/README.md:
NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py, PRs #12545 and #12636, and cpp/include/tensorrt_llm/executor/
types.h at a98a9061d72f6fd39f5d055ebdd2c6878a100e2c; sgl-project/sglang python/sglang/srt/metrics/collector.py),
rendered by the real prometheus_client and served over HTTP on 127.0.0.1 to the real monitor.

Diagnosis (pipeline/monitor_diagnosis.py): the verdict table, the served-files comparison on real directories, and a
simulation of the canary and the traffic: 1,000 rounds of the validated pair without a single alarm or verdict,
each of the three causes diagnosed in the round its first alarm comes.

Monitoring files (pipeline/monitor_alerts.py): `promtool check rules` and `promtool test rules` (Debian's
prometheus package) on the rules, Grafana's grafana-foundation-sdk schema on the dashboards.
"""
from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading

import numpy as np
import pytest

from support import DATA

HERE = DATA / "monitor_metrics"
PP = [0.8, 0.7, 0.6, 0.5]          # a validated chain (AL 2.87 at K=4), like the tiny pair's


def text(name: str) -> str:
    return (HERE / name).read_text()


# ---------------------------------------------------------------------------------------------- readers


def test_trtllm_prometheus_totals_and_per_position():
    from pipeline.monitor_metrics import trtllm_prometheus

    a = trtllm_prometheus(text("trtllm_prometheus_a.txt"), draft_len=4)
    (series, c), = a.items()
    assert 'model_name="tensorrt_llm"' in series and "token_position" not in series
    assert (c["steps"], c["accepted"], c["drafted"]) == (300, 559, 1200)
    assert c["per_position"] == {"0": [300, 240], "1": [300, 168], "2": [300, 101], "3": [300, 50]}
    b = trtllm_prometheus(text("trtllm_prometheus_b.txt"), draft_len=4)[series]
    assert 1 + (b["accepted"] - c["accepted"]) / (b["steps"] - c["steps"]) == pytest.approx(1.5)
    # a server with only #12636's per-position counters: the same steps and accepted tokens, summed over positions
    only = "\n".join(ln for ln in text("trtllm_prometheus_a.txt").splitlines() if "_num_" not in ln)
    p = trtllm_prometheus(only, draft_len=4)[series]
    assert (p["steps"], p["accepted"]) == (300, 559)
    assert trtllm_prometheus(text("sglang_a.txt"), draft_len=4) == {}


def test_trtllm_iteration_stats_skip_idle_and_zero_draft_iterations():
    from pipeline.monitor_metrics import trtllm_iterations

    doc = json.loads(text("trtllm_iterations.json"))
    assert trtllm_iterations(doc, None) == (4.0, 9.0, 10, 2)        # iter 7 drafted nothing, iter 10 is idle
    assert trtllm_iterations(doc, 8) == (2.0, 6.0, 10, 1)           # already counted up to 8
    assert trtllm_iterations([json.dumps(it) for it in doc], None) == (4.0, 9.0, 10, 2)
    assert trtllm_iterations(doc, 500)[:2] == (4.0, 9.0)              # smaller ids than seen: a restarted server


def test_sglang_counters_and_gauges():
    from pipeline.monitor_metrics import sglang_prometheus

    series, gauges = sglang_prometheus(text("sglang_a.txt"))
    (c,) = series.values()
    assert (c["steps"], c["accepted"]) == (300, 559)                 # AL = generation tokens / verify calls
    assert gauges == {"sglang:spec_accept_length": 2.86, "sglang:spec_accept_rate": 0.47}
    assert sglang_prometheus(text("trtllm_prometheus_a.txt"))[0] == {}


class _Served:
    """A real HTTP server on 127.0.0.1 answering GET with the current body."""

    def __init__(self):
        served = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                data = served.body.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.body = ""
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served():
    s = _Served()
    yield s
    s.close()


def _run(tmp_path, baseline=None, identity=None):
    from pipeline.monitor import Run

    return Run(tmp_path, {}, {"code": ["p"], "prose": ["q"]}, 4, 16, 0.0, "tensorrt_llm", "digest",
               {"code": PP, "prose": PP}, baseline or PP, served_identity=identity)


@pytest.mark.parametrize("engine,first,second", [("trtllm", "trtllm_prometheus_a.txt", "trtllm_prometheus_b.txt"),
                                                 ("sglang", "sglang_a.txt", "sglang_b.txt")])
def test_engine_monitor_over_http(tmp_path, served, engine, first, second):
    """Round 1 reads the counters (all of it: AL 2.86, the baseline), round 2 nothing new (idle: no observation),
    round 3 the drop to AL 1.5 over 100 steps: the alarm, with a diagnosis that asks for the canary."""
    from pipeline.monitor import Design, Endpoint
    from pipeline.monitor_engines import EngineMonitor

    out = []
    mon = EngineMonitor(_run(tmp_path), Design(draft_len=4), Endpoint(None, metrics_url=served.url, passive=True),
                        engine=engine, state_path=tmp_path / "s.json", prom_path=tmp_path / "m.prom", echo=out.append)
    served.body = text(first)
    assert mon.step() == [] and mon.tests["overall"].last_al == pytest.approx(1 + 559 / 300)
    assert mon.step() == [] and any("no traffic since the last round" in o for o in out)
    assert mon.tests["overall"].probes == 1
    served.body = text(second)
    assert mon.step() == ["overall"]
    line = next(o for o in out if o.startswith("DRIFT ALARM"))
    assert "live acceptance length 1.500" in line and "diagnosis: unknown" in line and "add --url" in line
    st = json.loads((tmp_path / "s.json").read_text())
    assert st["diagnosis"]["cause"] == "unknown"
    prom = (tmp_path / "m.prom").read_text()
    assert 'specpipe_monitor_diagnosis{cause="unknown",' in prom and 'drift_alarm{domain="overall"' in prom


def test_trtllm_json_monitor_counts_each_iteration_once(tmp_path, served):
    from pipeline.monitor import Design, Endpoint
    from pipeline.monitor_engines import EngineMonitor

    mon = EngineMonitor(_run(tmp_path), Design(draft_len=4), Endpoint(None, metrics_url=served.url, passive=True),
                        engine="trtllm-json", state_path=tmp_path / "s.json", prom_path=tmp_path / "m.prom",
                        echo=lambda *a: None)
    served.body = text("trtllm_iterations.json")
    mon.step()
    t = mon.tests["overall"]
    assert (t.probes, t.last_steps, t.last_al) == (1, 4, pytest.approx(1 + 9 / 4))
    mon.step()                                    # the same iterations again (a server that does not drain): nothing new
    assert t.probes == 1


def test_engine_errors_are_clear(tmp_path, served):
    from pipeline.monitor import Design, Endpoint, ProbeError
    from pipeline.monitor_engines import EngineMonitor

    served.body = "# nothing\nprocess_cpu_seconds_total 1.0\n"
    for engine, needle in (("trtllm", "no trtllm_spec_decode_"), ("sglang", "no sglang:spec_verify_calls_total"),
                           ("trtllm-json", "not JSON")):
        mon = EngineMonitor(_run(tmp_path), Design(draft_len=4), Endpoint(None, metrics_url=served.url, passive=True),
                            engine=engine, state_path=tmp_path / f"{engine}.json", prom_path=tmp_path / "m.prom",
                            echo=lambda *a: None)
        with pytest.raises(ProbeError, match=needle):
            mon.step()


# ---------------------------------------------------------------------------------------------- diagnosis


def _test(name, al_live=None, alarm=False):
    from pipeline.monitor import Design, make_test

    t = make_test(name, PP, Design(draft_len=4))
    t.alarm = alarm
    if al_live is not None:
        t.last_al = al_live
    return t


def test_verdict_table():
    from pipeline.monitor_diagnosis import diagnose

    ok, low = 2.85, 1.6
    canary = {"code": _test("code", ok), "prose": _test("prose", ok)}
    assert diagnose(canary, _test("traffic", ok), []) is None
    v = diagnose({"code": _test("code", low, True), "prose": _test("prose", low, True)}, _test("traffic", low, True), [])
    assert v.cause == "engine_state" and "restart" in v.action
    v = diagnose({"code": _test("code", low, True), "prose": _test("prose", ok)}, _test("traffic", low), [])
    assert v.cause == "engine_state"                              # traffic below its boundary before its own alarm
    v = diagnose(canary, _test("traffic", low, True), [])
    assert v.cause == "traffic_drift" and "retrain" in v.action and any("canary holds: code" in e for e in v.evidence)
    v = diagnose({"code": _test("code", low, True), "prose": _test("prose", ok)}, _test("traffic", ok), [])
    assert v.cause == "canary_only"
    v = diagnose({"code": _test("code", low, True)}, None, ["target config sha256 a != exported b"])
    assert v.cause == "target_changed" and "rebuild" in v.action and v.evidence[0].startswith("target config")
    assert diagnose(canary, None, ["target weights ..."]).cause == "target_changed"     # no drop yet: still said
    v = diagnose({"code": _test("code", low, True)}, None, ["draft weights sha256 a != exported b"])
    assert v.cause == "draft_changed" and "redeploy the exported draft" in v.action
    assert diagnose({}, _test("traffic", low, True), []).cause == "unknown"


def test_served_identity_names_the_changed_files(tmp_path):
    from pipeline.monitor_diagnosis import compare_identity, model_identity

    a = tmp_path / "exported"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 64}')
    (a / "tokenizer.json").write_text("{}")
    (a / "model.safetensors").write_bytes(b"\0" * 64)
    cache = {}
    exported = model_identity(a, cache)
    assert all(exported.values()) and model_identity(a, cache) == exported
    b = tmp_path / "served"
    shutil.copytree(a, b)
    assert compare_identity("target", exported, model_identity(b)) == []
    (b / "model.safetensors").write_bytes(b"\1" * 64)                 # same size, other weights
    (b / "config.json").write_text('{"hidden_size": 65}')
    ev = compare_identity("target", exported, model_identity(b, cache))
    assert [e.split(" sha256")[0] for e in ev] == ["target config", "target weights"]


class _SimulatedEndpoint:
    """Canary responses and live traffic drawn from the chain with conditional acceptances p (per step), with a
    response-level random effect (each response's acceptances scaled by one Beta draw, mean 1) so that steps of one
    response are correlated as in real serving: the per-round variance the test's `dispersion` covers."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def draw(self, p, responses, steps_per_response=48):
        scale = self.rng.beta(40, 1, size=(responses, 1, 1)) / (40 / 41)
        u = self.rng.random((responses, steps_per_response, len(p)))
        acc = np.cumprod(u < np.clip(np.asarray(p) * scale, 0, 1), axis=-1).sum()
        return float(responses * steps_per_response), float(acc)


def _simulated_monitor(tmp_path, sim, state, *, identity=None, served=()):
    from pipeline.monitor import TRAFFIC, Design, Endpoint, Monitor

    class Simulated(Monitor):
        """The real Monitor (CUSUM, diagnosis, state, Prometheus file) with the endpoint simulated."""

        def _observe_active(self):
            return {d: sim.draw(state["canary"][d], 3) for d in self.run.prompts}

        def read_series(self):
            steps, acc = sim.draw(state["traffic"], 8)
            state["cum"] = [state["cum"][0] + steps, state["cum"][1] + acc]
            return {"s": {"steps": state["cum"][0], "accepted": state["cum"][1]}}

    mon = Simulated(_run(tmp_path, identity=identity), Design(draft_len=4),
                    Endpoint("http://127.0.0.1:1", metrics_url="http://127.0.0.1:1/metrics", traffic=True,
                             served=served),
                    state_path=tmp_path / "s.json", prom_path=tmp_path / "m.prom", echo=lambda *a: None)
    assert TRAFFIC in mon.tests
    return mon


def test_no_alarm_over_1000_rounds_of_the_validated_pair(tmp_path):
    """Canary (2 domains, 3 responses each) and traffic (8 responses between rounds) at the validated acceptance with
    the response-level variance: 1,000 rounds, no alarm, no verdict (designed: <= 0.001 false alarms per round and
    test, so about 3 expected at most over the 3 tests; the CUSUM's actual rate is far below its bound)."""
    sim = _SimulatedEndpoint(seed=7)
    state = {"canary": {"code": PP, "prose": PP}, "traffic": PP, "cum": [0.0, 0.0]}
    mon = _simulated_monitor(tmp_path, sim, state)
    alarms = verdicts = 0
    top = 0.0
    for _ in range(1000):
        alarms += len(mon.step())
        verdicts += mon.verdict is not None
        top = max(top, *(t.S for t in mon.tests.values()))
    print(f"1000 rounds: {alarms} alarms, {verdicts} verdicts; largest CUSUM {top:.2f} (threshold "
          f"{mon.design.threshold:.2f})")
    assert alarms == 0 and verdicts == 0


def test_no_alarm_over_1000_rounds_at_the_measured_variance(tmp_path):
    """The canary's rounds as measured on a served pair (monitor_metrics/measured_canary_rounds.json: the tiny pair behind
    the real CPU Triton server, temperature 1.0, 100 rounds; bench/monitor_variance.py), resampled: 1,000 rounds through
    the real Monitor (CUSUM per domain, traffic, diagnosis, state file), each domain's observation one measured round
    drawn at random, the traffic the two domains of another measured round together. The baseline is the pair as if
    validated at that temperature: per domain a constant-p chain whose mean is the measured mean (the per-round spread
    is what was measured, not modelled). No alarm, no verdict. The measured dispersion (the per-round variance over the
    chain's, times the steps) is below the test's assumed 2, so the design is conservative for this pair."""
    from pipeline.monitor import TRAFFIC, Design, Endpoint, Monitor, Run, make_test, scaled_for_mean

    doc = json.loads(text("measured_canary_rounds.json"))
    rounds, K = doc["rounds"], doc["draft_len"]
    domains = sorted(rounds[0])
    assert len(rounds) == 100 and all(0.5 < s["dispersion"] < 2.0 for s in doc["summary"].values())

    def chain(obs):
        return scaled_for_mean([1.0] * K, sum(o["accepted"] for o in obs) / sum(o["steps"] for o in obs))

    per = {d: chain([r[d] for r in rounds]) for d in domains}
    overall = chain([r[d] for r in rounds for d in domains])
    run = Run(tmp_path, {}, {d: ["p"] for d in domains}, K, doc["max_new_tokens"], doc["temperature"], "tensorrt_llm",
              "measured", per, overall)
    rng = np.random.default_rng(41)
    cum = [0.0, 0.0]

    class Measured(Monitor):
        def _observe_active(self):
            return {d: (r[d]["steps"], r[d]["accepted"]) for d, r in ((d, rounds[rng.integers(len(rounds))])
                                                                      for d in domains)}

        def read_series(self):
            r = rounds[rng.integers(len(rounds))]
            cum[0] += sum(r[d]["steps"] for d in domains)
            cum[1] += sum(r[d]["accepted"] for d in domains)
            return {"s": {"steps": cum[0], "accepted": cum[1]}}

    mon = Measured(run, Design(draft_len=K), Endpoint("http://127.0.0.1:1", metrics_url="http://127.0.0.1:1/m",
                                                      traffic=True),
                   state_path=tmp_path / "s.json", prom_path=tmp_path / "m.prom", echo=lambda *a: None)
    assert TRAFFIC in mon.tests
    alarms = verdicts = 0
    top = 0.0
    for _ in range(1000):
        alarms += len(mon.step())
        verdicts += mon.verdict is not None
        top = max(top, *(t.S for t in mon.tests.values()))
    print(f"1000 rounds at the measured variance: {alarms} alarms, {verdicts} verdicts; largest CUSUM {top:.2f} "
          f"(threshold {mon.design.threshold:.2f}); baselines "
          + ", ".join(f"{d} AL {t.al0:.3f}" for d, t in mon.tests.items()))
    assert alarms == 0 and verdicts == 0
    # the same measured rounds against the pair's temperature-0 baseline (validated AL 5.0, alarm boundary 4.5) alarm
    # within 20 rounds (round 10 in order): sampling at temperature 1 accepts less (AL 4.43), which is why the canary
    # probes at validate's temperature, and the test can fail
    greedy = make_test("code", [1.0] * K, Design(draft_len=K))
    assert greedy.al0 == doc["validated_al"]["code"] == 5.0
    first = next((i for i, x in enumerate(rounds, 1) if greedy.update(x["code"]["steps"], x["code"]["accepted"]) is not None
                  and greedy.alarm), None)
    assert first is not None and first <= 20, first


def _first_verdict(mon, rounds=30):
    for r in range(1, rounds + 1):
        if mon.step():
            return r, mon.verdict
    return None, mon.verdict


@pytest.mark.parametrize("case", ["engine_state", "traffic_drift", "target_changed"])
def test_each_cause_is_diagnosed_in_the_round_of_its_first_alarm(tmp_path, case):
    from pipeline.monitor import scaled_for_mean, step_moments
    from pipeline.monitor_diagnosis import model_identity

    worse = scaled_for_mean(PP, 0.6 * (1 + step_moments(PP)[0]) - 1)        # AL 40% down
    sim = _SimulatedEndpoint(seed=11)
    state = {"canary": {"code": PP, "prose": PP}, "traffic": PP, "cum": [0.0, 0.0]}
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    identity = {"target": model_identity(target)}
    mon = _simulated_monitor(tmp_path, sim, state, identity=identity, served=(("target", str(target)),))
    for _ in range(5):
        assert mon.step() == [] and mon.verdict is None
    if case == "engine_state":
        state["canary"] = {"code": worse, "prose": worse}
        state["traffic"] = worse
    elif case == "traffic_drift":
        state["traffic"] = worse
    else:
        (target / "config.json").write_text('{"swapped": true}')
        state["canary"] = {"code": worse, "prose": worse}
        state["traffic"] = worse
    r, v = _first_verdict(mon)
    assert r is not None and v.cause == case, (r, v)
    print(f"{case}: first alarm in round {r} after the change: {v.line()}")
    prom = (tmp_path / "m.prom").read_text()
    assert f'specpipe_monitor_diagnosis{{cause="{case}",' in prom and f'cause="{case}",action="{v.action}"' in prom
    assert json.loads((tmp_path / "s.json").read_text())["diagnosis"]["cause"] == case


# ---------------------------------------------------------------------------------------------- monitoring files


@pytest.fixture(scope="module")
def monitoring(tmp_path_factory):
    from pipeline import monitor_alerts as A

    d = tmp_path_factory.mktemp("export") / "monitoring"
    A.write(d, model="tensorrt_llm", draft_len=4, al0=2.87, domains={"code": 3.26, "prose": 2.92})
    return d


def _promtool():
    p = shutil.which("promtool")
    if p is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; .ci/run installs it)")
    return p


def test_rules_pass_promtool_check(monitoring, tmp_path):
    promtool = _promtool()
    files = sorted(monitoring.glob("*.yml"))
    assert len(files) == 5
    r = subprocess.run([promtool, "check", "rules", *map(str, files)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "bad.yml"          # the check can fail: a broken expression
    bad.write_text((monitoring / "prometheus_rules_vllm.yml").read_text().replace("sum(rate(", "sum(rate((", 1))
    assert subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True).returncode != 0


@pytest.mark.parametrize("engine,drafts,accepted", [
    ("vllm", "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"),
    ("trtllm", "trtllm_spec_decode_num_draft_tokens_total", "trtllm_spec_decode_num_accepted_tokens_total"),
])
def test_engine_alert_fires_below_the_band_and_not_when_idle(monitoring, tmp_path, engine, drafts, accepted):
    """promtool's rule unit tests: 100 steps a minute accepting 1.87 per step (AL 2.87) then 0.6 (AL 1.6): the alert
    fires after its 30 minutes below the band; an idle engine (flat counters) never fires."""
    promtool = _promtool()
    per_step = 4 if engine == "trtllm" else 1         # trtllm counts draft tokens: K per step
    good, bad = f"0+{100 * per_step}x60", f"{6000 * per_step}+{100 * per_step}x120"
    series = [{"series": f'{drafts}{{model_name="m"}}', "values": f"{good} {bad}"},
              {"series": f'{accepted}{{model_name="m"}}', "values": "0+187x60 11220+60x120"}]
    idle = [{"series": f'{drafts}{{model_name="m"}}', "values": "0x180"},
            {"series": f'{accepted}{{model_name="m"}}', "values": "0x180"}]
    tests = {"rule_files": [str(monitoring / f"prometheus_rules_{engine}.yml")], "evaluation_interval": "1m",
             "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                 {"eval_time": "55m", "alertname": "SpecpipeEngineAcceptanceBelowBand", "exp_alerts": []},
                 {"eval_time": "110m", "alertname": "SpecpipeEngineAcceptanceBelowBand",
                  "exp_alerts": [{"exp_labels": {"severity": "warning", "engine": engine}, "exp_annotations": {
                      "summary": f"{engine}: live acceptance length below the validated band",
                      "description": "The engine's own counters give an acceptance length of 1.6 over 10m for 30 "
                                     "minutes; validated 2.870 at draft length 4, alarm boundary 2.583. Run "
                                     "`specpipe monitor --traffic` for the cause."}}]}]},
                 {"interval": "1m", "input_series": idle, "alert_rule_test": [
                     {"eval_time": "170m", "alertname": "SpecpipeEngineAcceptanceBelowBand", "exp_alerts": []}]}]}
    f = tmp_path / "t.yml"
    f.write_text(json.dumps(tests))
    r = subprocess.run([promtool, "test", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("engine", ["triton", "vllm", "trtllm", "sglang"])
def test_dashboard_matches_grafana_schema(monitoring, engine):
    """Grafana's own grafana-foundation-sdk (its typed dashboard model): every key and value the dashboard sets
    survives decoding into the schema's classes and encoding back (a key the schema does not know is dropped)."""
    sdk = pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk is in the [test] extra")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard
    from grafana_foundation_sdk.models.prometheus import Dataquery

    assert sdk
    register_default_plugins()
    doc = json.loads((monitoring / f"grafana_dashboard_{engine}.json").read_text())
    model = Dashboard.from_json(doc)
    assert all(isinstance(t, Dataquery) for p in model.panels for t in p.targets)
    back = json.loads(JSONEncoder().encode(model))

    def subset(a, b, path="$"):
        if isinstance(a, dict):
            assert isinstance(b, dict), path
            for k, v in a.items():
                assert k in b, f"{path}.{k} is not in Grafana's dashboard schema"
                subset(v, b[k], f"{path}.{k}")
        elif isinstance(a, list):
            assert isinstance(b, list) and len(a) == len(b), path
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                subset(x, y, f"{path}[{i}]")
        else:
            assert a == b, path

    subset(doc, back)
    exprs = " ".join(t["expr"] for p in doc["panels"] for t in p["targets"])
    assert "specpipe_monitor_cusum" in exprs and "specpipe_monitor_diagnosis" in exprs
    assert {"vllm": "vllm:spec_decode_num_drafts_total", "trtllm": "trtllm_spec_decode_num_draft_tokens_total",
            "sglang": "sglang:spec_verify_calls_total", "triton": "specpipe_verification_steps_total"}[engine] in exprs
    with pytest.raises(AssertionError, match="not in Grafana"):      # the check can fail
        subset({**doc, "panels": [{**doc["panels"][0], "gridpos": {}}]}, json.loads(JSONEncoder().encode(
            Dashboard.from_json({**doc, "panels": [{**doc["panels"][0], "gridpos": {}}]}))))


def test_cli_usage_errors(tmp_path):
    from conftest import run_cli

    r = run_cli("monitor", "--workdir", str(tmp_path), "--engine", "trtllm", "--url", "http://127.0.0.1:1")
    assert r.returncode == 2 and "--engine trtllm reads the engine's own metrics: give --passive" in r.stderr
    r = run_cli("monitor", "--workdir", str(tmp_path), "--passive", "--metrics-url", "http://127.0.0.1:1/m", "--traffic")
    assert r.returncode == 2 and "--traffic tests the engine's counters beside the active probes" in r.stderr
    r = run_cli("monitor", "--workdir", str(tmp_path), "--url", "http://127.0.0.1:1", "--served-target",
                str(tmp_path / "missing"))
    assert r.returncode == 2 and "--served-target" in r.stderr and "not a directory" in r.stderr


# ---------------------------------------------------------------------------------------------- LLM-API outputs, faults


def test_perf_counts_read_the_llmapi_outputs_as_triton_sends_them():
    """The LLM-API Triton model sends the counts with text_output's dtype (model.py@044a90d209e380c95e23e8ae42f3583fa05ada78
    `_create_response`), so /generate carries strings; numbers and one-element lists are read too; anything else is a
    ProbeError naming the output."""
    from pipeline.monitor import perf_counts
    from pipeline.monitor_metrics import ProbeError

    assert perf_counts({"total_draft_tokens": "12", "total_accepted_draft_tokens": "9"}, "u") == (12, 9)
    assert perf_counts({"total_draft_tokens": 12, "total_accepted_draft_tokens": [b"9"]}, "u") == (12, 9)
    for bad, name in (({"total_draft_tokens": "N/A", "total_accepted_draft_tokens": "1"}, "total_draft_tokens"),
                      ({"total_draft_tokens": "4", "total_accepted_draft_tokens": "1.5"}, "total_accepted_draft_tokens"),
                      ({"total_draft_tokens": "4"}, "total_accepted_draft_tokens"),
                      ({"total_draft_tokens": "4", "total_accepted_draft_tokens": "5"}, "> total_draft_tokens")):
        with pytest.raises(ProbeError, match=name):
            perf_counts(bad, "u")


def test_the_draft_decay_fault_is_off_unless_named_and_corrupts_after_n():
    import torch

    from runtime.serving.faults import DRAFT_DECAY, DraftDecay, FaultSpecError

    assert DraftDecay.from_env({}) is None
    f = DraftDecay.from_env({DRAFT_DECAY: "2:0.5:7"})
    assert (f.after, f.scale, f.seed) == (2, 0.5, 7)
    for bad in ("x", "2", "-1:0.5", "2:0", "2:0.5:1:2"):
        with pytest.raises(FaultSpecError, match="N:SCALE"):
            DraftDecay.from_env({DRAFT_DECAY: bad})
    m = torch.nn.Linear(8, 8)
    m.__dict__["_specpipe_plans"] = {"fp32": "fused"}
    w0 = m.weight.detach().clone()
    assert not f.request_finished(m) and not f.request_finished(m) and torch.equal(m.weight, w0)
    assert f.request_finished(m) and not torch.equal(m.weight, w0) and "_specpipe_plans" not in m.__dict__
