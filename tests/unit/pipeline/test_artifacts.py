"""pipeline.artifacts: the one reader of each artifact contract refuses what breaks the contract, naming the file,
instead of filtering rows out silently (the consumers used to apply five different row filters)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.artifacts import build, data, export, quantize, target, train_draft, tune, validate
from pipeline.errors import StageError


def _parquet(path, ids, masks):
    from datasets import Dataset

    Dataset.from_dict({"input_ids": ids, "loss_mask": masks, "domain": ["d"] * len(ids),
                       "source": ["s"] * len(ids)}).to_parquet(str(path))


def test_rows_are_read_truncated_and_the_row_rule_is_checked(tmp_path):
    _parquet(tmp_path / "calib.parquet", [[1, 2, 3, 4], [5, 6, 7]], [[0, 1, 1, 1], [0, 0, 1]])
    assert data.read_rows(tmp_path, "calib") == [([1, 2, 3, 4], [0, 1, 1, 1]), ([5, 6, 7], [0, 0, 1])]
    assert data.read_rows(tmp_path, "calib", limit=1, max_len=2) == [([1, 2], [0, 1])]
    _parquet(tmp_path / "train.parquet", [[1, 2, 3], [4, 5]], [[0, 1, 1], [0, 0]])
    with pytest.raises(StageError, match=r"train\.parquet row 1: 2 tokens, 2 mask entries, 0 trained on"):
        data.read_rows(tmp_path, "train")
    with pytest.raises(StageError, match=r"heldout\.parquet is missing"):
        data.read_rows(tmp_path, "heldout")


def test_eval_prompts_round_trip_and_a_broken_line_names_its_place(tmp_path):
    ps = [data.EvalPrompt(id="code-0", prompt="def f", prompt_ids=[1, 2, 3], reference=None),
          data.EvalPrompt(id="code-1", prompt="import", prompt_ids=[4, 5], reference="x")]
    data.write_eval(tmp_path, "code", ps)
    data.write_eval(tmp_path, "prose", ps[:1])
    assert data.read_eval(tmp_path) == {"code": ps, "prose": ps[:1]}
    assert data.read_eval(tmp_path, domains={"code"}, per_domain=1) == {"code": ps[:1]}
    (tmp_path / "eval" / "prose.jsonl").write_text(json.dumps({"id": "p", "prompt": "x"}) + "\n")
    with pytest.raises(StageError, match=r"prose\.jsonl:1: not an eval prompt of the data contract \(KeyError"):
        data.read_eval(tmp_path)
    (tmp_path / "eval" / "prose.jsonl").write_text(json.dumps({"id": "p", "prompt": "x", "prompt_ids": []}) + "\n")
    with pytest.raises(StageError, match=r"prose\.jsonl:1: empty prompt_ids"):
        data.read_eval(tmp_path)
    with pytest.raises(StageError, match="no evaluation domains"):
        data.read_eval(tmp_path / "nothing")


def test_quantize_info_resolves_paths_against_the_artifacts_directory(tmp_path):
    (tmp_path / "quantize").mkdir()
    (tmp_path / "quantize" / "quantize.json").write_text(json.dumps({
        "format": "fp8", "quant_algo": "FP8", "kv_cache": "fp8", "target_dir": "quantize/target_fp8",
        "draft_dir": "quantize/draft_fp8", "draft_format": "fp8"}))
    q = quantize.read_info(tmp_path / "quantize")
    assert q.draft_is_fp8 and q.kv_cache_fp8 and q.format == "fp8"
    assert q.target_dir(tmp_path) == (tmp_path / "quantize" / "target_fp8").resolve()
    assert q.draft_dir(tmp_path) == (tmp_path / "quantize" / "draft_fp8").resolve()


def test_stop_ids_prefer_the_list():
    from runtime.records import stop_ids

    assert stop_ids({"eos_token_ids": [7, 2, 7], "eos_token_id": 7}) == [2, 7]
    assert stop_ids({"eos_token_id": 5}) == [5]


# one document per record, as its stage writes it (the fields the readers use)
_TARGET = {"architecture": "LlamaForCausalLM", "num_layers": 4, "hidden_size": 64, "vocab_size": 512,
           "eos_token_id": 9, "eos_token_ids": [9, 2], "max_position_embeddings": 512}
_DRAFT = {"algorithm": "EAGLE3", "num_layers": 1, "aux_layer_ids": [1, 2], "block_size": None}
_TUNING = {"deployment": {"trtllm_version": "1.2.1", "mode": "one_model", "note": "n"},
           "draft_schedule": {"runs": [[1, 16, 3]]}, "max_batch_size": 16}
_DEPLOYMENT = {"trtllm_version": "1.2.1", "serving_image": "img", "target_dir": "/t", "draft_dir": "/d",
               "options_file": "deployment/llm_api_options.yaml", "draft_schedule": {"runs": [[1, 8, 3], [9, 16, 1]]}}
_ACCEPTANCE = {"measured_draft_len": 4, "domains": {"code": {"fp8": {"per_position": [0.5]}}},
               "overall": {"fp8": {"per_position": [0.5]}}, "gates": {"passed": True, "rows": []}}
_EXPORT = {"model_name": "m", "trtllm_version": "1.2.1", "serving_image": "img",
           "served_identity": {"target": {"config": "ab"}}}

RECORDS = [   # (stage, file, reader, document, the fields its contract requires)
    ("target", "target.json", target.read_info, _TARGET, ("architecture", "num_layers", "hidden_size", "vocab_size")),
    ("train_draft", "draft.json", train_draft.read_info, _DRAFT, ("algorithm",)),
    ("tune", "tuning.json", tune.read_tuning, _TUNING, ("deployment", "draft_schedule", "max_batch_size")),
    ("build", "deployment.json", build.read_deployment, _DEPLOYMENT,
     ("trtllm_version", "serving_image", "target_dir", "draft_dir", "options_file", "draft_schedule")),
    ("validate", "acceptance.json", validate.read_acceptance, _ACCEPTANCE,
     ("measured_draft_len", "domains", "overall", "gates")),
    ("export", "export.json", export.read_export, _EXPORT, ("model_name", "trtllm_version", "serving_image")),
]
MISSING = [(stage, f, reader, doc, field) for stage, f, reader, doc, req in RECORDS for field in req]


@pytest.mark.parametrize(("stage", "name", "reader", "doc", "field"), MISSING,
                         ids=[f"{m[1]}-{m[4]}" for m in MISSING])
def test_a_record_refuses_a_document_missing_a_required_field(tmp_path, stage, name, reader, doc, field):
    art = tmp_path / stage
    art.mkdir()
    (art / name).write_text(json.dumps(doc))
    rec = reader(art)
    assert rec.raw == doc                                    # the whole document, as written
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.raw = {}
    (art / name).write_text(json.dumps({k: v for k, v in doc.items() if k != field}))
    with pytest.raises(StageError) as e:
        reader(art)
    msg = str(e.value)
    assert str(art / name) in msg and repr(field) in msg and f"--force {stage}`" in msg


@pytest.mark.parametrize(("stage", "name", "reader"), [r[:3] for r in RECORDS], ids=[r[1] for r in RECORDS])
def test_a_record_refuses_a_file_that_is_not_there_or_not_json(tmp_path, stage, name, reader):
    art = tmp_path / stage
    art.mkdir()
    with pytest.raises(StageError, match=rf"{name}: not readable.*--force {stage}`"):
        reader(art)
    (art / name).write_text("{not json")
    with pytest.raises(StageError, match=rf"{name}: not readable.*--force {stage}`"):
        reader(art)


def test_records_decide_their_defaults_once(tmp_path):
    for stage, name, _, doc, _ in RECORDS:
        (tmp_path / stage).mkdir()
        (tmp_path / stage / name).write_text(json.dumps(doc))
    t = target.read_info(tmp_path / "target")
    assert (t.dtype, t.stop_ids, t.eos_token_id, t.mask_token_id) == ("bfloat16", (2, 9), 9, None)
    assert (t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (None, None, None)
    (tmp_path / "target" / "target.json").write_text(json.dumps({**_TARGET, "num_attention_heads": 8}))
    t = target.read_info(tmp_path / "target")                  # no num_key_value_heads: multi-head attention
    assert (t.num_attention_heads, t.num_key_value_heads) == (8, 8)
    (tmp_path / "target" / "target.json").write_text(json.dumps({**_TARGET, "eos_token_id": [7, 3], "eos_token_ids": None}))
    t = target.read_info(tmp_path / "target")                  # an HF config's list of eos ids
    assert (t.eos_token_id, t.stop_ids) == (7, (3, 7))
    d = train_draft.read_info(tmp_path / "train_draft")
    assert (d.algorithm, d.capture_layers, d.block_size) == ("eagle3", [1, 2], None)
    (tmp_path / "train_draft" / "draft.json").write_text(json.dumps({"algorithm": "dflash", "target_layer_ids": [0, 3],
                                                                      "aux_layer_ids": [1], "block_size": 8}))
    d = train_draft.read_info(tmp_path / "train_draft")
    assert (d.algorithm, d.capture_layers, d.block_size) == ("dflash", [0, 3], 8)
    tu = tune.read_tuning(tmp_path / "tune")
    assert (tu.max_num_tokens, tu.cuda_graph_batch_sizes, tu.predicted, tu.note) == (None, [1, 2, 4, 8], [], "n")
    legacy = {**_TUNING, "acceptance": {"K": 3, "source_max_draft_len": 4, "weights": {"c": 1.0}}}
    (tmp_path / "tune" / "tuning.json").write_text(json.dumps(legacy))   # a tuning.json from before the glossary renames
    assert tune.read_tuning(tmp_path / "tune").acceptance == {"draft_len": 3, "measured_draft_len": 4,
                                                              "weights": {"c": 1.0}}
    dep = build.read_deployment(tmp_path / "build")
    assert dep.trtllm_draft_dir == "/d" and dep.speculation and dep.algorithm is None
    assert [dep.schedule().k_at(b) for b in (1, 8, 9, 16)] == [3, 3, 1, 1]
    acc = validate.read_acceptance(tmp_path / "validate")
    assert (acc.passed, acc.max_new_tokens, acc.temperature, acc.eos_token_ids, acc.pairs) == (True, 48, 0.0, [], {})
    assert (acc.engines, acc.ngram, acc.runtime, acc.batch_size) == ({}, None, None, None)
    assert acc.domains["code"].fp8.per_position == [0.5] and acc.overall.bf16 is None
    old = {**{k: v for k, v in _ACCEPTANCE.items() if k != "measured_draft_len"}, "max_draft_len": 5}
    (tmp_path / "validate" / "acceptance.json").write_text(json.dumps(old))      # before the rename
    assert validate.read_acceptance(tmp_path / "validate").measured_draft_len == 5
    ex = export.read_export(tmp_path / "export")
    assert (ex.served_identity, ex.speculators, ex.prompt_format, ex.triton_image) == (_EXPORT["served_identity"], None, {},
                                                                                       None)


def test_deployment_options_and_the_draft_config_name_their_file(tmp_path):
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "deployment.json").write_text(json.dumps(_DEPLOYMENT))
    dep = build.read_deployment(tmp_path / "build")
    with pytest.raises(StageError, match=r"llm_api_options\.yaml: the LLM-API options .*--force build`"):
        build.read_options(tmp_path / "build", dep)
    (tmp_path / "build" / "deployment").mkdir()
    (tmp_path / "build" / "deployment" / "llm_api_options.yaml").write_text("max_batch_size: 16\n")
    assert build.read_options(tmp_path / "build", dep) == {"max_batch_size": 16}
    with pytest.raises(StageError, match=r"draft/config\.json: the draft checkpoint's config\.json .*--force train_draft`"):
        train_draft.read_draft_config(tmp_path / "train_draft")
    (tmp_path / "train_draft" / "draft").mkdir(parents=True)
    (tmp_path / "train_draft" / "draft" / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    c = train_draft.read_draft_config(tmp_path / "train_draft")
    assert (c.num_hidden_layers, c.max_position_embeddings, c.raw) == (2, None, {"num_hidden_layers": 2})
    with pytest.raises(StageError, match=r"draft_fp8/config\.json: .*--force quantize`"):   # quantize's FP8 draft
        train_draft.read_config(tmp_path / "quantize" / "draft_fp8")
