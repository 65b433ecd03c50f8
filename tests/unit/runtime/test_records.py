"""The artifact records write themselves: `from_json(to_json(x)) == x` for every record, each built with every field
set away from its default (a field `to_json` forgot, or `from_json` did not read back, makes the round trip fail),
through real JSON text (tuples become lists and come back)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from runtime.algorithms.schedule import DraftSchedule
from runtime.records import DraftInfo, EvalPrompt, QuantizeInfo, TargetInfo
from runtime.records_deploy import CheckRow, DeploymentInfo, ExportInfo, TuningInfo
from runtime.records_validate import AcceptanceInfo, DomainAcceptance, GateRow, Gates, PairAcceptance

SCHEDULE = DraftSchedule(((1, 4, 3), (5, 8, 2), (9, None, 0)))
PAIR = PairAcceptance(acceptance_length=2.5, per_position=[0.8, 0.5, None], prompts=4,
                      figures={"drafted": 30, "accepted": 15, "draft_acceptance_rate": 0.5})
DOMAIN = DomainAcceptance(fp8=PAIR, bf16=dataclasses.replace(PAIR, acceptance_length=2.6), retention=0.96,
                          arms={"fp8_other_norm": {"first_layer_norm": "serving", "acceptance_length": 2.4}})

RECORDS = [
    EvalPrompt(id="code-0", prompt="def f", prompt_ids=[1, 2, 3], reference="x"),
    TargetInfo(architecture="LlamaForCausalLM", num_layers=4, hidden_size=64, vocab_size=512, num_attention_heads=8,
               num_key_value_heads=2, intermediate_size=172, head_dim=8, dtype="float32", eos_token_ids=(9, 2),
               max_position_embeddings=512, mask_token_id=5, mask_token="<|mask|>", source="bootstrap:tiny",
               model_type="llama", tokenizer_size=513, end_of_turn={"id": 9, "token": "<|end|>"},
               eos_sources={"config": [2]}, eos_rejected=[{"id": 3, "token": "x", "source": "s", "why": "w"}],
               pad_token_id=0, has_chat_template=True, num_parameters=123456),
    DraftInfo(algorithm="eagle3", num_layers=1, block_size=4, capture_layers=[1, 2, 3], capture_field="aux_layer_ids",
              draft_vocab_size=256,
              vocab_size=512, max_position_embeddings=512, has_d2t=True, mask_token_id=5, trained_draft_len=3,
              objective="kl", rope_scaling={"type": "linear", "factor": 2.0}, serving_context={"max_seq_len": 512},
              mode="online", acceptance_length=2.1, eval_draft_len=3, acceptance_estimator="runtime", exported_step=40,
              export_reason="best held-out AL", draft_vocab={"token_coverage": 0.99},
              budget={"max_minutes": 36, "steps": 423}),
    DraftInfo(algorithm="dflash", capture_layers=[0, 3], capture_field="target_layer_ids",
              block_size=8),     # the other capture-layer key
    QuantizeInfo(format="fp8", quant_algo="FP8", kv_cache="fp8", target_rel="quantize/target_fp8",
                 draft_rel="train_draft/draft", draft_format="bf16", exclude_modules=["lm_head"],
                 auto_excluded=["model.layers.0.*"], recipes_tried=["fp8"], calib_samples=64, calib_seq_len=256,
                 checks=[{"name": "scales", "ok": True}]),
    AcceptanceInfo(measured_draft_len=3, domains={"code": DOMAIN, "prose": DomainAcceptance(fp8=PAIR)},
                   overall=DOMAIN, gates=Gates.of([GateRow("code", "acceptance_length", 2.5, 1.5, True),
                                                   GateRow("vllm", "agreement", "0.1", "<= 0.2", True, {"engine": "v"})]),
                   pairs={"fp8": {"target_dir": "quantize/target_fp8", "draft_dir": "train_draft/draft"}},
                   max_new_tokens=32, temperature=0.7, batch_size=4, runtime="reference", runtime_reason="no GPU",
                   requested_max_draft_len=4, eos_token_ids=[9, 2], same_pair=False, draft={"first_layer_norm": "modelopt"},
                   draft_kv_cache={"dtype": "bf16", "why": "w"}, lossless={"passed": True}, tokens_per_s={"speedup": 1.2},
                   step_ms={"target": 3.0}, fp8_info={"kv": "fp8"}, trtllm_version="1.2.1",
                   engines={"vllm": {"ran": False}}, ngram={"k": 3}, hybrid={"k": 3}),
    AcceptanceInfo(measured_draft_len=2, domains={}, overall=DomainAcceptance(),
                   gates=Gates(passed=False, detail="an old gates string"), pairs={}),
    TuningInfo(deployment={"trtllm_version": "1.2.1", "mode": "one_model", "name": "per_batch", "note": "n"},
               draft_schedule=SCHEDULE, max_batch_size=16, speculation=False, max_draft_len=3, max_num_tokens=2048,
               cuda_graph_batch_sizes=[1, 2], context_length=1024, kv_capacity_sequences=20, hardware={"gpu": "h100"},
               models={"algorithm": "eagle3"}, acceptance={"draft_len": 3, "measured_draft_len": 4},
               predicted=[{"batch": 1, "k": 3}], prediction_check={"ok": True}, sa_enhancer={"deploy": False}),
    DeploymentInfo(trtllm_version="1.2.1", serving_image="img", target_dir="/t", draft_dir="/d",
                   options_file="deployment/llm_api_options.yaml", draft_schedule=SCHEDULE, trtllm_draft_dir="/b/d",
                   algorithm="eagle3", mode="one_model", speculation=False, decoding_type="Eagle3", backend="other",
                   draft_weight_names={"renamed": 4}, eagle3_layers_to_capture=[1, 2, 3], max_draft_len=3,
                   max_batch_size=16, max_num_tokens=2048, max_seq_len=1024, enable_chunked_prefill=True,
                   schedule_note="n", acceptance_guard={"window": 8}, acceptance_guard_note="g",
                   bench={"prompts": 4, "requests": 8, "concurrency": 2, "model_name": "m"}, load={"loaded": False},
                   checks=(CheckRow("options", True, "ok"),), workdir="/w", ngram={"k": 3}, sa_enhancer={"note": "s"}),
    ExportInfo(model_name="m", trtllm_version="1.2.1", serving_image="img", triton_image="t", decoupled=True,
               container_path="/models", speculation=True, prompt_format={"file": "triton/prompt_format.json"},
               cpu_repository="triton_cpu", config_pbtxt={"triton/m/config.pbtxt": "parsed"},
               speculators={"speculative_tokens": 3}, speculation_profile={"files": ["p.json"]},
               monitoring={"rules": "r"}, served_identity={"target": {"config": "ab"}}),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_reads_back_what_it_writes(record):
    doc = json.loads(json.dumps(record.to_json()))
    back = type(record).from_json(doc)
    assert back == record
    assert json.loads(json.dumps(back.to_json())) == doc          # and writes the same document again


def test_every_field_of_the_round_trip_records_is_set():
    """The round trip proves a field is written only where its value is not the default: the first record of each
    type sets every field (raw aside), so a field missing from `to_json` fails above."""
    seen = set()
    for rec in RECORDS:
        if type(rec) in seen:
            continue
        seen.add(type(rec))
        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else
                             f.default_factory() if f.default_factory is not dataclasses.MISSING else object())
                    for f in dataclasses.fields(rec) if f.name != "raw"}
        same = [n for n, d in defaults.items() if getattr(rec, n) == d]
        assert not same, f"{type(rec).__name__}: set {same} away from their defaults"


def test_acceptance_reads_the_older_name_of_the_measured_draft_length():
    """acceptance.json said `max_draft_len` before it said `measured_draft_len` (the deployed length is tuning.json's
    and deployment.json's `max_draft_len`); an older document reads the same and is written with the new name."""
    doc = {"max_draft_len": 4, "domains": {}, "overall": {}, "gates": {"passed": True, "rows": []}}
    acc = AcceptanceInfo.from_json(doc)
    assert acc.measured_draft_len == 4
    out = acc.to_json()
    assert out["measured_draft_len"] == 4 and "max_draft_len" not in out
    old = Gates.from_json({"passed": False, "code": {"measured": 1.4, "required": 2.0}})   # gates without rows
    assert not old.passed and old.rows == () and old.detail == {"code": {"measured": 1.4, "required": 2.0}}
    assert Gates.from_json(json.loads(json.dumps(old.to_json()))) == old


def test_nested_acceptance_types_read_what_consumers_use():
    acc = AcceptanceInfo.from_json(json.loads(json.dumps(RECORDS[5].to_json())))
    code = acc.domains["code"]
    assert code.fp8.per_position == [0.8, 0.5, None] and code.bf16.acceptance_length == 2.6
    assert code.entry("fp8_other_norm")["first_layer_norm"] == "serving" and code.entry("ngram") == {}
    assert code.entry("fp8")["drafted"] == 30
    assert acc.passed and [r.failure() for r in acc.gates.rows if not r.passed] == []
    assert not RECORDS[6].passed


def test_target_stop_ids_come_from_one_field():
    t = RECORDS[1]
    assert (t.eos_token_id, t.stop_ids) == (9, (2, 9))
    assert TargetInfo.from_json({**t.to_json(), "eos_token_ids": None, "eos_token_id": [7, 3]}).stop_ids == (3, 7)


def test_draft_json_capture_fields_are_the_algorithms():
    """records.py keeps draft.json's capture-layer field per algorithm without importing the algorithms (a stage
    reading a record would reach every algorithm's code): the table must say what each algorithm's writer writes."""
    from runtime.algorithms import registry
    from runtime.records import _DRAFT_JSON_CAPTURE_FIELD

    trained = {n: registry.get(n).capture_field for n in ("eagle3", "dflash")}
    assert _DRAFT_JSON_CAPTURE_FIELD == trained
