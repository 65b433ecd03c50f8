"""Stage `tune`: the draft length per batch size from the cost model and measured acceptance, its TensorRT-LLM
settings in both schedule formats, and its config errors.

The stage runs for real on synthetic upstream artifacts (target.json, draft.json + draft config.json,
quantize.json, acceptance.json written exactly as the contracts in docs/architecture.md say), so each case
controls the shapes and the acceptance it needs.
"""
from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.config import HardwareConfig
from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext
from runtime import compat
from runtime import trtllm_options as T
from runtime.costmodel import parse_schedule
from stages import tune

from conftest import run_cli

LLAMA_8B = dict(architecture="LlamaForCausalLM", num_layers=32, hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                max_position_embeddings=131072, dtype="bfloat16")
LLAMA_70B = dict(LLAMA_8B, num_layers=80, hidden_size=8192, num_attention_heads=64, intermediate_size=28672)
TINY = dict(LLAMA_8B, num_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, max_position_embeddings=2048)


def eagle3(t: dict, draft_vocab: int | None = None) -> tuple[dict, dict]:
    draft = {"algorithm": "eagle3", "num_layers": 1, "aux_layer_ids": [1, t["num_layers"] // 2 - 1, t["num_layers"] - 4],
             "vocab_size": t["vocab_size"], "draft_vocab_size": draft_vocab or t["vocab_size"], "has_d2t": bool(draft_vocab),
             "trained_draft_len": 6, "max_position_embeddings": t["max_position_embeddings"]}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t["hidden_size"],
           "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
           "head_dim": t["head_dim"], "intermediate_size": t["intermediate_size"], "num_hidden_layers": 1,
           "vocab_size": t["vocab_size"], "draft_vocab_size": draft["draft_vocab_size"]}
    return draft, cfg


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
            "gates": {"passed": True}}


def run_tune(tmp: Path, *, target=LLAMA_8B, curves=None, gpu="h200", tp=1, quant=None, profile=None,
             draft_vocab=32000, acc=None, **section) -> dict:
    """Write the upstream artifacts, run the stage, return tuning.json (plus `_metrics`)."""
    arts = tmp / "artifacts"
    draft, dcfg = eagle3(target, draft_vocab)
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
    cfg = SimpleNamespace(hardware=HardwareConfig(gpu=gpu, tensor_parallel_size=tp, profile=profile), tune=sec)
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    ctx = StageContext(name="tune", config=cfg, section=sec, out_dir=out, scratch_dir=tmp / "scratch", inputs=inputs,
                       workdir=tmp, fingerprint="x", log=logging.getLogger("specpipe.test.tune"))
    metrics = tune.run(ctx)
    doc = json.loads((out / "tuning.json").read_text())
    doc["_metrics"] = metrics
    json.dumps(metrics)   # metrics land in status --json
    return doc


def ks_of(doc: dict) -> list[int]:
    """The draft length TensorRT-LLM will use at each batch size under the emitted settings."""
    sem = compat.release(doc["trtllm_version"]).schedule_semantics
    return parse_schedule(doc["draft_len_schedule"], doc["max_concurrency"], doc["max_draft_len"], sem,
                          doc["max_batch_size"])


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
    doc = run_tune(tmp_path, curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=128, max_batch_size=1024,
                   batch_sizes=[1, 8, 32, 64, 128, 256, 512, 1024])
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
    assert doc["max_concurrency"] is not None and doc["max_concurrency"] < 512
    # Where the context is long, reading the KV cache dominates and verification shares it across the 1+k rows:
    # the same batch still gains from a short draft.
    long = run_tune(tmp_path / "long", curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=2048,
                    max_batch_size=512, batch_sizes=[512])
    assert long["predicted"][0]["k"] >= 1 and long["predicted"][0]["speedup"] > 1
    assert ks_of(doc)[doc["max_concurrency"]] == 0          # batch max_concurrency + 1: off
    assert ks_of(doc)[doc["max_concurrency"] - 1] > 0       # batch max_concurrency: on


def test_acceptance_zero_turns_speculation_off(tmp_path):
    doc = run_tune(tmp_path, curves={"code": [0.0] * 4, "prose": [0.0] * 4}, batch_sizes=[1, 4, 16])
    assert not doc["speculation"] and doc["max_draft_len"] == 0
    assert all(r["k"] == 0 and r["speedup"] == 1.0 for r in doc["predicted"])
    assert doc["draft_len_schedule"] is None and doc["max_concurrency"] is None
    assert "speculative_config" not in doc["llm_api"]
    assert doc["_metrics"]["speculation"] is False


@pytest.mark.parametrize("version", ["1.2.1", "1.3.0rc27"])
@pytest.mark.parametrize("gpu,target,tp", [("h200", LLAMA_8B, 1), ("l40s", LLAMA_8B, 1), ("h100_sxm", LLAMA_70B, 2),
                                           ("b200", TINY, 1)])
def test_max_num_tokens_always_covers_the_draft_tokens(tmp_path, version, gpu, target, tp):
    doc = run_tune(tmp_path, target=target, gpu=gpu, tp=tp, curves={"code": [0.9, 0.8, 0.7, 0.6]},
                   trtllm_version=version, min_num_tokens=256, batch_sizes=[1, 4, 16, 64, 256])
    assert doc["max_num_tokens"] >= doc["max_batch_size"] * (1 + doc["max_draft_len"])
    assert doc["llm_api"]["max_num_tokens"] == doc["max_num_tokens"]
    assert max(doc["cuda_graph_batch_sizes"]) == doc["max_batch_size"]
    assert all(1 <= b <= doc["max_batch_size"] for b in doc["cuda_graph_batch_sizes"])


# ---------------------------------------------------------------------------------------------- formats


def test_schedules_serialize_in_both_trtllm_formats(tmp_path):
    kw = dict(curves={"code": [0.75, 0.65, 0.55, 0.5, 0.45]}, context_length=128, max_batch_size=512,
              batch_sizes=[1, 16, 64, 256, 512])
    d12 = run_tune(tmp_path / "v12", trtllm_version="1.2.1", **kw)
    d13 = run_tune(tmp_path / "v13", trtllm_version="1.3.0rc27", **kw)
    assert d12["schedule_semantics"] == "lower_bound" and d13["schedule_semantics"] == "upper_bound"
    s12 = {int(k): v for k, v in d12["draft_len_schedule"].items()}
    s13 = {int(k): v for k, v in d13["draft_len_schedule"].items()}
    assert len(set(s12.values())) >= 3                 # several draft lengths, then off
    # 1.2: key 1 == max_draft_len, a trailing 0 switches speculation off; max_concurrency may accompany it.
    assert s12[1] == d12["max_draft_len"] and s12[max(s12)] == 0
    assert d12["max_concurrency"] == max(s12) - 1
    # 1.3: the smallest key's value == max_draft_len, no 0 values, and no max_concurrency next to a schedule.
    assert s13[min(s13)] == d13["max_draft_len"] and 0 not in s13.values() and d13["max_concurrency"] is None
    # Same decisions, two encodings: TensorRT-LLM reads both as the same draft length at every batch size...
    assert ks_of(d12) == ks_of(d13)
    assert [lo for lo, _, _ in d12["draft_len_by_batch"]] == sorted(s12)
    # ... and so does build's decoder (runtime.trtllm_options), which re-encodes for the version it deploys.
    for doc, sched in ((d12, s12), (d13, s13)):
        iv = T.schedule_to_intervals(sched, doc["schedule_semantics"])
        iv = T.cap_intervals(iv, doc["max_concurrency"])
        decoded = [next(k for lo, hi, k in iv if lo <= b and (hi is None or b <= hi))
                   for b in range(1, doc["max_batch_size"] + 1)]
        assert decoded == ks_of(doc)
        assert T.schedule_problems(sched, doc["max_draft_len"], doc["trtllm_version"]) == []
    # The reference examples, exactly.
    from runtime.costmodel import schedule_for

    ks = [4] * 3 + [2] * 4 + [0] * 5          # batch 1-3: 4, 4-7: 2, >= 8: 0
    assert schedule_for(ks, "lower_bound")["draft_len_schedule"] == {"1": 4, "4": 2, "8": 0}
    ks = [4] * 4 + [2] * 4 + [1] * 24 + [0] * 8
    up = schedule_for(ks, "upper_bound", with_max_concurrency=False)
    assert up["draft_len_schedule"] == {"4": 4, "8": 2, "32": 1} and up["max_concurrency"] is None


def test_llm_api_fragment_uses_only_fields_the_version_has(tmp_path):
    for version in ("1.2.1", "1.3.0rc27"):
        doc = run_tune(tmp_path / version, trtllm_version=version, curves={"code": [0.7, 0.6, 0.5, 0.4]},
                       context_length=128, max_batch_size=512, batch_sizes=[1, 64, 512])
        frag = doc["llm_api"]
        schema = T.load_schema(compat.release(version).schema)
        spec_fields = T._class_fields(schema, "Eagle3DecodingConfig") | T._class_fields(schema, "DecodingBaseConfig")
        assert set(frag["speculative_config"]) <= spec_fields
        if "CudaGraphConfig" in schema["classes"]:
            assert set(frag["cuda_graph_config"]) <= T._class_fields(schema, "CudaGraphConfig")
        assert set(frag) - {"speculative_config", "cuda_graph_config"} <= T.allowed_fields(version)["top"]
        sc = frag["speculative_config"]
        assert "draft_len_schedule" in sc
        if version.startswith("1.3"):
            assert "max_concurrency" not in sc
        assert all(k.isdigit() for k in sc["draft_len_schedule"])   # JSON keys; batch sizes


def test_constant_k_with_cutoff_is_a_lone_max_concurrency(tmp_path):
    # One useful draft position: k is 1 or 0; both versions say it with max_concurrency alone.
    for version in ("1.2.1", "1.3.0rc27"):
        doc = run_tune(tmp_path / version, trtllm_version=version, curves={"code": [0.6, 0.0]}, context_length=256,
                       max_batch_size=1024, batch_sizes=[1, 64, 1024])
        assert doc["max_draft_len"] == 1 and doc["draft_len_schedule"] is None
        assert doc["max_concurrency"] is not None and 1 < doc["max_concurrency"] < 1024
        assert ks_of(doc) == [1] * doc["max_concurrency"] + [0] * (1024 - doc["max_concurrency"])


# ---------------------------------------------------------------------------------------------- production shape


def test_llama70b_on_h200_gets_a_plausible_schedule(tmp_path):
    curves = {"coding": [0.85, 0.8, 0.76, 0.72, 0.68, 0.64], "math": [0.82, 0.77, 0.72, 0.68, 0.64, 0.6],
              "writing": [0.72, 0.62, 0.55, 0.5, 0.45, 0.4], "roleplay": [0.68, 0.58, 0.5, 0.44, 0.4, 0.35]}
    doc = run_tune(tmp_path, target=LLAMA_70B, curves=curves, context_length=4096,
                   domain_weights={"coding": 0.4, "math": 0.2, "writing": 0.2, "roleplay": 0.2},
                   batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256])
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
        run_tune(tmp_path / "a", target=LLAMA_70B, gpu="l40s")
    doc = run_tune(tmp_path / "b", target=LLAMA_70B, gpu="l40s", tp=4, context_length=2048, batch_sizes=[1, 8])
    assert doc["hardware"]["tensor_parallel_size"] == 4 and doc["kv_capacity_sequences"] >= 1
    with pytest.raises(StageError, match="no FP8 tensor cores"):
        run_tune(tmp_path / "c", gpu="a100_80gb")
    with pytest.raises(StageError, match="does not divide"):
        run_tune(tmp_path / "d", tp=3)


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
           "domains": {"code": {"fp8": {"acceptance_length": 2.71, "per_position": None}}}}
    doc = run_tune(tmp_path, acc=acc, batch_sizes=[1])
    a = doc["acceptance"]["per_position"]["code"]
    assert len(a) == 3 and all(x == pytest.approx(a[0]) for x in a)
    assert 1 + a[0] + a[0] ** 2 + a[0] ** 3 == pytest.approx(2.71, abs=1e-6)
    bad = {"runtime": "x", "max_draft_len": 2, "domains": {"code": {"fp8": {"per_position": [0.5, 1.5]}}}}
    with pytest.raises(StageError, match=r"\[0, 1\]"):
        run_tune(tmp_path / "bad", acc=bad)


def test_a_measured_profile_replaces_the_datasheet(tmp_path):
    prof = {"format": "specpipe.hardware-profile/1", "device": "cuda:NVIDIA H200",
            "machine": {"peak_tflops": {"fp8": 1200.0}, "bandwidth_tb_s": 4.0, "op_overhead_us": 3.0}}
    p = tmp_path / "h200.json"
    p.write_text(json.dumps(prof))
    doc = run_tune(tmp_path / "run", profile=p, batch_sizes=[1, 64])
    assert doc["hardware"]["profile"] == str(p) and "NVIDIA H200" in doc["hardware"]["machine"]
    assert doc["hardware"]["peak_tflops"] == {"fp8": pytest.approx(1200.0)}
    assert doc["hardware"]["ridge_rows"] == pytest.approx(1200 / 4.0 / 2)


def test_report_has_the_plot_and_the_schedule(tmp_path):
    run_tune(tmp_path, curves={"code": [0.75, 0.65, 0.55]}, context_length=512, max_batch_size=512,
             batch_sizes=[1, 32, 128, 512])
    html = tune.report(Artifact("tune", tmp_path / "out", {"fingerprint": "x", "metrics": {}}))
    assert "<img" in html and "draft_len_schedule" in html and "max_concurrency" in html and "speedup code" in html


# ---------------------------------------------------------------------------------------------- config


def test_section_validation():
    with pytest.raises(ValueError, match="strictly increasing"):
        tune.Config(batch_sizes=[1, 8, 4])
    with pytest.raises(ValueError, match="1.2 and 1.3"):
        tune.Config(trtllm_version="1.1.0")
    with pytest.raises(ValueError, match="positive weight"):
        tune.Config(domain_weights={"code": 0.0})
    assert tune.Config(trtllm_version="1.3.0rc27").trtllm_version == "1.3.0rc27"
    cfg = SimpleNamespace(tune=tune.Config(), build=SimpleNamespace(trtllm_version="1.3.0rc27"))
    assert tune.target_version(cfg) == "1.3.0rc27"           # default: the version build deploys
    assert tune.target_version(SimpleNamespace(tune=tune.Config())) == compat.DEFAULT_TRTLLM_VERSION


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
    cfg = SimpleNamespace(hardware=HardwareConfig(profile=tmp_path / "nope.json"), tune=tune.Config())
    probs = tune.check(cfg)
    assert probs and probs[0][0] == "hardware.profile" and "specpipe profile" in probs[0][1]
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    cfg = SimpleNamespace(hardware=HardwareConfig(profile=tmp_path / "bad.json"), tune=tune.Config())
    assert "not a specpipe hardware profile" in tune.check(cfg)[0][1]


def test_cross_section_checks():
    draft = lambda kind: SimpleNamespace(algorithm=SimpleNamespace(kind=kind))  # noqa: E731
    cfg = SimpleNamespace(hardware=HardwareConfig(), tune=tune.Config(trtllm_version="1.2.1"), train_draft=draft("dflash"))
    probs = dict(tune.check(cfg))
    assert "DFlash needs TensorRT-LLM 1.3" in probs["tune.trtllm_version"]
    cfg.tune = tune.Config(trtllm_version="1.3.0rc27")
    assert tune.check(cfg) == []
    cfg = SimpleNamespace(hardware=HardwareConfig(gpu="a100_80gb"), tune=tune.Config(),
                          quantize=SimpleNamespace(format="fp8"))
    assert "no FP8 tensor cores" in dict(tune.check(cfg))["hardware.gpu"]


def test_table_and_schedule_agree(tmp_path):
    doc = run_tune(tmp_path, curves={"code": [0.7, 0.6, 0.5, 0.45, 0.4]}, context_length=128, max_batch_size=512,
                   batch_sizes=[1, 8, 32, 64, 128, 256, 512, 1024])
    ks = ks_of(doc)
    for r in doc["predicted"]:
        if r["batch"] <= doc["max_batch_size"]:
            assert r["deployed_k"] == ks[r["batch"] - 1] == r["k"]
        else:
            assert r["deployed_k"] is None and not r["within_max_batch_size"]


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


def test_dflash_without_a_version_targets_one_that_serves_it():
    cfg = SimpleNamespace(tune=tune.Config())
    assert tune.target_version(cfg, "eagle3") == compat.DEFAULT_TRTLLM_VERSION
    v = tune.target_version(cfg, "dflash")
    assert compat.algorithm_problem(v, "dflash") is None and compat.release(v).schedule_semantics == "upper_bound"
