"""n-gram (prompt-lookup) drafting: no draft model and no export; what defines it is its settings.

Settings {k, min_n, max_n}: propose up to k tokens that followed the earliest occurrence of the longest suffix n-gram
(min_n <= n <= max_n) of the context (vLLM 0.32.0 vllm/v1/spec_decode/ngram_proposer.py; the engine's port is
runtime/engine/ngram.py). The config selects it with validate.ngram (measured beside the trained draft) and
build.ngram (deployed beside it). TensorRT-LLM's NGramDecodingConfig needs max_draft_len > 0 and
max_matching_ngram_size > 0 (TorchLlmArgs, tensorrt_llm/llmapi/llm_args.py 1.2.1) and has no min n (its drafter,
tensorrt_llm/_torch/speculative/ngram.py at 0249976575050d2c624a5f285683c66de311a3b7, matches sizes max_n down to 1).
Capture layers, d2t and tensors: none. Draft-length cap: none beyond k >= 1 (the context may propose fewer).
"""
from __future__ import annotations

from runtime.algorithms.export import Problem

SETTINGS = ("k", "min_n", "max_n")
TRTLLM_MIN_N = 1


def check_export(settings: dict, where: str = "n-gram settings") -> list[Problem]:
    """The problems of n-gram settings {k, min_n, max_n} (the only 'export' n-gram drafting has)."""
    out = []
    if missing := [s for s in SETTINGS if settings.get(s) is None]:
        return [Problem("config_keys", f"{where}: {missing} not set; n-gram drafting needs k, min_n and max_n")]
    k, lo, hi = (int(settings[s]) for s in SETTINGS)
    if k < 1:
        out.append(Problem("k", f"{where}: k {k} < 1: n-gram drafting proposes at least one token per step "
                                "(TensorRT-LLM: max_draft_len > 0)"))
    if hi < 1:
        out.append(Problem("max_n", f"{where}: max_n {hi} < 1 (TensorRT-LLM: max_matching_ngram_size > 0)"))
    if not 1 <= lo <= max(hi, 1):
        out.append(Problem("min_n", f"{where}: min_n {lo} must be in 1..max_n ({hi})"))
    return out
