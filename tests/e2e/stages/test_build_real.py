"""Stage `build` on the real model's inputs (tests/e2e: `real_model`, prepared by `bash bench/real_model/prepare.sh`;
skipped, naming it, where they are not prepared, a failure under CI): the shipped real-model configs' deployment, and
SmolLM2's own config.json through the RoPE normalization. The rest of the build stage's tests: test_build.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runtime import hf_config

from support import REPO
from support.synthetic import needs_prepared_inputs, serves_up_to_max_seq_len


@pytest.mark.parametrize("cfg_file", [p for p in sorted((REPO / "configs").glob("*.yaml")) if needs_prepared_inputs(p)],
                         ids=lambda p: p.stem)
def test_every_real_model_config_serves_prompts_up_to_its_max_seq_len(tmp_path, cfg_file, real_model):
    """As test_build.py's shipped configs: support.synthetic.serves_up_to_max_seq_len, on the configs that read the
    prepared inputs (the config loads only where they are)."""
    serves_up_to_max_seq_len(tmp_path, cfg_file)


def test_rope_is_written_in_the_form_each_version_reads(real_model):
    """SmolLM2's config.json (transformers 5.14.1) states theta 1e5 only in `rope_parameters`. TensorRT-LLM 1.2 pins
    transformers 4.57.1 (requirements.txt stored 000867d9) and RopeParams.from_config reads config.rope_theta
    (default 10000) and config.rope_scaling through RotaryScalingType.from_string, which rejects 'default'
    (attention_backend/interface.py, functional.py: compat.SOURCES rope_1_2); transformers 5 reads rope_parameters."""
    from transformers import AutoConfig

    raw = json.loads((real_model["model_dir"] / "config.json").read_text())
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 1e5
    assert "no top-level rope_theta" in " ".join(hf_config.problems(raw, "legacy"))
    assert hf_config.problems(raw, "rope_parameters", expected_theta=1e5) == []
    norm = hf_config.normalize(raw)
    assert norm["rope_theta"] == 1e5 and norm["rope_scaling"] is None
    assert norm["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e5}
    assert hf_config.problems(norm, "legacy", expected_theta=1e5) == hf_config.problems(norm, "rope_parameters",
                                                                                        expected_theta=1e5) == []
    # the transformers 4.57 reading (an attribute per key, defaults for the rest) gets 1e5 and no scaling
    assert norm.get("rope_theta", 10000.0) == 1e5 and norm.get("rope_scaling") is None
    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"rope-{os.getpid()}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(norm))
    assert AutoConfig.from_pretrained(d).rope_parameters["rope_theta"] == 1e5   # transformers 5 too
    # ModelOpt's EAGLE-3 export form (default-type rope_scaling) is what 1.2 cannot read; normalized it can
    mo = {"rope_theta": 1e4, "rope_scaling": {"rope_type": "default", "rope_theta": 1e4}}
    assert "RotaryScalingType rejects" in " ".join(hf_config.problems(mo, "legacy"))
    assert hf_config.problems(hf_config.normalize(mo), "legacy") == []
    # scaled RoPE keeps its scaling in both forms; contradictory forms are an error, not a guess
    y = hf_config.normalize({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e5, "factor": 4.0,
                                                 "original_max_position_embeddings": 8192}})
    assert y["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(hf_config.RopeError, match="different RoPE thetas"):
        hf_config.normalize({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
