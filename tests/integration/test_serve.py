"""`specpipe serve`: a real Triton Inference Server (nvidia-pytriton's binary) on the exported CPU repository.

One server for the module, started through the real CLI (`specpipe serve --workdir ... --max-batch 4
--max-queue 4`, free ports on 127.0.0.1, readiness bounded) and stopped with SIGINT as a user's Ctrl-C would.
The requests go through tritonclient (gRPC) and plain HTTP, and are compared with the same FP8 pair run
in-process through `runtime.serving.adapter` (specpipe's speculative runtime). Under load: concurrent clients (at most
12, loopback only, each bounded by a timeout), requests joining a running batch, the overloaded error,
cancellation and disconnection freeing a slot, every class of bad request, and the Prometheus metrics.

The run comes from the session's tiny pipeline (conftest `tiny_run`); set SPECPIPE_TEST_RUN=<workdir> to
reuse an existing run that has a committed `export`.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pipeline.monitor import perf_counts

from conftest import REPO
from support.serve import cli_server, http_generate

MAX_TOKENS = 16
MAX_BATCH, MAX_QUEUE = 4, 4
LONG = 1500          # tokens: a request that decodes for a second or more on the tiny pair




@pytest.fixture(scope="module")
def server(run_dir):
    with cli_server(run_dir, "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)) as info:
        yield info


@pytest.fixture(scope="module")
def model_dir(run_dir) -> Path:
    return run_dir / "artifacts" / "export" / "triton_cpu" / "tensorrt_llm" / "1"


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same FP8 pair in-process, through the adapter the Triton model uses."""
    from runtime.serving.adapter import ServingEngine

    spec = json.loads((model_dir / "specpipe_model.json").read_text())
    return ServingEngine(model_dir / spec["target"], model_dir / spec["draft"], draft_len=spec["draft_len"])


@pytest.fixture(scope="module")
def prompts(run_dir) -> list[str]:
    out = []
    for f in sorted((run_dir / "artifacts" / "data" / "eval").glob("*.jsonl")):
        out.append(json.loads(f.read_text().splitlines()[0])["prompt"])
    return out[:2]


def _tensors(inputs: dict) -> list:
    """tritonclient inputs: a Python value picks its Triton type; (datatype, numpy array) is sent as given."""
    import tritonclient.grpc as g

    dtypes = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32), str: ("BYTES", np.object_),
              bytes: ("BYTES", np.object_)}
    tensors = []
    for name, v in inputs.items():
        if isinstance(v, tuple):
            dt, arr = v
        else:
            dt, npt = dtypes[type(v)]
            arr = np.array([v.encode() if isinstance(v, str) else v], dtype=npt)
        t = g.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        tensors.append(t)
    return tensors


def grpc_stream(server, inputs: dict, *, cancel_after: int | None = None, timeout: float = 120) -> list:
    """One request over a gRPC stream; returns (text, outputs, final flag) per response, or raises its error.
    `cancel_after`: cancel the stream (tritonclient's stop_stream(cancel_requests=True)) after that many responses."""
    import tritonclient.grpc as g

    q: queue.Queue = queue.Queue()
    c = g.InferenceServerClient(server["grpc"])
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    cancelled = False
    try:
        c.async_stream_infer("tensorrt_llm", _tensors(inputs), enable_empty_final_response=True)
        out = []
        while True:
            res, err = q.get(timeout=timeout)
            if err is not None:
                raise RuntimeError(str(err))
            final = res.get_response().parameters["triton_final_response"].bool_param
            text = res.as_numpy("text_output")
            out.append((text[0].decode() if text is not None else None, res, final))
            if final:
                return out
            if cancel_after is not None and len(out) >= cancel_after:
                c.stop_stream(cancel_requests=True)
                cancelled = True
                return out
    finally:
        if not cancelled:
            c.stop_stream()
        c.close()


def metrics(server) -> dict[str, float]:
    """The specpipe_* samples of Triton's Prometheus endpoint, keyed by name{labels}."""
    with urllib.request.urlopen(server["metrics"], timeout=10) as r:   # noqa: S310 - 127.0.0.1
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("specpipe_"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def metric(m: dict, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include these (model tensorrt_llm, version 1 by default)."""
    want = {"model": "tensorrt_llm", "version": "1", **labels}
    found, total = False, 0.0
    for k, v in m.items():
        n, _, rest = k.partition("{")
        got = {a: b.strip('"') for a, b in (p.split("=", 1) for p in rest.rstrip("}").split(",") if p)}
        if n == name and all(got.get(a) == b for a, b in want.items()) and (name != "specpipe_requests_total"
                                                                             or "outcome" in labels):
            found, total = True, total + v
    if not found:
        raise KeyError(f"{name}{labels} not in {sorted(m)}")
    return total


def wait_for(cond, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def outcome(server, name: str) -> float:
    return metric(metrics(server), "specpipe_requests_total", outcome=name)


def test_http_and_grpc_return_the_in_process_text(server, reference, prompts):
    for p in prompts:
        want = reference.complete(p, max_tokens=MAX_TOKENS)
        status, body = http_generate(server, {"text_input": p, "sampling_param_max_tokens": MAX_TOKENS})
        assert status == 200, body
        assert body["text_output"] == want.text
        got = grpc_stream(server, {"text_input": p, "sampling_param_max_tokens": MAX_TOKENS})
        assert [t for t, _, _ in got if t is not None] == [want.text]   # one response when not streaming


def test_streaming_returns_tokens_incrementally(server, reference, prompts):
    want = reference.complete(prompts[0], max_tokens=MAX_TOKENS)
    got = grpc_stream(server, {"text_input": prompts[0], "sampling_param_max_tokens": MAX_TOKENS, "streaming": True})
    texts = [t for t, _, _ in got]
    assert len(texts) >= 3 and got[-1][2]          # several responses, the last one final
    assert texts == want.chunks                    # one response per decoding step, as the runtime produced them
    for a, b in zip(texts, texts[1:], strict=False):             # cumulative text, growing
        assert b.startswith(a) and len(b) > len(a)
    assert texts[-1] == want.text
    status, events = http_generate(server, {"text_input": prompts[0], "sampling_param_max_tokens": MAX_TOKENS,
                                            "streaming": True}, stream=True)
    assert status == 200 and [e["text_output"] for e in events] == want.chunks


def test_acceptance_outputs_agree_with_the_runtime(server, reference, prompts):
    for p in prompts:
        want = reference.complete(p, max_tokens=MAX_TOKENS)
        status, body = http_generate(server, {"text_input": p, "sampling_param_max_tokens": MAX_TOKENS,
                                              "sampling_param_return_perf_metrics": True, "return_finish_reason": True})
        assert status == 200, body
        # sent as the LLM-API model sends them: text_output's dtype, so /generate gives strings (model.py@044a90d2
        # `_create_response`: np.asarray([...], dtype=self.output_dtype)); specpipe monitor reads them (perf_counts)
        perf = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "arrival_time_ns",
                "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
        assert all(isinstance(body[k], str) for k in perf), {k: body[k] for k in perf}
        assert body["total_draft_tokens"] == str(want.total_draft_tokens)
        assert want.total_draft_tokens == want.steps * want.draft_len > 0
        assert body["total_accepted_draft_tokens"] == str(want.total_accepted_draft_tokens)
        assert perf_counts(body, "test") == (want.total_draft_tokens, want.total_accepted_draft_tokens)
        assert float(body["acceptance_rate"]) == pytest.approx(want.total_accepted_draft_tokens / want.total_draft_tokens,
                                                               abs=1e-6)
        assert body["finish_reason"] in ("length", "stop")
        assert int(body["arrival_time_ns"]) <= int(body["first_token_time_ns"]) <= int(body["last_token_time_ns"])
        # without the flag, like the LLM-API model, only the text comes back
        _, plain = http_generate(server, {"text_input": p, "sampling_param_max_tokens": MAX_TOKENS})
        assert "acceptance_rate" not in plain


def test_unsupported_sampling_is_refused_with_a_message(server, prompts):
    with pytest.raises(RuntimeError, match="sampling_param_top_k=5 is not supported"):
        grpc_stream(server, {"text_input": prompts[0], "sampling_param_top_k": 5})


def test_a_broken_repository_fails_to_load_with_the_servers_message(tmp_path, model_dir):
    """A copy of the exported model with its checkpoint weights missing, and a config whose input has no dims
    (valid protobuf, rejected by the server): loading each raises with Triton's own message."""
    import shutil

    from runtime.serving import triton_server

    bad = tmp_path / "repo"
    shutil.copytree(model_dir.parent, bad / "no_weights", ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = (bad / "no_weights" / "config.pbtxt").read_text()
    (bad / "no_weights" / "config.pbtxt").write_text(cfg.replace('name: "tensorrt_llm"', 'name: "no_weights"'))
    (bad / "no_dims" / "1").mkdir(parents=True)
    (bad / "no_dims" / "1" / "model.py").write_text("class TritonPythonModel:\n    def execute(self, requests):\n        return "
                                                    "[]\n")
    (bad / "no_dims" / "config.pbtxt").write_text('name: "no_dims"\nbackend: "python"\n'
                                                  'input { name: "x" data_type: TYPE_FP32 }\n')
    srv = triton_server.start(bad, models=[], ready_timeout=60)
    try:
        with pytest.raises(triton_server.TritonServerError) as e:
            srv.load("no_weights", timeout=300)
        print(e.value)
        assert "failed to load model 'no_weights'" in str(e.value) and "safetensors" in str(e.value).lower()
        with pytest.raises(triton_server.TritonServerError) as e:
            srv.load("no_dims", timeout=60)
        print(e.value)
        assert "failed to load model 'no_dims'" in str(e.value) and "dims" in str(e.value)
        assert srv.alive() and srv.loaded == []      # the server survives a bad model
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------- under load


class Stream:
    """A gRPC streaming request kept open, so the test decides when its client cancels (disconnects)."""

    def __init__(self, server, inputs: dict):
        import tritonclient.grpc as g

        self.q: queue.Queue = queue.Queue()
        self.c = g.InferenceServerClient(server["grpc"])
        self.c.start_stream(callback=lambda result, error: self.q.put((result, error)))
        self.c.async_stream_infer("tensorrt_llm", _tensors({**inputs, "streaming": True}), enable_empty_final_response=True)

    def first(self, timeout: float = 60):
        res, err = self.q.get(timeout=timeout)
        return res, err

    def cancel(self):
        self.c.stop_stream(cancel_requests=True)
        self.c.close()


def in_process(reference, prompt: str, max_tokens: int) -> str:
    """What the runtime's own generate() produces for this prompt (greedy), decoded as the server decodes."""
    ids = reference.encode(prompt)
    g = reference.engine.generate([ids], max_new_tokens=max_tokens, draft_len=reference.draft_len,
                                  eos_token_id=reference.eos_token_ids)
    return reference.decode(g.tokens[0])


@pytest.fixture(scope="module")
def all_prompts(run_dir) -> list[str]:
    return [json.loads(line)["prompt"] for f in sorted((run_dir / "artifacts" / "data" / "eval").glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


def test_concurrent_greedy_responses_equal_in_process_generate(server, reference, all_prompts):
    """MAX_BATCH + MAX_QUEUE clients at once, half over HTTP, half over gRPC streaming: every response is what
    the runtime's generate() gives for that prompt alone, and the target forwards were shared (rows per forward > 1)."""
    n = MAX_BATCH + MAX_QUEUE
    ps = [all_prompts[i % len(all_prompts)] for i in range(n)]
    want = [in_process(reference, p, 24) for p in ps]
    m0 = metrics(server)
    got: dict[int, str] = {}

    def client(i):
        if i % 2:
            status, body = http_generate(server, {"text_input": ps[i], "sampling_param_max_tokens": 24})
            got[i] = body["text_output"] if status == 200 else f"HTTP {status}: {body}"
        else:
            try:
                got[i] = grpc_stream(server, {"text_input": ps[i], "sampling_param_max_tokens": 24, "streaming": True})[-1][0]
            except RuntimeError as e:
                got[i] = f"gRPC error: {e}"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert [got.get(i) for i in range(n)] == want          # nothing lost, nothing refused, nothing changed
    m1 = metrics(server)
    rows = metric(m1, "specpipe_decode_rows_total") - metric(m0, "specpipe_decode_rows_total")
    fwd = metric(m1, "specpipe_target_forwards_total") - metric(m0, "specpipe_target_forwards_total")
    print(f"{n} concurrent requests: {rows:.0f} rows over {fwd:.0f} target forwards")
    assert fwd > 0 and rows / fwd > 1.5
    assert metric(m1, "specpipe_batch_rows") == 0 and metric(m1, "specpipe_queue_depth") == 0


def test_a_request_joins_the_running_batch_at_the_next_step(server, reference, prompts):
    """A long request decodes; a short one arriving later joins the running batch and finishes first, instead of
    waiting for the long one (one model instance: only continuous batching can do that).

    The order is read from the server's clock (the perf-metric outputs, `time.time_ns()` in
    runtime/serving/adapter.py), not from when the clients read their responses: on a loaded machine a client
    thread may be scheduled late, the server's order is what batching decides. The premise, that the short request
    reached the server while the long one was decoding (about 2 s on the tiny pair), is checked too; a try where the
    machine delayed the short request past the long one's end says so and tries again (3 tries)."""
    want = reference.complete(prompts[1], max_tokens=MAX_TOKENS).text
    perf = {"sampling_param_return_perf_metrics": True}
    for attempt in range(3):
        m0 = metrics(server)
        got: dict[str, tuple] = {}
        t = threading.Thread(target=lambda got=got: got.setdefault("long", http_generate(
            server, {"text_input": prompts[0], "sampling_param_max_tokens": LONG, **perf})))
        t.start()
        wait_for(lambda: metric(metrics(server), "specpipe_batch_rows") >= 1, what="the long request decoding")
        status, short = http_generate(server, {"text_input": prompts[1], "sampling_param_max_tokens": MAX_TOKENS,
                                               **perf})
        t.join(timeout=180)
        assert status == 200 and short["text_output"] == want, short
        assert got["long"][0] == 200, got["long"]
        long_ = got["long"][1]
        if int(short["arrival_time_ns"]) < int(long_["last_token_time_ns"]):
            break
        print(f"try {attempt + 1}: the short request reached the server "
              f"{(int(short['arrival_time_ns']) - int(long_['last_token_time_ns'])) / 1e9:.2f} s after the long one finished")
    else:
        pytest.fail("in 3 tries the short request never reached the server while the long one was decoding")
    assert metric(metrics(server), "specpipe_requests_joined_running_batch_total") - \
        metric(m0, "specpipe_requests_joined_running_batch_total") >= 1
    # scheduled (prefilled) while the long request was decoding, and finished before it
    assert short["first_scheduled_time_ns"] < long_["last_token_time_ns"]
    assert short["last_token_time_ns"] < long_["last_token_time_ns"]


def test_overload_is_refused_and_cancelled_clients_free_their_slots(server, reference, prompts):
    """Fill every batch slot and the queue with long streaming requests; the next requests get an UNAVAILABLE
    'overloaded' error at once; cancelling the clients frees every slot (decoding and waiting) within the
    cancellation check period; then a request is served again."""
    c0 = outcome(server, "cancelled")
    r0 = outcome(server, "rejected_overloaded")
    streams = [Stream(server, {"text_input": prompts[i % 2], "sampling_param_max_tokens": LONG})
               for i in range(MAX_BATCH + MAX_QUEUE)]
    try:
        wait_for(lambda: (lambda m: metric(m, "specpipe_batch_rows") == MAX_BATCH
                          and metric(m, "specpipe_queue_depth") == MAX_QUEUE)(metrics(server)),
                 what="every slot and the queue taken")
        for transport in ("grpc", "http"):
            t0 = time.monotonic()
            if transport == "grpc":
                with pytest.raises(RuntimeError) as e:
                    grpc_stream(server, {"text_input": prompts[0], "sampling_param_max_tokens": 4})
                msg = str(e.value)
                assert "UNAVAILABLE" in msg or "overloaded" in msg
            else:
                status, body = http_generate(server, {"text_input": prompts[0], "sampling_param_max_tokens": 4})
                assert status != 200
                msg = body["error"]
            print(f"{transport}: {msg}")
            assert "overloaded" in msg and f"max_batch {MAX_BATCH}" in msg and f"max_queue {MAX_QUEUE}" in msg
            assert time.monotonic() - t0 < 5                          # refused at once, not queued
        assert outcome(server, "rejected_overloaded") - r0 == 2
    finally:
        for s in streams:
            s.cancel()
    wait_for(lambda: outcome(server, "cancelled") - c0 == MAX_BATCH + MAX_QUEUE, timeout=30,
             what="every cancelled request counted")
    m = metrics(server)
    assert metric(m, "specpipe_batch_rows") == 0 and metric(m, "specpipe_queue_depth") == 0
    status, body = http_generate(server, {"text_input": prompts[0], "sampling_param_max_tokens": MAX_TOKENS})
    assert status == 200 and body["text_output"] == reference.complete(prompts[0], max_tokens=MAX_TOKENS).text


def test_an_http_client_that_disconnects_frees_its_slot(server, prompts):
    """A streaming HTTP client closes its connection after the first event: Triton cancels the request, the
    model sees it and the row leaves the batch."""
    import socket

    c0 = outcome(server, "cancelled")
    host, port = server["http"].split(":")
    body = json.dumps({"text_input": prompts[0], "sampling_param_max_tokens": LONG, "streaming": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v2/models/tensorrt_llm/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while b"data: " not in received:     # the headers and the first event may come in separate reads
            chunk = s.recv(4096)
            assert chunk, f"the server closed the stream before its first event: {received!r}"
            received += chunk
    wait_for(lambda: outcome(server, "cancelled") - c0 == 1, timeout=30, what="the disconnected request cancelled")
    assert metric(metrics(server), "specpipe_batch_rows") == 0


BAD = [  # (transport, inputs, what the error must say); each is answered and the model keeps serving
    ("http", {"text_input": ""}, "text_input is empty"),
    ("http", {"text_input": "abc", "sampling_param_max_tokens": 0}, "sampling_param_max_tokens must be >= 1, got 0"),
    ("http", {"text_input": "abc", "sampling_param_max_tokens": -3}, "sampling_param_max_tokens must be >= 1, got -3"),
    ("http", {"text_input": "abc", "sampling_param_max_tokens": 100000}, "is not below the model's context"),
    ("http", {"text_input": "abc " * 3000, "sampling_param_max_tokens": 4}, "the model's context is"),
    ("http", {"text_input": "abc " * 500, "sampling_param_max_tokens": 2000}, "exceed the model's context"),
    ("http", {"text_input": "abc", "max_tokens": 4}, "unknown parameter(s) ['max_tokens']"),
    ("http", {"text_input": "abc", "sampling_param_temperature": -1.0}, "sampling_param_temperature must be"),
    ("http", {"text_input": "abc", "sampling_param_top_p": 0.0}, "sampling_param_top_p must be in (0, 1]"),
    ("http", {"text_input": "abc", "sampling_param_max_tokens": "many"}, ""),        # Triton's own JSON check
    ("grpc", {"text_input": b"\xff\xfeabc"}, "text_input is not valid UTF-8"),
    ("grpc", {"text_input": ("BYTES", np.array([b"a", b"b"], dtype=np.object_))}, "exactly one prompt, got 2"),
    ("grpc", {"text_input": "abc", "sampling_param_max_tokens": ("FP32", np.array([4.0], dtype=np.float32))},
     "expects 'INT32'"),
    ("grpc", {"text_input": "abc", "sampling_param_max_tokens": ("INT32", np.array([4, 5], dtype=np.int32))},
     "unexpected shape for input 'sampling_param_max_tokens'"),
    ("grpc", {"text_input": "abc", "no_such_input": 1}, "unexpected inference input 'no_such_input'"),
    ("grpc", {"text_input": "abc", "sampling_param_top_k": 5}, "sampling_param_top_k=5 is not supported"),
]
MODEL_SIDE = 12       # the BAD cases the model itself answers (the others Triton rejects before the model)


def test_every_bad_request_gets_its_error_and_the_server_keeps_serving(server, reference, prompts):
    r0 = outcome(server, "rejected_invalid")
    for transport, inputs, expected in BAD:
        if transport == "http":
            status, body = http_generate(server, inputs)
            assert status >= 400, (inputs, body)
            msg = body["error"]
        else:
            with pytest.raises(RuntimeError) as e:
                grpc_stream(server, inputs)
            msg = str(e.value)
        print(f"{transport} {sorted(inputs)}: {msg[:160]}")
        assert expected in msg, (inputs, msg)
    assert outcome(server, "rejected_invalid") - r0 == MODEL_SIDE
    status, body = http_generate(server, {"text_input": prompts[0], "sampling_param_max_tokens": MAX_TOKENS})
    assert status == 200 and body["text_output"] == reference.complete(prompts[0], max_tokens=MAX_TOKENS).text


def test_prometheus_counters_match_the_responses(server, reference, prompts):
    """The custom metrics on Triton's metrics port count exactly what the responses report."""
    m0 = metrics(server)
    tot = {"draft": 0, "acc": 0}
    for p in prompts:
        status, body = http_generate(server, {"text_input": p, "sampling_param_max_tokens": MAX_TOKENS,
                                              "sampling_param_return_perf_metrics": True})
        assert status == 200
        drafted, accepted = perf_counts(body, "test")
        tot["draft"] += drafted
        tot["acc"] += accepted
    m1 = metrics(server)
    d = lambda name: metric(m1, name) - metric(m0, name)  # noqa: E731
    assert d("specpipe_draft_tokens_total") == tot["draft"] > 0
    assert d("specpipe_accepted_draft_tokens_total") == tot["acc"]
    assert d("specpipe_verification_steps_total") * reference.draft_len == tot["draft"]
    assert metric(m1, "specpipe_draft_len") == reference.draft_len
    assert metric(m1, "specpipe_max_batch") == MAX_BATCH and metric(m1, "specpipe_max_queue") == MAX_QUEUE
    assert metric(m1, "specpipe_requests_total", outcome="completed") - \
        metric(m0, "specpipe_requests_total", outcome="completed") == len(prompts)


def test_http_infer_clients_share_forwards_without_speculation(run_dir, reference, all_prompts):
    """`specpipe serve --not-decoupled --draft-len 0`: Triton's HTTP `infer` endpoint (what perf_analyzer -i http
    uses; it refuses decoupled models), the target alone. Concurrent infer requests still share target forwards,
    and each greedy response is generate()'s output at draft length 0."""
    import tritonclient.http as h

    ps = all_prompts[:4]
    want = []
    for p in ps:
        g = reference.engine.generate([reference.encode(p)], max_new_tokens=24, draft_len=0,
                                      eos_token_id=reference.eos_token_ids)
        want.append(reference.decode(g.tokens[0]))
    with cli_server(run_dir, "--not-decoupled", "--draft-len", "0", "--max-batch", "4") as srv:
        m0 = metrics(srv)
        got: dict[int, str] = {}

        def client(i):
            c = h.InferenceServerClient(srv["http"], network_timeout=180)
            t = h.InferInput("text_input", [1], "BYTES")
            t.set_data_from_numpy(np.array([ps[i].encode()], dtype=np.object_))
            n = h.InferInput("sampling_param_max_tokens", [1], "INT32")
            n.set_data_from_numpy(np.array([24], dtype=np.int32))
            got[i] = c.infer("tensorrt_llm", [t, n]).as_numpy("text_output")[0].decode()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert [got.get(i) for i in range(len(ps))] == want
        m1 = metrics(srv)
        assert metric(m1, "specpipe_draft_len") == 0
        assert metric(m1, "specpipe_draft_tokens_total") == metric(m0, "specpipe_draft_tokens_total") == 0
        rows = metric(m1, "specpipe_decode_rows_total") - metric(m0, "specpipe_decode_rows_total")
        fwd = metric(m1, "specpipe_target_forwards_total") - metric(m0, "specpipe_target_forwards_total")
        assert rows / fwd > 1.5


@pytest.mark.slow
def test_perf_analyzer_load_loses_nothing_and_matches_generate(run_dir, tmp_path):
    """bench/serve_load.py at small scale: perf_analyzer (tritonclient 2.51's binary, a client nobody here wrote)
    drives the server over gRPC streaming and HTTP infer at 1 and 3 clients; no response is lost and every greedy
    response equals the in-process generate() output for its prompt (the script exits 1 otherwise)."""
    import shutil
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import serve_load

    try:
        lib = serve_load.cudart_dir()
    except SystemExit as e:
        pytest.skip(f"perf_analyzer cannot run here: {e} (.ci/run installs it)")
    pa = shutil.which("perf_analyzer") or str(Path(sys.executable).parent / "perf_analyzer")
    probe = subprocess.run([pa, "--help"], capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": lib})
    if "error while loading shared libraries" in probe.stderr:
        pytest.skip(f"perf_analyzer cannot run here: {probe.stderr.strip()} (.ci/run installs libb64-0d)")
    script = REPO / "bench" / "serve_load.py"
    r = subprocess.run([sys.executable, str(script), "--workdir", str(run_dir), "--concurrency", "1,3", "--requests", "6",
                        "--max-tokens", "16", "--prompts", "4", "--modes", "speculative", "--stability", "1000",
                        "--max-trials", "6", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(r.stdout, r.stderr[-3000:])
    assert r.returncode == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(x["protocol"], x["concurrency"]) for x in rows} == {("grpc streaming", 1), ("grpc streaming", 3),
                                                                 ("http", 1), ("http", 3)}
    for x in rows:
        assert x["requests"] >= 6 and x["lost"] == 0 and x["mismatches"] == 0 and x["throughput_tok_s"] > 0
    assert "| tokens/s |" in r.stdout and "Command: `" in r.stdout
