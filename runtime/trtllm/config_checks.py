"""Config combinations a TensorRT-LLM version cannot deploy as validated (build's `check`): an FP8 EAGLE-3 `fc` the
1.2 loader would read without its scale, and a draft KV cache validate measures differently from the engine. They read
the whole config duck-typed (runtime never imports pipeline)."""
from __future__ import annotations

from runtime.algorithms.registry import get as get_algorithm
from runtime.trtllm import compat


def fp8_draft_fc_problems(cfg, rel: compat.Release, algo: str) -> list[tuple[str, str]]:
    """An FP8 EAGLE-3 draft whose fc is FP8 where the version's loader builds fc without a quant config (1.2): the
    FP8 codes would be cast to BF16 without their scale (compat.SOURCES eagle3_fc_quant)."""
    q = cfg.quantize
    if not get_algorithm(algo).fp8_draft or rel.eagle3_fc_fp8 or not q.enabled or (q.draft, q.draft_fc) != ("fp8", "fp8"):
        return []
    return [("quantize.draft_fc", f"is fp8, but TensorRT-LLM {cfg.build.trtllm_version}'s EAGLE-3 draft model builds fc without "
             "a quant config: an FP8 fc.weight would be cast to BF16 without its scale, silently. Set quantize.draft_fc: "
             f"bf16 (fc kept in BF16), or quantize.draft: none, or build.trtllm_version: {compat.REFERENCE_1_3}")]


def draft_kv_problems(cfg, rel: compat.Release, algo: str) -> list[tuple[str, str]]:
    """validate gates on the draft computed with the KV cache the deployment gives it (options.draft_kv_cache)."""
    from runtime.trtllm.options import draft_kv_cache

    q, v = cfg.quantize, cfg.validate
    if not (v.enabled and q.enabled):
        return []
    kv_fp8 = q.kv_cache == "fp8"
    engine = draft_kv_cache(rel.mode(algo, cfg.build.eagle3_mode == "one_model"), cfg.build.kv_cache.dtype, kv_fp8)
    measured = v.draft_kv_cache if v.draft_kv_cache != "auto" else ("fp8" if kv_fp8 else "bf16")
    if engine is None or engine == measured:
        return []
    return [("validate.draft_kv_cache", f"validate measures the draft with a {measured.upper()} KV cache, but one-model "
             f"TensorRT-LLM (kv_cache_config dtype {cfg.build.kv_cache.dtype}) runs it with {engine.upper()}: set {engine}")]
