"""Stage `tune`: the draft length per batch size from the cost model and measured acceptance, its TensorRT-LLM
settings in both schedule formats, and its config errors.

The stage runs for real on synthetic upstream artifacts (target.json, draft.json + draft config.json,
quantize.json, acceptance.json written exactly as the contracts in docs/architecture.md say), so each case
controls the shapes and the acceptance it needs. The deployment it tunes for (TensorRT-LLM version and
EAGLE-3 mode) comes from the build section, as in a real config.
"""
from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

from pipeline.config import HardwareConfig
from pipeline.device import ResolvedDevice
from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext
from runtime.algorithms.schedule import DraftSchedule
from runtime.trtllm import compat, draft_schedule
from runtime.trtllm import schema as trtllm_schema
from stages import build, train_draft, tune

from conftest import run_cli
from support import REPO, real_config
from support.synthetic import LLAMA_8B, eagle3

LLAMA_70B = dict(LLAMA_8B, num_layers=80, hidden_size=8192, num_attention_heads=64, intermediate_size=28672)
TINY = dict(LLAMA_8B, num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, max_position_embeddings=2048)


def acceptance(curves: dict[str, list[float]]) -> dict:
    def stats(pp):
        e, run = 1.0, 1.0
        for a in pp:
            run *= a
            e += run
        return {"acceptance_length": e, "per_position": pp, "draft_acceptance_rate": (e - 1) / len(pp)}

    K = max(len(c) for c in curves.values())
    return {"runtime": "reference", "max_draft_len": K,
            "domains": {d: {"fp8": stats(c), "bf16": stats(c)} for d, c in curves.items()},
            "overall": {"fp8": stats(next(iter(curves.values())))}, "gates": {"passed": True}}


def run_tune(tmp: Path, *, target=LLAMA_8B, curves=None, hardware: HardwareConfig | None = None, quant=None, acc=None,
             build_version=None, mode="one_model", **section) -> dict:
    """Write the upstream artifacts (a draft of 32000 tokens), run the stage on `hardware` (default: one H200),
    return tuning.json (plus `_metrics`)."""
    arts = tmp / "artifacts"
    draft, dcfg = eagle3(target, 32000)
    files = {
        "target/target.json": target,
        "train_draft/draft.json": draft,
        "train_draft/draft/config.json": dcfg,
        "quantize/quantize.json": quant or {"format": "fp8", "kv_cache": "fp8", "target_dir": "quantize/target_fp8",
                                            "draft_dir": "train_draft/draft", "draft_format": "bf16"},
        "validate/acceptance.json": acc or acceptance(curves or {"code": [0.8] * 5}),
    }
    for rel, doc in files.items():
        (arts / rel).parent.mkdir(parents=True, exist_ok=True)
        (arts / rel).write_text(json.dumps(doc))
    inputs = {n: Artifact(n, arts / n, {"fingerprint": n, "metrics": {}}) for n in tune.CONSUMES}
    sec = tune.Config(**section)
    cfg = real_config(hardware=hardware or HardwareConfig(), tune=sec,
                      build=build.Config(trtllm_version=build_version or compat.DEFAULT_TRTLLM_VERSION, eagle3_mode=mode))
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    ctx = StageContext(name="tune", config=cfg, section=sec, out_dir=out, scratch_dir=tmp / "scratch", inputs=inputs,
                       workdir=tmp, fingerprint="x", log=logging.getLogger("specpipe.test.tune"),
                       device=ResolvedDevice("cpu", "cpu"))
    metrics = tune.run(ctx)
    doc = json.loads((out / "tuning.json").read_text())
    doc["_metrics"] = metrics
    json.dumps(metrics)   # metrics land in status --json
    return doc


def ks_of(doc: dict) -> list[int]:
    """The draft length TensorRT-LLM will use at each batch size: the tuned schedule written in the targeted
    version's settings (as build writes them) and read back with that version's runtime rules."""
    d, mbs = doc["deployment"], doc["max_batch_size"]
    sched = DraftSchedule.from_json(doc["draft_schedule"])
    if not sched.speculates(mbs):
        return [0] * mbs
    rel = compat.release(d["trtllm_version"])
    return draft_schedule.decode(draft_schedule.encode(sched, rel, d["mode"], mbs), rel, d["mode"], mbs).ks(mbs)


TWO_MODEL = dict(build_version="1.2.1", mode="two_model")     # per-batch draft length, 0 allowed
ONE_ENGINE_13 = dict(build_version="1.3.0rc27")               # per-batch draft length, never 0 (PR #16888)


def by_batch(doc: dict) -> dict[int, dict]:
    return {r["batch"]: r for r in doc["predicted"]}


# ---------------------------------------------------------------------------------------------- regimes


def test_memory_bound_keeps_the_longest_useful_k(tmp_path):
    # 8B FP8 on an H200 at batch 1: 7 verification rows are far below the ~200-row ridge, so a draft token pays
    # as long as what it adds beats one more draft pass (~9% of a target step here): k = all 6 positions.
    doc = run_tune(tmp_path / "a", curves={"code": [0.9] * 6}, batch_sizes=[1, 2, 4])
    assert [by_batch(doc)[b]["k"] for b in (1, 2, 4)] == [6, 6, 6]
    assert doc["max_draft_len"] == 6 and doc["speculation"]
    assert by_batch(doc)[1]["rows_over_ridge"] < 0.1
    # ... but not a token past the last one that is ever accepted: the longest *useful* k is 3.
    doc = run_tune(tmp_path / "b", curves={"code": [0.9, 0.85, 0.8, 0.0, 0.0, 0.0]}, batch_sizes=[1, 2, 4])
    assert by_batch(doc)[1]["k"] == 3 and doc["max_draft_len"] == 3


def test_past_the_ridge_k_drops_and_speculation_switches_off(tmp_path):
    # Short contexts keep attention small, so the GEMMs decide: the regime the ridge point describes.
    # Two-model EAGLE-3 on 1.2 runs a per-batch schedule that may reach 0 (compat.SOURCES per_batch_draft_len_1_2).
    doc = run_tune(tmp_path, curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=128, max_batch_size=1024,
                   batch_sizes=[1, 8, 32, 64, 128, 256, 512, 1024], **TWO_MODEL)
    rows = by_batch(doc)
    assert rows[1]["k"] == doc["max_draft_len"] >= 3
    ridge = doc["hardware"]["ridge_rows"]
    assert 150 < ridge < 260          # H200 FP8 at the default efficiencies (anchors: ~206 at datasheet rates)
    past = [b for b in rows if b * 2 > ridge]
    assert past and all(rows[b]["k"] < rows[1]["k"] for b in past)
    ks = [rows[b]["k"] for b in sorted(rows)]
    assert ks == sorted(ks, reverse=True)
    # At 512 sequences the target is compute-bound even without drafts: speculation costs more than it returns.
    assert rows[512]["k"] == 0 and rows[512]["speedup"] == 1.0
    assert all(s < 1.0 for s in rows[512]["speedups_by_k"][1:])
    deployed = ks_of(doc)
    off = deployed.index(0)
    assert 0 < off < 511 and set(deployed[off:]) == {0} and doc["deployment"]["name"] == "per_batch"
    assert [rows[b]["deployed_draft_len"] for b in sorted(rows) if b <= 1024] == [deployed[b - 1] for b in sorted(rows)]
    # Where the context is long, reading the KV cache dominates and verification shares it across the 1+k rows:
    # the same batch still gains from a short draft.
    long = run_tune(tmp_path / "long", curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=2048,
                    max_batch_size=512, batch_sizes=[512], **TWO_MODEL)
    assert long["predicted"][0]["k"] >= 1 and long["predicted"][0]["speedup"] > 1


def test_acceptance_zero_turns_speculation_off(tmp_path):
    for kw in ({}, TWO_MODEL, ONE_ENGINE_13):
        doc = run_tune(tmp_path / str(kw.get("build_version")) / kw.get("mode", "-"), curves={"code": [0.0] * 4,
                                                                                              "prose": [0.0] * 4},
                       batch_sizes=[1, 4, 16], **kw)
        assert not doc["speculation"] and doc["max_draft_len"] == 0
        assert all(r["k"] == 0 and r["speedup"] == 1.0 for r in doc["predicted"])
        assert doc["draft_schedule"] == {"runs": [[1, doc["max_batch_size"], 0]]}
        assert doc["_metrics"]["speculation"] is False


def test_1_2_one_model_tunes_one_draft_length_for_every_batch_size(tmp_path):
    """Defect 4: TensorRT-LLM 1.2 one-model has no drafter, so draft_len_schedule and max_concurrency are never
    applied (py_executor.py `_prepare_and_schedule_batch` under `if self.drafter is not None`; speculative/utils.py
    get_spec_drafter: compat.SOURCES per_batch_draft_len_1_2). tune picks the one k with the best geometric-mean
    speedup over the table's batch sizes and tuning.json says it is constant."""
    kw = dict(curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=128, max_batch_size=1024,
              batch_sizes=[1, 8, 32, 64, 128, 256, 512, 1024])
    one = run_tune(tmp_path / "one", **kw)
    two = run_tune(tmp_path / "two", **kw, **TWO_MODEL)
    d = one["deployment"]
    assert d == {**d, "trtllm_version": "1.2.1", "mode": "one_model", "name": "constant", "per_batch_draft_len": False}
    assert "one draft length at every batch size" in d["note"]
    runs = one["draft_schedule"]["runs"]
    assert len(runs) == 1 and runs[0][2] >= 1 and ks_of(one) == [runs[0][2]] * 1024
    # the ideal per-batch choice is the same table; the constant k is one of its values, and it is the best
    # constant by the geometric mean over the table
    assert [r["k"] for r in one["predicted"]] == [r["k"] for r in two["predicted"]]
    k = runs[0][2]
    gm = lambda j: sum(__import__("math").log(r["speedups_by_k"][j]) for r in one["predicted"])  # noqa: E731
    assert all(gm(k) >= gm(j) - 1e-9 for j in range(1, one["acceptance"]["draft_len"] + 1))
    assert all(r["deployed_draft_len"] == k for r in one["predicted"])
    assert len(two["draft_schedule"]["runs"]) > 1                       # two-model: per batch, as tuned


def test_1_3_one_engine_schedule_never_reaches_zero(tmp_path):
    """Defect 5: in 1.3 one-engine mode a schedule resolving to 0 (or max_concurrency, translated into one)
    corrupts drafter state and acceptance collapses after speculation resumes (TensorRT-LLM PR #16888, open:
    compat.SOURCES zero_draft_len_one_engine). Where speculation stops paying, tune keeps the best k >= 1."""
    kw = dict(curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=128, max_batch_size=1024,
              batch_sizes=[1, 8, 32, 64, 128, 256, 512, 1024])
    doc = run_tune(tmp_path, **kw, **ONE_ENGINE_13)
    rows = by_batch(doc)
    assert rows[512]["k"] == 0                                    # ideal: off ...
    assert rows[512]["deployed_draft_len"] == 1                           # ... deployed: 1, the best k >= 1 there
    assert rows[512]["deployed_speedup"] == rows[512]["speedups_by_k"][1] < 1
    ks = ks_of(doc)
    assert min(ks) == 1 and ks == sorted(ks, reverse=True) and ks[0] == doc["max_draft_len"]
    assert doc["deployment"]["name"] == "per_batch_min1" and "16888" in doc["deployment"]["note"]
    sc = draft_schedule.encode(DraftSchedule.from_json(doc["draft_schedule"]), compat.release("1.3.0rc27"),
                               "one_model", doc["max_batch_size"])
    assert "max_concurrency" not in sc and max(sc["draft_len_schedule"]) == doc["max_batch_size"]


@pytest.mark.parametrize("version", ["1.2.1", "1.3.0rc27"])
@pytest.mark.parametrize("gpu,target,tp", [("h200", LLAMA_8B, 1), ("l40s", LLAMA_8B, 1), ("h100_sxm", LLAMA_70B, 2),
                                           ("b200", TINY, 1)])
def test_max_num_tokens_always_covers_the_draft_tokens(tmp_path, version, gpu, target, tp):
    doc = run_tune(tmp_path, target=target, hardware=HardwareConfig(gpu=gpu, tensor_parallel_size=tp),
                   curves={"code": [0.9, 0.8, 0.7, 0.6]},
                   build_version=version, min_num_tokens=256, batch_sizes=[1, 4, 16, 64, 256])
    assert doc["max_num_tokens"] >= doc["max_batch_size"] * (1 + doc["max_draft_len"])
    assert doc["deployment"]["trtllm_version"] == version
    assert max(doc["cuda_graph_batch_sizes"]) == doc["max_batch_size"]
    assert all(1 <= b <= doc["max_batch_size"] for b in doc["cuda_graph_batch_sizes"])


# ---------------------------------------------------------------------------------------------- formats


def test_one_schedule_type_written_in_each_versions_settings(tmp_path):
    """tuning.json holds the schedule once (`draft_schedule`, version-free runs); build writes it in the targeted
    version's settings, and those read back with that version's rules are the tuned draft lengths."""
    kw = dict(curves={"code": [0.75, 0.65, 0.55, 0.5, 0.45]}, context_length=128, max_batch_size=512,
              batch_sizes=[1, 16, 64, 256, 512])
    d12 = run_tune(tmp_path / "v12", **kw, **TWO_MODEL)
    d13 = run_tune(tmp_path / "v13", **kw, **ONE_ENGINE_13)
    for doc in (d12, d13):
        assert not {"draft_len_schedule", "max_concurrency", "llm_api", "draft_len_by_batch", "schedule_semantics"} & set(doc)
        sched = DraftSchedule.from_json(doc["draft_schedule"])
        assert ks_of(doc) == sched.ks(doc["max_batch_size"])
        rel = compat.release(doc["deployment"]["trtllm_version"])
        sc = draft_schedule.encode(sched, rel, doc["deployment"]["mode"], doc["max_batch_size"])
        schema = trtllm_schema.load_schema(rel.schema)
        assert set(sc) <= (trtllm_schema._class_fields(schema, "Eagle3DecodingConfig")
                           | trtllm_schema._class_fields(schema, "DecodingBaseConfig"))
        if "draft_len_schedule" in sc:
            assert draft_schedule.schedule_problems(sc["draft_len_schedule"], sc["max_draft_len"], rel) == []
    k12, k13 = ks_of(d12), ks_of(d13)
    assert len(set(k12)) >= 3 and k12[-1] == 0                    # several lengths, then off (1.2 two-model)
    assert [a or 1 for a in k12] == k13                           # 1.3: the same, floored at 1 where 1.2 is off
    sc12 = draft_schedule.encode(DraftSchedule.from_json(d12["draft_schedule"]), compat.release("1.2.1"), "two_model", 512)
    assert min(sc12["draft_len_schedule"]) == 1 and sc12["draft_len_schedule"][max(sc12["draft_len_schedule"])] == 0


def test_constant_k_with_cutoff_per_version(tmp_path):
    # One useful draft position: 1.2 two-model says "off above N" with max_concurrency alone; 1.3 one-engine
    # cannot switch off (PR #16888) and keeps k = 1 everywhere.
    kw = dict(curves={"code": [0.6, 0.0]}, context_length=256, max_batch_size=1024, batch_sizes=[1, 64, 1024])
    d12 = run_tune(tmp_path / "12", **kw, **TWO_MODEL)
    sc = draft_schedule.encode(DraftSchedule.from_json(d12["draft_schedule"]), compat.release("1.2.1"), "two_model", 1024)
    assert sc["max_draft_len"] == 1 and "draft_len_schedule" not in sc and 1 < sc["max_concurrency"] < 1024
    assert ks_of(d12) == [1] * sc["max_concurrency"] + [0] * (1024 - sc["max_concurrency"])
    d13 = run_tune(tmp_path / "13", **kw, **ONE_ENGINE_13)
    assert ks_of(d13) == [1] * 1024


# ---------------------------------------------------------------------------------------------- production shape


def test_llama70b_on_h200_gets_a_plausible_schedule(tmp_path):
    curves = {"coding": [0.85, 0.8, 0.76, 0.72, 0.68, 0.64], "math": [0.82, 0.77, 0.72, 0.68, 0.64, 0.6],
              "writing": [0.72, 0.62, 0.55, 0.5, 0.45, 0.4], "roleplay": [0.68, 0.58, 0.5, 0.44, 0.4, 0.35]}
    doc = run_tune(tmp_path, target=LLAMA_70B, curves=curves, context_length=4096,
                   domain_weights={"coding": 0.4, "math": 0.2, "writing": 0.2, "roleplay": 0.2},
                   batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256], **ONE_ENGINE_13)
    rows = by_batch(doc)
    # 70B FP8 (~70 GB) + FP8 KV at 4096 tokens (160 KiB/token, anchors) on 141 GB: room for ~90 sequences.
    assert 60 <= doc["kv_capacity_sequences"] <= 120
    assert doc["max_batch_size"] == doc["kv_capacity_sequences"]
    assert 15 <= rows[1]["target_step_ms"] <= 25      # anchors: >= ~15 ms per step at batch 1
    assert 3 <= doc["max_draft_len"] <= 6
    assert 2.0 <= rows[1]["speedup"] <= 4.0            # public EAGLE-3 70B: AL ~3-3.6, 2-3x
    assert rows[1]["domain_speedups"]["coding"] > rows[1]["domain_speedups"]["roleplay"]
    ks = ks_of(doc)
    assert ks[0] == doc["max_draft_len"] and ks == sorted(ks, reverse=True)
    assert ks[-1] < ks[0]                               # past the ridge at the KV-limited batch
    assert doc["max_num_tokens"] >= doc["max_batch_size"] * (1 + doc["max_draft_len"])
    assert rows[256]["within_max_batch_size"] is False
    assert doc["hardware"]["datasheet_source"].startswith("NVIDIA H200")


def test_tensor_parallel_and_memory_limits(tmp_path):
    # 70B FP8 does not fit one L40S (48 GB): a plain error that names the fix.
    with pytest.raises(StageError, match="tensor_parallel_size"):
        run_tune(tmp_path / "a", target=LLAMA_70B, hardware=HardwareConfig(gpu="l40s"))
    doc = run_tune(tmp_path / "b", target=LLAMA_70B, hardware=HardwareConfig(gpu="l40s", tensor_parallel_size=4),
                   context_length=2048, batch_sizes=[1, 8])
    assert doc["hardware"]["tensor_parallel_size"] == 4 and doc["kv_capacity_sequences"] >= 1
    with pytest.raises(StageError, match="no FP8 tensor cores"):
        run_tune(tmp_path / "c", hardware=HardwareConfig(gpu="a100_80gb"))
    with pytest.raises(StageError, match="does not divide"):
        run_tune(tmp_path / "d", hardware=HardwareConfig(tensor_parallel_size=3))


# ---------------------------------------------------------------------------------------------- inputs


def test_domain_weights_mix_and_unknown_domains(tmp_path):
    curves = {"code": [0.9, 0.85, 0.8, 0.75], "prose": [0.4, 0.3, 0.2, 0.1]}
    code = run_tune(tmp_path / "a", curves=curves, domain_weights={"code": 1.0, "prose": 0.0}, batch_sizes=[1])
    prose = run_tune(tmp_path / "b", curves=curves, domain_weights={"code": 0.0, "prose": 1.0}, batch_sizes=[1])
    even = run_tune(tmp_path / "c", curves=curves, batch_sizes=[1])
    s = [d["predicted"][0]["speedup"] for d in (code, prose, even)]
    assert s[0] > s[2] > s[1]
    assert code["predicted"][0]["k"] >= prose["predicted"][0]["k"]
    with pytest.raises(StageError, match="measured domains: code, prose"):
        run_tune(tmp_path / "d", curves=curves, domain_weights={"chat": 1.0})


def test_acceptance_without_per_position_uses_the_flat_rate(tmp_path):
    # validate's TensorRT-LLM runtime reports acceptance lengths only.
    acc = {"runtime": "tensorrt_llm", "max_draft_len": 3,
           "domains": {"code": {"fp8": {"acceptance_length": 2.71, "per_position": None}}},
           "overall": {"fp8": {"acceptance_length": 2.71, "per_position": None}}, "gates": {"passed": True}}
    doc = run_tune(tmp_path, acc=acc, batch_sizes=[1])
    a = doc["acceptance"]["per_position"]["code"]
    assert len(a) == 3 and all(x == pytest.approx(a[0]) for x in a)
    assert 1 + a[0] + a[0] ** 2 + a[0] ** 3 == pytest.approx(2.71, abs=1e-6)
    bad = {**acc, "runtime": "x", "max_draft_len": 2, "domains": {"code": {"fp8": {"per_position": [0.5, 1.5]}}}}
    with pytest.raises(StageError, match=r"\[0, 1\]"):
        run_tune(tmp_path / "bad", acc=bad)


def test_a_measured_profile_replaces_the_datasheet(tmp_path):
    prof = {"format": "specpipe.hardware-profile/1", "device": "cuda:NVIDIA H200",
            "machine": {"peak_tflops": {"fp8": 1200.0}, "bandwidth_tb_s": 4.0, "op_overhead_us": 3.0}}
    p = tmp_path / "h200.json"
    p.write_text(json.dumps(prof))
    doc = run_tune(tmp_path / "run", hardware=HardwareConfig(profile=p), batch_sizes=[1, 64])
    assert doc["hardware"]["profile"] == str(p) and "NVIDIA H200" in doc["hardware"]["machine"]
    assert doc["hardware"]["peak_tflops"] == {"fp8": pytest.approx(1200.0)}
    assert doc["hardware"]["ridge_rows"] == pytest.approx(1200 / 4.0 / 2)


def test_report_has_the_plot_and_the_schedule(tmp_path):
    run_tune(tmp_path, curves={"code": [0.75, 0.65, 0.55]}, context_length=512, max_batch_size=512,
             batch_sizes=[1, 32, 128, 512], **TWO_MODEL)
    html = tune.report(Artifact("tune", tmp_path / "out", {"fingerprint": "x", "metrics": {}}))
    assert "<img" in html and "draft length by batch" in html and "speedup code" in html
    assert "draft_len_schedule" in html and "two-model" in html


def test_the_prediction_comes_with_its_published_error_band(tmp_path):
    """tuning.json and the report carry how far the model, priced as tune prices it, was from the published GPU runs
    held out of the overhead fit (runtime/cost/engine_fit.py RAW_HELD_OUT, recomputed from the record by
    tests/unit/runtime/cost/test_published.py)."""
    from runtime.cost import engine_fit

    doc = run_tune(tmp_path, curves={"code": [0.75, 0.65, 0.55]}, batch_sizes=[1, 8], **TWO_MODEL)
    band = doc["prediction_check"]
    assert band["runs_held_out"] == engine_fit.RAW_HELD_OUT["speedup"].n > 20
    assert band["speedup_mean_abs_error"] == engine_fit.RAW_HELD_OUT["speedup"].mean_abs
    html = tune.report(Artifact("tune", tmp_path / "out", {"fingerprint": "x", "metrics": {}}))
    assert "error band of these predictions" in html and "bench/published_runs.yaml" in html


# ---------------------------------------------------------------------------------------------- config


def test_section_validation():
    with pytest.raises(ValueError, match="strictly increasing"):
        tune.Config(batch_sizes=[1, 8, 4])
    with pytest.raises(ValueError, match="1.2 and 1.3"):
        tune.Config(trtllm_version="1.1.0")
    with pytest.raises(ValueError, match="positive weight"):
        tune.Config(domain_weights={"code": 0.0})
    assert tune.Config(trtllm_version="1.3.0rc27").trtllm_version == "1.3.0rc27"
    cfg = real_config(build=build.Config(trtllm_version="1.3.0rc27"))
    assert tune.target_version(cfg) == "1.3.0rc27"           # default: the version build deploys
    assert tune.target_version(real_config()) == compat.DEFAULT_TRTLLM_VERSION


def _write(tmp: Path, body: str) -> Path:
    p = tmp / "c.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_unknown_gpu_is_a_config_error_listing_the_known_ones(tmp_path):
    p = _write(tmp_path, """
        target: {bootstrap: tiny}
        hardware: {gpu: h900}
    """)
    r = run_cli("check", str(p))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "hardware.gpu" in r.stderr and "h900" in r.stderr
    for known in ("h100_sxm", "h100_pcie", "h200", "b200", "a100_80gb", "l40s"):
        assert known in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("check", str(p), "-o", "hardware.gpu=H200")
    assert r.returncode == 0, r.stderr


def test_missing_profile_is_a_config_error(tmp_path):
    cfg = real_config(hardware=HardwareConfig(profile=tmp_path / "nope.json"))
    probs = tune.check(cfg)
    assert probs and probs[0][0] == "hardware.profile" and "specpipe profile" in probs[0][1]
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    cfg = real_config(hardware=HardwareConfig(profile=tmp_path / "bad.json"))
    assert "not a specpipe hardware profile" in tune.check(cfg)[0][1]


def test_cross_section_checks():
    # build disabled: tune tunes for its own tune.trtllm_version
    cfg = real_config(tune=tune.Config(trtllm_version="1.2.1"), train_draft=train_draft.Config(algorithm="dflash"),
                      build=build.Config(enabled=False))
    probs = dict(tune.check(cfg))
    assert "DFlash needs TensorRT-LLM 1.3" in probs["tune.trtllm_version"]
    cfg.tune = tune.Config(trtllm_version="1.3.0rc27")
    assert tune.check(cfg) == []
    cfg = real_config(hardware=HardwareConfig(gpu="a100_80gb"))          # the tiny config's quantize.format: fp8
    assert "no FP8 tensor cores" in dict(tune.check(cfg))["hardware.gpu"]
    # tune tunes for what build deploys: a different tune.trtllm_version is an error while build is enabled
    cfg = real_config(tune=tune.Config(trtllm_version="1.3.0rc27"), build=build.Config(trtllm_version="1.2.1"))
    assert "differs from build.trtllm_version" in dict(tune.check(cfg))["tune.trtllm_version"]
    cfg.build.enabled = False
    assert tune.check(cfg) == [] and tune.target_version(cfg) == "1.3.0rc27"


def test_build_section_enters_tunes_fingerprint(tmp_path):
    """Defect 7: tune reads build.trtllm_version and build.eagle3_mode (which schedules the deployment runs); both
    must make a committed tuning.json stale (pipeline/runner.py fingerprint_inputs: USES sections enter the doc)."""
    from pipeline import registry, runner
    from pipeline.config import validate

    spec = registry.get("tune")
    assert "build" in spec.uses
    up = {d: "0" * 64 for d in spec.consumes}
    base = {"target": {"bootstrap": "tiny"}}
    docs = {name: runner.fingerprint_inputs(spec, validate({**base, "build": b}), up) for name, b in (
        ("default", {}), ("13", {"trtllm_version": "1.3.0rc27"}), ("two", {"eagle3_mode": "two_model"}))}
    assert len({runner.fingerprint(d) for d in docs.values()}) == 3
    assert "build.trtllm_version" in runner.stale_reason(docs["default"], docs["13"])
    assert "build.eagle3_mode" in runner.stale_reason(docs["default"], docs["two"])


def test_table_and_schedule_agree(tmp_path):
    doc = run_tune(tmp_path, curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=128, max_batch_size=512,
                   batch_sizes=[1, 8, 32, 64, 128, 256, 512, 1024], **TWO_MODEL)
    ks = ks_of(doc)
    for r in doc["predicted"]:
        if r["batch"] <= doc["max_batch_size"]:
            assert r["deployed_draft_len"] == ks[r["batch"] - 1] == r["k"]
        else:
            assert r["deployed_draft_len"] is None and not r["within_max_batch_size"]


def test_profile_content_enters_the_fingerprint(tmp_path):
    from pipeline import registry, runner
    from pipeline.config import validate

    prof = {"format": "specpipe.hardware-profile/1", "device": "x",
            "machine": {"peak_tflops": {"fp8": 1000.0}, "bandwidth_tb_s": 4.0, "op_overhead_us": 2.0}}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    cfg = validate({"target": {"bootstrap": "tiny"}, "hardware": {"gpu": "h200", "profile": str(p)}})
    spec = registry.get("tune")
    up = {d: "0" * 64 for d in spec.consumes}
    before = runner.fingerprint_inputs(spec, cfg, up)
    prof["machine"]["bandwidth_tb_s"] = 4.5            # same path, new measurement
    p.write_text(json.dumps(prof))
    after = runner.fingerprint_inputs(spec, cfg, up)
    assert runner.fingerprint(before) != runner.fingerprint(after)
    assert runner.stale_reason(before, after) == "hardware.profile content changed"


@pytest.mark.parametrize("name", ["tiny_fp8_dflash", "llama8b_fp8_dflash"])
def test_a_dflash_config_targets_a_version_that_serves_it(name):
    """build.trtllm_version always has a value: the shipped DFlash configs name 1.3, and a DFlash config left at the
    default (1.2) is a config error before tune runs. (The DFlash configs that load without prepared inputs; the
    real-model one, configs/smollm2_fp8_dflash.yaml, is read as written below and loaded where its inputs are:
    tests/unit/stages/test_build.py's shipped configs.)"""
    from pipeline.config import load_config, read_yaml
    from pipeline.errors import ConfigError

    assert tune.target_version(real_config()) == compat.DEFAULT_TRTLLM_VERSION
    v = tune.target_version(real_config(config=REPO / "configs" / f"{name}.yaml"))
    assert compat.algorithm_problem(v, "dflash") is None and compat.release(v).schedule_semantics == "upper_bound"
    with pytest.raises(ConfigError, match="build.trtllm_version"):
        load_config(REPO / "configs" / f"{name}.yaml", ["build.trtllm_version=1.2.1"])
    smol, _ = read_yaml(REPO / "configs" / "smollm2_fp8_dflash.yaml")
    assert smol["train_draft"]["algorithm"]["kind"] == "dflash"
    assert compat.algorithm_problem(compat.normalize_version(smol["build"]["trtllm_version"]), "dflash") is None


def test_draft_precision_comes_from_quantize_json(tmp_path):
    """tune prices the draft in the precision quantize.json states (`draft_format`), not one guessed from where the
    draft directory lies: a BF16 draft is priced at 2 bytes per weight wherever it is, an FP8 one at 1."""
    base = {"format": "fp8", "kv_cache": "fp8", "target_dir": "quantize/target_fp8"}
    fp8 = run_tune(tmp_path / "fp8", quant={**base, "draft_dir": "quantize/draft_fp8", "draft_format": "fp8"})
    bf16 = run_tune(tmp_path / "bf16", quant={**base, "draft_dir": "quantize/draft_bf16", "draft_format": "bf16"})
    assert fp8["models"]["draft_precision"]["gemm_dtype"] == "fp8"
    assert fp8["models"]["draft_precision"]["weight_bytes"] == 1.0
    assert bf16["models"]["draft_precision"]["gemm_dtype"] == "bf16"
    assert bf16["models"]["draft_precision"]["weight_bytes"] == 2.0


def test_a_quantize_json_without_the_contract_fields_is_a_clear_error(tmp_path):
    with pytest.raises(StageError, match=r"quantize\.json.*draft_format"):
        run_tune(tmp_path, quant={"format": "fp8", "kv_cache": "fp8", "target_dir": "quantize/target_fp8",
                                  "draft_dir": "train_draft/draft"})
