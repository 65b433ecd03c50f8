"""runtime/quant/hf_quant_config.py: the one reader of hf_quant_config.json (ModelOpt 0.47's export writes
{"producer": ..., "quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}: modelopt/torch/export/
unified_export_hf.py in the installed modelopt 0.47 wheel), and every caller reading it the same way."""
from __future__ import annotations

import json

import pytest

from runtime.engine.fp8 import checkpoint
from runtime.quant import checks, hf_quant_config


def _write(d, doc):
    d.mkdir(parents=True, exist_ok=True)
    (d / "hf_quant_config.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return d


def test_nested_flat_and_missing_read_the_same_everywhere(tmp_path):
    nested = _write(tmp_path / "n", {"producer": {"name": "modelopt"},
                                     "quantization": {"quant_algo": "fp8", "kv_cache_quant_algo": "fp8"}})
    flat = _write(tmp_path / "f", {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"})
    missing = tmp_path / "m"
    missing.mkdir()
    assert hf_quant_config.read(nested) == {"quant_algo": "fp8", "kv_cache_quant_algo": "fp8"}
    assert hf_quant_config.quant_algo(nested) == "FP8" and hf_quant_config.kv_cache_quant_algo(nested) == "FP8"
    assert hf_quant_config.quant_algo(flat) == "FP8_PER_CHANNEL_PER_TOKEN"
    assert hf_quant_config.kv_cache_quant_algo(flat) is None
    assert hf_quant_config.read(missing) is None and hf_quant_config.quant_algo(missing) is None
    # the callers: the runtime's FP8 loader and quantize's checks agree with the reader
    for d in (nested, flat, missing):
        assert checkpoint.quant_algo(d) == hf_quant_config.quant_algo(d)
        assert checks.read_hf_quant_config(d) == (hf_quant_config.read(d) or {})
    assert checkpoint.is_fp8_checkpoint(nested) and checkpoint.is_fp8_checkpoint(flat)
    assert not checkpoint.is_fp8_checkpoint(missing)


@pytest.mark.parametrize("text,needle", [("{not json", "not readable as JSON"), ("[1, 2]", "expected a JSON object"),
                                         ('{"quantization": "FP8"}', "`quantization` must be an object")])
def test_a_broken_file_is_named(tmp_path, text, needle):
    d = _write(tmp_path / "b", text)
    with pytest.raises(hf_quant_config.HFQuantConfigError, match=needle) as e:
        hf_quant_config.read(d)
    assert str(d / "hf_quant_config.json") in str(e.value)
