"""The draft's KV cache as TensorRT-LLM computes it in one-model mode: FP8 (E4M3, unit scale) next to a target
whose KV cache is FP8, and validate measuring (and gating on) that figure, with the BF16-KV figure beside it.

Upstream (issue 22 item 5), read from the 1.2-era source of NVIDIA/TensorRT-LLM (the exact v1.2.1 blob is not in the
search index; the 1.2-era version is identified by its 1.2-only content: the draft loader that only prefixes
`model.`, before PR #11010, and no separate draft KV cache manager, before PR #10502):
- tensorrt_llm/_torch/models/modeling_speculative.py @ byshiue/TensorRT-LLM 022e9f62376de38db7d089ebbfb790c0ba85b51f,
  SpecDecOneEngineForCausalLM.__init__: `draft_config.quant_config.kv_cache_quant_algo =
  model_config.quant_config.kv_cache_quant_algo`, and the draft's `attn_layers` join the target's (one KV cache);
- tensorrt_llm/_torch/attention_backend/trtllm.py @ 9144c0e6: `kv_cache_scaling_factor` is ones (unit scales),
  cited in runtime/engine/fp8/kv_cache.py.

The stage test runs on the tiny run (SPECPIPE_TEST_RUN, else the session's tiny pipeline), whose quantize stage
wrote an FP8 KV cache; the artifacts are only read.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.stage import Artifact, StageContext
from runtime.engine.drafts import load_draft
from runtime.engine.fp8 import qdq_e4m3
from runtime.engine.layers import KVCache
from stages import validate as V

from conftest import artifact_dir, stage_context


def test_fp8_kv_cache_holds_e4m3_values_at_its_scale():
    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 3, 8) * 3, torch.randn(2, 2, 3, 8) * 3
    pos = torch.arange(3)[None].expand(2, 3)
    plain, fp8 = (KVCache(1, 2, 2, 8, 16, torch.float32, "cpu", s) for s in (None, 1.0))
    for c in (plain, fp8):
        c.write(0, k, v, pos, 0)
    assert torch.equal(plain.k[0][:, :, :3], k) and torch.equal(plain.v[0][:, :, :3], v)
    one = torch.tensor(1.0)
    assert torch.equal(fp8.k[0][:, :, :3], qdq_e4m3(k, one)) and torch.equal(fp8.v[0][:, :, :3], qdq_e4m3(v, one))
    assert not torch.equal(fp8.k[0][:, :, :3], k)
    # every held value is an E4M3 code x 1 (what the FP8 cache stores, dequantized on read)
    held = fp8.k[0][:, :, :3]
    assert torch.equal(held.to(torch.float8_e4m3fn).float(), held)
    # scattered writes (rows at different positions) go through E4M3 too
    fp8.write(0, k[:, :, :1], v[:, :, :1], torch.tensor([[5], [7]]), None)
    assert torch.equal(fp8.k[0][0, :, 5], qdq_e4m3(k[0, :, 0], one))


def _step_logits(draft, seed: int = 1):
    """Draft logits for four positions, written and attended through the draft's own KV cache."""
    g = torch.Generator().manual_seed(seed)
    H = draft.hidden_size
    hidden = torch.randn(1, 4, H, generator=g) * 4
    embeds = torch.randn(1, 4, H, generator=g)
    cache = draft.new_cache(1, 16, "cpu")
    with torch.no_grad():
        logits, _ = draft.step(hidden, embeds, cache, torch.arange(4)[None], 0)
    return logits, cache


def test_fp8_kv_draft_path_is_used_and_off_is_unchanged(run_dir):
    """A constructed case on the tiny run's EAGLE-3 draft: with kv_cache='fp8' the cached K/V are E4M3 values and
    the logits move; with 'bf16' (the default) they are bit-identical to a draft loaded without the option."""
    d = artifact_dir(run_dir, "train_draft") / "draft"
    default, off, on = load_draft(d), load_draft(d, kv_cache="bf16"), load_draft(d, kv_cache="fp8")
    assert default.kv_fp8_scale is None and off.kv_fp8_scale is None and on.kv_fp8_scale == 1.0
    l_default, _ = _step_logits(default)
    l_off, c_off = _step_logits(off)
    l_on, c_on = _step_logits(on)
    assert torch.equal(l_default, l_off)
    assert not torch.equal(l_on, l_off) and (l_on - l_off).abs().max() > 1e-6
    k_on = c_on.k[0][:, :, :4]
    assert torch.equal(k_on.to(torch.float8_e4m3fn).float(), k_on)          # the cache holds E4M3 values
    assert torch.equal(k_on, qdq_e4m3(c_off.k[0][:, :, :4], torch.tensor(1.0)))  # = BF16-KV keys through E4M3
    with pytest.raises(ValueError, match="kv_cache"):
        load_draft(d, kv_cache="int8")


def _ctx(arts: Path, tmp: Path, **section) -> StageContext:
    inputs = {s: Artifact(s, arts / s, {"fingerprint": s, "metrics": {}}) for s in V.CONSUMES}
    out, scratch = tmp / "out", tmp / "scratch"
    out.mkdir(parents=True)
    scratch.mkdir(parents=True)
    sec = V.Config(**{"max_new_tokens": 8, "num_prompts": 2, "batch_size": 2, "lossless_prompts": 0,
                      "measure_bf16": False, "measure_other_norm": False, "runtime": "reference", **section})
    return stage_context("validate", sec, inputs=inputs, out_dir=out, scratch_dir=scratch, workdir=arts.parent)


def test_validate_gates_on_the_fp8_kv_draft_and_reports_both(run_dir, tmp_path):
    """auto: the tiny run's target has an FP8 KV cache, so the deployed pair is measured (and gated) with the
    draft's KV in FP8, and the BF16-KV figure is reported beside it, per domain and overall, in acceptance.json
    and the report section."""
    arts = run_dir / "artifacts"
    assert json.loads((arts / "quantize" / "quantize.json").read_text())["kv_cache"] == "fp8"
    ctx = _ctx(arts, tmp_path / "auto", gates={"min_acceptance_length": 1.0})
    metrics = V.run(ctx)
    a = json.loads((ctx.out_dir / "acceptance.json").read_text())
    assert a["draft_kv_cache"]["dtype"] == "fp8" and a["draft_kv_cache"]["scale"] == 1.0
    assert a["draft"]["kv_cache"] == "fp8"
    for d in [*a["domains"].values(), a["overall"]]:
        other = d["fp8_other_draft_kv"]
        assert other["draft_kv_cache"] == "bf16" and other["acceptance_length"] >= 1.0
        assert len(other["per_position"]) == a["measured_draft_len"]
    # the gate row and the stage metrics are the FP8-KV figure
    rows = [r for r in a["gates"]["rows"] if r["metric"] == "acceptance_length"]
    assert rows and all(r["measured"] == a["domains"][r["domain"]]["fp8"]["acceptance_length"] for r in rows)
    assert metrics["overall_acceptance_length"] == a["overall"]["fp8"]["acceptance_length"]
    html = V._render(a)
    assert "AL FP8, draft BF16 KV" in html and "KV cache: <b>FP8</b> (scale 1)" in html


def test_validate_without_fp8_draft_kv_measures_one_arm(run_dir, tmp_path):
    ctx = _ctx(run_dir / "artifacts", tmp_path / "off", draft_kv_cache="bf16")
    V.run(ctx)
    a = json.loads((ctx.out_dir / "acceptance.json").read_text())
    assert a["draft_kv_cache"] == {"dtype": "bf16", "scale": None, "why": "validate.draft_kv_cache"}
    assert a["draft"]["kv_cache"] == "bf16"
    assert all("fp8_other_draft_kv" not in d for d in [*a["domains"].values(), a["overall"]])
    assert "AL FP8, draft BF16 KV" not in V._render(a)


def test_draft_kv_cache_resolution():
    auto = V.Config()
    assert V.draft_kv_cache(auto, True)["dtype"] == "fp8" and V.draft_kv_cache(auto, False)["dtype"] == "bf16"
    assert V.draft_kv_cache(V.Config(draft_kv_cache="bf16"), True)["dtype"] == "bf16"
    assert V.measure_settings(auto, draft_kv_cache="fp8").draft_kv_cache == "fp8"


@pytest.mark.parametrize("overrides, refused", [
    (("-o", "build.kv_cache.dtype=fp8", "-o", "quantize.kv_cache=none"), True),     # engine FP8, validate auto -> BF16
    (("-o", "build.kv_cache.dtype=fp8", "-o", "quantize.kv_cache=none", "-o", "validate.draft_kv_cache=fp8"), False),
    ((), False),                                                                       # FP8 KV target: auto -> FP8
])
def test_build_refuses_a_validate_draft_kv_that_is_not_the_engines(overrides, refused):
    """`specpipe check`: the KV cache validate gives the draft must be the one the one-model deployment gives it."""
    from conftest import REPO, TINY_CONFIG, run_cli

    r = run_cli("check", str(TINY_CONFIG), *overrides, cwd=REPO)
    assert r.returncode == (2 if refused else 0), r.stdout + r.stderr
    assert ("validate.draft_kv_cache" in r.stdout + r.stderr) == refused
