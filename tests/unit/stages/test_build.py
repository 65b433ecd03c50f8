"""Stage `build`: LLM-API options per TensorRT-LLM version and mode, named consistency checks, command files.

TensorRT-LLM cannot be installed here, so these tests check what can be checked without it: every generated
key exists in the targeted version's field list (runtime/trtllm/schemas, extracted from llm_args.py), each version's
behaviour as read from its source (runtime/trtllm/compat.py SOURCES; each test that encodes one names it), each
consistency check failing on a broken input with its message, and the generated shell scripts passing paths
with spaces/quotes/dollars through bash unchanged. The stage itself runs on synthetic upstream artifacts (tiny
checkpoint dirs written here: config.json, hf_quant_config.json, a draft with real safetensors files named as
ModelOpt 0.47 exports them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.errors import StageError
from runtime import hf_config
from runtime.algorithms.schedule import DraftSchedule
from runtime.trtllm import checks, compat, draft_schedule, draft_weights, load, schema
from runtime.trtllm import options as T
from stages import build

from support import DATA, REPO, real_config
from support.synthetic import H, Upstream, needs_prepared_inputs, serves_up_to_max_seq_len, shipped_build, write_checkpoints
from support.synthetic import build_context as make_ctx

REF_SCHEMAS = DATA / "trtllm_reference"   # upstream extractions, see its README


# ------------------------------------------------------------------------------------------ fixtures


def run_build(root: Path, **section) -> tuple[dict, dict, Path]:
    """Run the stage; (llm_api_options.yaml, deployment.json, deployment dir)."""
    ctx = make_ctx(root, build.Config(**section))
    build.run(ctx)
    dep = ctx.out_dir / "deployment"
    opts = yaml.safe_load((dep / "llm_api_options.yaml").read_text())
    return opts, json.loads((ctx.out_dir / "deployment.json").read_text()), dep


def spec(**kw) -> T.DeploymentSpec:
    base = dict(version="1.2.1", algorithm="eagle3", draft_dir="/d", schedule=DraftSchedule.constant(4),
                capture_layers=[1, 15, 28], max_batch_size=16, max_num_tokens=2048, max_seq_len=2048,
                cuda_graph_batch_sizes=[1, 2, 4, 8, 16])
    base.update(kw)
    return T.DeploymentSpec(**base)


TWO_MODEL_12 = dict(eagle3_one_model=False, schedule=DraftSchedule.from_json({"runs": [[1, 4, 4], [5, 8, 2], [9, 16, 0]]}))
ONE_ENGINE_13 = dict(version="1.3.0rc27", schedule=DraftSchedule.from_json({"runs": [[1, 4, 4], [5, 8, 2], [9, 16, 1]]}))


# ------------------------------------------------------------------------------------------ schema keys


@pytest.mark.parametrize("version,kw", [
    ("1.2.1", {}),
    ("1.2.1", {**TWO_MODEL_12, "acceptance_window": 32, "min_acceptance_rate": 0.3}),
    ("1.2.0", {"capture_layers": [0, 3, 5], "eagle3_one_model": False,
               "schedule": DraftSchedule.from_json({"runs": [[1, 8, 3], [9, 16, 0]]})}),
    ("1.3.0rc27", {**ONE_ENGINE_13, "acceptance_window": 32, "min_acceptance_rate": 0.3}),
    ("1.3.0rc27", {"algorithm": "dflash", "capture_layers": None}),
])
def test_every_generated_key_exists_in_the_targeted_schema(version, kw):
    opts = T.llm_api_options(spec(**{**kw, "version": version}))
    assert schema.unknown_keys(opts, version) == []
    # and the same body as Triton's model.yaml
    body = {"model": "/m", "backend": "pytorch", **opts, "triton_config": {"max_batch_size": 0, "decoupled": True}}
    assert schema.unknown_keys(body, version, model_yaml=True) == []


def test_unknown_and_renamed_keys_are_reported_per_version():
    opts = T.llm_api_options(spec(**TWO_MODEL_12, acceptance_window=16, min_acceptance_rate=0.2))
    assert "acceptance_window" in opts["speculative_config"]           # 1.2 name
    assert schema.unknown_keys(opts, "1.2.1") == []
    assert schema.unknown_keys(opts, "1.3.0rc27") == ["speculative_config.acceptance_window",
                                                 "speculative_config.acceptance_length_threshold"]
    opts["kv_cache_config"]["free_gpu_mem"] = 0.5
    opts["max_batch"] = 3
    assert {"kv_cache_config.free_gpu_mem", "max_batch"} <= set(schema.unknown_keys(opts, "1.2.1"))
    dflash = T.llm_api_options(spec(version="1.3.0rc27", algorithm="dflash", capture_layers=None))
    assert schema.unknown_keys(dflash, "1.2.1") == ["speculative_config.decoding_type=DFlash"]


def test_packaged_schemas_match_the_reference():
    ref = json.loads((REF_SCHEMAS / "trtllm-1.2-llmapi.json").read_text())
    mine = schema.load_schema("trtllm-1.2")
    for cls in mine["classes"]:
        assert mine["classes"][cls] == ref["classes"][cls], cls
    ref13 = json.loads((REF_SCHEMAS / "trtllm-1.3-specdec.json").read_text())
    assert schema.load_schema("trtllm-1.3")["classes"]["DFlashDecodingConfig"] == ref13["classes"]["DFlashDecodingConfig"]


# ------------------------------------------------------------------------------------------ schedules per version and mode


def test_schedule_is_written_in_each_versions_semantics_and_read_back():
    """1.2 keys are lower bounds, 1.3 upper bounds (runtime/trtllm/schemas rules, from llm_args.py); what is written
    decodes back to the same step function under the version's rules."""
    s12 = T.llm_api_options(spec(**TWO_MODEL_12))["speculative_config"]
    s13 = T.llm_api_options(spec(**ONE_ENGINE_13))["speculative_config"]
    assert s12["draft_len_schedule"] == {1: 4, 5: 2, 9: 0}        # lower bounds, key 1 == max_draft_len
    assert s13["draft_len_schedule"] == {4: 4, 8: 2, 16: 1}       # upper bounds, last key = max_batch_size
    r12, r13 = compat.release("1.2.1"), compat.release("1.3.0rc27")
    assert draft_schedule.schedule_problems(s12["draft_len_schedule"], 4, r12) == []
    assert draft_schedule.schedule_problems(s13["draft_len_schedule"], 4, r13) == []
    assert draft_schedule.decode(s12, r12, "two_model", 16) == TWO_MODEL_12["schedule"]
    assert draft_schedule.decode(s13, r13, "one_model", 16) == ONE_ENGINE_13["schedule"]
    # a 1.2 schedule read with 1.3's rules means something else, and 1.2's rules catch a 1.3 one
    assert draft_schedule.decode({"max_draft_len": 4, "draft_len_schedule": {1: 4, 5: 2, 9: 0}}, r13, "one_model",
                                 16).k_at(2) == 2
    assert draft_schedule.schedule_problems({2: 4}, 4, r12)                    # 1.2 needs key 1
    # one draft length then off: max_concurrency alone in 1.2 two-model
    off = T.llm_api_options(spec(eagle3_one_model=False,
                                 schedule=DraftSchedule.from_json({"runs": [[1, 6, 4], [7, 16, 0]]})))["speculative_config"]
    assert off.get("max_concurrency") == 6 and "draft_len_schedule" not in off


def test_1_2_one_model_cannot_run_a_per_batch_schedule():
    """TensorRT-LLM 1.2.x applies draft_len_schedule / max_concurrency only in the two-model drafter: py_executor.py
    `_prepare_and_schedule_batch` does it under `if self.drafter is not None`, and speculative/utils.py
    get_spec_drafter creates no drafter for EAGLE3_ONE_MODEL (compat.SOURCES per_batch_draft_len_1_2). Written
    anyway, the keys would be ignored silently: specpipe refuses to write them."""
    with pytest.raises(draft_schedule.UnsupportedSchedule, match="every batch size"):
        T.llm_api_options(spec(schedule=TWO_MODEL_12["schedule"]))
    one = T.llm_api_options(spec())["speculative_config"]
    assert one["max_draft_len"] == 4 and "draft_len_schedule" not in one and "max_concurrency" not in one
    # and what TensorRT-LLM 1.2 one-model does with a schedule in the options: max_draft_len everywhere
    assert draft_schedule.decode({"max_draft_len": 4, "draft_len_schedule": {1: 4, 5: 2}, "max_concurrency": 6},
                                 compat.release("1.2.1"), "one_model", 16) == DraftSchedule.constant(4)


def test_1_3_one_engine_never_resolves_to_zero_draft_tokens():
    """TensorRT-LLM PR #16888 (open): in one-engine mode a schedule resolving to 0 above its largest key, and
    max_concurrency (translated into exactly such a schedule), skip drafting and corrupt drafter state; acceptance
    collapses after speculation resumes (compat.SOURCES zero_draft_len_one_engine)."""
    r13 = compat.release("1.3.0rc27")
    with_zero = DraftSchedule.from_json({"runs": [[1, 4, 4], [5, 16, 0]]})
    with pytest.raises(draft_schedule.UnsupportedSchedule, match="16888"):
        draft_schedule.encode(with_zero, r13, "one_model", 16)
    sc = T.llm_api_options(spec(**ONE_ENGINE_13))["speculative_config"]
    assert "max_concurrency" not in sc and max(int(k) for k in sc["draft_len_schedule"]) == 16
    assert min(draft_schedule.decode(sc, r13, "one_model", 16).ks(16)) >= 1
    # max_concurrency alone is the same bug: the check catches it in options from elsewhere
    mc = {k: v for k, v in sc.items() if k != "draft_len_schedule"} | {"max_concurrency": 8}
    got = _checks_of({**T.llm_api_options(spec(version="1.3.0rc27")), "speculative_config": mc}, version="1.3.0rc27")
    assert not got["zero_draft_len"].ok and "16888" in got["zero_draft_len"].message


def test_acceptance_guard_is_converted_per_version_not_copied():
    """1.2 `acceptance_length_threshold` is compared with the rolling mean of max(0, avg decoded tokens per
    iteration - 1), i.e. accepted draft tokens per step = rate x k (speculation_gate.py stored 41080dc55e22d58a
    record_avg_decoded); 1.3 (PR #12905) thresholds the rate itself. Neither is 1 + rate x k."""
    o12 = T.llm_api_options(spec(**TWO_MODEL_12, acceptance_window=64, min_acceptance_rate=0.25))["speculative_config"]
    o13 = T.llm_api_options(spec(**ONE_ENGINE_13, acceptance_window=64, min_acceptance_rate=0.25))["speculative_config"]
    assert o12["acceptance_window"] == 64 and o12["acceptance_length_threshold"] == pytest.approx(0.25 * 4)
    assert o13["acceptance_rate_window_size"] == 64 and o13["acceptance_rate_threshold"] == 0.25
    assert "acceptance_rate_threshold" not in o12 and "acceptance_length_threshold" not in o13
    # 1.2 one-model: the gate's result is read only inside the drafter branch of py_executor: not written, and said
    o1 = T.llm_api_options(spec(acceptance_window=64, min_acceptance_rate=0.25))["speculative_config"]
    assert not {"acceptance_window", "acceptance_length_threshold"} & set(o1)
    _, note = T.acceptance_guard(compat.release("1.2.1"), "one_model", 64, 0.25, 4)
    assert "not written" in note and "two_model" in note


def test_layers_to_capture_are_always_written_from_the_draft():
    """eagle3.py Eagle3SpecMetadata: unset, TensorRT-LLM captures (1, L//2-1, L-4) and raises for L <= 5;
    llm_args.py Eagle3DecodingConfig.num_capture_layers sizes the draft's fc from the set (3 when unset)."""
    for aux in ([1, 15, 28], [2, 16, 29], [0, 1, 2], [3, 1]):
        sc = T.llm_api_options(spec(capture_layers=aux))["speculative_config"]
        assert sc["eagle3_layers_to_capture"] == sorted(aux)


# ------------------------------------------------------------------------------------------ config errors


def _cfg(algorithm: str, **build_kw):
    from stages import train_draft

    return real_config(build=build.Config(**build_kw), train_draft=train_draft.Config(algorithm=algorithm))


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


def _checks_of(opts, ck=None, **kw):
    ck = ck or {}
    return {c.name: c for c in checks.consistency_checks(
        opts, version=kw.pop("version", "1.2.1"), algorithm=kw.pop("algorithm", "eagle3"),
        target_dir=ck.get("target", Path("/nonexistent")), draft_dir=kw.pop("draft_dir", ck.get("draft", Path("/nonexistent"))),
        expected=checks.Expected(**kw))}


def _good(tmp_path, **kw):
    """A written deployment draft (names as 1.2 reads them) and options that pass every check."""
    ck = write_checkpoints(tmp_path, Upstream(**kw))
    ddir, _ = draft_weights.trtllm_draft_dir(ck["draft"], tmp_path / "trtllm_draft", compat.release("1.2.1"), 1)
    ck["draft"] = ddir
    opts = T.llm_api_options(spec(draft_dir=str(ddir), capture_layers=ck["aux"]))
    return opts, ck


def _checks(opts, ck, **kw):
    return _checks_of(opts, ck, target_hidden_size=H, num_target_layers=8, capture_layers=ck["aux"],
                      target_rope_theta=1e5, draft_rope_theta=1e4, **kw)


def test_consistency_checks_pass_on_a_good_deployment(tmp_path):
    opts, ck = _good(tmp_path)
    got = _checks(opts, ck)
    assert [n for n, c in got.items() if not c.ok] == []
    assert {"token_budget", "cuda_graph_batch_sizes", "target_quant_config", "target_rope", "draft_vocab",
            "eagle3_capture_layers", "eagle3_fc_shape", "draft_weight_names", "draft_rope", "zero_draft_len",
            "two_model_overlap_scheduler", "no_pipeline_parallel", "draft_positions", "schema_keys"} <= set(got)


def _resave(ck, drop=(), add=None):
    from safetensors.numpy import load_file, save_file

    f = ck["draft"] / "model.safetensors"
    t = {k: v for k, v in load_file(str(f)).items() if k not in drop}
    t.update(add or {})
    f.unlink()
    save_file(t, str(f))


def _edit(path: Path, **kv):
    d = json.loads(path.read_text())
    for k, v in kv.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("name,breaker,needle", [
    ("token_budget", lambda o, ck: o.update(max_num_tokens=40, enable_chunked_prefill=True),
     "max_batch_size 16 x (1 + max_total_draft_tokens 4) = 80"),
    ("cuda_graph_batch_sizes", lambda o, ck: o["cuda_graph_config"]["batch_sizes"].append(32), "too large: [32]"),
    ("target_quant_config", lambda o, ck: (ck["target"] / "hf_quant_config.json").unlink(), "unquantized"),
    # one reader (runtime/quant/hf_quant_config.py): a file that is not JSON is named as found, not a crash
    ("target_quant_config", lambda o, ck: (ck["target"] / "hf_quant_config.json").write_text("{not json"), "found: unreadable"),
    ("draft_vocab", lambda o, ck: _resave(ck, drop=("d2t",)), "no d2t tensor"),
    # eagle3.py: unset, TensorRT-LLM captures its own default layers (and raises for L <= 5)
    ("eagle3_capture_layers", lambda o, ck: o["speculative_config"].pop("eagle3_layers_to_capture"), "Not enough hidden layers"),
    # modeling_speculative.py Eagle3DraftModel: fc = Linear(hidden_in x num_capture_layers, hidden); the rule and its
    # words are runtime/algorithms/eagle3.py check_export's (fc_shape)
    ("eagle3_fc_shape", lambda o, ck: _resave(ck, add={"fc.weight": np.zeros((H, 2 * H), np.float32)}),
     "fc.weight takes 16 inputs = 2 x hidden 8, but eagle_aux_hidden_state_layer_ids lists 3 layers"),
    # the 1.2-era Eagle3ForCausalLM.load_weights only prefixes model.: layers.0.* match no module (PR #11010 adds the remap)
    ("draft_weight_names", lambda o, ck: _resave(ck, add={"layers.0.mlp.up_proj.weight": np.zeros((H, H), np.float32)}),
     "skipped silently"),
    ("target_rope", lambda o, ck: _edit(ck["target"] / "config.json", rope_theta=None, rope_scaling=None), "no top-level "
                                                                                                           "rope_theta"),
    ("draft_rope", lambda o, ck: _edit(ck["draft"] / "config.json", rope_scaling={"rope_type": "default", "rope_theta": 1e4}),
     "RotaryScalingType rejects"),
    ("two_model_overlap_scheduler", lambda o, ck: o["speculative_config"].update(eagle3_one_model=False),
     "disable_overlap_scheduler: true"),
    ("no_pipeline_parallel", lambda o, ck: o.update(pipeline_parallel_size=2), "pipeline parallelism"),
    ("draft_positions", lambda o, ck: o.update(max_seq_len=8192, enable_chunked_prefill=True), "acceptance collapses"),
    # llm.py _check_arguments: without chunked prefill a prompt longer than max_num_tokens is refused
    ("long_prompts", lambda o, ck: o.update(max_num_tokens=1024), "should not exceed max_num_tokens (1024)"),
    ("schema_keys", lambda o, ck: o["speculative_config"].update(acceptance_rate_threshold=0.5), "acceptance_rate_threshold"),
])
def test_each_consistency_check_fails_on_a_broken_input(tmp_path, name, breaker, needle):
    opts, ck = _good(tmp_path)
    breaker(opts, ck)
    got = _checks(opts, ck)
    assert not got[name].ok, got[name].message
    assert needle in got[name].message
    assert [n for n, c in got.items() if not c.ok] == [name]   # the others still pass: checks are independent


def test_every_quant_algo_the_version_serves_is_accepted(tmp_path):
    """tensorrt_llm/_torch/modules/linear.py get_quant_method: FP8 per-tensor and FP8 per-channel-per-token
    (row-wise) both load; an algorithm the backend does not serve is named."""
    for algo, ok in (("FP8", True), ("FP8_PER_CHANNEL_PER_TOKEN", True), ("FP8_BLOCK_SCALES", True), ("FP4_SOMETHING", False)):
        opts, ck = _good(tmp_path / algo, quant_algo=algo)
        got = _checks(opts, ck)["target_quant_config"]
        assert got.ok is ok and (ok or "FP4_SOMETHING" in got.message)


def test_schedule_as_tuned_fails_when_options_would_run_something_else(tmp_path):
    opts, ck = _good(tmp_path)
    got = _checks(opts, ck, schedule=DraftSchedule.constant(3))
    assert not got["schedule_as_tuned"].ok and "k=4" in got["schedule_as_tuned"].message


# ------------------------------------------------------------------------------------------ the stage


def test_build_stage_writes_a_checked_deployment(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)   # `import tensorrt_llm` fails, whatever is installed
    ck = write_checkpoints(tmp_path)
    opts, doc, dep = run_build(tmp_path)
    assert schema.unknown_keys(opts, "1.2.1") == []
    sc = opts["speculative_config"]
    assert sc["decoding_type"] == "Eagle3" and sc["max_draft_len"] == 4 and sc["eagle3_one_model"] is True
    assert opts["max_num_tokens"] >= opts["max_batch_size"] * 5
    assert doc["load"] == {"loaded": False, "reason": load.NOT_LOADED}       # load: auto, no TensorRT-LLM
    assert doc["draft_schedule"] == {"runs": [[1, 16, 4]]} and doc["speculation"] is True
    assert doc["serving_image"] == compat.SHIPPED_TRITON_IMAGE
    assert doc["draft_dir"] == str(ck["draft"].resolve())
    readme = (dep / "README.md").read_text()
    assert "TensorRT-LLM not available" in readme and "| 1-16 | 4 |" in readme
    assert "one draft length at every batch size" in readme        # tune's note on what 1.2 one-model runs


def test_build_writes_the_capture_layers_and_checks_fc_for_any_count(tmp_path):
    """Defect 1: the draft's capture layers are written whatever they are (here TensorRT-LLM's own default for 8
    layers, {1, 3, 4}, which main left out, and 2 layers, which TensorRT-LLM's default of 3 would mis-size); fc is
    checked against n x hidden (eagle3.py Eagle3SpecMetadata, modeling_speculative.py Eagle3DraftModel.fc)."""
    for aux in ([1, 3, 4], [1, 3]):
        root = tmp_path / "-".join(map(str, aux))
        write_checkpoints(root, Upstream(aux=aux))
        opts, doc, _ = run_build(root)
        assert opts["speculative_config"]["eagle3_layers_to_capture"] == aux == doc["eagle3_layers_to_capture"]
        fc = {c["name"]: c for c in doc["checks"]}["eagle3_fc_shape"]
        assert fc["ok"] and f"{len(aux)} capture layers x {H}" in fc["message"]
    # a draft whose fc was trained on 2 layers while draft.json says 3: refused, naming fc
    root = tmp_path / "bad"
    ck = write_checkpoints(root, Upstream(aux=[1, 3, 5]))
    _resave(ck, add={"fc.weight": np.zeros((H, 2 * H), np.float32)})
    with pytest.raises(StageError, match=r"eagle3_fc_shape: .*fc.weight takes 16 inputs = 2 x hidden 8"):
        run_build(root)


def test_build_names_draft_weights_as_the_targeted_loader_reads_them(tmp_path):
    """Defect 3: ModelOpt 0.47 writes layers.<i>.*; TensorRT-LLM's module is midlayer. The 1.2 line's
    Eagle3ForCausalLM.load_weights only prefixes `model.` (the remap came with PR #11010, main commit c37531c3f7,
    2026-01-28, after the release/1.2 cut): 1.2.1 gets a renamed copy under deployment/draft, bytes unchanged; 1.3
    (which remaps) reads train_draft's draft as is. train_draft's artifact is never changed."""
    from safetensors.numpy import load_file

    ck = write_checkpoints(tmp_path / "12", Upstream(draft_layers=2))
    before = (ck["draft"] / "model.safetensors").read_bytes()
    opts, doc, dep = run_build(tmp_path / "12")
    new = dep / "draft"          # written here; the options name where the committed artifact will be
    committed = (ck["arts"] / "build" / "deployment" / "draft").resolve()
    assert opts["speculative_config"]["speculative_model"] == str(committed) == doc["trtllm_draft_dir"]
    got, src = load_file(str(new / "model.safetensors")), load_file(str(ck["draft"] / "model.safetensors"))
    assert not [k for k in got if k.startswith("layers.")]
    assert np.array_equal(got["midlayer.1.self_attn.q_proj.weight"], src["layers.1.self_attn.q_proj.weight"])
    assert np.array_equal(got["midlayer.0.hidden_norm.weight"], src["layers.0.hidden_norm.weight"])
    assert set(got) - {k for k in got if k.startswith("midlayer.")} == {"fc.weight", "norm.weight", "lm_head.weight", "d2t"}
    assert (new / "config.json").read_text() == (ck["draft"] / "config.json").read_text()
    assert (new / "tokenizer_config.json").exists()
    assert (ck["draft"] / "model.safetensors").read_bytes() == before
    assert doc["draft_dir"] == str(ck["draft"].resolve()) and doc["draft_weight_names"]["renamed"] == 5
    ck1 = write_checkpoints(tmp_path / "one")
    one = load_file(str(draft_weights.trtllm_draft_dir(ck1["draft"], tmp_path / "one" / "x", compat.release("1.2.1"),
                                           1)[0] / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in one                    # one layer: midlayer is the layer itself
    with pytest.raises(ValueError, match="merge"):                      # 2 layers named as 1: refused, not merged
        draft_weights.trtllm_draft_dir(ck["draft"], tmp_path / "two-as-one", compat.release("1.2.1"), 1)
    ck13 = write_checkpoints(tmp_path / "13", Upstream(version="1.3.0rc27"))
    opts, doc, dep = run_build(tmp_path / "13", trtllm_version="1.3.0rc27")
    assert opts["speculative_config"]["speculative_model"] == str(ck13["draft"].resolve()) and not (dep / "draft").exists()


def test_build_on_1_2_and_1_3_writes_each_versions_forms(tmp_path):
    """Done-when: `specpipe build` on a config targeting 1.3.0rc27 and one targeting 1.2.1 writes each version's
    forms: schedule keys, guard names and units, draft weight names, RoPE reading (compat.SOURCES)."""
    guard = build.AcceptanceGuard(window=64, min_acceptance_rate=0.25)
    runs12 = [[1, 4, 4], [5, 8, 2], [9, 16, 0]]
    write_checkpoints(tmp_path / "a", Upstream(runs=runs12, mode="two_model"))
    o12, d12, _ = run_build(tmp_path / "a", eagle3_mode="two_model", acceptance_guard=guard)
    write_checkpoints(tmp_path / "b", Upstream(version="1.3.0rc27"))
    o13, d13, _ = run_build(tmp_path / "b", trtllm_version="1.3.0rc27", acceptance_guard=guard)
    s12, s13 = o12["speculative_config"], o13["speculative_config"]
    assert s12["draft_len_schedule"] == {1: 4, 5: 2, 9: 0} and s12["eagle3_one_model"] is False
    assert o12["disable_overlap_scheduler"] is True
    assert s13["draft_len_schedule"] == {4: 4, 8: 2, 16: 1} and "eagle3_one_model" not in s13
    assert (s12["acceptance_window"], s12["acceptance_length_threshold"]) == (64, 1.0)
    assert (s13["acceptance_rate_window_size"], s13["acceptance_rate_threshold"]) == (64, 0.25)
    assert s12["speculative_model"].endswith("/deployment/draft") and not s13["speculative_model"].endswith("/deployment/draft")
    assert d12["draft_schedule"] == {"runs": runs12} and d13["draft_schedule"] == {"runs": [[1, 4, 4], [5, 8, 2], [9, 16, 1]]}
    assert schema.unknown_keys(o12, "1.2.1") == [] and schema.unknown_keys(o13, "1.3.0rc27") == []
    doc = json.loads((tmp_path / "b" / ".tmp" / "build" / "deployment.json").read_text())
    assert doc["serving_image"].endswith("release:1.3.0rc27")


def test_build_refuses_a_tuning_made_for_another_version_or_mode(tmp_path):
    write_checkpoints(tmp_path, Upstream(version="1.3.0rc27"))
    with pytest.raises(StageError, match="tuned for TensorRT-LLM 1.3.0rc27 one_model, but build deploys 1.2.1"):
        run_build(tmp_path)


def test_build_without_speculation_deploys_the_target_alone(tmp_path):
    """Defect 7: tune found that speculation never pays (a schedule of 0 everywhere). Main turned that into the
    trained draft length (`0 or trained_draft_len`) and failed on an unrelated check; now the deployment has no
    speculative_config and says why, and every draft check is not applicable."""
    write_checkpoints(tmp_path, Upstream(runs=[[1, 16, 0]]))
    opts, doc, dep = run_build(tmp_path)
    assert "speculative_config" not in opts and doc["speculation"] is False and doc["decoding_type"] is None
    assert doc["trtllm_draft_dir"] is None and doc["draft_dir"] is None and not (dep / "draft").exists()
    assert schema.unknown_keys(opts, "1.2.1") == []
    names = {c["name"]: c for c in doc["checks"]}
    assert names["speculation"]["ok"] and "tune predicted no speedup" in names["speculation"]["message"]
    assert "draft_vocab" not in names and all(c["ok"] for c in doc["checks"])
    readme = (dep / "README.md").read_text()
    assert "no speculative decoding" in readme and "deployed alone" in readme


def test_build_fails_with_the_named_checks(tmp_path):
    write_checkpoints(tmp_path, Upstream(d2t=False, fp8=False))
    with pytest.raises(StageError) as e:
        run_build(tmp_path, max_num_tokens=20)
    msg = str(e.value)
    for name in ("token_budget", "target_quant_config", "draft_vocab"):
        assert f"  {name}: " in msg
    assert "two_model_overlap_scheduler" not in msg


def test_bench_dataset_holds_enough_requests_for_its_concurrency(tmp_path):
    """Defect 8: with 6 eval prompts, main's bench ran `--concurrency 256` over 6 requests: no batch above 6 was
    ever measured. The dataset now holds bench.rounds x concurrency requests."""
    write_checkpoints(tmp_path / "a")
    _, doc, dep = run_build(tmp_path / "a")
    rows = [json.loads(line) for line in (dep / "bench_dataset.jsonl").read_text().splitlines()]
    assert doc["bench_concurrency"] == 16 and len(rows) == doc["bench_requests"] == 4 * 16 >= 16
    assert [r["task_id"] for r in rows] == list(range(64)) and doc["bench_prompts"] == 6
    assert set(rows[0]) == {"task_id", "prompt", "input_ids", "output_tokens", "category"} and rows[0]["output_tokens"] == 128
    assert rows[6]["prompt"] == rows[0]["prompt"] and {r["category"] for r in rows} == {"code", "prose"}
    write_checkpoints(tmp_path / "b")
    _, doc, dep = run_build(tmp_path / "b", bench=build.Bench(concurrency=256, rounds=2))
    assert doc["bench_requests"] == 512 and len((dep / "bench_dataset.jsonl").read_text().splitlines()) == 512
    assert "--concurrency 256" in (dep / "bench.sh").read_text()


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


def test_version_as_yaml_writes_it():
    assert build.Config(trtllm_version=1.3).trtllm_version == compat.REFERENCE_1_3   # YAML `1.3` is a float
    assert build.Config(trtllm_version="1.2").trtllm_version == compat.DEFAULT_TRTLLM_VERSION
    assert build.Config(trtllm_version="1.3.0rc5").trtllm_version == "1.3.0rc5"


# ------------------------------------------------------------------------------------------ RoPE in config.json


def test_build_checks_rope_against_the_source_model(tmp_path):
    """A target config.json as transformers 5 writes it (rope_parameters only) fails the 1.2.1 build; the same
    passes 1.3.0rc27 (transformers 5 reads it); a theta that is not the source model's fails both."""
    write_checkpoints(tmp_path / "a", Upstream(target_rope="transformers5"))
    with pytest.raises(StageError, match="target_rope: .*no top-level rope_theta"):
        run_build(tmp_path / "a")
    write_checkpoints(tmp_path / "b", Upstream(target_rope="transformers5", version="1.3.0rc27"))
    run_build(tmp_path / "b", trtllm_version="1.3.0rc27")
    ck = write_checkpoints(tmp_path / "c")
    _edit(ck["target"] / "config.json", **hf_config.normalize({"rope_theta": 10000.0}))
    with pytest.raises(StageError, match="theta 10000 differs from the model's 100000"):
        run_build(tmp_path / "c")


# ------------------------------------------------------------------------------------------ long prompts


def test_prompt_admission_is_tensorrt_llms_check_arguments():
    """tensorrt_llm/llmapi/llm.py BaseLLM._check_arguments (compat.SOURCES prompt_vs_max_num_tokens): on the PyTorch
    backend, without enable_chunked_prefill, prompt_len / cp_size + query_len > max_num_tokens is refused."""
    opts = {"max_num_tokens": 8192, "max_seq_len": 131072}
    assert checks.prompt_rejection(opts, 8192) is None
    assert "should not exceed max_num_tokens (8192)" in checks.prompt_rejection(opts, 8193)
    assert "prompt length (8193.0), query length (0)" in checks.prompt_rejection(opts, 8193)
    assert checks.prompt_rejection(opts, 8000, query_len=192) is None
    assert checks.prompt_rejection(opts, 8000, query_len=193) is not None
    assert checks.prompt_rejection(opts, 16384, cp_size=2) is None
    assert checks.prompt_rejection(opts, 100_000, is_gen_only=True) is None
    assert checks.prompt_rejection({**opts, "enable_chunked_prefill": True}, 131071) is None
    assert checks.prompt_rejection({"max_seq_len": 131072}, 8193) is not None     # TorchLlmArgs default 8192
    ok, msg = checks.long_prompt_check(opts)
    assert not ok and "131071 tokens" in msg and "build.chunked_prefill: auto" in msg


@pytest.mark.parametrize("cfg_file", [p for p in sorted((REPO / "configs").glob("*.yaml")) if not needs_prepared_inputs(p)],
                         ids=lambda p: p.stem)
def test_every_shipped_config_serves_prompts_up_to_its_max_seq_len(tmp_path, cfg_file):
    """The configs that load without the real model's prepared inputs (the others: test_build_real.py); what is
    checked: support.synthetic.serves_up_to_max_seq_len."""
    serves_up_to_max_seq_len(tmp_path, cfg_file)


def test_chunked_prefill_off_is_a_deliberate_cap_and_a_contradiction_fails(tmp_path):
    cfg_file = REPO / "configs" / "llama70b_fp8_eagle3.yaml"
    opts, doc = shipped_build(tmp_path / "off", cfg_file, 131072, chunked_prefill="off")
    assert "enable_chunked_prefill" not in opts and opts["max_seq_len"] == opts["max_num_tokens"]
    assert checks.prompt_rejection(opts, opts["max_seq_len"] - 1) is None
    short, _ = shipped_build(tmp_path / "short", cfg_file, 2048)       # a short context needs no chunking
    assert "enable_chunked_prefill" not in short and short["max_seq_len"] == 2048
    with pytest.raises(StageError, match="long_prompts: a prompt of 32767 tokens"):
        shipped_build(tmp_path / "bad", cfg_file, 131072, chunked_prefill="off", max_seq_len=32768)
