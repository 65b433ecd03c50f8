"""pipeline.artifacts: the one reader of each artifact contract refuses what breaks the contract, naming the file,
instead of filtering rows out silently (the consumers used to apply five different row filters)."""
from __future__ import annotations

import json

import pytest

from pipeline.artifacts import data, quantize, target
from pipeline.errors import StageError

pytestmark = pytest.mark.fast


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
    assert target.stop_ids({"eos_token_ids": [7, 2, 7], "eos_token_id": 7}) == [2, 7]
    assert target.stop_ids({"eos_token_id": 5}) == [5]
