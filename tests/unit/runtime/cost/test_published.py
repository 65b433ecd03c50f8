"""`specpipe predict` and the published-run record (bench/published_runs.yaml): the errors it prints are the cost
model's against the published figures, a malformed record is a usage error naming the run and field, the engine
overheads refit to the shipped constants, and the record holds what docs/benchmarks.md says it holds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.hardware import GPUS
from runtime.cost import costmodel as cm
from runtime.cost import engine_fit, published

from conftest import REPO, run_cli

RECORD = REPO / "bench" / "published_runs.yaml"

L8B = {"kind": "target", "num_layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
       "vocab": 128256, "source": "test"}
D8B = {"kind": "eagle3", "num_layers": 1, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
       "vocab": 128256, "draft_vocab": 32000, "target_hidden": 4096, "source": "test"}


def small_record(tmp: Path, **changes) -> Path:
    runs = [
        {"id": "plain-h100", "engine": "vllm", "gpu": "h100_sxm", "target": "l8b", "batch": 1,
         "measured": {"base_tokens_per_s": 150.0}},
        {"id": "chain-h200", "engine": "sglang", "gpu": "h200", "target": "l8b", "batch": 1, "context": 2048,
         "drafter": {"shape": "d8b"}, "spec": {"steps": 3, "topk": 1, "num_draft_tokens": 4},
         "measured": {"al": 2.9, "base_tokens_per_s": 190.0, "spec_tokens_per_s": 400.0}},
    ]
    for i, ch in changes.items():
        runs[int(i[1:])] = {**runs[int(i[1:])], **ch}
    p = tmp / "runs.yaml"
    p.write_text(yaml.safe_dump({"shapes": {"l8b": L8B, "d8b": D8B}, "runs": runs}))
    return p


def expected(gpu: str, *, k: int | None, context: int, al: float | None = None):
    """The model by hand (tune's default efficiencies), not through runtime/cost/published.py."""
    m = cm.machine_from_gpu(GPUS[gpu], compute_efficiency=0.8, memory_efficiency=0.85, op_overhead_us=2.0)
    draft = cm.ModelShape("d", 1, 4096, 32, 8, 128, cm.llama_layer_gemms(4096, 32, 8, 128, 14336, qkv_in=8192),
                          head_gemms=(cm.Gemm("lm_head", 4096, 32000),),
                          input_gemms=(cm.Gemm("fc", 3 * 4096, 4096, split=False),))
    target = cm.llama("t", num_layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
    bf16 = cm.Precision("bf16", 2.0, 2.0)
    dep = cm.Deployment(target, draft, "eagle3", bf16, bf16, m, 1, context)
    plain = dep.target_time(1, 1)
    spec = dep.spec_time(1, k) if k else None
    return plain, spec


def test_predict_prints_the_models_error_against_each_published_figure(tmp_path):
    r = run_cli("predict", str(small_record(tmp_path)), "--overheads", "none", "--json")
    assert r.returncode == 0, r.stderr
    runs = {x["id"]: x for x in json.loads(r.stdout)["runs"]}
    plain, _ = expected("h100_sxm", k=None, context=published.DEFAULT_CONTEXT)
    p = runs["plain-h100"]
    assert p["predicted"]["plain_tokens_per_s"] == pytest.approx(1 / plain, rel=1e-9)
    assert p["error"]["plain_tokens_per_s"] == pytest.approx((1 / plain) / 150.0 - 1, rel=1e-9)
    assert p["error"]["speedup"] is None and p["predicted"]["spec_tokens_per_s"] is None
    plain, spec = expected("h200", k=3, context=2048)
    c = runs["chain-h200"]
    assert c["predicted"]["spec_tokens_per_s"] == pytest.approx(2.9 / spec, rel=1e-9)
    assert c["error"]["spec_tokens_per_s"] == pytest.approx(2.9 / spec / 400.0 - 1, rel=1e-9)
    assert c["published"]["speedup"] == pytest.approx(400.0 / 190.0)
    assert c["error"]["speedup"] == pytest.approx((2.9 * plain / spec) / (400.0 / 190.0) - 1, rel=1e-9)


def test_fitted_overheads_are_applied_per_engine(tmp_path):
    """`--overheads fitted` prices the SGLang run with SGLang's fitted constants and the vLLM run (no constants) as
    the model alone."""
    r = run_cli("predict", str(small_record(tmp_path)), "--json")
    assert r.returncode == 0, r.stderr
    runs = {x["id"]: x for x in json.loads(r.stdout)["runs"]}
    ov = engine_fit.FITTED["sglang"]
    plain, spec = expected("h200", k=3, context=2048)
    plain_s = ov.scale * plain + ov.step
    spec_s = ov.spec_scale * spec + ov.step + ov.verify + 3 * ov.draft_pass
    assert runs["chain-h200"]["predicted"]["speedup"] == pytest.approx(2.9 * plain_s / spec_s, rel=1e-9)
    plain, _ = expected("h100_sxm", k=None, context=published.DEFAULT_CONTEXT)
    assert runs["plain-h100"]["predicted"]["plain_tokens_per_s"] == pytest.approx(1 / plain, rel=1e-9)
    table = run_cli("predict", str(small_record(tmp_path)))
    assert table.returncode == 0 and "chain-h200" in table.stdout and "held-out:" in table.stdout


@pytest.mark.parametrize("change, words", [
    ({"r1": {"measured": {"al": "2.9", "base_tokens_per_s": 190.0}}}, ["chain-h200", "measured.al"]),
    ({"r0": {"gpu": "a800"}}, ["plain-h100", "'gpu'", "h200"]),
    ({"r0": {"engine": "llamacpp"}}, ["plain-h100", "'engine'"]),
    ({"r1": {"spec": {"steps": 3, "topk": 1, "num_draft_tokens": 6}}}, ["chain-h200", "spec.num_draft_tokens"]),
    ({"r1": {"drafter": {"shape": "nope"}}}, ["chain-h200", "drafter.shape"]),
    ({"r0": {"batch": 0}}, ["plain-h100", "'batch'"]),
    ({"r1": {"drafter": {"shape": "d8b", "algorithm": "dflash"}}}, ["chain-h200", "drafter.algorithm", "eagle3"]),
])
def test_a_malformed_record_exits_2_naming_the_run_and_field(tmp_path, change, words):
    r = run_cli("predict", str(small_record(tmp_path, **change)))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert all(w in r.stderr for w in words), r.stderr
    assert "Traceback" not in r.stderr


def test_a_dflash_run_is_priced_as_one_parallel_draft_pass(tmp_path):
    """A `kind: dflash` drafter (fc over `feature_layers` target layers, plain layers, lm_head over the full
    vocabulary) prices k drafts as one pass of 1 + k rows (costmodel.Deployment.draft_time), not k EAGLE passes."""
    shapes = {"l8b": L8B, "df": {"kind": "dflash", "num_layers": 5, "hidden": 4096, "heads": 32, "kv_heads": 8,
                                 "intermediate": 14336, "vocab": 128256, "target_hidden": 4096, "feature_layers": 5,
                                 "source": "test"}}
    run = {"id": "dflash-h100", "engine": "vllm", "gpu": "h100_sxm", "target": "l8b", "batch": 1,
           "drafter": {"shape": "df", "algorithm": "dflash"}, "spec": {"steps": 7, "topk": 1, "num_draft_tokens": 8},
           "measured": {"al": 4.0, "spec_tokens_per_s": 400.0}}
    path = tmp_path / "df.yaml"
    path.write_text(yaml.safe_dump({"shapes": shapes, "runs": [run]}))
    rec = published.load_record(path, GPUS)
    r = rec.runs[0]
    dep = published.deployment(r, rec.shapes, GPUS)
    assert r.algorithm == "dflash" and dep.algorithm == "dflash"
    m = cm.machine_from_gpu(GPUS["h100_sxm"], compute_efficiency=0.8, memory_efficiency=0.85, op_overhead_us=2.0)
    draft = cm.ModelShape("d", 5, 4096, 32, 8, 128, cm.llama_layer_gemms(4096, 32, 8, 128, 14336),
                          head_gemms=(cm.Gemm("lm_head", 4096, 128256),),
                          input_gemms=(cm.Gemm("fc", 5 * 4096, 4096, split=False),))
    one_pass = cm.step_time(cm.forward_ops(draft, batch=1, q_len=8, context=published.DEFAULT_CONTEXT,
                                           prec=cm.Precision("bf16", 2.0, 2.0), logits_rows=7), m)
    plain, spec = published.model_times(r, dep)
    assert spec == pytest.approx(dep.target_time(1, 8) + one_pass, rel=1e-12)
    shapes["df"]["kind"] = "eagle3"
    path.write_text(yaml.safe_dump({"shapes": shapes, "runs": [run]}))
    bad = run_cli("predict", str(path))
    assert bad.returncode == 2 and "drafter.algorithm" in bad.stderr


def test_a_missing_file_exits_2(tmp_path):
    r = run_cli("predict", str(tmp_path / "none.yaml"))
    assert r.returncode == 2 and "none.yaml" in r.stderr


# ---------------------------------------------------------------------------------------------- the record


@pytest.fixture(scope="module")
def record():
    return published.load_record(RECORD, GPUS)


def test_tree_priced_as_a_tree():
    """A tree of top-k 1 is the chain; wider trees cost more draft rows and more verified nodes."""
    m = cm.machine_from_gpu(GPUS["h200"], compute_efficiency=0.8, memory_efficiency=0.85, op_overhead_us=2.0)
    rec = published.load_record(RECORD, GPUS)
    dep = cm.Deployment(rec.shapes["llama-3.1-8b"], rec.shapes["eagle3-specforge-llama-8b"], "eagle3",
                        cm.Precision("bf16", 2.0, 2.0), cm.Precision("bf16", 2.0, 2.0), m, 1, 1024)
    assert dep.tree_time(1, 5, 1, 6) == pytest.approx(dep.spec_time(1, 5), rel=1e-12)
    assert dep.tree_time(8, 5, 3, 6) > dep.tree_time(8, 5, 1, 6)
    assert dep.tree_time(8, 5, 3, 64) > dep.tree_time(8, 5, 3, 6)


def test_the_fit_is_reproducible_and_gives_the_shipped_constants(record):
    first = engine_fit.fit(record, GPUS)
    again = engine_fit.fit(published.Record(record.path, record.shapes, record.runs[::-1]), GPUS)
    assert first == again
    assert set(first) == set(engine_fit.FITTED) == {"sglang"}     # the only engine with runs in the fit set
    for e, ov in first.items():
        for k, v in vars(ov).items():
            assert v == pytest.approx(getattr(engine_fit.FITTED[e], k), rel=1e-5, abs=1e-9), (e, k)


def test_the_split_is_by_group_and_deterministic(record):
    held = {engine_fit.group(r.id) for r in record.runs if engine_fit.held_out(r) and r.source == "specbundle"}
    fitted = {engine_fit.group(r.id) for r in record.runs if not engine_fit.held_out(r)}
    assert held and fitted and not held & fitted
    assert all(engine_fit.held_out(r) for r in record.runs if r.source != "specbundle")
    assert engine_fit.group("specbundle-l8b-gsm8k-b1-s3t1n4-specforge") == "specbundle-l8b-gsm8k"


def test_what_tune_reports_is_the_records_held_out_error(record):
    got = engine_fit.evaluate(record, GPUS, {})
    for q, s in engine_fit.RAW_HELD_OUT.items():
        assert (got[q].n, got[q].worst) == (s.n, s.worst)
        assert round(got[q].mean_abs, 4) == s.mean_abs and round(got[q].max_abs, 4) == s.max_abs
    trt = next(r for r in record.runs if r.engine == "trtllm")
    e = published.errors(trt, published.predict(trt, published.deployment(trt, record.shapes, GPUS)))
    assert round(e["speedup"], 3) == engine_fit.TRTLLM_HELD_OUT_SPEEDUP


def test_the_record_holds_what_the_issue_asks(record):
    """At least 20 runs from 3 engines and 2 GPU types, batch 1 and larger, each naming a source that says where
    it was read; no batch-1 run with speedup above its AL (those are kept out, with the reason)."""
    doc = yaml.safe_load(RECORD.read_text())
    assert len(record.runs) >= 20
    assert {r.engine for r in record.runs} == {"sglang", "vllm", "trtllm"}
    assert len({GPUS[r.gpu].name.split()[0] for r in record.runs}) >= 2
    assert {1} < {r.batch for r in record.runs}
    for r in record.runs:
        src = doc["sources"][r.source]
        assert src.get("url") or (src.get("file") and src.get("commit")), r.source
        s, al = r.published_speedup(), r.measured.get("al")
        assert not (r.batch == 1 and s and al and s > al), r.id
    assert all(e.get("reason") and e.get("source") for e in record.excluded)
    assert all(v.get("source") for v in doc["shapes"].values())


def test_goals_on_the_held_out_runs(record):
    """The issue's goals as data checks (docs/benchmarks.md reports every figure, met or not): on the held-out runs
    of the engines with fitted overheads (SGLang) the held-out mean |error| of speedup and plain tokens/s is within
    10 %, the uncorrected model's is not; the fastest chain depth is picked at least as often as without the fit.
    Over every engine the plain-rate goal is not met (vLLM's TP-8 DFlash runs have no constants: docs say so)."""
    fitted = engine_fit.evaluate(record, GPUS, engine_fit.FITTED, engines=set(engine_fit.FITTED))
    raw = engine_fit.evaluate(record, GPUS, {}, engines=set(engine_fit.FITTED))
    assert fitted["speedup"].mean_abs <= 0.10 < raw["speedup"].mean_abs
    assert fitted["plain_tokens_per_s"].mean_abs <= 0.10 < raw["plain_tokens_per_s"].mean_abs
    assert engine_fit.best_k_agreement(record, GPUS, engine_fit.FITTED)[0] >= engine_fit.best_k_agreement(record, GPUS, {})[0]
    assert engine_fit.evaluate(record, GPUS, engine_fit.FITTED)["plain_tokens_per_s"].mean_abs > 0.10


def test_the_record_holds_dflash_runs_on_an_h100(record):
    """DFlash runs with AL on an H100 (ModelOpt's doc, vLLM), each priced with its DFlash shape."""
    dflash = [r for r in record.runs if r.algorithm == "dflash"]
    assert len([r for r in dflash if r.measured.get("al")]) >= 16
    assert {r.gpu for r in dflash} == {"h100_sxm"} and {r.engine for r in dflash} == {"vllm"}
    assert all(published.deployment(r, record.shapes, GPUS).algorithm == "dflash" for r in dflash)
