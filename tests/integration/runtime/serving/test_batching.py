"""Continuous batching in-process: the step-wise core (`runtime.engine.decode_batch.DecodeBatch`) and the scheduler
(`runtime.serving.batching.Scheduler`) on the tiny pipeline's deployed FP8 pair, without a server.

The serving tests (test_serve.py) show the same behaviour through a real Triton; these pin the core down:
a request joining a running batch decodes exactly what it decodes alone, cancelled rows leave without
disturbing the others, a failing prefill leaves the running rows untouched, batches of different sampling
rules share one engine, and the scheduler's bounds and cancellation.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from runtime.engine.sampling import Sampling

from conftest import artifact_dir

N = 24


@pytest.fixture(scope="module")
def engine(request):
    from runtime.serving.adapter import ServingEngine

    if os.environ.get("SPECPIPE_TEST_RUN"):
        wd = Path(os.environ["SPECPIPE_TEST_RUN"])
    else:
        wd, _ = request.getfixturevalue("tiny_run")
    md = artifact_dir(wd, "export") / "triton_cpu" / "tensorrt_llm" / "1"
    spec = json.loads((md / "specpipe_model.json").read_text())
    eng = ServingEngine(md / spec["target"], md / spec["draft"], draft_len=spec["draft_len"])
    eng.prompts = [json.loads(line)["prompt_ids"] for f in sorted((wd / "artifacts" / "data" / "eval").glob("*.jsonl"))
                   for line in f.read_text().splitlines() if line.strip()]
    return eng


def solo(engine, ids, n=N, **kw):
    g = engine.engine.generate([ids], max_new_tokens=n, draft_len=engine.draft_len, eos_token_id=engine.eos_token_ids, **kw)
    return g.tokens[0], g.requests[0]


def test_requests_joining_a_running_batch_decode_what_they_decode_alone(engine):
    ps = engine.prompts[:4]
    budgets = [N, 7, N, 13]
    want = [solo(engine, p, n)[0] for p, n in zip(ps, budgets, strict=True)]
    b = engine.engine.batch(draft_len=engine.draft_len)
    k0 = b.add([ps[0]], max_new_tokens=budgets[0], eos_token_id=engine.eos_token_ids)
    b.step()
    b.step()
    k12 = b.add(ps[1:3], max_new_tokens=budgets[1:3], eos_token_id=engine.eos_token_ids)   # join mid-decode
    b.step()
    k3 = b.add([ps[3]], max_new_tokens=budgets[3], eos_token_id=engine.eos_token_ids)
    while b.live:
        b.step()
    keys = k0 + k12 + k3
    assert [b.finished[k].tokens for k in keys] == want
    assert max(b.stats.rows_per_step) == 4 and b.stats.rows_per_step[:2] == [1, 1]
    assert b.stats.steps == sum(b.finished[k].stats.steps for k in keys)
    assert all(b.finished[k].finish == "length" for k in keys)


def test_a_cancelled_row_leaves_and_the_others_are_unchanged(engine):
    ps = engine.prompts[:3]
    want = [solo(engine, p)[0] for p in ps]
    b = engine.engine.batch(draft_len=engine.draft_len)
    keys = b.add(ps, max_new_tokens=N, eos_token_id=engine.eos_token_ids)
    b.step()
    assert b.cancel([keys[1]]) == [keys[1]] and b.live == 2
    assert b.finished[keys[1]].finish == "cancelled"
    while b.live:
        b.step()
    assert b.finished[keys[0]].tokens == want[0] and b.finished[keys[2]].tokens == want[2]
    assert b.cancel([keys[0]]) == []                       # no longer live: nothing to cancel


def test_a_failing_prefill_leaves_the_running_rows_untouched(engine):
    p = engine.prompts[0]
    want = solo(engine, p)[0]
    b = engine.engine.batch(draft_len=engine.draft_len)
    (k,) = b.add([p], max_new_tokens=N, eos_token_id=engine.eos_token_ids)
    b.step()
    vocab = engine.engine.target.vocab_size
    with pytest.raises(IndexError):                         # a token id outside the vocabulary: the embedding fails
        b.add([[vocab + 5]], max_new_tokens=4)
    assert b.live == 1
    while b.live:
        b.step()
    assert b.finished[k].tokens == want


def test_batches_of_different_sampling_share_one_engine(engine):
    """A greedy batch and a sampled batch stepped in turn on one engine keep their own caches."""
    p, q = engine.prompts[0], engine.prompts[1]
    want = solo(engine, p)[0]
    want_sampled = solo(engine, q, sampling=Sampling(0.8, seed=3))[0]
    greedy = engine.engine.batch(draft_len=engine.draft_len)
    sampled = engine.engine.batch(draft_len=engine.draft_len, sampling=Sampling(0.8, seed=3))
    (kg,) = greedy.add([p], max_new_tokens=N, eos_token_id=engine.eos_token_ids)
    (ks,) = sampled.add([q], max_new_tokens=N, eos_token_id=engine.eos_token_ids)
    while greedy.live or sampled.live:
        greedy.step()
        sampled.step()
    assert greedy.finished[kg].tokens == want
    assert sampled.finished[ks].tokens == want_sampled       # alone in its batch: the seed reproduces it


def test_scheduler_bounds_cancels_and_stops_by_id(engine):
    from runtime.serving.batching import Overloaded, Scheduler
    from runtime.serving.jobs import Job

    counts: dict[str, float] = {}
    s = Scheduler(engine, max_batch=2, max_queue=1, cancel_check_s=0.01,
                  metrics=lambda n, v: counts.__setitem__(n, counts.get(n, 0) + v) if not n.startswith("set:") else None)
    flag = threading.Event()
    try:
        long = [engine.request(engine.decode(engine.prompts[i]), max_tokens=1500) for i in range(3)]
        jobs = [Job(engine, long[0], is_cancelled=flag.is_set), Job(engine, long[1], request_id="r1"),
                Job(engine, long[2])]
        for j in jobs:
            s.submit(j)
        with pytest.raises(Overloaded, match=r"overloaded: .*max_batch 2.*max_queue 1"):
            s.submit(Job(engine, long[0]))
        jobs[2].is_cancelled = lambda: True                  # the waiting request's client goes away
        assert jobs[2].done.wait(30) and jobs[2].cancelled and not jobs[0].done.is_set()
        assert s.stop_request("r1") == 1 and s.stop_request("nobody") == 0
        flag.set()                                           # the first client goes away
        assert jobs[0].done.wait(30) and jobs[1].done.wait(30)
        assert jobs[0].cancelled and jobs[1].cancelled
        assert s.stop_request("") == 0
        short = Job(engine, engine.request(engine.decode(engine.prompts[3]), max_tokens=N))
        s.submit(short)                                      # the freed slots take new work
        assert short.done.wait(60) and short.error is None
        assert short.result.token_ids == solo(engine, engine.prompts[3])[0]
        time.sleep(0.05)
        assert s.snapshot() == {"queued": 0, "live": 0, "groups": 0}
        assert counts["requests_cancelled"] == 3 and counts["requests_rejected_overloaded"] == 1
        assert counts["requests_completed"] == 1
    finally:
        s.shutdown()


def test_a_response_is_counted_before_the_client_receives_it(engine):
    """`on_done` is the moment the Triton model sends the final response: the request's outcome must already be in
    the counters then, or a client that scrapes /metrics right after its last response misses it (seen on a loaded
    machine as test_serve's Prometheus test counting 1 completed request of 2)."""
    from runtime.serving.batching import Scheduler
    from runtime.serving.jobs import Job

    counts: dict[str, float] = {}
    s = Scheduler(engine, max_batch=2, metrics=lambda n, v: counts.__setitem__(n, counts.get(n, 0) + v))
    seen: list[dict] = []
    try:
        def on_done(job):
            seen.append(dict(counts))

        done = Job(engine, engine.request(engine.decode(engine.prompts[0]), max_tokens=4), on_done=on_done)
        s.submit(done)
        assert done.done.wait(60) and done.error is None
        gone = Job(engine, engine.request(engine.decode(engine.prompts[1]), max_tokens=1500), is_cancelled=lambda: True,
                   on_done=on_done)
        s.submit(gone)
        assert gone.done.wait(60) and gone.cancelled
        assert seen[0].get("requests_completed") == 1 and seen[1].get("requests_cancelled") == 1
    finally:
        s.shutdown()


def test_request_validation_names_the_input(engine):
    from runtime.serving.adapter import RequestError

    for kw, msg in [(dict(prompt=""), "text_input is empty"), (dict(prompt=b"\xc3("), "not valid UTF-8"),
                    (dict(prompt="x", max_tokens=0), "must be >= 1"),
                    (dict(prompt="x", max_tokens=engine.context), "not below the model's context"),
                    (dict(prompt="x", temperature=float("nan")), "sampling_param_temperature"),
                    (dict(prompt="x", top_p=1.5), "sampling_param_top_p")]:
        prompt = kw.pop("prompt")
        with pytest.raises(RequestError, match=msg):
            engine.request(prompt, **kw)
