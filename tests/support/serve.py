"""`specpipe serve` as a user runs it, and plain-HTTP generation against it (the serving and real-model tests)."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import SPECPIPE

START_TIMEOUT_S = 600


@contextlib.contextmanager
def cli_server(run_dir, *args: str):
    """`specpipe serve` as a user runs it; yields its endpoints; stops it with SIGINT."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([SPECPIPE, "serve", "--workdir", str(run_dir), *args], stdout=subprocess.PIPE,
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
        elif s.startswith("metrics"):
            info["metrics"] = s.split()[1]
        elif "ready (pid" in s:
            info["pid"] = int(s.split("(pid ")[1].rstrip(")"))
        elif s.startswith("Ctrl-C"):
            info["ready"] = True
        if proc.poll() is not None and lines.empty():
            pytest.fail(f"specpipe serve exited with {proc.returncode}: {proc.stderr.read()}")
    try:
        yield info
    except BaseException:   # the test failed inside the block: stop the server anyway, or it outlives the session
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert rc == 0, err
    assert "stopped (exit code" in err
    with pytest.raises(ProcessLookupError):   # the server process is gone, not orphaned
        os.kill(info["pid"], 0)



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


