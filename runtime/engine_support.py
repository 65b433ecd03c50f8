"""What the engines specpipe drives can run, where more than one stage decides on it: a ground-floor module.

data (which engine regenerates the answers: runtime/data/regen_engines.py) and validate (the vLLM arm's preflight:
runtime/validate/vllm_arm.py) both ask whether vLLM's CPU attention has a kernel for a model's head size. The
fact lives here, beside runtime/algorithms/, so that data's code fingerprint (pipeline/codehash.py) does not reach
the validate stage's vLLM arm and the vLLM export code behind it: an edit there no longer reruns data.
"""
from __future__ import annotations

import json
from pathlib import Path

# vllm/v1/attention/backends/cpu_attn.py (v0.32.0), CPUAttentionBackend.get_supported_head_sizes
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_dim(model_dir: Path) -> int:
    """A model directory's attention head size, from its config.json (`head_dim`, else hidden / heads)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
