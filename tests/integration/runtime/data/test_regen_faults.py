"""Regeneration through endpoints that misbehave (runtime/data/endpoint_client.py, regen_engines.server_batches,
answers.py): a real HTTP server in a thread on 127.0.0.1 (tests/support/fake_completions.py, vLLM v0.32.0's
completions shape) answers 503, 429 with Retry-After, resets connections mid-body, hangs past the client's timeout,
dies while serving, sends malformed JSON or ids outside the vocabulary; every prompt must come back answered exactly
once, right, and a process killed mid-run must resume without asking twice."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runtime.data import endpoint_client as C
from runtime.data import regen_engines as R
from runtime.data import server_engine as S
from runtime.data.answers import AnswerLog
from runtime.data.regenerate import Decoding, RegenRun, regenerate

from support import REPO
from support.fake_completions import FakeCompletions, State, expected_answer

LOG = logging.getLogger("test.regen_faults")
VOCAB, NEW = 1000, 16
DEC = Decoding(max_new_tokens=NEW, temperature=0.0, top_p=1.0, stop_ids=[2], seed=0)


def _prompts(n: int):
    return [[5 + i % 7, 11 + i, 3 + (i * 7) % 13] for i in range(n)], [f"k{i:05d}" for i in range(n)]


def _run(urls, prompts, keys, scratch, *, concurrency=8, max_failed=0.0, attempts=6, timeout=0.5, **kw):
    pool = C.CompletionsPool(C.ClientSettings(tuple(urls), timeout_s=timeout, max_attempts=attempts, backoff_s=0.01,
                                              concurrency=concurrency, vocab_size=VOCAB, **kw))
    job = S.ServerJob(pool, 4, max_failed_fraction=max_failed)
    try:
        return regenerate(Path("/unused"), prompts, keys, batch_size=4, decoding=DEC, run=RegenRun(scratch, LOG),
                          generate_batches=lambda *a, **k: S.server_batches(job, *a, **k))
    finally:
        pool.close()


def _journal(scratch: Path) -> list[dict]:
    return [json.loads(x) for x in (scratch / "answers.jsonl").read_text().splitlines()]


def test_every_prompt_answered_exactly_once_through_every_retryable_fault(tmp_path, monkeypatch, caplog):
    """~3 % of prompts each get 503, 429 (Retry-After: 1), a reset mid-body, a hang past the 0.5 s timeout, and one of
    the two endpoints dies after 40 answers: all 300 answered right, once each (server side and journal); the progress
    lines count answered, retried, failed, tokens/s and ETA."""
    monkeypatch.setattr(S, "LOG_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger=LOG.name)
    st = State({"503": 0.03, "429": 0.03, "reset": 0.03, "hang": 0.02}, vocab=VOCAB, retry_after="1", hang_s=1.0)
    prompts, keys = _prompts(300)
    with FakeCompletions(st) as a, FakeCompletions(st, die_after=40) as b:
        t0 = time.perf_counter()
        res, stats = _run([a.url, b.url], prompts, keys, tmp_path)
        took = time.perf_counter() - t0
        res2, st2 = _run([a.url], prompts, keys, tmp_path)          # a rerun over the same journal asks nothing
    assert res == [expected_answer(p, NEW, [2], VOCAB) for p in prompts]
    assert {k: v > 0 for k, v in st.faulted.items()} == {"503": True, "429": True, "reset": True, "hang": True}
    # the dead endpoint's last error names it: refused connections, or (which one comes last depends on the machine's
    # load) a fault it served before dying: a hang's timeout, a reset
    assert b.dead and stats["endpoints"][b.url]["answered"] == 40
    assert stats["endpoints"][b.url]["last_error"].startswith(b.url)
    assert len(st.answered) == 300 and set(st.answered.values()) == {1}       # never asked again once answered
    lines = _journal(tmp_path)
    assert sorted(x["i"] for x in lines) == list(range(300)) and all(x["k"] == keys[x["i"]] for x in lines)
    assert stats["failed_prompts"] == 0 and stats["retried_requests"] >= sum(st.faulted.values())
    assert stats["generated_prompts"] == 300 and stats["concurrency"] == 8
    assert took >= 1.0                            # a 429's Retry-After: 1 was waited for (backoff_s alone: ~10 ms)
    lines = [r.getMessage() for r in caplog.records if "answered (0 resumed)" in r.getMessage()]
    assert lines and re.fullmatch(r"regeneration: \d+/300 answered \(0 resumed\), \d+ retried, 0 failed, [\d.]+ new tokens/s, "
                                  r"ETA \d+:\d\d:\d\d", lines[-1]), lines[-1:]
    assert int(lines[-1].split(", ")[1].split()[0]) > 0          # retries counted live
    assert res2 == res and st2["resumed_prompts"] == 300 and st2["generated_prompts"] == 0 and len(_journal(tmp_path)) == 300


@pytest.mark.parametrize("mode,words", [("malformed", "not JSON"), ("bad_ids", "not an id of the target's vocabulary")])
def test_an_answer_asking_again_cannot_fix_fails_fast_and_keeps_the_rest(tmp_path, mode, words):
    st = State({mode: 0.02}, vocab=VOCAB)
    prompts, keys = _prompts(200)
    with FakeCompletions(st) as a, pytest.raises(C.EndpointError, match=words) as e:
        _run([a.url], prompts, keys, tmp_path, concurrency=2)
    assert "(prompt k" in str(e.value) and "a rerun asks only for the rest" in str(e.value)
    assert st.faulted[mode] == 1                                     # no retry, the run stopped at the first
    kept = _journal(tmp_path)
    assert 0 < len(kept) < 200 and all(x["t"] == expected_answer(prompts[x["i"]], NEW, [2], VOCAB) for x in kept)


def test_a_4xx_is_not_retried_and_names_what_the_server_said(tmp_path):
    prompts, keys = _prompts(4)
    with FakeCompletions(State(vocab=VOCAB), api_key="sekret") as a:
        with pytest.raises(C.EndpointError, match="HTTP 401") as e:        # GET /v1/models without the key
            _run([a.url], prompts, keys, tmp_path)
        assert "sekret" not in str(e.value)
        res, _ = _run([a.url], prompts, keys, tmp_path, api_key="sekret", headers=(("X-Team", "drafts"),))
    assert res == [expected_answer(p, NEW, [2], VOCAB) for p in prompts]
    seen = a.state.headers_seen[-1]
    assert seen["authorization"] == "Bearer sekret" and seen["x-team"] == "drafts"
    assert "sekret" not in repr(C.ClientSettings(("http://h",), api_key="sekret"))


def test_tls_verified_against_the_ca_bundle_and_an_untrusted_certificate_fails_fast(tmp_path):
    """https with a self-signed certificate (made by the openssl CLI): untrusted without data.regenerate.ca_bundle (a
    fatal answer naming the field, not retried), answered with it, and with tls_verify: false."""
    import shutil

    if shutil.which("openssl") is None:
        from support import missing

        missing("the openssl command line tool is missing (apt-get install openssl)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    prompts, keys = _prompts(6)
    with FakeCompletions(State(vocab=VOCAB), tls=(str(cert), str(key))) as a:
        assert a.url.startswith("https://")
        with pytest.raises(C.FatalAnswer, match="not trusted.*data.regenerate.ca_bundle"):
            _run([a.url], prompts, keys, tmp_path / "x")
        res, _ = _run([a.url], prompts, keys, tmp_path / "ca", verify=str(cert))
        assert res == [expected_answer(p, NEW, [2], VOCAB) for p in prompts]
        res, _ = _run([a.url], prompts, keys, tmp_path / "off", verify=False)
        assert res == [expected_answer(p, NEW, [2], VOCAB) for p in prompts]


def test_failures_beyond_the_allowed_fraction_fail_at_the_end_and_a_rerun_asks_only_for_them(tmp_path):
    st = State({"always503": 0.05}, vocab=VOCAB)
    prompts, keys = _prompts(120)
    with FakeCompletions(st) as a:
        with pytest.raises(C.EndpointError) as e:
            _run([a.url], prompts, keys, tmp_path, attempts=2)
        msg = str(e.value)
        bad = st.faulted["always503"] // 2
        assert f"{bad} of 120 prompts failed every one of their 2 attempts at {a.url}" in msg
        assert "allows 0" in msg and "HTTP 503" in msg and "Service Unavailable" in msg
        assert len(_journal(tmp_path)) == 120 - bad
        res, stats = _run([a.url], prompts, keys, tmp_path, attempts=2, max_failed=0.1)     # allowed: left out, counted
        assert stats["failed_prompts"] == bad and stats["resumed_prompts"] == 120 - bad and stats["generated_prompts"] == 0
        assert sum(r is None for r in res) == bad and stats["failed_examples"] and "HTTP 503" in stats["last_error"]
    st.faults.clear()
    with FakeCompletions(st) as a:                                                        # the endpoint healed
        res, stats = _run([a.url], prompts, keys, tmp_path)
    assert stats["generated_prompts"] == bad and res == [expected_answer(p, NEW, [2], VOCAB) for p in prompts]


def test_a_dead_endpoint_stops_the_run_instead_of_failing_every_prompt(tmp_path):
    prompts, keys = _prompts(500)
    a = FakeCompletions(State(vocab=VOCAB), die_after=30)
    a.start()
    with pytest.raises(C.EndpointError, match="in a row failed every one of their 2 attempts: the endpoints .* look down"):
        _run([a.url], prompts, keys, tmp_path, attempts=2, concurrency=2)
    assert len(_journal(tmp_path)) == 30


def test_journal_cuts_a_torn_line_and_skips_stale_and_repeated_ones(tmp_path):
    p = tmp_path / "answers.jsonl"
    p.write_text('{"i":0,"k":"a","t":[1,2]}\n{"i":1,"k":"OLD","t":[3]}\n{"i":0,"k":"a","t":[9]}\nnot json\n'
                 '{"i":2,"k":"c","t":[4]}\n{"i":1,"k":"b","t":[5')
    res = [None] * 3
    log = AnswerLog(p, ["a", "b", "c"])
    assert log.load(res) == 2 and res == [[1, 2], None, [4]]
    assert log.loaded == {"answers": 2, "torn_bytes": len('{"i":1,"k":"b","t":[5'), "stale": 1, "repeated": 1, "unreadable": 1}
    with log:
        log.append(1, [6, 2])
    assert p.read_text().endswith('{"i":2,"k":"c","t":[4]}\n{"i":1,"k":"b","t":[6,2]}\n')


def test_backoff_and_retry_after():
    assert C.retry_after_s("7") == 7.0 and C.retry_after_s(None) is None and C.retry_after_s("soon") is None
    when = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < C.retry_after_s(when) <= 30
    lo = SimpleNamespace(uniform=lambda a, b: a)
    hi = SimpleNamespace(uniform=lambda a, b: b)
    assert C.backoff_delay(1, 0.5, rng=lo) == 0.25 and C.backoff_delay(3, 0.5, rng=hi) == 2.0
    assert C.backoff_delay(20, 0.5, rng=hi) == C.BACKOFF_CAP_S
    assert C.backoff_delay(1, 0.5, 12.0, rng=hi) == 12.0 and C.backoff_delay(1, 0.5, 1e6) == C.RETRY_AFTER_CAP_S


KILLED = """
import logging, sys
from pathlib import Path
sys.path[:0] = [{repo!r}, {tests!r}]
from runtime.data import endpoint_client as C, server_engine as S
from runtime.data.regenerate import Decoding, RegenRun, regenerate
prompts = [[5 + i % 7, 11 + i, 3 + (i * 7) % 13] for i in range(400)]
keys = [f"k{{i:05d}}" for i in range(400)]
pool = C.CompletionsPool(C.ClientSettings(({url!r},), timeout_s=5, backoff_s=0.01, concurrency=4, vocab_size=1000))
job = S.ServerJob(pool, 4)
regenerate(Path("/unused"), prompts, keys, batch_size=4, decoding=Decoding(16, 0.0, 1.0, [2], 0),
           run=RegenRun(Path({scratch!r}), logging.getLogger("x")),
           generate_batches=lambda *a, **k: S.server_batches(job, *a, **k))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_mid_run_resumes_losing_at_most_the_requests_in_flight(tmp_path, sig):
    st = State({"503": 0.03}, vocab=VOCAB)
    prompts, keys = _prompts(400)
    with FakeCompletions(st, delay_s=0.005) as a:
        code = KILLED.format(repo=str(REPO), tests=str(REPO / "tests"), url=a.url, scratch=str(tmp_path))
        proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ""})
        journal = tmp_path / "answers.jsonl"
        deadline = time.monotonic() + 60
        while not (journal.exists() and journal.read_text().count("\n") >= 100) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(sig)
        assert proc.wait(30) != 0
        before = len(_journal(tmp_path))
        assert 100 <= before < 400
        asked_before = sum(st.answered.values())
        assert asked_before - before <= 4                            # lost: at most the 4 requests in flight
        res, stats = _run([a.url], prompts, keys, tmp_path, concurrency=4)
    assert stats["resumed_prompts"] == before and stats["generated_prompts"] == 400 - before
    assert res == [expected_answer(p, NEW, [2], VOCAB) for p in prompts]
    lines = _journal(tmp_path)
    assert sorted(x["i"] for x in lines) == list(range(400))          # nothing written twice
    assert sum(st.answered.values()) - 400 <= 4 and max(st.answered.values()) <= 2


def test_config_errors_name_the_field(tmp_path):
    base = dict(engine="endpoint", endpoint=["http://a:1", "b:2"], endpoint_model=None, api_key_env=None, headers={},
                tls_verify=True, ca_bundle=None, concurrency=None, batch_size=4, timeout_s=1.0, max_attempts=2, backoff_s=0.1,
                max_failed_fraction=0.0)
    with pytest.raises(R.EngineConfigError) as e:
        R.choose_engine(SimpleNamespace(**base))
    assert e.value.field == "data.regenerate.endpoint.1"
    with pytest.raises(R.EngineConfigError, match="credentials in the URL") as e:
        R.choose_engine(SimpleNamespace(**{**base, "endpoint": "https://me:pw@host:1"}))
    assert e.value.field == "data.regenerate.endpoint" and "pw" not in str(e.value)
    rc = SimpleNamespace(**{**base, "endpoint": ["http://a:1", "https://b:2/"], "api_key_env": "SPECPIPE_TEST_NO_SUCH_KEY"})
    with pytest.raises(R.EngineConfigError, match="SPECPIPE_TEST_NO_SUCH_KEY is not set") as e:
        R.choose_engine(rc)
    assert e.value.field == "data.regenerate.api_key_env"
    rc.api_key_env, rc.ca_bundle = None, tmp_path / "missing.pem"
    with pytest.raises(R.EngineConfigError, match="file not found") as e:
        R.choose_engine(rc)
    assert e.value.field == "data.regenerate.ca_bundle"
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    rc.ca_bundle = tmp_path / "ca.pem"
    c = R.choose_engine(rc)
    assert c.client.endpoints == ("http://a:1", "https://b:2") and c.client.verify == str(tmp_path / "ca.pem")
    assert c.client.concurrency == 4


def test_cli_check_exits_2_naming_the_api_key_variable():
    from conftest import TINY_CONFIG, run_cli

    r = run_cli("check", str(TINY_CONFIG), "-o", "data.regenerate.enabled=true", "-o", "data.regenerate.engine=endpoint",
                "-o", "data.regenerate.endpoint=http://127.0.0.1:9",
                "-o", "data.regenerate.api_key_env=SPECPIPE_TEST_NO_SUCH_KEY")
    assert r.returncode == 2, r.stderr
    assert "data.regenerate.api_key_env: the environment variable SPECPIPE_TEST_NO_SUCH_KEY is not set" in r.stderr


def test_how_the_endpoint_is_reached_stays_out_of_the_fingerprint(monkeypatch):
    """Another endpoint list, key variable, concurrency, timeout or failure budget keeps the data stage's fingerprint,
    so the answers journaled in its scratch directory are resumed; the model or the sampling does not."""
    from pipeline import registry, runner
    from pipeline.config import load_config

    from conftest import TINY_CONFIG

    spec = next(s for s in registry.stages() if s.name == "data")
    monkeypatch.setenv("SPECPIPE_TEST_FP_KEY", "x")

    def fp(*o):
        cfg = load_config(TINY_CONFIG, ["data.regenerate.enabled=true", "data.regenerate.engine=endpoint", *o])
        return runner.fingerprint(runner.fingerprint_inputs(spec, cfg, {"target": "t"}))

    base = fp("data.regenerate.endpoint=http://a:1")
    assert fp("data.regenerate.endpoint=[http://b:1, http://c:2]", "data.regenerate.concurrency=64",
              "data.regenerate.api_key_env=SPECPIPE_TEST_FP_KEY", "data.regenerate.timeout_s=5", "data.regenerate.max_attempts=9",
              "data.regenerate.max_failed_fraction=0.01", "data.regenerate.headers={X-A: b}") == base
    assert fp("data.regenerate.endpoint=http://a:1", "data.regenerate.endpoint_model=other") != base
    assert fp("data.regenerate.endpoint=http://a:1", "data.regenerate.max_new_tokens=9") != base
