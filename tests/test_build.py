"""Stage `build`: LLM-API options per TensorRT-LLM version, named consistency checks, command files.

TensorRT-LLM cannot be installed here, so these tests check what can be checked without it: every generated
key exists in the targeted version's field list (runtime/schemas, extracted from llm_args.py), the version's
schedule semantics, each consistency check failing on a broken input with its message, and the generated
shell scripts passing paths with spaces/quotes/dollars through bash unchanged. The stage itself runs on
synthetic upstream artifacts (tiny checkpoint dirs written here: config.json, hf_quant_config.json, a draft
with a real safetensors header).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from pipeline.errors import StageError
from pipeline.stage import Artifact, StageContext
from runtime import compat
from runtime import trtllm_options as T
from stages import build

REF_SCHEMAS = Path(__file__).resolve().parents[2] / "shared" / "reference" / "schemas"


# ------------------------------------------------------------------------------------------ fixtures


def write_checkpoints(root: Path, *, layers: int = 8, vocab: int = 512, draft_vocab: int | None = 256,
                      d2t: bool = True, aux: list[int] | None = None, fp8: bool = True, algorithm: str = "eagle3") -> dict:
    """Synthetic upstream artifacts laid out as the stages write them (docs/architecture.md contracts)."""
    from safetensors.numpy import save_file

    arts = root / "artifacts"
    tgt = arts / "quantize" / "target_fp8"
    tgt.mkdir(parents=True)
    (tgt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
                                                 "vocab_size": vocab, "max_position_embeddings": 2048}))
    if fp8:
        (tgt / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    draft = arts / "train_draft" / "draft"
    draft.mkdir(parents=True)
    aux = aux if aux is not None else sorted(T.default_layers_to_capture(layers))
    dcfg = {"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": vocab, "max_position_embeddings": 2048,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}
    tensors = {"fc.weight": np.zeros((4, 8), np.float32)}
    if draft_vocab is not None:
        dcfg["draft_vocab_size"] = draft_vocab
        tensors["lm_head.weight"] = np.zeros((draft_vocab, 4), np.float32)
        if d2t:
            tensors["d2t"] = np.zeros((draft_vocab,), np.int64)
    if algorithm == "dflash":   # ModelOpt's DFlash export: no lm_head/embeddings, block + dflash_config
        dcfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8, "num_target_layers": layers,
                "max_position_embeddings": 2048, "dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 5]}}
        tensors = {"fc.weight": np.zeros((4, 8), np.float32)}
    (draft / "config.json").write_text(json.dumps(dcfg))
    save_file(tensors, str(draft / "model.safetensors"))
    (arts / "quantize" / "quantize.json").write_text(json.dumps({"format": "fp8", "target_dir": "quantize/target_fp8",
                                                                 "draft_dir": "train_draft/draft"}))
    (arts / "train_draft" / "draft.json").write_text(json.dumps({
        "algorithm": algorithm, "num_layers": 1, "aux_layer_ids": aux if algorithm == "eagle3" else None,
        "block_size": 8 if algorithm == "dflash" else None, "vocab_size": vocab,
        "draft_vocab_size": draft_vocab or vocab, "has_d2t": d2t, "trained_draft_len": 3, "max_position_embeddings": 2048}))
    (arts / "tune").mkdir(parents=True)
    (arts / "tune" / "tuning.json").write_text(json.dumps({
        "trtllm_version": "1.2.1", "max_draft_len": 4, "draft_len_schedule": {"1": 4, "5": 2, "9": 0},
        "max_concurrency": None, "max_batch_size": 16, "max_num_tokens": 2048, "cuda_graph_batch_sizes": [1, 2, 4, 5, 8, 9, 16]}))
    ev = arts / "data" / "eval"
    ev.mkdir(parents=True)
    for dom in ("code", "prose"):
        ev.joinpath(f"{dom}.jsonl").write_text("".join(json.dumps({"id": f"{dom}-{i}", "prompt": f"{dom} prompt {i}",
                                                                  "prompt_ids": [1, 2, 3 + i], "reference": None}) + "\n"
                                                       for i in range(3)))
    return {"arts": arts, "target": tgt, "draft": draft}


def make_ctx(root: Path, section: build.Config, tp: int = 1) -> StageContext:
    arts = root / "artifacts"
    out = root / ".tmp" / "build"
    out.mkdir(parents=True)
    inputs = {n: Artifact(n, arts / n, {"fingerprint": n, "metrics": {}}) for n in build.CONSUMES}
    cfg = SimpleNamespace(hardware=SimpleNamespace(tensor_parallel_size=tp), build=section)
    return StageContext(name="build", config=cfg, section=section, out_dir=out, scratch_dir=root / "scratch",
                        inputs=inputs, workdir=root, fingerprint="x", log=logging.getLogger("test.build"))


def spec(**kw) -> T.DeploymentSpec:
    base = dict(version="1.2.1", algorithm="eagle3", draft_dir="/d", max_draft_len=4, num_target_layers=32,
                aux_layer_ids=[1, 15, 28], max_batch_size=16, max_num_tokens=2048, max_seq_len=2048,
                schedule=[(1, 4, 4), (5, 8, 2), (9, None, 0)], cuda_graph_batch_sizes=[1, 2, 4, 8, 16])
    base.update(kw)
    return T.DeploymentSpec(**base)


# ------------------------------------------------------------------------------------------ schema keys


@pytest.mark.parametrize("version,kw", [
    ("1.2.1", {}),
    ("1.2.1", {"eagle3_one_model": False, "max_concurrency": 12, "acceptance_window": 32, "min_acceptance_rate": 0.3}),
    ("1.2.0", {"aux_layer_ids": [0, 3, 5], "schedule": None, "max_concurrency": 8}),
    ("1.3.0rc27", {"max_concurrency": 6, "acceptance_window": 32, "min_acceptance_rate": 0.3}),
    ("1.3.0rc27", {"algorithm": "dflash", "aux_layer_ids": None}),
])
def test_every_generated_key_exists_in_the_targeted_schema(version, kw):
    opts = T.llm_api_options(spec(version=version, **kw))
    assert T.unknown_keys(opts, version) == []
    # and the same body as Triton's model.yaml
    body = {"model": "/m", "backend": "pytorch", **opts, "triton_config": {"max_batch_size": 0, "decoupled": True}}
    assert T.unknown_keys(body, version, model_yaml=True) == []


def test_unknown_and_renamed_keys_are_reported_per_version():
    opts = T.llm_api_options(spec(acceptance_window=16, min_acceptance_rate=0.2))
    assert "acceptance_window" in opts["speculative_config"]           # 1.2 name
    assert T.unknown_keys(opts, "1.2.1") == []
    assert T.unknown_keys(opts, "1.3.0rc27") == ["speculative_config.acceptance_window",
                                                 "speculative_config.acceptance_length_threshold"]
    opts["kv_cache_config"]["free_gpu_mem"] = 0.5
    opts["max_batch"] = 3
    assert {"kv_cache_config.free_gpu_mem", "max_batch"} <= set(T.unknown_keys(opts, "1.2.1"))
    dflash = T.llm_api_options(spec(version="1.3.0rc27", algorithm="dflash", aux_layer_ids=None))
    assert T.unknown_keys(dflash, "1.2.1") == ["speculative_config.decoding_type=DFlash"]


def test_packaged_schemas_match_the_reference():
    if not REF_SCHEMAS.exists():
        pytest.skip("reference schemas not present (outside a development checkout)")
    ref = json.loads((REF_SCHEMAS / "trtllm-1.2-llmapi.json").read_text())
    mine = T.load_schema("trtllm-1.2")
    for cls in mine["classes"]:
        assert mine["classes"][cls] == ref["classes"][cls], cls
    ref13 = json.loads((REF_SCHEMAS / "trtllm-1.3-specdec.json").read_text())
    assert T.load_schema("trtllm-1.3")["classes"]["DFlashDecodingConfig"] == ref13["classes"]["DFlashDecodingConfig"]


# ------------------------------------------------------------------------------------------ version semantics


def test_schedule_is_written_in_each_versions_semantics():
    iv = [(1, 4, 4), (5, 8, 2), (9, None, 0)]
    s12 = T.llm_api_options(spec(schedule=iv))["speculative_config"]
    s13 = T.llm_api_options(spec(version="1.3.0rc27", schedule=iv))["speculative_config"]
    assert s12["draft_len_schedule"] == {1: 4, 5: 2, 9: 0}        # lower bounds, key 1 == max_draft_len
    assert s13["draft_len_schedule"] == {4: 4, 8: 2}              # upper bounds, off above 8
    assert T.schedule_problems(s12["draft_len_schedule"], 4, "1.2.1") == []
    assert T.schedule_problems(s13["draft_len_schedule"], 4, "1.3.0rc27") == []
    # the same step function decoded back from either form
    assert T.schedule_to_intervals(s12["draft_len_schedule"], "lower_bound") == iv
    assert T.schedule_to_intervals(s13["draft_len_schedule"], "upper_bound") == iv
    # a 1.2 schedule read as 1.3 would be wrong, and the 1.3 rules say so
    assert T.schedule_problems({1: 4, 5: 2, 9: 0}, 4, "1.3.0rc27") == []  # valid syntax, different meaning:
    assert T.schedule_to_intervals({1: 4, 5: 2, 9: 0}, "upper_bound")[0] == (1, 1, 4)
    assert T.schedule_problems({2: 4}, 4, "1.2.1")                       # 1.2 needs key 1


def test_max_concurrency_with_schedule_is_folded_for_1_3():
    iv = [(1, 4, 4), (5, None, 2)]
    o13 = T.llm_api_options(spec(version="1.3.0rc27", schedule=iv, max_concurrency=12))["speculative_config"]
    assert "max_concurrency" not in o13 and o13["draft_len_schedule"] == {4: 4, 12: 2}
    o12 = T.llm_api_options(spec(schedule=iv, max_concurrency=12))["speculative_config"]
    assert o12["draft_len_schedule"] == {1: 4, 5: 2, 13: 0}
    const = T.llm_api_options(spec(version="1.3.0rc27", schedule=[(1, 6, 4), (7, None, 0)]))["speculative_config"]
    assert const.get("max_concurrency") == 6 and "draft_len_schedule" not in const


def test_acceptance_guard_translates_rate_to_length_for_1_2():
    o12 = T.llm_api_options(spec(acceptance_window=64, min_acceptance_rate=0.25))["speculative_config"]
    o13 = T.llm_api_options(spec(version="1.3.0rc27", acceptance_window=64, min_acceptance_rate=0.25))["speculative_config"]
    assert o12["acceptance_window"] == 64 and o12["acceptance_length_threshold"] == pytest.approx(1 + 0.25 * 4)
    assert o13["acceptance_rate_window_size"] == 64 and o13["acceptance_rate_threshold"] == 0.25


def test_layers_to_capture_only_when_not_default():
    assert "eagle3_layers_to_capture" not in T.llm_api_options(spec(aux_layer_ids=[1, 15, 28]))["speculative_config"]
    assert T.llm_api_options(spec(aux_layer_ids=[2, 16, 29]))["speculative_config"]["eagle3_layers_to_capture"] == [2, 16, 29]


# ------------------------------------------------------------------------------------------ config errors


def _cfg(algorithm: str, **build_kw):
    return SimpleNamespace(build=build.Config(**build_kw), train_draft=SimpleNamespace(algorithm=algorithm))


def test_dflash_on_1_2_is_a_config_error_naming_the_version_that_supports_it():
    probs = dict(build.check(_cfg("dflash", trtllm_version="1.2.1")))
    msg = probs["build.trtllm_version"]
    assert compat.REFERENCE_1_3 in msg and "tensorrt-llm/release" in msg and "DFlash" in msg
    assert build.check(_cfg("dflash", trtllm_version="1.3.0rc27")) == []
    assert build.check(_cfg("eagle3")) == []


def test_tensorrt_engine_backend_with_eagle3_is_a_config_error_that_explains():
    msg = dict(build.check(_cfg("eagle3", backend="tensorrt")))["build.backend"]
    assert "EAGLE-3" in msg and "PyTorch backend" in msg and "build.backend: pytorch" in msg


def test_other_config_errors():
    assert "build.pipeline_parallel_size" in dict(build.check(_cfg("eagle3", pipeline_parallel_size=2)))
    assert "build.eagle3_mode" in dict(build.check(_cfg("eagle3", trtllm_version="1.3.0rc27", eagle3_mode="two_model")))
    with pytest.raises(ValueError, match="1.2 and 1.3"):
        build.Config(trtllm_version="1.1.0")


# ------------------------------------------------------------------------------------------ consistency checks


def _checks(opts, ck, **kw):
    return {c.name: c for c in T.consistency_checks(opts, version=kw.pop("version", "1.2.1"), algorithm="eagle3",
                                                    target_dir=ck["target"], draft_dir=ck["draft"], **kw)}


def test_consistency_checks_pass_on_a_good_deployment(tmp_path):
    ck = write_checkpoints(tmp_path)
    got = _checks(T.llm_api_options(spec(draft_dir=str(ck["draft"]), num_target_layers=8, aux_layer_ids=None)), ck)
    assert [n for n, c in got.items() if not c.ok] == []
    assert {"token_budget", "cuda_graph_batch_sizes", "fp8_target_quant_config", "draft_vocab",
            "two_model_overlap_scheduler", "no_pipeline_parallel", "draft_positions", "schema_keys"} <= set(got)


@pytest.mark.parametrize("name,breaker,needle", [
    ("token_budget", lambda o, ck: o.update(max_num_tokens=40), "max_batch_size 16 x (1 + max_total_draft_tokens 4) = 80"),
    ("cuda_graph_batch_sizes", lambda o, ck: o["cuda_graph_config"]["batch_sizes"].append(32), "too large: [32]"),
    ("fp8_target_quant_config", lambda o, ck: (ck["target"] / "hf_quant_config.json").unlink(), "unquantized"),
    ("draft_vocab", lambda o, ck: (ck["draft"] / "model.safetensors").unlink() or __import__("safetensors.numpy").numpy.save_file(
        {"lm_head.weight": np.zeros((256, 4), np.float32)}, str(ck["draft"] / "model.safetensors")), "needs a d2t tensor of 256"),
    ("two_model_overlap_scheduler", lambda o, ck: o["speculative_config"].update(eagle3_one_model=False), "disable_overlap_scheduler: true"),
    ("no_pipeline_parallel", lambda o, ck: o.update(pipeline_parallel_size=2), "pipeline parallelism"),
    ("draft_positions", lambda o, ck: o.update(max_seq_len=8192), "acceptance collapses"),
    ("draft_len_schedule", lambda o, ck: o["speculative_config"].update(draft_len_schedule={1: 3, 4: 2}), "key 1 with value max_draft_len"),
    ("schema_keys", lambda o, ck: o["speculative_config"].update(acceptance_rate_threshold=0.5), "acceptance_rate_threshold"),
])
def test_each_consistency_check_fails_on_a_broken_input(tmp_path, name, breaker, needle):
    ck = write_checkpoints(tmp_path)
    opts = T.llm_api_options(spec(draft_dir=str(ck["draft"]), num_target_layers=8, aux_layer_ids=None))
    breaker(opts, ck)
    got = _checks(opts, ck)
    assert not got[name].ok
    assert needle in got[name].message
    assert [n for n, c in got.items() if not c.ok] == [name]   # the others still pass: checks are independent


# ------------------------------------------------------------------------------------------ the stage


def test_build_stage_writes_a_checked_deployment(tmp_path):
    ck = write_checkpoints(tmp_path, aux=[0, 3, 6])   # not the default {1, 3, 4} for 8 layers
    ctx = make_ctx(tmp_path, build.Config())
    metrics = build.run(ctx)
    dep = ctx.out_dir / "deployment"
    opts = yaml.safe_load((dep / "llm_api_options.yaml").read_text())
    assert T.unknown_keys(opts, "1.2.1") == []
    sc = opts["speculative_config"]
    assert sc["decoding_type"] == "Eagle3" and sc["max_draft_len"] == 4 and sc["speculative_model"] == str(ck["draft"])
    assert sc["eagle3_layers_to_capture"] == [0, 3, 6]
    assert sc["draft_len_schedule"] == {1: 4, 5: 2, 9: 0}
    assert opts["max_num_tokens"] >= opts["max_batch_size"] * 5
    doc = json.loads((ctx.out_dir / "deployment.json").read_text())
    assert doc["load"] == {"loaded": False, "reason": build.NOT_LOADED} and metrics["loaded"] is False
    assert doc["draft_len_by_batch"] == [[1, 4, 4], [5, 8, 2], [9, 16, 0]]
    assert doc["serving_image"] == compat.SHIPPED_TRITON_IMAGE
    rows = [json.loads(line) for line in (dep / "bench_dataset.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and [r["task_id"] for r in rows] == list(range(6))
    assert set(rows[0]) == {"task_id", "prompt", "input_ids", "output_tokens", "category"} and rows[0]["output_tokens"] == 128
    assert "TensorRT-LLM not available" in (dep / "README.md").read_text()


def test_build_stage_retargets_a_tuned_schedule_to_1_3(tmp_path):
    write_checkpoints(tmp_path)
    ctx = make_ctx(tmp_path, build.Config(trtllm_version="1.3.0rc27"))
    build.run(ctx)
    opts = yaml.safe_load((ctx.out_dir / "deployment" / "llm_api_options.yaml").read_text())
    assert opts["speculative_config"]["draft_len_schedule"] == {4: 4, 8: 2}   # tuned as 1.2 {1:4, 5:2, 9:0}
    assert T.unknown_keys(opts, "1.3.0rc27") == []
    assert json.loads((ctx.out_dir / "deployment.json").read_text())["serving_image"].endswith("release:1.3.0rc27")


def test_build_stage_fails_with_the_named_checks(tmp_path):
    write_checkpoints(tmp_path, d2t=False, fp8=False)
    ctx = make_ctx(tmp_path, build.Config(max_num_tokens=20))
    with pytest.raises(StageError) as e:
        build.run(ctx)
    msg = str(e.value)
    for name in ("token_budget", "fp8_target_quant_config", "draft_vocab"):
        assert f"  {name}: " in msg
    assert "two_model_overlap_scheduler" not in msg


def test_command_files_quote_paths_safely(tmp_path):
    """Run the generated scripts through bash with stand-in executables that print their argv."""
    nasty = tmp_path / "run dir $HOME 'q' \"dq\" `x` ;rm -rf"
    ck = write_checkpoints(nasty)
    ctx = make_ctx(nasty, build.Config(bench=build.Bench(model_name="org/my model")))
    build.run(ctx)
    dep = ctx.out_dir / "deployment"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for exe in ("trtllm-serve", "trtllm-bench"):
        p = bindir / exe
        p.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        p.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    serve = json.loads(subprocess.run(["bash", str(dep / "serve.sh"), "--log_level", "info"], env=env, cwd="/",
                                      capture_output=True, text=True, check=True).stdout)
    assert serve == [str(ck["target"]), "--backend", "pytorch", "--host", "127.0.0.1", "--port", "8000",
                     "--extra_llm_api_options", str(dep / "llm_api_options.yaml"), "--log_level", "info"]
    bench = json.loads(subprocess.run(["bash", str(dep / "bench.sh")], env=env, cwd="/", capture_output=True,
                                      text=True, check=True).stdout)
    assert bench[:4] == ["--model", "org/my model", "--model_path", str(ck["target"])]
    assert bench[bench.index("--dataset") + 1] == str(dep / "bench_dataset.jsonl")
    assert bench[bench.index("--concurrency") + 1] == "16"


def test_build_reads_tunes_step_function_whatever_version_tune_wrote_for(tmp_path):
    """tune's `draft_len_by_batch` runs are version-free; a 1.3-style schedule next to them is not reused as is."""
    write_checkpoints(tmp_path)
    p = tmp_path / "artifacts" / "tune" / "tuning.json"
    t = json.loads(p.read_text())
    t.update(trtllm_version="1.3.0rc27", draft_len_schedule={"4": 4, "8": 2},
             draft_len_by_batch=[[1, 4, 4], [5, 8, 2], [9, 16, 0]])
    p.write_text(json.dumps(t))
    ctx = make_ctx(tmp_path, build.Config())      # builds for 1.2.1
    build.run(ctx)
    opts = yaml.safe_load((ctx.out_dir / "deployment" / "llm_api_options.yaml").read_text())
    assert opts["speculative_config"]["draft_len_schedule"] == {1: 4, 5: 2, 9: 0}


def test_version_as_yaml_writes_it():
    assert build.Config(trtllm_version=1.3).trtllm_version == compat.REFERENCE_1_3   # YAML `1.3` is a float
    assert build.Config(trtllm_version="1.2").trtllm_version == compat.DEFAULT_TRTLLM_VERSION
    assert build.Config(trtllm_version="1.3.0rc5").trtllm_version == "1.3.0rc5"
