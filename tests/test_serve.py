"""`specpipe serve`: a real Triton Inference Server (nvidia-pytriton's binary) on the exported CPU repository.

One server for the module, started through the real CLI (`specpipe serve --workdir ...`, free ports on
127.0.0.1, readiness bounded) and stopped with SIGINT as a user's Ctrl-C would. The requests go through
tritonclient (gRPC) and plain HTTP, and are compared with the same FP8 pair run in-process through
`runtime.serving` (specpipe's speculative runtime).

The run comes from the session's tiny pipeline (conftest `tiny_run`); set SPECPIPE_TEST_RUN=<workdir> to
reuse an existing run that has a committed `export`.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import SPECPIPE, artifact_dir

MAX_TOKENS = 16
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def run_dir(request) -> Path:
    if os.environ.get("SPECPIPE_TEST_RUN"):
        return Path(os.environ["SPECPIPE_TEST_RUN"])
    wd, r = request.getfixturevalue("tiny_run")
    artifact_dir(wd, "export")
    return wd


@pytest.fixture(scope="module")
def server(run_dir):
    """`specpipe serve` as a user runs it; yields its endpoints; stops it with SIGINT."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([SPECPIPE, "serve", "--workdir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    info, deadline = {}, time.monotonic() + START_TIMEOUT_S
    while "ready" not in info:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            pytest.fail(f"specpipe serve not ready after {START_TIMEOUT_S}s: {proc.stderr.read()}")
        s = line.strip()
        if s.startswith("HTTP"):
            info["http"] = s.split("http://")[1]
        elif s.startswith("gRPC"):
            info["grpc"] = s.split()[1]
        elif "ready (pid" in s:
            info["pid"] = int(s.split("(pid ")[1].rstrip(")"))
        elif s.startswith("Ctrl-C"):
            info["ready"] = True
        if proc.poll() is not None and lines.empty():
            pytest.fail(f"specpipe serve exited with {proc.returncode}: {proc.stderr.read()}")
    yield info
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert rc == 0, err
    assert "stopped (exit code" in err
    with pytest.raises(ProcessLookupError):   # the server process is gone, not orphaned
        os.kill(info["pid"], 0)


@pytest.fixture(scope="module")
def model_dir(run_dir) -> Path:
    return run_dir / "artifacts" / "export" / "triton_cpu" / "tensorrt_llm" / "1"


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same FP8 pair in-process, through the adapter the Triton model uses."""
    from runtime.serving import ServingEngine

    spec = json.loads((model_dir / "specpipe_model.json").read_text())
    return ServingEngine(model_dir / spec["target"], model_dir / spec["draft"], draft_len=spec["draft_len"])


@pytest.fixture(scope="module")
def prompts(run_dir) -> list[str]:
    out = []
    for f in sorted((run_dir / "artifacts" / "data" / "eval").glob("*.jsonl")):
        out.append(json.loads(f.read_text().splitlines()[0])["prompt"])
    return out[:2]


def http_generate(server, body: dict, stream: bool = False):
    path = "generate_stream" if stream else "generate"
    req = urllib.request.Request(f"http://{server['http']}/v2/models/tensorrt_llm/{path}",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:   # noqa: S310 - 127.0.0.1
            raw = r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if stream:
        return 200, [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]
    return 200, json.loads(raw)


def grpc_stream(server, inputs: dict) -> list:
    """One request over a gRPC stream; returns (text, outputs, final flag) per response, or raises its error."""
    import tritonclient.grpc as g

    dtypes = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32), str: ("BYTES", np.object_)}
    tensors = []
    for name, v in inputs.items():
        dt, npt = dtypes[type(v)]
        t = g.InferInput(name, [1], dt)
        t.set_data_from_numpy(np.array([v.encode() if isinstance(v, str) else v], dtype=npt))
        tensors.append(t)
    q: queue.Queue = queue.Queue()
    c = g.InferenceServerClient(server["grpc"])
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        c.async_stream_infer("tensorrt_llm", tensors, enable_empty_final_response=True)
        out = []
        while True:
            res, err = q.get(timeout=120)
            if err is not None:
                raise RuntimeError(str(err))
            final = res.get_response().parameters["triton_final_response"].bool_param
            text = res.as_numpy("text_output")
            out.append((text[0].decode() if text is not None else None, res, final))
            if final:
                return out
    finally:
        c.stop_stream()
        c.close()


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
    for a, b in zip(texts, texts[1:]):             # cumulative text, growing
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
        assert body["total_draft_tokens"] == want.total_draft_tokens == want.steps * want.draft_len > 0
        assert body["total_accepted_draft_tokens"] == want.total_accepted_draft_tokens
        assert body["acceptance_rate"] == pytest.approx(want.total_accepted_draft_tokens / want.total_draft_tokens, abs=1e-6)
        assert body["finish_reason"] in ("length", "stop")
        assert body["arrival_time_ns"] <= body["first_token_time_ns"] <= body["last_token_time_ns"]
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

    from runtime import triton_server

    bad = tmp_path / "repo"
    shutil.copytree(model_dir.parent, bad / "no_weights", ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = (bad / "no_weights" / "config.pbtxt").read_text()
    (bad / "no_weights" / "config.pbtxt").write_text(cfg.replace('name: "tensorrt_llm"', 'name: "no_weights"'))
    (bad / "no_dims" / "1").mkdir(parents=True)
    (bad / "no_dims" / "1" / "model.py").write_text("class TritonPythonModel:\n    def execute(self, requests):\n        return []\n")
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
