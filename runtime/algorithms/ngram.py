"""n-gram (prompt-lookup) drafting: no draft model and no export; what defines it is its settings.

Settings {k, min_n, max_n}: propose up to k tokens that followed the earliest occurrence of the longest suffix n-gram
(min_n <= n <= max_n) of the context (vLLM 0.32.0 vllm/v1/spec_decode/ngram_proposer.py; the engine's port is
runtime/engine/ngram_drafter.py). The config selects it with validate.ngram (measured beside the trained draft) and
build.ngram (deployed beside it). TensorRT-LLM's NGramDecodingConfig needs max_draft_len > 0 and
max_matching_ngram_size > 0 (TorchLlmArgs, tensorrt_llm/llmapi/llm_args.py 1.2.1) and has no min n (its drafter,
tensorrt_llm/_torch/speculative/ngram.py at 0249976575050d2c624a5f285683c66de311a3b7, matches sizes max_n down to 1).
Capture layers, d2t and tensors: none. Draft-length cap: none beyond k >= 1 (the context may propose fewer).
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class NgramSettings:
    """What configures n-gram drafting (`NGRAM.parse`)."""

    k: int
    min_n: int
    max_n: int


@dataclass(frozen=True)
class Ngram:
    """n-gram drafting as the `Algorithm` protocol (runtime/algorithms/base.py) answers it: no draft model, so no
    export, capture layers or d2t; its 'export' is its settings."""

    name: str = "ngram"
    title: str = "n-gram"
    architecture: str | None = None
    needs_trained_draft: bool = False
    takes_hidden_states: bool = False
    drafts_block: bool = False
    has_draft_vocab: bool = False
    shares_target_head: bool = False
    first_layer_norm_choice: bool = False
    capture_key: str | None = None
    capture_field: str | None = None
    capture_count: int | None = None
    trtllm_decoding_type: str = "NGram"      # NGramDecodingConfig (runtime/trtllm/ngram_deployment.py)
    trtllm_two_model: bool = False
    trtllm_layers_to_capture: bool = False
    trtllm_renamed_weights: bool = False
    fp8_draft: bool = False
    vllm_method: str = "ngram"               # runtime/vllm/ngram_config.py
    speculators_model_type: str | None = None

    def parse(self, cfg: dict) -> NgramSettings:
        if probs := check_export(cfg):
            raise ValueError(probs[0].message)
        return NgramSettings(*(int(cfg[s]) for s in SETTINGS))

    def check_export(self, ex, *, target=None) -> list[Problem]:
        return check_export(ex if isinstance(ex, dict) else ex.cfg)

    def capture_layers(self, cfg: dict) -> list[int] | None:
        return None

    def draft_len_cap(self, block_size: int | None = None) -> int | None:
        return None


NGRAM = Ngram()
