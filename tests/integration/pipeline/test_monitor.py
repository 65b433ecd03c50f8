"""`specpipe monitor`: the sequential test's design, and the monitor against a real served pair.

Design (simulation, no server): per-step accepted counts drawn from the validated per-position acceptance
(the model the test is built on). Under the baseline the CUSUM's false-alarm rate stays below the designed
alpha per probe; a deployment 5% below the baseline (inside the tolerance band, e.g. another engine's numerics)
does not alarm either; a 20% drop (the designed alternative) alarms within a few probes.

For real (slow): the tiny pipeline's validated pair behind a real Triton server; the monitor, run through the
CLI as an operator runs it, raises no alarm over N = 5 probe rounds (active) nor on the passive counters. Then the
same endpoint (same server, same URL, same FP8 target) serves a degraded draft, trained for 2 steps in the test,
after a model reload: the monitor raises the alarm within M = 2 rounds (the design expects 1: a degraded draft
accepts ~1 token per step against a baseline near 5), names the domain, the baseline, the live value and the
confidence, exits 1 in `--once` mode, and its Prometheus text file says so; the diagnosis (the served draft hashed
against export.json's served_identity) says the draft changed, in the alarm line, the state and the text file.
Designed false-alarm rate: 0.001 per probe and domain (threshold ln 1000).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_CONFIG, artifact_dir, run_cli, tiny_overrides

N_PROBES, M_PROBES = 5, 2


# ---------------------------------------------------------------------------------------------- design


def _simulate(design_pp, true_pp, *, probes, monitors, steps_per_probe=48, seed=0, **design_kw):
    """`monitors` independent CUSUMs over `probes` probes of `steps_per_probe` i.i.d. steps whose accepted counts
    follow the chain with conditional acceptances `true_pp`. Returns (alarms per monitor with restart after each
    alarm, first alarm probe per monitor or -1)."""
    from pipeline.monitor import Design, make_test

    K = len(design_pp)
    t = make_test("d", design_pp, Design(draft_len=K, **design_kw))
    rng = np.random.default_rng(seed)
    u = rng.random((probes, monitors, steps_per_probe, K))
    accepted = np.cumprod(u < np.asarray(true_pp), axis=-1).sum(-1).sum(-1)      # [probes, monitors]
    x = accepted / steps_per_probe
    v = t.var / steps_per_probe
    llr = (t.mu0 - t.mu1) / v * ((t.mu0 + t.mu1) / 2 - x)
    S = np.zeros(monitors)
    alarms = np.zeros(monitors, dtype=int)
    first = np.full(monitors, -1)
    for i in range(probes):
        S = np.maximum(0, S + llr[i])
        hit = S >= t.threshold
        first[(first < 0) & hit] = i + 1
        alarms += hit
        S[hit] = 0
    return alarms, first, t


PP = [0.8, 0.7, 0.6, 0.5]


def test_false_alarm_rate_is_below_the_design_under_the_baseline():
    alarms, _, t = _simulate(PP, PP, probes=2000, monitors=200)
    rate = alarms.sum() / (2000 * 200)
    print(f"baseline AL {t.al0:.3f}: {alarms.sum()} false alarms in {2000 * 200} probes (designed <= 1e-3)")
    assert rate <= 1e-3


def test_a_deviation_inside_the_tolerance_band_does_not_alarm():
    from pipeline.monitor import scaled_for_mean, step_moments

    mu0 = step_moments(PP)[0]
    worse = scaled_for_mean(PP, 0.95 * (1 + mu0) - 1)          # AL 5% below the baseline
    alarms, _, _ = _simulate(PP, worse, probes=1000, monitors=100, seed=1)
    assert alarms.sum() / (1000 * 100) <= 1e-3


def test_the_designed_drop_is_detected_within_a_few_probes():
    from pipeline.monitor import scaled_for_mean, step_moments

    mu0 = step_moments(PP)[0]
    dropped = scaled_for_mean(PP, 0.8 * (1 + mu0) - 1)         # AL 20% below: the alternative
    _, first, t = _simulate(PP, dropped, probes=50, monitors=500, seed=2)
    assert (first > 0).all()
    print(f"AL {t.al0:.3f} -> {t.al1:.3f}: median detection after {np.median(first):.0f} probes, 99th pct "
          f"{np.percentile(first, 99):.0f}")
    assert np.percentile(first, 99) <= 10


def test_baseline_at_a_shorter_deployed_draft_length():
    """validate measured 4 positions; deployed at 2 the baseline uses the first two: AL = 1 + p1 + p1 p2."""
    from pipeline.monitor import Design, make_test

    t = make_test("code", PP, Design(draft_len=2))
    assert t.al0 == pytest.approx(1 + 0.8 + 0.8 * 0.7)
    with pytest.raises(Exception, match="deployed draft length is 5"):
        make_test("code", PP, Design(draft_len=5))


# ---------------------------------------------------------------------------------------------- for real


@pytest.fixture(scope="module")
def degraded_draft(run_dir, tmp_path_factory) -> Path:
    """The same run's draft trained for 2 steps instead of the configured 30 (everything upstream reused)."""
    wd = tmp_path_factory.mktemp("degraded") / "run"
    shutil.copytree(run_dir / "artifacts", wd / "artifacts", symlinks=True)
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides(), "-o", "train_draft.steps=2",
                "-o", "train_draft.warmup_steps=1", "--only", "train_draft")
    assert r.returncode == 0, r.stderr[-3000:]
    return artifact_dir(wd, "train_draft") / "draft"


def monitor(run_dir, *args) -> subprocess.CompletedProcess:
    r = run_cli("monitor", "--workdir", str(run_dir), *args, timeout=600)
    print(r.stdout[-3000:], r.stderr[-1500:])
    return r


@pytest.mark.slow
def test_monitor_quiet_on_the_validated_pair_alarms_on_a_degraded_draft(run_dir, degraded_draft, tmp_path):
    from runtime.serving import triton_server

    repo = tmp_path / "repo"
    shutil.copytree(run_dir / "artifacts" / "export" / "triton_cpu", repo)
    state, prom = tmp_path / "state.json", tmp_path / "monitor.prom"
    pstate, pprom = tmp_path / "pstate.json", tmp_path / "passive.prom"
    srv = triton_server.start(repo, ready_timeout=120)
    try:
        url = f"http://{srv.http_url}"
        draft = repo / "tensorrt_llm" / "1" / "draft"
        # the canary, the traffic between rounds (none here) and the served draft compared with export.json
        common = ["--url", url, "--state", str(state), "--prom-file", str(prom), "--traffic", "--metrics-url",
                  srv.metrics_url, "--served-draft", str(draft)]
        r = monitor(run_dir, *common, "--probes", str(N_PROBES), "--interval", "0")
        assert r.returncode == 0 and "DRIFT ALARM" not in r.stdout and "no drift alarm" in r.stdout
        assert "diagnosis" not in r.stdout and "[traffic] no traffic since the last round" in r.stdout
        domains = sorted(json.loads((run_dir / "artifacts" / "validate" / "acceptance.json").read_text())["domains"])
        rounds = re.findall(r"round (\d+) \[(\w+)\] AL ([\d.]+)", r.stdout)
        assert len(rounds) == N_PROBES * len(domains)
        text = prom.read_text()
        for d in domains:
            assert re.search(rf'specpipe_monitor_drift_alarm{{domain="{d}",[^}}]*}} 0', text)
            assert re.search(rf'specpipe_monitor_probes{{domain="{d}",[^}}]*}} {N_PROBES}', text)
        r = monitor(run_dir, "--passive", "--metrics-url", srv.metrics_url, "--once", "--state", str(pstate),
                    "--prom-file", str(pprom))
        assert r.returncode == 0 and "[overall] AL" in r.stdout

        # the same endpoint now serves the same target with a degraded draft
        shutil.rmtree(draft)
        shutil.copytree(degraded_draft, draft)
        srv.load("tensorrt_llm", timeout=300, parameters={"specpipe_reload": "degraded-draft"})
        for i in range(1, M_PROBES + 1):  # noqa: B007 - i, the probe count, is printed after the loop
            r = monitor(run_dir, *common, "--once")
            if "DRIFT ALARM" in r.stdout:
                break
        assert r.returncode == 1, "no alarm within M probes"
        print(f"alarm after {i} probe round(s) on the degraded draft")
        alarm = re.search(r"DRIFT ALARM domain=(\w+): live acceptance length ([\d.]+) vs validated baseline ([\d.]+) "
                          r".*confidence (.+?) that", r.stdout)
        assert alarm, r.stdout
        live, base = float(alarm.group(2)), float(alarm.group(3))
        assert alarm.group(1) in domains and live < 0.8 * base
        assert re.search(r'specpipe_monitor_drift_alarm{domain="\w+",[^}]*} 1', prom.read_text())
        # the diagnosis: the served draft's weights are not the exported ones
        assert "| diagnosis: draft changed (draft weights sha256" in r.stdout and "redeploy the exported draft" in r.stdout
        assert re.search(r'specpipe_monitor_diagnosis{cause="draft_changed",[^}]*} 1', prom.read_text())
        assert json.loads(state.read_text())["diagnosis"]["cause"] == "draft_changed"
        r = monitor(run_dir, "--passive", "--metrics-url", srv.metrics_url, "--once", "--state", str(pstate),
                    "--prom-file", str(pprom))
        assert r.returncode == 1 and "DRIFT ALARM domain=overall" in r.stdout
        assert srv.alive()                                     # the reload with custom metrics did not crash it
    finally:
        srv.stop()


def test_monitor_errors_are_clear(run_dir, tmp_path):
    r = monitor(run_dir)
    assert r.returncode == 2 and "give --url" in r.stderr
    r = monitor(run_dir, "--passive")
    assert r.returncode == 2 and "--metrics-url" in r.stderr
    r = monitor(tmp_path, "--url", "http://127.0.0.1:1")
    assert r.returncode == 2 and "no committed validate artifact" in r.stderr
    dead = f"http://127.0.0.1:{__import__('runtime.serving.triton_server', fromlist=['free_port']).free_port()}"
    r = monitor(run_dir, "--url", dead, "--once", "--state", str(tmp_path / "s.json"), "--prom-file", str(tmp_path / "p"))
    assert r.returncode == 1 and "probe failed" in r.stderr and "no answer" in r.stderr


@pytest.mark.slow
def test_engine_state_decay_is_diagnosed_and_a_fresh_instance_is_fine(run_dir, tmp_path):
    """A served engine whose acceptance decays with unchanged files: the real CPU Triton server on a copy of the export,
    with the TEST FAULT of runtime/serving/faults.py (after FAULT_AFTER completed requests every further one corrupts
    the draft's weights in memory). Round 1 (its canary: the fault's first FAULT_AFTER requests) is quiet; live traffic
    then decays the engine; round 2, the first after the decay, alarms and diagnoses engine state (canary and traffic
    down, the served files still the exported ones: restart first). A fresh instance of the same export (the restart)
    is probed afterwards: no alarm, the validated AL."""
    from pipeline import monitor as M
    from runtime.serving import triton_server
    from runtime.serving.faults import DRAFT_DECAY
    from runtime.serving.prompt_format import text_input_for

    per_probe = 2
    run = M.read_run(run_dir, prompts_per_probe=per_probe)
    fault_after = per_probe * len(run.prompts)          # round 1's canary requests are served clean
    repo = tmp_path / "repo"
    shutil.copytree(run_dir / "artifacts" / "export" / "triton_cpu", repo)
    model = repo / "tensorrt_llm" / "1"
    state, prom = tmp_path / "state.json", tmp_path / "monitor.prom"
    srv = triton_server.start(repo, ready_timeout=120, env={DRAFT_DECAY: f"{fault_after}:1.0:3"})
    try:
        assert DRAFT_DECAY in srv.log_tail(60)                  # the model says the fault is on
        url = f"http://{srv.http_url}"
        common = ["--url", url, "--traffic", "--metrics-url", srv.metrics_url, "--served-draft", str(model / "draft"),
                  "--served-target", str(model / "target_fp8"), "--prompts-per-probe", str(per_probe),
                  "--state", str(state), "--prom-file", str(prom), "--once"]
        r = monitor(run_dir, *common)
        assert r.returncode == 0 and "DRIFT ALARM" not in r.stdout and "diagnosis" not in r.stdout
        for i in range(4):                                     # live traffic (not the canary's prompts) decays it
            M.probe(url, run.model_name, text_input_for(f"traffic request {i}: def add(a, b):", run.prompt_format),
                    max_tokens=run.max_new_tokens, temperature=0.0, timeout=120)
        r = monitor(run_dir, *common)
        assert r.returncode == 1 and "DRIFT ALARM" in r.stdout, "no alarm in the first round after the decay"
        assert "| diagnosis: engine state (" in r.stdout and "served files unchanged" in r.stdout
        assert "action: restart the engine first" in r.stdout
        assert re.search(r"\[traffic\] AL [\d.]+ over", r.stdout)
        st = json.loads(state.read_text())
        assert st["diagnosis"]["cause"] == "engine_state" and st["served_changed"] == []
        assert re.search(r'specpipe_monitor_diagnosis{cause="engine_state",[^}]*} 1', prom.read_text())
    finally:
        srv.stop()
    fresh = triton_server.start(repo, ready_timeout=120)       # the restart: the same files, a fresh instance
    try:
        r = monitor(run_dir, "--url", f"http://{fresh.http_url}", "--prompts-per-probe", str(per_probe), "--once",
                    "--state", str(tmp_path / "fresh.json"), "--prom-file", str(tmp_path / "fresh.prom"))
        assert r.returncode == 0 and "DRIFT ALARM" not in r.stdout
        als = [float(a) for a in re.findall(r"\] AL ([\d.]+) over", r.stdout)]
        base = {d: t["al0"] for d, t in json.loads((tmp_path / "fresh.json").read_text())["tests"].items()}
        assert len(als) == len(base) and all(abs(a - b) < 0.1 * b for a, b in zip(als, base.values(), strict=True))
    finally:
        fresh.stop()


def test_traffic_on_a_triton_model_without_speculative_counters_says_what_is_possible(tmp_path):
    """A real Triton server whose model publishes no speculative counters, as TensorRT-LLM's LLM-API model
    (model.py@044a90d209e380c95e23e8ae42f3583fa05ada78 creates no pb_utils.MetricFamily): here the FAKE LLM-API model of
    tests/support/fake_trtllm_llmapi (TensorRT-LLM cannot run here). Reading the traffic counters stops with a
    message that says so and names the ways out, not the generic 'no specpipe_* counters'."""
    from pipeline.monitor_metrics import ProbeError, read_counters
    from runtime.serving import triton_server

    from support import SUPPORT

    fake = SUPPORT / "fake_trtllm_llmapi"
    model = tmp_path / "repo" / "tensorrt_llm"
    (model / "1").mkdir(parents=True)
    shutil.copy2(fake / "model.py", model / "1" / "model.py")
    (model / "1" / "model.yaml").write_text("model: /nowhere\ntriton_config: {max_batch_size: 0, decoupled: true}\n")
    (model / "config.pbtxt").write_text(
        'name: "tensorrt_llm"\nbackend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
        'input [ { name: "text_input" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\n')
    srv = triton_server.start(model.parent, ready_timeout=120)
    try:
        with pytest.raises(ProbeError) as e:
            read_counters(srv.metrics_url, "tensorrt_llm")
        msg = str(e.value)
        assert "without speculative counters" in msg and "--engine trtllm" in msg and "canary" in msg, msg
        with pytest.raises(ProbeError, match="no specpipe_\\* counters for model 'other'"):
            read_counters(srv.metrics_url, "other")                # a model Triton does not serve: the generic error
    finally:
        srv.stop()
