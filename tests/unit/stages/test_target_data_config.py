"""Stages `target` and `data` in process, without building anything: their config sections, cross-section checks
and local-input fingerprints, as `specpipe check`/`plan` see them. The builds themselves (formats, masks, malformed
lines, regeneration) run through the CLI in tests/integration/stages/test_target_data.py."""
from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from pipeline.config import load_config
from pipeline.errors import ConfigError
from stages import data, target


def _config(tmp_path, text: str):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_target_takes_exactly_one_source():
    with pytest.raises(ValidationError, match="exactly one of target.model"):
        target.Config()
    with pytest.raises(ValidationError, match="exactly one of target.model"):
        target.Config(model="/some/where", bootstrap="tiny")
    assert target.Config(bootstrap="tiny").tiny.steps == 400


@pytest.mark.parametrize("shape,word", [({"hidden_size": 250, "num_heads": 4}, "hidden_size 250"),
                                        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads 3")])
def test_tiny_target_shape_is_checked(shape, word):
    with pytest.raises(ValidationError, match=word):
        target.TinyConfig(**shape)


def test_a_local_target_directory_enters_the_fingerprint(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    sec = target.Config(model=str(model))
    before = target.fingerprint_extra(sec)
    assert before == {"config.json": [2, int((model / "config.json").stat().st_mtime)]}
    (model / "config.json").write_text('{"a": 1}')
    assert target.fingerprint_extra(sec) != before
    assert target.fingerprint_extra(target.Config(model="org/name")) is None   # a hub id: its revision decides


def test_data_checks_name_the_field(tmp_path):
    bad_tmpl = tmp_path / "t.jinja"
    bad_tmpl.write_text("{% for m in messages %}")
    cfg = _config(tmp_path, f"""
target: {{model: {tmp_path}}}
data:
  sources: [{{kind: bootstrap}}, {{kind: jsonl, path: {tmp_path}/missing.jsonl}}]
  chat_template: {bad_tmpl}
""")
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    problems = dict(ei.value.problems)
    assert "target.bootstrap: tiny" in problems["data.sources.0.kind"]
    assert "file not found" in problems["data.sources.1.path"]
    assert "not a valid Jinja chat template" in problems["data.chat_template"]


def test_data_regeneration_must_leave_room_for_a_prompt(tmp_path):
    cfg = _config(tmp_path, """
target: {bootstrap: tiny}
data: {max_length: 64, regenerate: {enabled: true, engine: runtime, max_new_tokens: 64}}
""")
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    assert "leaves no room for a prompt" in dict(ei.value.problems)["data.regenerate.max_new_tokens"]


def test_a_local_data_file_enters_the_fingerprint_and_how_it_is_reached_does_not(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "hello"}) + "\n")
    sec = data.Config(sources=[{"kind": "jsonl", "path": str(rows)}])
    before = data.fingerprint_extra(sec)
    assert list(before) == [str(rows)]
    os.utime(rows, (1, 1))
    assert data.fingerprint_extra(sec) != before
    # where regeneration's endpoint is and how it is reached says how, not what: kept out of data's fingerprint
    assert {"regenerate.endpoint", "regenerate.api_key_env", "regenerate.concurrency"} <= set(data.EXECUTION_ONLY)
