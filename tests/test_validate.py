"""Stage `validate`: measurement of the deployed pair per domain, gates, runtime choice, TensorRT-LLM arguments.

The stage runs on a hand-built artifacts tree (tiny target, its ModelOpt FP8 export, a ModelOpt-exported EAGLE-3
draft, eval prompts) through its `run(ctx)`; the end-to-end test at the bottom drives the real `specpipe build`
with an impossible gate and checks that later stages are blocked.
"""
from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext
from stages import validate as V
from test_runtime import _batches, tiny_assets

# The reference schemas where the shared reference exists; elsewhere (CI) the project's extracted copies.
SHARED = Path(__file__).resolve().parents[2] / "shared" / "reference" / "schemas"
LOCAL = {"trtllm-1.2-llmapi.json": "trtllm-1.2.json", "trtllm-1.3-specdec.json": "trtllm-1.3.json",
         "triton-llmapi-model.json": "triton-llmapi-model.json"}


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """artifacts/{target,data,train_draft,quantize} as the upstream stages write them (contracts in
    docs/architecture.md), with a real ModelOpt FP8 target export."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import LlamaForCausalLM

    t = tiny_assets()
    root = tmp_path_factory.mktemp("validate") / "artifacts"
    shutil.copytree(t["target_dir"], root / "target" / "model")
    tok = t["tok"]
    (root / "target" / "target.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id, "num_layers": 4}))
    (root / "data" / "eval").mkdir(parents=True)
    data = t["data"]
    for name, start in (("code", 2000), ("prose", 40000)):
        with open(root / "data" / "eval" / f"{name}.jsonl", "w") as f:
            for i in range(6):
                ids = data[start + 97 * i: start + 97 * i + 10 + i].tolist()
                f.write(json.dumps({"id": f"{name}-{i}", "prompt": tok.decode(ids), "prompt_ids": ids, "reference": None}) + "\n")
    shutil.copytree(t["eagle_dir"], root / "train_draft" / "draft")
    (root / "train_draft" / "draft.json").write_text(json.dumps({"algorithm": "eagle3", "aux_layer_ids": [0, 1]}))
    m = LlamaForCausalLM.from_pretrained(t["target_dir"], dtype=torch.float32)
    calib = list(_batches(data, 4, 4, 64, 5))
    m = mtq.quantize(m, mtq.FP8_DEFAULT_CFG, lambda mm: [mm(x) for x in calib])
    export_hf_checkpoint(m, export_dir=root / "quantize" / "target_fp8")
    (root / "quantize" / "quantize.json").write_text(json.dumps(
        {"format": "fp8", "kv_cache": "none", "target_dir": "quantize/target_fp8", "draft_dir": "train_draft/draft"}))
    return root


def _ctx(arts: Path, tmp: Path, **section) -> StageContext:
    inputs = {s: Artifact(s, arts / s, {"fingerprint": s, "metrics": {}}) for s in V.CONSUMES}
    out, scratch = tmp / "out", tmp / "scratch"
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    sec = V.Config(**{"max_new_tokens": 20, "num_prompts": 6, "batch_size": 3, "lossless_prompts": 3, **section})
    return StageContext(name="validate", config=None, section=sec, out_dir=out, scratch_dir=scratch, inputs=inputs,
                        workdir=arts.parent, fingerprint="x", log=logging.getLogger("specpipe.test.validate"))


@pytest.fixture(scope="module")
def measured(arts, tmp_path_factory):
    ctx = _ctx(arts, tmp_path_factory.mktemp("ok"), gates={"min_acceptance_length": 1.1, "min_retention": 0.8})
    metrics = V.run(ctx)
    return ctx, metrics, json.loads((ctx.out_dir / "acceptance.json").read_text())


def test_acceptance_json_per_domain(measured):
    ctx, metrics, a = measured
    assert a["runtime"] == "reference" and a["runtime_reason"].startswith("auto:")
    assert a["pairs"]["fp8"] == {"target_dir": "quantize/target_fp8", "draft_dir": "train_draft/draft"}
    assert a["pairs"]["bf16"] == {"target_dir": "target/model", "draft_dir": "train_draft/draft"}
    assert set(a["domains"]) == {"code", "prose"} and a["max_draft_len"] == 4
    for d in a["domains"].values():
        for label in ("fp8", "bf16"):
            s = d[label]
            assert len(s["per_position"]) == 4 and s["steps"] > 0 and s["drafted"] == 4 * s["steps"]
            assert s["acceptance_length"] == pytest.approx(1 + s["accepted"] / s["steps"], rel=1e-5)
            assert s["draft_acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], rel=1e-5)
            # AL is the sum over positions of the products of conditional acceptances (same steps, k = 4)
            prod, al = 1.0, 1.0
            for p in s["per_position"]:
                prod *= p or 0.0
                al += prod
            assert al == pytest.approx(s["acceptance_length"], rel=1e-5)
        assert d["retention"] == pytest.approx(d["fp8"]["acceptance_length"] / d["bf16"]["acceptance_length"], rel=1e-3)
        assert 0.8 < d["retention"] < 1.25           # FP8 of this target barely moves acceptance
        assert d["fp8_other_norm"]["first_layer_norm"] == "serving" and d["fp8_other_norm"]["acceptance_length"] >= 1.0
    assert a["lossless"]["passed"] is True and a["lossless"]["checked_prompts"] == 6
    assert a["gates"]["passed"] and {r["metric"] for r in a["gates"]["rows"]} == {"acceptance_length", "retention", "lossless"}
    sm = a["step_ms"]
    assert all(sm[k] > 0 for k in ("target_ar", "target_verify", "draft_step", "draft_pass"))
    assert a["tokens_per_s"]["speculative"] > 0 and a["tokens_per_s"]["autoregressive"] > 0
    assert metrics["gates_passed"] and metrics["acceptance_length"]["code"] == a["domains"]["code"]["fp8"]["acceptance_length"]
    json.dumps(metrics)


def test_report_renders(measured, tmp_path):
    ctx, _, _ = measured
    html = V.report(Artifact("validate", ctx.out_dir, {"metrics": {}}))
    assert "retention" in html and "<img" in html and "lossless check: True" in html


def test_failed_gate_raises_with_table_and_keeps_measurements(arts, tmp_path):
    ctx = _ctx(arts, tmp_path, num_prompts=2, lossless_prompts=1, measure_bf16=False,
               gates={"min_acceptance_length": {"code": 4.9}, "min_overall_acceptance_length": 1.0})
    with pytest.raises(StageError) as e:
        V.run(ctx)
    msg = str(e.value)
    assert "acceptance gate failed" in msg and "FAIL" in msg and "code" in msg and "4.900" in msg
    assert not (ctx.out_dir / "acceptance.json").exists()
    assert e.value.metrics["gates"]["passed"] is False and "FAIL" in V.report_failed(e.value.metrics)
    kept = json.loads((ctx.scratch_dir / "acceptance.json").read_text())
    row = next(r for r in kept["gates"]["rows"] if r["domain"] == "code")
    assert row["required"] == 4.9 and row["passed"] is False and row["measured"] == kept["domains"]["code"]["fp8"]["acceptance_length"]


def test_stale_draft_config_is_rejected(arts, tmp_path):
    a2 = tmp_path / "artifacts"
    shutil.copytree(arts, a2)
    (a2 / "train_draft" / "draft.json").write_text(json.dumps({"algorithm": "eagle3", "aux_layer_ids": [1, 2]}))
    with pytest.raises(StageError, match="trained on target layers"):
        V.run(_ctx(a2, tmp_path, num_prompts=1, lossless_prompts=0))


def test_runtime_choice():
    assert V._choose_runtime("reference") == ("reference", "configured")
    rt, why = V._choose_runtime("auto")
    assert rt == "reference" and why.startswith("auto:")
    with pytest.raises(StageError, match="tensorrt_llm requested but not usable here"):
        V._choose_runtime("tensorrt_llm")


def test_config_checks():
    class Cfg:
        pass

    cfg = Cfg()
    cfg.data = Cfg()
    cfg.data.eval_domains = {"code": None, "prose": None}
    cfg.validate = V.Config(max_draft_len=3, measure_bf16=False,
                            gates={"min_acceptance_length": {"code": 2.0, "math": 2.0}, "min_retention": 0.9})
    probs = dict(V.check(cfg))
    assert "unknown domain" in probs["validate.gates.min_acceptance_length.math"]
    assert "measure_bf16" in probs["validate.gates.min_retention"]
    cfg.validate = V.Config(max_draft_len=3, gates={"min_acceptance_length": 4.5})
    assert "no draft can reach it" in dict(V.check(cfg))["validate.gates.min_acceptance_length"]
    with pytest.raises(ValueError):
        V.Config(runtime="vllm")


def _schema_file(name, shared: bool = True):
    p = SHARED / name
    if not (shared and p.exists()):
        p = Path(__file__).resolve().parent.parent / "runtime" / "schemas" / LOCAL[name]
    return json.loads(p.read_text())


@pytest.mark.parametrize("shared", [True, False])
def test_trtllm_arguments_match_schema(shared):
    """The LLM(...) / speculative_config / SamplingParams arguments the tensorrt_llm runtime would pass, checked
    against the extracted TensorRT-LLM schemas (1.2 LLM API; DFlash against 1.3) without running anything:
    the shared reference and the project's copies in runtime/schemas."""
    _schema = functools.partial(_schema_file, shared=shared)
    s12 = _schema("trtllm-1.2-llmapi.json")
    llm_fields = set(s12["classes"]["TorchLlmArgs"]["fields"])
    kw = V.trtllm_llm_kwargs("/m/target_fp8", "/m/draft", algorithm="eagle3", max_draft_len=4, num_target_layers=4,
                             aux_layer_ids=[0, 1], batch_size=8, max_seq_len=512)
    assert set(kw) <= llm_fields, set(kw) - llm_fields
    spec = dict(kw["speculative_config"])
    assert s12["decoding_types"][spec.pop("decoding_type")] == "Eagle3DecodingConfig"
    assert set(spec) <= set(s12["classes"]["Eagle3DecodingConfig"]["all_field_names"])
    assert spec["max_draft_len"] > 0 and spec["speculative_model"]           # rules: both required for Eagle3
    assert kw["max_num_tokens"] >= kw["max_batch_size"] * (1 + spec["max_draft_len"])
    assert "eagle3_layers_to_capture" not in spec                            # {0,1} is the default for 4 layers
    kw2 = V.trtllm_llm_kwargs("/t", "/d", algorithm="eagle3", max_draft_len=3, num_target_layers=32,
                              aux_layer_ids=[2, 15, 28], batch_size=1, max_seq_len=64)
    assert kw2["speculative_config"]["eagle3_layers_to_capture"] == [2, 15, 28]   # differs from {1, 15, 28}
    s13 = _schema("trtllm-1.3-specdec.json")
    kd = V.trtllm_llm_kwargs("/t", "/d", algorithm="dflash", max_draft_len=7, num_target_layers=4, aux_layer_ids=None,
                             batch_size=2, max_seq_len=64)["speculative_config"]
    assert set(kd) <= set(s13["classes"]["DFlashDecodingConfig"]["all_field_names"])
    assert "DFlash" not in s12["decoding_types"]                              # hence 1.3+ for DFlash
    names = {i["name"] for i in _schema("triton-llmapi-model.json")["config_pbtxt"]["inputs"]}
    for t in (0.0, 0.7):
        sp = V.trtllm_sampling_kwargs(max_new_tokens=32, temperature=t, seed=0)
        assert sp["return_perf_metrics"] is True
        assert {f"sampling_param_{k}" for k in sp} <= names, {f"sampling_param_{k}" for k in sp} - names


# ---------------------------------------------------------------------------------------------- end to end


def test_impossible_gate_blocks_later_stages(tiny_run, tmp_path):
    """`specpipe build` on the tiny default: validate commits acceptance.json; with an impossible gate the same
    build fails at validate (exit 1) with the table, and nothing after it runs."""
    from conftest import TINY_CONFIG, artifact_dir, run_cli, status_json, tiny_overrides

    from pipeline import registry

    if "validate" not in registry.names():
        pytest.fail("stages.validate is not registered")
    wd, r = tiny_run
    a = json.loads((artifact_dir(wd, "validate") / "acceptance.json").read_text())
    assert a["lossless"]["passed"] and a["domains"]
    wd2 = tmp_path / "run"
    shutil.copytree(wd, wd2)
    # the 40-step toy target repeats itself, so its draft can be nearly perfect (AL 8.5 of 9 measured at k=8):
    # "impossible" = every draft token accepted everywhere AND the FP8 pair 50 % better than the BF16 pair
    r2 = run_cli("build", str(TINY_CONFIG), "--workdir", str(wd2), *tiny_overrides(), "-o", "validate.max_draft_len=8",
                 "-o", "validate.gates.min_overall_acceptance_length=9", "-o", "validate.gates.min_retention=1.5")
    assert r2.returncode == 1, r2.stderr
    assert "acceptance gate failed" in r2.stderr and "FAIL" in r2.stderr
    st = {s["name"]: s for s in status_json(wd2)["stages"]}
    assert st["validate"]["last_build"] == "failed" and "1.500" in st["validate"]["error"]
    fm = st["validate"]["failed_metrics"]
    assert fm["gates"]["passed"] is False and any(r["required"] == 1.5 and not r["passed"] for r in fm["gates"]["rows"])
    kept = json.loads((wd2 / "artifacts" / "validate" / "acceptance.json").read_text())   # the earlier, passing run
    assert kept == a and kept["max_draft_len"] != 8                                          # nothing committed now
    after = registry.names()[registry.names().index("validate") + 1:]
    assert all(st[n]["last_build"] == "blocked" for n in after)


def test_lossless_gate_tolerates_numerical_ties_only():
    base = {"domains": {}, "overall": {"fp8": {"acceptance_length": 2.0}}}
    g = V.Gates(require_lossless=True)
    tie = {**base, "lossless": {"passed": True, "identical": False, "numerical_ties": 1, "mismatches": [{"margin": 1e-5}]}}
    row = V.evaluate_gates(tie, g)["rows"][-1]
    assert row["passed"] and row["measured"] == "1 ties"
    real = {**base, "lossless": {"passed": False, "identical": False, "numerical_ties": 0, "mismatches": [{"margin": 2.0}]}}
    res = V.evaluate_gates(real, g)
    assert not res["passed"] and res["rows"][-1]["measured"] == "1 differ"
