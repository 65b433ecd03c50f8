"""The one compatibility table: container image -> TensorRT-LLM version -> what that version can deploy.

Used by `stages/tune.py` (which draft-length schedules the deployment honours), `stages/build.py` (which fields
to write and what they mean), `stages/export.py` (which container serves the production repository) and the
Dockerfiles. Every behavioural fact below was read from TensorRT-LLM's source; `SOURCES` names the file and the
stored commit (or PR) for each, and tests that encode a fact cite the same entry.

What changes between the TensorRT-LLM lines specpipe targets, each of which silently changes behaviour if a
generator gets it wrong:
- who applies a per-batch draft length. 1.2: only the two-model drafter (`Drafter`, created by
  `get_spec_drafter` for two-model EAGLE-3 / draft-target / NGram) applies `draft_len_schedule`,
  `max_concurrency` and the acceptance guard; with `eagle3_one_model: true` there is no drafter and the draft
  length is `max_draft_len` at every batch size. 1.3: the one-engine path applies the schedule.
- the schedule's keys: 1.2 lower bounds ({1: 4, 4: 2, 8: 0}: batch >= 4 uses 2; key 1 must equal
  max_draft_len); 1.3 upper bounds ({4: 4, 8: 2}: 1-4 -> 4, 5-8 -> 2, above 8 -> 0; the smallest key's value
  must equal max_draft_len), and 1.3 rejects `max_concurrency` together with a schedule (alone it becomes
  {max_concurrency: max_draft_len}).
- a draft length of 0 in one-engine mode (1.3): TensorRT-LLM PR #16888 (open): drafter state is not refreshed
  while the resolved length is 0, so acceptance collapses once speculation resumes; a schedule reaching 0 and
  `max_concurrency` (translated into such a schedule) are both affected.
- the acceptance guard: 1.2 `acceptance_window` + `acceptance_length_threshold`, compared with the rolling mean
  of (decoded tokens per iteration - 1) = accepted draft tokens per iteration over completed requests; 1.3
  (PR #12905) `acceptance_rate_window_size` + `acceptance_rate_threshold`, a rate accepted / drafted in [0, 1]
  over speculation-enabled iterations.
- EAGLE-3 draft weight names: the module is `midlayer`; ModelOpt exports `layers.0.*`. The loader's remap
  (PR #11010, merged to main 2026-01-28) is in the 1.3 line, not in the 1.2 branch (cut at 1.2.0rc6 in
  December 2025), whose loader only prefixes `model.`: `layers.0.*` tensors match no module and are skipped.
- the EAGLE-3 draft's `fc`: the 1.2-era `Eagle3DraftModel` builds it as `Linear(..., dtype=config.torch_dtype)`
  without a quant config (its q/k/v/o and MLP get the draft's), so an FP8 `fc.weight` is cast to BF16 by
  `copy_weight` without its `weight_scale`, silently; the 1.3 line passes `quant_config=model_config.get_quant_config()`.
  An FP8 draft for 1.2 keeps `fc` in BF16 (`quantize.draft_fc: bf16`); `build` refuses it otherwise.
- the HF config the model code reads: the 1.2 line pins transformers 4.57.1 (top-level `rope_theta` /
  `rope_scaling`; a config with only `rope_parameters` gets the default theta 10000) and its
  `RotaryScalingType.from_string` has no "default" (a `rope_scaling` of type "default" raises); the 1.3 line
  runs transformers 5 (`rope_parameters`; top-level `rope_theta` is still converted on load).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from runtime.algorithms.registry import get as get_algorithm

Semantics = Literal["lower_bound", "upper_bound"]
Mode = Literal["one_model", "two_model"]

# Quantization algorithms the PyTorch backend's linear layers serve (`tensorrt_llm/_torch/modules/linear.py`
# `get_quant_method`: FP8 QDQ, FP8 row-wise = per-channel weights x per-token activations, FP8 block scales,
# NVFP4, W4A8 NVFP4/MXFP4 x FP8, weight-only INT4/INT8, INT4 AWQ, W4A8 AWQ, MXFP4 x MXFP8) plus
# MIXED_PRECISION (per-layer algorithms, `_torch/model_config.py`). Same list on both lines read.
PYTORCH_QUANT_ALGOS = frozenset({
    "FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "NVFP4", "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8",
    "W4A8_MXFP4_MXFP8", "W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "MIXED_PRECISION"})


@dataclass(frozen=True)
class Release:
    line: str                      # "1.2" / "1.3"
    schema: str                    # runtime/trtllm/schemas/<schema>.json
    algorithms: frozenset[str]     # specpipe draft algorithms this version's PyTorch backend serves
    decoding_types: dict           # specpipe algorithm -> speculative_config.decoding_type
    schedule_semantics: Semantics
    schedule_with_max_concurrency: bool   # both may be given together
    per_batch_draft_len: frozenset[str]   # modes whose runtime applies draft_len_schedule / max_concurrency
    zero_draft_len_ok: frozenset[str]     # modes where a resolved draft length of 0 is safe (switches speculation off)
    acceptance_guard_modes: frozenset[str]   # modes whose runtime evaluates the acceptance guard
    acceptance_window_key: str
    acceptance_threshold_key: str
    acceptance_threshold_kind: Literal["accepted_tokens", "rate"]
    eagle3_two_model: bool         # eagle3_one_model: false is honoured (1.3 resets it to true)
    emits_eagle3_one_model: bool   # the field exists in this line's docs
    eagle3_draft_layer_prefix: Literal["midlayer", "layers"]   # the EAGLE-3 draft layer names the loader reads
    hf_rope_form: Literal["legacy", "rope_parameters"]          # how the pinned transformers reads RoPE settings
    eagle3_fc_fp8: bool            # the EAGLE-3 draft's fc is built with the draft's quant config (reads FP8 + scales)
    quant_algos: frozenset[str] = PYTORCH_QUANT_ALGOS

    def mode(self, algorithm: str, eagle3_one_model: bool = True) -> Mode:
        """DFlash always runs in one engine; EAGLE-3 as configured (1.3 always one)."""
        if get_algorithm(algorithm).trtllm_two_model and not eagle3_one_model and self.eagle3_two_model:
            return "two_model"
        return "one_model"


RELEASES: dict[str, Release] = {
    "1.2": Release(
        line="1.2", schema="trtllm-1.2", algorithms=frozenset({"eagle3"}), decoding_types={"eagle3": "Eagle3"},
        schedule_semantics="lower_bound", schedule_with_max_concurrency=True,
        per_batch_draft_len=frozenset({"two_model"}), zero_draft_len_ok=frozenset({"two_model"}),
        acceptance_guard_modes=frozenset({"two_model"}),
        acceptance_window_key="acceptance_window", acceptance_threshold_key="acceptance_length_threshold",
        acceptance_threshold_kind="accepted_tokens", eagle3_two_model=True, emits_eagle3_one_model=True,
        eagle3_draft_layer_prefix="midlayer", hf_rope_form="legacy", eagle3_fc_fp8=False),
    "1.3": Release(
        line="1.3", schema="trtllm-1.3", algorithms=frozenset({"eagle3", "dflash"}),
        decoding_types={"eagle3": "Eagle3", "dflash": "DFlash"},
        schedule_semantics="upper_bound", schedule_with_max_concurrency=False,
        per_batch_draft_len=frozenset({"one_model"}), zero_draft_len_ok=frozenset(),
        acceptance_guard_modes=frozenset({"one_model"}),
        acceptance_window_key="acceptance_rate_window_size", acceptance_threshold_key="acceptance_rate_threshold",
        acceptance_threshold_kind="rate", eagle3_two_model=False, emits_eagle3_one_model=False,
        eagle3_draft_layer_prefix="layers", hf_rope_form="rope_parameters", eagle3_fc_fp8=True),
}

# Where each fact above was read (NVIDIA/TensorRT-LLM unless named; "stored <sha>" = the version of the file the
# search index holds at that commit; the exact v1.2.1 blobs are not in the index, so the 1.2-line versions were
# identified by their 1.2-only content: `acceptance_length_threshold`, lower-bound schedule comments).
SOURCES: dict[str, str] = {
    "layers_to_capture": "tensorrt_llm/_torch/speculative/eagle3.py Eagle3SpecMetadata.__post_init__ (default "
                         "(1, L//2-1, L-4), ValueError 'Not enough hidden layers for default EAGLE3 capture' for L <= 5, "
                         "layers sorted); tensorrt_llm/llmapi/llm_args.py Eagle3DecodingConfig.num_capture_layers "
                         "(len(eagle3_layers_to_capture), else 3)",
    "fc_shape": "tensorrt_llm/_torch/models/modeling_speculative.py Eagle3DraftModel: fc = Linear(hidden_size_in x "
                "spec_config.num_capture_layers, hidden) when num_capture_layers > 1; midlayer = one Eagle3DecoderLayer "
                "(a ModuleList midlayer.<i> for several layers)",
    "draft_weight_names": "modeling_speculative.py Eagle3ForCausalLM.load_weights: 1.2-era version only prefixes 'model.'; "
                          "main commit c37531c3f7 (PR #11010, 2026-01-28) adds layers.0. -> midlayer. / layers.N. -> midlayer.N.",
    "per_batch_draft_len_1_2": "tensorrt_llm/_torch/pyexecutor/py_executor.py _prepare_and_schedule_batch (1.2-era, "
                               "schedule {1:4, 4:2, 8:0} semantics): draft_len_schedule, should_use_spec_decode "
                               "(max_concurrency) and speculation_permanently_disabled are applied only under "
                               "`if self.drafter is not None`; tensorrt_llm/_torch/speculative/utils.py get_spec_drafter "
                               "returns a drafter only for two-model EAGLE-3 / draft-target / MTP-Eagle / NGram",
    "zero_draft_len_one_engine": "PR #16888 (open) 'Keep drafting alive when dynamic draft length hits its floor': "
                                 "a schedule resolving to 0, and max_concurrency (translated into one), skip drafting in "
                                 "one-engine mode and corrupt drafter state; acceptance collapses after resuming",
    "acceptance_guard_1_2": "tensorrt_llm/_torch/speculative/speculation_gate.py stored "
                            "41080dc55e22d58ad38a78f8ca6143a88e903468: "
                            "record_avg_decoded compares mean(max(0, avg_decoded_tokens_per_iter - 1)) over the last "
                            "`window` completed requests with the threshold",
    "acceptance_guard_1_3": "PR #12905: acceptance_rate_window_size / acceptance_rate_threshold, rate accepted / drafted in "
                            "[0, 1] over speculation-enabled iterations (SpeculationGate.record_acceptance_rate)",
    "decoupled": "triton_backend/scripts/launch_triton_server.py stored 0a2e2c1f1268b34586393794045691b666ba28be: always "
                 "passes --disable-auto-complete-config; triton_backend/all_models/llmapi/tensorrt_llm/1/model.py stored "
                 "044a90d209e380c95e23e8ae42f3583fa05ada78: only auto_complete_config copies triton_config into the model config",
    "transformers_1_2": "requirements.txt stored 000867d9b1ad62f3de1e54e111c094da492a5626 (1.2 line: torch<=2.9.0, "
                        "nvidia-modelopt~=0.37.0): transformers==4.57.1; the exact v1.2.1 blob is not in the index",
    "transformers_1_3": "PR #12829 'Upgrade transformers dependency to 5.3.0' (main, before the 1.3.0rc tags), then "
                        "#13994 -> 5.5.3 (2026-05-11) and #14456 -> 5.5.4 (2026-05-22): the 1.3 line runs transformers 5; "
                        "the 1.3.0rc27 requirements.txt blob is not in the index",
    "tokenizer_class": "transformers v4.57.1 models/auto/tokenization_auto.py AutoTokenizer.from_pretrained: tokenizer_class "
                       "looked up by name ('Tokenizer class TokenizersBackend does not exist or is not currently imported'); "
                       "transformers 5 tokenization_utils_tokenizers.py: PreTrainedTokenizerFast = TokenizersBackend "
                       "(runtime/text/tokenizer_files.py)",
    "rope_1_2": "tensorrt_llm/_torch/attention_backend/interface.py RopeParams.from_config (pre-PR #10636 form): "
                "theta = getattr(config, 'rope_theta', 10000.0), scaling from config.rope_scaling via "
                "tensorrt_llm/functional.py RotaryScalingType.from_string, which raises for 'default'",
    "quant_algos": "tensorrt_llm/_torch/modules/linear.py get_quant_method (stored 00bbf71e796406ea8593a77cbfb828356182db16 "
                   "and the 1.x versions in the index)",
    "eagle3_fc_quant": "tensorrt_llm/_torch/models/modeling_speculative.py Eagle3DraftModel.__init__: 1.2-era "
                       "(byshiue/TensorRT-LLM@022e9f62376de38db7d089ebbfb790c0ba85b51f, loader prefixing only 'model.') "
                       "fc = Linear(hidden_size_in * num_capture_layers, hidden, bias, dtype=config.torch_dtype), no "
                       "quant_config, while Eagle3Attention.qkv_proj gets model_config.get_quant_config(); 1.3-line main "
                       "(mikeiovine/TensorRT-LLM@1b1598c0c25ff230a26e1fde71ad5494b68be14a, with the separate draft KV "
                       "cache of PR #10502) adds quant_config=model_config.get_quant_config() to fc; "
                       "tensorrt_llm/_torch/modules/linear.py copy_weight: src.to(dst.dtype), no scale",
    "dflash_block_size": "llm_args.py DFlashDecodingConfig (1.3): max_draft_len <= block_size - 1",
    "openai_part_reasoning_text": "tensorrt_llm/serve/responses_utils.py stored 02238b67ef3a25ae4d8c50d5f1942ddee2f8f00b imports "
                                  "PartReasoningText from openai.types.responses.response_content_part_added_event; "
                                  "openai/openai-python d296d85884cac05917a2776cc22c632027e8eb05 (2025-09-19) adds it, first "
                                  "tag v1.108.1; triton-inference-server/tutorials qwen2_5_vl_trtllm_guide.md stored "
                                  "9511717dc28753922ce5125b36ea1ded031a7a3f: the 26.07 image's openai is too old for "
                                  "tensorrt_llm.serve (its version is not stated: unknown here); requirements.txt stored "
                                  "000867d9 lists openai unpinned (runtime/trtllm/triton_launch.py)",
    "llmapi_launch": "tensorrt_llm/executor/proxy.py stored 005bc848893f575ec14b45d6b13139360d67c790 ExecutorBindingsProxy: "
                     "mpi_session None -> MpiPoolSession (MPI_Comm_spawn) unless TLLM_SPAWN_PROXY_PROCESS=1 "
                     "(create_mpi_comm_session); GenerationExecutor.create passes mpi_session=None for one GPU; "
                     "tensorrt_llm/llmapi/trtllm-llmapi-launch stored 020c89e64e49f24102f1b62be96a1a68283cdf7a sets it, "
                     "rank 0 runs the command + mgmn_leader_node, ranks > 0 mgmn_worker_node; llmapi model.py stored "
                     "044a90d2: global_mpi_size() > 1 -> MpiCommSession(COMM_WORLD) (runtime/trtllm/triton_launch.py)",
    "prompt_vs_max_num_tokens": "tensorrt_llm/llmapi/llm.py BaseLLM._check_arguments, read at "
                                "byshiue/TensorRT-LLM@1dbe7443c687504a8c96db5fe4a534b0bdba1ae5 (a 1.x-line snapshot; the "
                                "NVIDIA/TensorRT-LLM version the index holds for main raises RequestError on the same "
                                "condition): for backend pytorch, `not enable_chunked_prefill and not is_gen_only` and "
                                "prompt_len / cp_size + query_len > max_num_tokens -> 'The sum of prompt length (...), query "
                                "length (...) should not exceed max_num_tokens (...)'. Added by PR #5541 (merged 2025-06-27, "
                                "before the 1.2 line); PR #9499 'Enable chunked prefill by default' was closed unmerged, so "
                                "enable_chunked_prefill stays False by default (BaseLlmArgs, schemas/trtllm-1.2.json); issue "
                                "#9277 shows the error from a Triton LLM-API model (llm.py(583): _check_arguments)",
}


@dataclass(frozen=True)
class Container:
    image: str
    trtllm_version: str
    kind: Literal["triton", "trtllm"]   # Triton with the TensorRT-LLM backend, or TensorRT-LLM's own release image


# Triton images pin one TensorRT-LLM version each: `ARG TENSORRTLLM_VER` (and TENSORRTLLM_REPO_TAG) in
# triton-inference-server/tensorrtllm_backend dockerfile/Dockerfile.triton.trt_llm_backend on the image's release
# branch (TRITON_DOCKERFILES below). The 1.1 line is listed for lookups but specpipe has no field lists for it, so
# `build` refuses it.
CONTAINERS: tuple[Container, ...] = (
    *(Container(f"nvcr.io/nvidia/tritonserver:{t}-trtllm-python-py3", "1.2.1", "triton")
      for t in ("26.04", "26.05", "26.06", "26.07")),
    Container("nvcr.io/nvidia/tritonserver:26.03-trtllm-python-py3", "1.2.0rc8", "triton"),
    *(Container(f"nvcr.io/nvidia/tritonserver:{t}-trtllm-python-py3", "1.1.0", "triton")
      for t in ("25.12", "26.01", "26.02")),
    Container("nvcr.io/nvidia/tensorrt-llm/release:1.2.1", "1.2.1", "trtllm"),
    Container("nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc27", "1.3.0rc27", "trtllm"),
)

# Where each Triton image's version was read: tensorrtllm_backend branch r<yy.mm> (its head commit when read),
# dockerfile/Dockerfile.triton.trt_llm_backend `ARG TENSORRTLLM_REPO_TAG` / `ARG TENSORRTLLM_VER`.
TRITON_DOCKERFILES: dict[str, tuple[str, str, str]] = {   # yy.mm -> (branch head commit, REPO_TAG, VER)
    "25.12": ("5419275f0e9830ca7083ddab1651eaa10c66636f", "release/1.1", "1.1.0"),
    "26.01": ("5b0830fc388c4c4bd3f62874a30046f596445f8f", "release/1.1", "1.1.0"),
    "26.02": ("47c80a359531952f58e74ae8e891c010b7663d76", "release/1.1", "1.1.0"),
    "26.03": ("9736c4df0f5b3d02eacd2912ecd930072d59d9cf", "release/1.2", "1.2.0rc8"),
    "26.04": ("ce68ff5fd0a746eac895cfb4a5677b329c5bc707", "release/1.2.1", "1.2.1"),
    "26.05": ("a4f2f549f22fdd8d8448bc0ac343d5969033d765", "release/1.2.1", "1.2.1"),
    "26.06": ("e1611ce8612ae4973a45f2bdc5e928061ff7d7e2", "release/1.2.1", "1.2.1"),
    "26.07": ("3bc115373ce1fde1d94891964b492449402e3a68", "release/1.2.1", "1.2.1"),
}

# The Triton image specpipe ships its production repository for (newest in the table), and the version it pins.
SHIPPED_TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
DEFAULT_TRTLLM_VERSION = "1.2.1"
# The 1.3 release candidate whose documentation the 1.3 field lists were cross-checked with.
REFERENCE_1_3 = "1.3.0rc27"

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(rc\d+)?$")


def line_of(version: str) -> str:
    m = _VERSION.match(version.strip())
    if not m:
        raise ValueError(f"'{version}' is not a TensorRT-LLM version (expected e.g. 1.2.1 or 1.3.0rc27)")
    return f"{m.group(1)}.{m.group(2)}"


def normalize_version(v) -> str:
    """A version as configs write it: YAML reads `1.3` as a number, and a bare line means its reference release."""
    v = str(v).strip()
    if re.fullmatch(r"\d+\.\d+", v):
        v = {"1.2": DEFAULT_TRTLLM_VERSION, "1.3": REFERENCE_1_3}.get(v, v + ".0")
    release(v)
    return v


def release(version: str) -> Release:
    """The Release for a version string; ValueError (with the supported versions) when specpipe has no field lists."""
    line = line_of(version)
    if line not in RELEASES:
        raise ValueError(f"TensorRT-LLM {version} is not supported: specpipe has field lists for the 1.2 and 1.3 "
                         f"lines only (e.g. {DEFAULT_TRTLLM_VERSION}, {REFERENCE_1_3})")
    return RELEASES[line]


def triton_image_for(version: str) -> str | None:
    """The newest Triton image pinning this version, or None (no Triton image ships it yet)."""
    imgs = [c.image for c in CONTAINERS if c.trtllm_version == version and c.kind == "triton"]
    return max(imgs) if imgs else None


def serving_image_for(version: str) -> str:
    """Where to run this version: a Triton image if one pins it, else TensorRT-LLM's own release image."""
    return triton_image_for(version) or f"nvcr.io/nvidia/tensorrt-llm/release:{version}"


def supported_versions_for(algorithm: str) -> list[str]:
    return sorted({c.trtllm_version for c in CONTAINERS if _supports(c.trtllm_version, algorithm)})


def _supports(version: str, algorithm: str) -> bool:
    try:
        return algorithm in release(version).algorithms
    except ValueError:
        return False


def algorithm_problem(version: str, algorithm: str) -> str | None:
    """Why `version` cannot deploy `algorithm` (naming a version/container that can), or None."""
    rel = release(version)
    if algorithm in rel.algorithms:
        return None
    if algorithm in release(REFERENCE_1_3).algorithms:
        algo = get_algorithm(algorithm)
        return (f"{algo.title} needs TensorRT-LLM 1.3 or newer ({algo.trtllm_decoding_type}DecodingConfig is absent from "
                f"{version}; "
                f"no Triton image ships 1.3 yet): set build.trtllm_version: {REFERENCE_1_3} and serve with "
                f"trtllm-serve in nvcr.io/nvidia/tensorrt-llm/release:{REFERENCE_1_3}, or build a custom Triton image "
                f"on it; {SHIPPED_TRITON_IMAGE} pins {DEFAULT_TRTLLM_VERSION}")
    return f"TensorRT-LLM {version} has no decoding type for '{algorithm}'"
