"""An FP8 EAGLE-3 draft on TensorRT-LLM 1.2: the draft's `fc` stays in BF16, or the config is refused (issue 22 item 4).

Upstream, NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_speculative.py `Eagle3DraftModel.__init__`:
- 1.2-era, byshiue/TensorRT-LLM@022e9f62376de38db7d089ebbfb790c0ba85b51f (the exact v1.2.1 blob is not in the search
  index; this version carries the 1.2-only loader that only prefixes `model.`, before PR #11010):
  `self.fc = Linear(self.hidden_size_in * num_capture_layers, config.hidden_size, bias=..., dtype=config.torch_dtype)`
  with no quant_config, while `Eagle3Attention.qkv_proj` gets `quant_config=model_config.get_quant_config()`;
- 1.3-line main, mikeiovine/TensorRT-LLM@1b1598c0c25ff230a26e1fde71ad5494b68be14a: fc gets
  `quant_config=model_config.get_quant_config()`;
- tensorrt_llm/_torch/modules/linear.py `copy_weight`: `src.to(dst.dtype)`, so an FP8 fc.weight is cast to BF16
  without its weight_scale, silently.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine.fp8 import FP8_MAX, read_safetensors
from runtime.trtllm import compat
from runtime.trtllm.checks import eagle3_fc_precision

from conftest import REPO, TINY_CONFIG, artifact_dir, run_cli


@pytest.fixture(scope="module")
def run_dir(request) -> Path:
    """The tiny run (SPECPIPE_TEST_RUN, else the session's tiny pipeline): its target, EAGLE-3 draft and data."""
    if os.environ.get("SPECPIPE_TEST_RUN"):
        return Path(os.environ["SPECPIPE_TEST_RUN"])
    wd, _ = request.getfixturevalue("tiny_run")
    return wd


@pytest.mark.parametrize("overrides, refused", [
    ((), True),                                                    # 1.2.1 (default) + FP8 fc: refused
    (("quantize.draft_fc=bf16",), False),                          # fc kept in BF16: what 1.2 reads
    (("build.trtllm_version=1.3.0rc27",), False),                  # 1.3 builds fc with the draft's quant config
    (("quantize.draft=none",), False),
])
def test_fp8_draft_fc_refused_for_1_2(overrides, refused):
    extra = [a for o in overrides for a in ("-o", o)]
    args = ["-o", "quantize.draft=fp8"] if "quantize.draft=none" not in overrides else []
    r = run_cli("check", str(TINY_CONFIG), *args, *extra, cwd=REPO)
    assert r.returncode == (2 if refused else 0), r.stdout + r.stderr
    if refused:
        assert "quantize.draft_fc" in r.stdout + r.stderr and "without its scale" in r.stdout + r.stderr


def test_releases_say_which_loader_reads_an_fp8_fc():
    assert compat.release("1.2.1").eagle3_fc_fp8 is False and compat.release("1.3.0rc27").eagle3_fc_fp8 is True
    assert "022e9f62" in compat.SOURCES["eagle3_fc_quant"] and "1b1598c0" in compat.SOURCES["eagle3_fc_quant"]


def _draft_with_fp8_fc(src: Path, dst: Path) -> Path:
    """A copy of an exported EAGLE-3 draft whose fc.weight is per-tensor FP8 with its weight_scale (as ModelOpt writes)."""
    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    sd = load_file(f)
    w = sd["fc.weight"].float()
    scale = w.abs().max() / FP8_MAX
    sd["fc.weight"] = (w / scale).to(torch.float8_e4m3fn)
    sd["fc.weight_scale"] = scale.reshape(())
    save_file(sd, f)
    return dst


def test_deployment_check_refuses_an_fp8_fc_where_the_loader_drops_its_scale(run_dir, tmp_path):
    draft = artifact_dir(run_dir, "train_draft") / "draft"
    fp8_fc = _draft_with_fp8_fc(draft, tmp_path / "draft")
    ok, msg = eagle3_fc_precision(fp8_fc, compat.release("1.2.1"), "1.2.1")
    assert not ok and "F8_E4M3" in msg and "quantize.draft_fc: bf16" in msg
    assert eagle3_fc_precision(fp8_fc, compat.release("1.3.0rc27"), "1.3.0rc27")[0]
    assert eagle3_fc_precision(draft, compat.release("1.2.1"), "1.2.1")[0]   # BF16 fc: read as stored


def test_quantized_draft_keeps_fc_in_bf16_when_asked(run_dir, tmp_path):
    """The real ModelOpt draft quantization with fc_fp8=False on the tiny run's pair: fc.weight stays high precision
    without scales, every decoder-layer linear is FP8, and the written draft passes the 1.2 deployment check."""
    from runtime.quant.eagle_draft import DraftRecipe, quantize_eagle_checkpoint
    from stages.quantize import read_samples

    samples = read_samples(artifact_dir(run_dir, "data"), "calib", 4, 64)
    out = tmp_path / "draft_fp8"
    m = quantize_eagle_checkpoint(artifact_dir(run_dir, "target") / "model", artifact_dir(run_dir, "train_draft") / "draft",
                                  out, samples, samples[:2], recipe=DraftRecipe(kv_cache="fp8", fc_fp8=False))
    sd = read_safetensors(out)
    assert sd["fc.weight"].dtype != torch.float8_e4m3fn and "fc.weight_scale" not in sd and "fc.input_scale" not in sd
    assert sd["layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert sd["layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert m["draft_fc_fp8"] is False
    assert eagle3_fc_precision(out, compat.release("1.2.1"), "1.2.1")[0]
    q = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8"
