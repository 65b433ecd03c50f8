"""The trained draft with TensorRT-LLM's suffix-automaton enhancer through the pipeline: validate's measurement per
domain and threshold (runtime/validate/hybrid.py), the speculation profile's figures, tune's choice of the threshold
(runtime/cost/hybrid.py) and build's sa_config per targeted version (runtime/trtllm/sa_enhancer.py, options.py).

Upstream facts encoded: SAEnhancerConfig {threshold: PositiveInt = 4, enable_global_pool: bool = False} is a field
(`sa_config`) of Eagle3DecodingConfig in NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py @
a7c5ad67dd5dfe159e736c62dbe918024788e2ea (the 1.3 reference schema, ../shared/reference/schemas/
trtllm-1.3-specdec.json) and not in the 1.2.1 one (trtllm-1.2-llmapi.json); DFlashDecodingConfig has none.

The run: SPECPIPE_TEST_RUN (a tiny run built with this code) or the session's tiny run.
"""
from __future__ import annotations

import json

import pytest
import yaml

from conftest import artifact_dir, run_cli, status_json


def test_validate_measures_the_hybrid_per_domain_and_threshold(run_dir):
    """acceptance.json: every threshold measured on every domain (same prompts as the trained draft), the best one's
    figures per domain with per-position rates and SA counters, the comparison (what training buys, what matching
    adds) consistent with the ALs; the invariant covered those runs; metrics and report carry it."""
    acc = json.loads((artifact_dir(run_dir, "validate") / "acceptance.json").read_text())
    hy = acc["hybrid"]
    assert hy["thresholds"] == [2, 4, 8] and hy["enable_global_pool"] is False and hy["k"] == acc["measured_draft_len"]
    assert set(hy["by_threshold"]) == {"2", "4", "8"}
    best = hy["best_threshold"]
    assert hy["by_threshold"][str(best)]["overall"]["acceptance_length"] == \
        max(v["overall"]["acceptance_length"] for v in hy["by_threshold"].values())
    for d, v in acc["domains"].items():
        h, t = v["hybrid"], v["fp8"]
        assert h["threshold"] == best and h["prompts"] == t["prompts"] and len(h["per_position"]) == acc["measured_draft_len"]
        assert h["sa_accepted"] <= h["sa_drafted"] and h["sa_steps"] <= h["lookups"] <= h["steps"]
        assert h["sa_drafted"] + h["trained_drafted"] == h["drafted"]
        assert h["sa_accepted"] + h["trained_accepted"] == h["accepted"]
        c = hy["comparison"][d]
        assert c["matching_adds"] == pytest.approx(h["acceptance_length"] - t["acceptance_length"], abs=1e-3)
        assert c["training_buys"] == pytest.approx(h["acceptance_length"] - v["ngram"]["acceptance_length"], abs=1e-3)
        assert c["reaches_better_of_both"] == (c["hybrid"] >= max(c["trained"], c["ngram"]) - 1e-9)
    assert acc["lossless"]["invariant"]["pairs"]["fp8"]["passed"]
    assert acc["lossless"]["invariant"]["pairs"]["fp8"]["generations"] >= 3 * len(acc["domains"]) * 2
    m = next(s for s in status_json(run_dir)["stages"] if s["name"] == "validate")["metrics"]["hybrid"]
    assert m["threshold"] == best and set(m["acceptance_length"]) == set(hy["comparison"])
    r = run_cli("report", "--workdir", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert "suffix-automaton enhancer (sa_config)" in (run_dir / "report.html").read_text()


def test_speculation_profile_carries_the_hybrids_per_position_figures(run_dir):
    """The exported profile (beside the speculators draft) has `sa_enhancer.by_threshold`, each a measurement with
    ModelOpt's per-position fields per domain, equal to validate's figures for that threshold."""
    acc = json.loads((artifact_dir(run_dir, "validate") / "acceptance.json").read_text())
    prof = json.loads((artifact_dir(run_dir, "export") / "speculators" / "speculation_profile.json").read_text())
    sa = prof["sa_enhancer"]
    assert sa["best_threshold"] == acc["hybrid"]["best_threshold"] and sa["enable_global_pool"] is False
    for t, meas in sa["by_threshold"].items():
        assert meas["measurement_conditions"]["sa_threshold"] == int(t)
        for d, b in meas["per_category"].items():
            v = acc["hybrid"]["by_threshold"][t]["domains"][d]
            assert b["reported_mean_accept_length"] == v["acceptance_length"]
            assert b["mean_accept_length"] == pytest.approx(v["acceptance_length"], abs=1e-3)
            assert len(b["conditional_accept_rates"]) == acc["measured_draft_len"]


def test_tune_prices_each_threshold_and_build_refuses_sa_config_on_1_2(run_dir):
    """tuning.json: every measured threshold priced at the trained draft's k per batch size, the chosen one the best
    at batch 1, `pays` = beats the trained draft there; the tiny config targets 1.2.1, which has no sa_config: not
    deployed, the reason names the version that has it and what vLLM runs instead; build writes no sa_config and
    deployment.json says why."""
    t = json.loads((artifact_dir(run_dir, "tune") / "tuning.json").read_text())["sa_enhancer"]
    assert t["measured"] and set(t["candidates"]) == {"2", "4", "8"}
    b1 = "1"
    assert t["threshold"] == max((int(x) for x in t["candidates"]),
                                 key=lambda x: (t["candidates"][str(x)]["speedup_by_batch"][b1], x))
    assert t["pays"] == (t["candidates"][str(t["threshold"])]["speedup_by_batch"][b1] > t["trained"]["speedup_by_batch"][b1])
    assert t["deploy"] is False and t["supported"] is False
    assert "1.3.0rc27" in t["unsupported_reason"] and "method" in t["vllm_alternative"]
    dep = json.loads((artifact_dir(run_dir, "build") / "deployment.json").read_text())
    opts = yaml.safe_load((artifact_dir(run_dir, "build") / "deployment" / "llm_api_options.yaml").read_text())
    assert "sa_config" not in opts.get("speculative_config", {})
    assert dep["sa_enhancer"]["sa_config"] is None and dep["sa_enhancer"]["note"].startswith("refused: TensorRT-LLM 1.2.1")


def test_sa_config_is_written_only_for_versions_that_have_it():
    """The writer: 1.3 (Eagle3DecodingConfig.sa_config) gets {threshold, enable_global_pool: false} with every key
    in the version's field list; 1.2.1 and DFlash are refused with the reason; a key SAEnhancerConfig lacks is named."""
    from runtime.algorithms.schedule import DraftSchedule
    from runtime.trtllm import options as T
    from runtime.trtllm import schema

    tuning = {"sa_enhancer": {"measured": True, "deploy": True, "pays": True, "threshold": 3, "why": "threshold 3: ...",
                              "vllm_alternative": "vLLM: method suffix"}}
    sa, note = T.sa_config_of(tuning, "1.3.0rc27", "eagle3", True)
    assert sa == {"threshold": 3, "enable_global_pool": False} and note.startswith("written")
    spec = T.DeploymentSpec(version="1.3.0rc27", algorithm="eagle3", draft_dir="/d", schedule=DraftSchedule.constant(3),
                            capture_layers=[1, 2], max_batch_size=8, max_num_tokens=512, max_seq_len=512, sa_config=sa)
    opts = T.llm_api_options(spec)
    assert opts["speculative_config"]["sa_config"] == sa and schema.unknown_keys(opts, "1.3.0rc27") == []
    assert schema.unknown_keys(opts, "1.2.1") == ["speculative_config.sa_config"]
    opts["speculative_config"]["sa_config"]["min_len"] = 2
    assert schema.unknown_keys(opts, "1.3.0rc27") == ["speculative_config.sa_config.min_len"]
    sa12, note12 = T.sa_config_of(tuning, "1.2.1", "eagle3", True)
    assert sa12 is None and "1.2.1's Eagle3DecodingConfig has no sa_config" in note12 and "method suffix" in note12
    assert T.sa_config_of(tuning, "1.3.0rc27", "dflash", True)[0] is None
    assert T.sa_config_of({**tuning, "sa_enhancer": {**tuning["sa_enhancer"], "deploy": False}}, "1.3.0rc27", "eagle3",
                          True)[0] is None


def test_packaged_sa_enhancer_class_equals_the_reference():
    from runtime.trtllm import schema

    from support import DATA

    ref = json.loads((DATA / "trtllm_reference" / "trtllm-1.3-specdec.json").read_text())
    assert schema.load_schema("trtllm-1.3")["classes"]["SAEnhancerConfig"] == ref["classes"]["SAEnhancerConfig"]
    assert ref["classes"]["SAEnhancerConfig"]["fields"]["threshold"]["default"] == 4


def _dep():
    """The cost model's deployment of an 8B Llama (FP8) with a one-layer EAGLE-3 draft on an H200's datasheet."""
    from pipeline.hardware import GPUS
    from runtime.cost import costmodel as cm
    from runtime.records import DraftInfo

    fp8, bf16 = cm.Precision("fp8", 1.0, 1.0), cm.Precision("bf16", 2.0, 2.0)
    target = cm.llama("8b", num_layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
    dcfg = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "num_hidden_layers": 1, "vocab_size": 128256}
    e3 = cm.draft_shape(DraftInfo.from_json({"algorithm": "eagle3", "num_layers": 1, "aux_layer_ids": [1, 15, 28],
                                            "draft_vocab_size": 32000}), dcfg, 4096)
    m = cm.machine_from_gpu(GPUS["h200"], compute_efficiency=0.85, memory_efficiency=0.85, op_overhead_us=2.0)
    return cm.Deployment(target, e3, "eagle3", fp8, bf16, m, context=1024)


def _hist(cond: list[float], steps: int = 10000) -> list[int]:
    """The accepted-count histogram of `steps` steps whose conditional acceptance per position is `cond`."""
    surv = [1.0]
    for c in cond:
        surv.append(surv[-1] * c)
    return [round(steps * (surv[a] - surv[a + 1])) for a in range(len(cond))] + [round(steps * surv[-1])]


def _acc(hybrid_pp: dict[str, dict[str, list[float]]]):
    from runtime.records_validate import AcceptanceInfo

    return AcceptanceInfo.from_json({"max_draft_len": 3, "domains": {}, "overall": {}, "gates": {"passed": True},
                                     "hybrid": {"by_threshold": {t: {"domains": {d: {"accepted_per_step": _hist(pp)}
                                                                                 for d, pp in doms.items()}}
                                                                 for t, doms in hybrid_pp.items()}}})


def test_hybrid_curve_counts_every_step_not_only_those_that_drafted_the_position():
    """A ragged proposal (SA continuation shorter than k) leaves later positions undrafted: the per-position rate over
    the steps that drafted them can read 1.0 while the step yields fewer tokens. The priced curve is the survival of
    the accepted-count histogram: 1 + sum of its marginals = AL."""
    from runtime.cost.hybrid import survival_curve

    hist = [0, 0, 6, 4]            # 10 steps: 6 drafted 2 tokens (both kept), 4 drafted 3 (all kept)
    c = survival_curve(hist)
    assert c == pytest.approx([1.0, 1.0, 0.4])
    marg = [c[0], c[0] * c[1], c[0] * c[1] * c[2]]
    assert 1 + sum(marg) == pytest.approx(sum((a + 1) * n for a, n in enumerate(hist)) / sum(hist))


def test_tune_chooses_the_threshold_that_pays_on_the_traffic_mix():
    """Two domains, two thresholds: the one whose curves emit more tokens on the weighted mix wins; where no threshold
    beats the trained draft it does not pay (auto: not deployed; always: deployed anyway); never: never; a version without
    sa_config: not deployed, with the reason."""
    from runtime.cost import hybrid

    dep = _dep()
    trained = {"code": [0.5, 0.4, 0.3], "chat": [0.4, 0.3, 0.2]}
    acc = _acc({"2": {"code": [0.6, 0.5, 0.5], "chat": [0.3, 0.2, 0.1]},
                "4": {"code": [0.55, 0.45, 0.4], "chat": [0.45, 0.3, 0.2]}})
    tgt = {"want": "auto", "problem": None, "vllm_alternative": "v"}
    code_heavy = hybrid.choose(dep, acc, (trained, {"code": 0.9, "chat": 0.1}, 3), [1, 8], {}, tgt)
    chat_heavy = hybrid.choose(dep, acc, (trained, {"code": 0.1, "chat": 0.9}, 3), [1, 8], {}, tgt)
    assert code_heavy["threshold"] == 2 and chat_heavy["threshold"] == 4
    assert code_heavy["pays"] and code_heavy["deploy"] and chat_heavy["pays"]
    worse = _acc({"4": {"code": [0.4, 0.3, 0.2], "chat": [0.3, 0.2, 0.1]}})
    no = hybrid.choose(dep, worse, (trained, {"code": 1.0, "chat": 1.0}, 3), [1], {}, tgt)
    assert not no["pays"] and not no["deploy"] and "does not pay" in no["why"]
    assert hybrid.choose(dep, worse, (trained, {"code": 1.0}, 3), [1], {}, {**tgt, "want": "always"})["deploy"]
    assert not hybrid.choose(dep, acc, (trained, {"code": 1.0}, 3), [1], {}, {**tgt, "want": "never"})["deploy"]
    refused = hybrid.choose(dep, acc, (trained, {"code": 1.0}, 3), [1], {}, {**tgt, "problem": "no sa_config"})
    assert refused["pays"] and not refused["deploy"] and "not deployable: no sa_config" in refused["why"]


def test_asking_for_sa_config_on_1_2_is_a_config_error_naming_the_version_that_has_it():
    """tune.sa_enhancer: always on a 1.2.1 deployment: exit 2, the field named, the reason and the way out."""
    from conftest import TINY_CONFIG

    r = run_cli("check", str(TINY_CONFIG), "-o", "tune.sa_enhancer=always")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "tune.sa_enhancer" in r.stderr and "1.2.1's Eagle3DecodingConfig has no sa_config" in r.stderr
    assert "build.trtllm_version: 1.3.0rc27" in r.stderr
    ok = run_cli("check", str(TINY_CONFIG), "-o", "tune.sa_enhancer=always", "-o", "build.trtllm_version=1.3.0rc27")
    assert ok.returncode == 0, ok.stderr
