"""speculation_profile.json beside every exported draft, `specpipe monitor`'s baseline from it, and the report's
opening (verdict, AL per domain, predicted speedup, artifacts to deploy) before any stage table.

The schema is NVIDIA ModelOpt's proposal (PRs #2247 #2313 #2315 #2316): NVIDIA/Model-Optimizer
`examples/specdec_bench/specdec_bench/speculation_profile.py` read at commit edf879d3daf7879acdeb2dab9f54a591837da7b0
(`SCHEMA_VERSION = "1.0"`, `build_profile`'s keys, marginal = survival of the acceptance length, conditional =
ratio of consecutive marginals, histogram keyed by acceptance length = accepted + 1, `1 + sum(marginal)` = AL).

The run: SPECPIPE_TEST_RUN (a tiny run built with this code) or the session's tiny run; every test that modifies
it works on a copy.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import stat
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, run_cli, status_json, tiny_overrides

# build_profile's keys at edf879d3 (the ModelOpt schema 1.0 a consumer reads)
MODELOPT_KEYS = {"schema_version", "measured", "method", "draft_checkpoint", "target_model", "num_speculative_tokens",
                 "block_size", "max_supported_k", "verification_method", "conditional_accept_rates",
                 "marginal_accept_rates", "mean_accept_length", "mean_accept_length_per_request", "accept_length_model",
                 "accept_length_by_k", "acceptance_length_histogram", "per_category", "measurement_conditions",
                 "validation"}


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    wd = tmp_path / "run"
    shutil.copytree(run_dir, wd, symlinks=True, ignore=shutil.ignore_patterns("scratch", ".lock", "monitor"))
    return wd


# ---------------------------------------------------------------------------------------------- the numbers


def test_vectors_follow_modelopts_conventions():
    """PR #2247's worked example (nvidia/MiniMax-M2.7-DFlash on MT-Bench): marginal [0.816, 0.634, 0.475] with
    conditional [0.816, 0.777, 0.750] and AL 2.925; as a histogram of accepted counts over 1000 steps."""
    from runtime.validate.profile import block, vectors

    hist = [184, 182, 159, 475]                    # steps accepting 0, 1, 2, 3 of 3 drafted tokens
    cond, marg, mean = vectors(hist)
    assert [round(x, 3) for x in marg] == [0.816, 0.634, 0.475]
    assert [round(x, 3) for x in cond] == [0.816, 0.777, 0.749]
    assert mean == pytest.approx(2.925) == pytest.approx(1 + sum(marg))
    b = block({"accepted_per_step": hist, "steps": 1000, "acceptance_length": 2.925}, 3)
    assert b["acceptance_length_histogram"] == {"1": 184, "2": 182, "3": 159, "4": 475}   # keyed by length = a + 1
    assert b["validation"]["mean_consistency"]["passed"] and b["validation"]["marginal_monotonicity"]["passed"]
    assert vectors([0, 0, 5, 0])[0] == [1.0, 1.0, 0.0]                 # after a zero marginal: 0.0, as ModelOpt
    assert block({"per_position": None, "acceptance_length": 1.7}, 3)["measured"] is False   # TensorRT-LLM runtime


def test_run_stats_record_the_accepted_count_histogram():
    """validate's statistics carry the histogram; the per-position conditionals are its ratios, and a histogram
    derived from per_position and steps (an acceptance.json written before the histogram) is the same."""
    from runtime.engine.stats import RunStats
    from runtime.validate.profile import histogram_of, vectors

    a, b = RunStats(3), RunStats(2)
    for acc in (0, 3, 3, 1, 2, 3, 0, 1):
        a.record_step(acc, 3)
        a.steps += 1
        a.accepted += acc
    b.record_step(2, 2)
    b.steps, b.accepted = 1, 2
    m = a.merge(b)
    d = m.as_dict()
    assert d["accepted_per_step"] == [2, 2, 2, 3] and sum(d["accepted_per_step"]) == d["steps"] == 9
    cond, _, mean = vectors(d["accepted_per_step"])
    assert mean == pytest.approx(d["acceptance_length"])
    a_d = a.as_dict()
    assert vectors(a_d["accepted_per_step"])[0] == pytest.approx(a_d["per_position"], abs=1e-6)
    derived, source = histogram_of({k: v for k, v in a_d.items() if k != "accepted_per_step"}, 3)
    assert derived == a_d["accepted_per_step"] and source.startswith("derived")


def test_engine_measured_entries_become_measurements():
    """The hook for engine-measured acceptance: acceptance.json `engines` -> one measurement per engine, after
    validate's (which stays the top level)."""
    from runtime.records_validate import AcceptanceInfo
    from runtime.validate.profile import build_profile

    st = {"acceptance_length": 2.5, "steps": 4, "accepted_per_step": [1, 1, 1, 1], "per_position": [0.75, 2 / 3, 0.5]}
    acc = {"max_draft_len": 3, "runtime": "reference", "temperature": 0.0, "domains": {"code": {"fp8": st}},
           "overall": {"fp8": st},
           "engines": {"vllm": {"version": "0.32.0", "draft_len": 3, "domains": {"code": {**st, "acceptance_length": 2.0,
                                                                                         "accepted_per_step": [2, 1, 0, 1]}},
                                "overall": {**st, "acceptance_length": 2.0, "accepted_per_step": [2, 1, 0, 1]}}}}
    p = build_profile(AcceptanceInfo.from_json({**acc, "gates": {"passed": True}}), method="eagle3", target={}, draft={},
                      conditions={"versions": {}})
    assert [m["engine"] for m in p["measurements"]] == ["specpipe", "vllm"]
    assert p["measurement_conditions"]["engine"] == "specpipe" and p["mean_accept_length"] == 2.5
    v = p["measurements"][1]
    assert v["measurement_conditions"]["engine_version"] == "0.32.0"
    assert v["per_category"]["code"]["mean_accept_length"] == 2.0
    assert v["per_category"]["code"]["acceptance_length_histogram"] == {"1": 2, "2": 1, "4": 1}


def test_profile_states_the_al_at_every_k_and_the_deployed_one():
    """accept_length_by_k at every k <= K from the measured chain (ModelOpt keeps only K's entry), the deployed draft
    length's AL beside ModelOpt's fields, ModelOpt's per-request mean (AcceptanceRate Average_AL: each request's tokens
    per step, averaged over requests) and DFlash's block_size / max_supported_k."""
    from runtime.records_validate import AcceptanceInfo
    from runtime.validate.profile import build_profile

    hist = [184, 182, 159, 475]                     # PR #2247's example: marginal [0.816, 0.634, 0.475], AL 2.925
    rows = [[10, 20], [30, 30]]                      # per prompt [steps, accepted]: 3.0 and 2.0 tokens per step
    st = {"acceptance_length": 2.925, "steps": 1000, "accepted_per_step": hist, "per_prompt": rows}
    acc = AcceptanceInfo.from_json({"max_draft_len": 3, "runtime": "reference", "domains": {"code": {"fp8": st}},
                                    "overall": {"fp8": {k: v for k, v in st.items() if k != "per_prompt"}},
                                    "gates": {"passed": True}})
    p = build_profile(acc, method="eagle3", target={}, draft={}, conditions={}, deployed_draft_len=2)
    assert p["accept_length_by_k"] == {"1": 1.816, "2": 2.45, "3": 2.925}
    assert p["accept_length_by_k"]["3"] == p["mean_accept_length"] and p["num_speculative_tokens"] == 3
    assert p["deployed_draft_len"] == 2 and p["deployed_accept_length"] == 2.45     # not the 2.925 measured at K
    assert p["accept_length_by_k_source"]["3"] == "measured" and p["accept_length_by_k_source"]["1"].startswith("chain")
    assert p["per_category"]["code"]["accept_length_by_k"] == p["accept_length_by_k"]
    assert p["mean_accept_length_per_request"] == 2.5 == p["per_category"]["code"]["mean_accept_length_per_request"]
    assert p["block_size"] is None and p["max_supported_k"] == 3
    d = build_profile(acc, method="dflash", target={}, draft={}, conditions={}, deployed_draft_len=3, block_size=8)
    assert d["block_size"] == 8 and d["max_supported_k"] == 7 and d["accept_length_model"] == "measured_per_k"
    assert d["deployed_accept_length"] == 2.925 and "DFlash drafter" in d["accept_length_by_k_source"]["2"]


def test_profile_and_verdict_lead_with_the_first_layer_the_engines_compute():
    """validate gates on ModelOpt's training first layer hidden_norm(input_layernorm(h)) by default; TensorRT-LLM, vLLM
    and SGLang compute hidden_norm(h) (validate's `serving`, measured as fp8_other_norm): the profile's
    served_computation and the report's verdict table give that figure first, the gated one beside it."""
    from pipeline.verdict import al_rows
    from runtime.records_validate import AcceptanceInfo
    from runtime.validate.profile import build_profile

    st = {"acceptance_length": 2.5, "steps": 4, "accepted_per_step": [1, 1, 1, 1]}
    doc = {"max_draft_len": 3, "runtime": "reference", "draft": {"first_layer_norm": "modelopt"}, "gates": {"passed": True},
           "domains": {"code": {"fp8": st, "fp8_other_norm": {"first_layer_norm": "serving", "acceptance_length": 2.2}},
                       "prose": {"fp8": {**st, "acceptance_length": 2.0}}},
           "overall": {"fp8": st}}
    p = build_profile(AcceptanceInfo.from_json(doc), method="eagle3", target={}, draft={}, conditions={})
    sc = p["served_computation"]
    assert sc["first_layer_norm"] == "serving" and sc["measured"] and sc["per_category"] == {"code": 2.2, "prose": None}
    assert sc["validate_per_category"] == {"code": 2.5, "prose": 2.0} and sc["mean_accept_length"] is None
    assert p["mean_accept_length"] == 2.5                                # ModelOpt's fields keep validate's measurement
    header, rows = al_rows(doc)
    assert "hidden_norm(h)" in header[1] and "training first layer" in header[2]
    assert rows[0][:3] == ["code", 2.2, 2.5] and rows[1][:3] == ["prose", "not measured", 2.0]
    assert rows[2][:3] == ["overall", "per domain only", 2.5]
    serving = {**doc, "draft": {"first_layer_norm": "serving"}}
    served = build_profile(AcceptanceInfo.from_json(serving), method="eagle3", target={}, draft={}, conditions={})
    sc = served["served_computation"]
    assert sc["mean_accept_length"] == 2.5 and sc["per_category"]["code"] == 2.5
    assert "hidden_norm" not in al_rows(serving)[0][1]                   # nothing to put beside it
    assert build_profile(AcceptanceInfo.from_json(doc), method="dflash", target={}, draft={}, conditions={})[
        "served_computation"] is None


# ---------------------------------------------------------------------------------------------- the tiny run


def test_every_exported_draft_carries_the_profile(run_dir):
    arts = run_dir / "artifacts"
    ex = json.loads((arts / "export" / "export.json").read_text())
    files = ex["speculation_profile"]["files"]
    expected = {"triton/tensorrt_llm/1/draft/speculation_profile.json",
                "triton_cpu/tensorrt_llm/1/draft/speculation_profile.json", "speculators/speculation_profile.json"}
    assert set(files) == expected
    dep = json.loads((arts / "build" / "deployment.json").read_text())
    # build's: beside the draft the TensorRT-LLM deployment ships (deployment/draft/ where build renamed the draft)
    built = arts / "build" / "deployment" / ("draft" if dep["draft_weight_names"] else "") / "speculation_profile.json"
    paths = [built, *[arts / "export" / f for f in files]]
    texts = {p.read_text() for p in paths}
    assert len(texts) == 1                                             # the same profile beside every draft
    for p in paths:
        assert p.stat().st_mode & stat.S_IROTH, f"{p} is not world-readable"
    entry = json.loads((arts / "build" / "manifest.json").read_text())["files"][str(built.relative_to(arts / "build"))]
    assert entry["sha256"] == hashlib.sha256(built.read_bytes()).hexdigest()   # export did not write through a link
    p = json.loads(texts.pop())
    acc = json.loads((arts / "validate" / "acceptance.json").read_text())
    assert MODELOPT_KEYS <= set(p) and p["schema_version"] == "1.0" and p["measured"] is True
    assert p["method"] == "eagle3" and p["accept_length_model"] == "chain_analytic"
    K = acc["measured_draft_len"]
    assert p["num_speculative_tokens"] == K and len(p["conditional_accept_rates"]) == K
    assert set(p["per_category"]) == set(acc["domains"])
    for d, v in acc["domains"].items():
        fp8, b = v["fp8"], p["per_category"][d]
        assert sum(fp8["accepted_per_step"]) == fp8["steps"]          # validate records the histogram
        assert b["histogram_source"] == "measured"
        assert sum(b["acceptance_length_histogram"].values()) == fp8["steps"]
        assert b["mean_accept_length"] == pytest.approx(fp8["acceptance_length"], abs=1e-5)
        assert b["conditional_accept_rates"] == pytest.approx([x or 0.0 for x in fp8["per_position"]], abs=1e-5)
        assert b["validation"]["mean_consistency"]["passed"]
    assert p["mean_accept_length"] == pytest.approx(acc["overall"]["fp8"]["acceptance_length"], abs=1e-5)
    assert list(p["accept_length_by_k"]) == [str(k) for k in range(1, K + 1)]
    dep = json.loads((arts / "build" / "deployment.json").read_text())
    k1 = dep["draft_schedule"]["runs"][0][2]
    assert p["deployed_draft_len"] == k1 and p["deployed_accept_length"] == p["accept_length_by_k"][str(k1)]
    assert p["mean_accept_length_per_request"] is not None
    c = p["measurement_conditions"]
    assert c["engine"] == "specpipe" and p["measurements"][0]["engine"] == "specpipe"
    assert c["pair"]["target_precision"] == "FP8" and c["pair"]["draft_precision"] in ("bf16", "fp8")
    assert c["sampling"]["temperature"] == acc["temperature"] and c["sampling"]["max_new_tokens"] == acc["max_new_tokens"]
    assert set(c["prompts"]["per_category"]) == set(acc["domains"]) and all(c["prompts"]["per_category"].values())
    assert all(c["versions"][k] for k in ("specpipe", "torch", "transformers", "modelopt")), c["versions"]
    assert str(run_dir) not in json.dumps(p)                            # no absolute paths in a published file


def test_monitor_reads_its_baseline_from_the_profile(run_dir, tmp_path):
    from pipeline.monitor import Design, Endpoint, Monitor, read_run

    wd = _copy(run_dir, tmp_path)
    arts = wd / "artifacts"
    first = arts / "export" / json.loads((arts / "export" / "export.json").read_text())["speculation_profile"]["files"][0]
    p = json.loads(first.read_text())
    for b in p["per_category"].values():
        b["conditional_accept_rates"] = [0.5] * len(b["conditional_accept_rates"])
    first.write_text(json.dumps(p))
    run = read_run(wd)
    assert run.baseline_source.startswith("artifacts/export/triton/") and "(specpipe)" in run.baseline_source
    mon = Monitor(run, Design(draft_len=run.draft_len), Endpoint("http://127.0.0.1:1", metrics_url=None, passive=False),
                  state_path=tmp_path / "s.json", prom_path=tmp_path / "p.prom", echo=lambda *a, **k: None)
    expected = 1 + sum(0.5 ** j for j in range(1, run.draft_len + 1))
    assert {d: round(t.al0, 6) for d, t in mon.tests.items()} == {d: round(expected, 6) for d in p["per_category"]}
    assert "speculation_profile.json" in mon.describe()

    del p["schema_version"]                                             # a broken profile: exit 2, naming it
    first.write_text(json.dumps(p))
    r = run_cli("monitor", "--workdir", str(wd), "--url", "http://127.0.0.1:1", "--once",
                "--state", str(tmp_path / "s2.json"), "--prom-file", str(tmp_path / "p2"))
    assert r.returncode == 2 and "speculation_profile.json" in r.stderr and "schema_version" in r.stderr, r.stderr

    shutil.rmtree(arts / "export")                                      # no export: validate's acceptance.json
    run = read_run(wd)
    acc = json.loads((arts / "validate" / "acceptance.json").read_text())
    assert run.baseline_source == "artifacts/validate/acceptance.json"
    assert run.baseline == {d: v["fp8"]["per_position"] for d, v in acc["domains"].items()}


# ---------------------------------------------------------------------------------------------- the report


def _report(wd: Path) -> str:
    r = run_cli("report", "--workdir", str(wd), "--out", str(wd / "r.html"))
    assert r.returncode == 0, r.stderr
    return (wd / "r.html").read_text()


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&#x27;", "'")


def test_report_opens_with_the_verdict(run_dir, tmp_path):
    wd = _copy(run_dir, tmp_path)
    arts = wd / "artifacts"
    acc = json.loads((arts / "validate" / "acceptance.json").read_text())
    tune = json.loads((arts / "tune" / "manifest.json").read_text())["metrics"]
    html = _report(wd)
    head = html[:html.index("<h2>Stages</h2>")]                        # everything before the first stage table
    assert "<h2 id='verdict'>Verdict</h2>" in head and "<h2>validate</h2>" not in head
    text = _text(head)
    assert "SHIPPED" in text and "gate(s) passed" in text
    for d, v in acc["domains"].items():     # the engines' first layer first where validate measured it, then the gated AL
        lead = f"{v['fp8_other_norm']['acceptance_length']:.4g} " if v.get("fp8_other_norm") else ""
        assert re.search(rf"{d} {lead}{v['fp8']['acceptance_length']:.4g} ", text), (d, text)
    assert f"{tune['predicted_speedup_batch1']:.2f}x at batch 1" in text
    assert "H200" in text
    ex = json.loads((arts / "export" / "export.json").read_text())
    paths = [arts / "build" / "deployment" / "serve.sh", arts / "export" / "triton" / "launch.sh",
             *(arts / "build" / "deployment").rglob("speculation_profile.json"),
             arts / "export" / "speculators" / "serve_vllm.sh",
             *[arts / "export" / f for f in ex["speculation_profile"]["files"]]]
    for p in paths:
        assert p.exists() and str(p) in text, p

    acc["engines"] = {"vllm": {"version": "0.32.0", "domains": {d: {"acceptance_length": 1.234} for d in acc["domains"]},
                               "overall": {"acceptance_length": 1.234}}}
    (arts / "validate" / "acceptance.json").write_text(json.dumps(acc))
    text = _text(_report(wd).split("<h2>Stages</h2>")[0])
    assert "AL measured by vllm 0.32.0" in text and text.count("1.234") == len(acc["domains"]) + 1


@pytest.mark.slow
def test_report_says_refused_and_why(run_dir, tmp_path):
    """The same run with a draft trained for 2 steps (it accepts ~nothing) and validate's AL gate at 2.5: validate
    fails, the report opens with REFUSED and the failed gate, and lists nothing to deploy (the export committed
    before is stale)."""
    wd = _copy(run_dir, tmp_path)
    r = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd), *tiny_overrides(), "-o", "train_draft.steps=2",
                "-o", "train_draft.warmup_steps=1", "-o", "validate.gates.min_acceptance_length=2.5",
                "--from", "train_draft")
    assert r.returncode == 1 and "gate" in r.stderr, r.stderr[-2000:]
    text = _text(_report(wd).split("<h2>Stages</h2>")[0])
    assert "REFUSED" in text and "stage validate failed" in text and "2.5" in text, text
    assert "Artifacts to deploy" not in text
    measured = next(s for s in status_json(wd)["stages"] if s["name"] == "validate")["failed_metrics"]
    assert "the pair validate refused" in text
    for d, v in measured["domains"].items():                            # the refused pair's AL, not the old artifact's
        # the engines' first-layer figure leads where validate measured it, the gated one beside it
        assert re.search(rf"{d} (?:[\d.]+ |not measured )?{v['fp8']['acceptance_length']:.4g} ", text), (d, text)
