"""The `Algorithm` protocol: what every speculative-decoding algorithm answers, so callers ask a trait instead of
comparing names.

The shape follows two upstream designs. TensorRT-LLM puts each trait on its mode enum and branches on the trait
(`SpeculativeDecodingMode.has_draft_model()`, `use_one_engine()`, `is_ngram()`,
NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative/interface.py at b35ac1b64368513d215c57d2ed01d62d910df8da);
speculators registers one typed config class per algorithm name (`@SpeculatorModelConfig.register("eagle3")`,
speculators 0.9.0 speculators/models/eagle3/config.py, the registry in speculators/config.py). Here each algorithm
is one frozen object (`eagle3.EAGLE3`, `dflash.DFLASH`, `ngram.NGRAM`) registered by name in
runtime/algorithms/registry.py (`get(name)`), and `parse` turns what it is configured by (the exported draft's
config.json; n-gram's settings) into a frozen typed value.

Traits are the questions callers branch on today; add one here (and answer it in each algorithm) rather than
comparing `algorithm == "..."` at the call site (tests/unit/runtime/algorithms/test_algorithm_protocol.py counts them).
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from runtime.algorithms.export import Export, Problem, TargetShape


@runtime_checkable
class Algorithm(Protocol):
    """One speculative-decoding algorithm: its name, traits, the parse of its export and its one check."""

    name: str                        # the config's and the artifacts' name: eagle3 | dflash | ngram
    title: str                       # as people write it: EAGLE-3, DFlash, n-gram
    architecture: str | None         # the exported config.json's `architectures` entry (None: no export)
    needs_trained_draft: bool        # train_draft trains a draft for it (n-gram: none)
    takes_hidden_states: bool        # the draft reads target hidden states at the capture layers
    drafts_block: bool               # drafts its k tokens in one forward pass (DFlash's block), else one per token
    has_draft_vocab: bool            # may predict a reduced vocabulary mapped by d2t (EAGLE-3)
    shares_target_head: bool         # no embeddings or lm_head of its own: the target's are used (DFlash)
    first_layer_norm_choice: bool    # its first layer's norm differs between ModelOpt training and the engines
    capture_key: str | None          # where config.json declares the capture layers (dotted), for messages
    capture_field: str | None        # draft.json's / the training job's field naming the capture layers
    capture_count: int | None        # the number of capture layers every deployment builds for (None: any)
    trtllm_decoding_type: str        # TensorRT-LLM's speculative_config decoding_type
    trtllm_two_model: bool           # TensorRT-LLM can run it as a separate draft engine (two-model mode)
    trtllm_layers_to_capture: bool   # TensorRT-LLM's options name its capture layers (eagle3_layers_to_capture)
    trtllm_renamed_weights: bool     # the targeted loader may read other tensor names (runtime/trtllm/draft_weights.py)
    fp8_draft: bool                  # quantize can write an FP8 copy of its draft (runtime/quant/eagle_draft.py)
    vllm_method: str                 # vLLM's speculative_config method ("served by vLLM as ...")
    speculators_model_type: str | None   # speculators' registered config name (None: not expressible there)

    def parse(self, cfg: dict) -> Any:
        """The frozen typed value of what configures it (raises DraftExportError naming what is missing)."""

    def check_export(self, ex: Export, *, target: TargetShape | None = None) -> list[Problem]:
        """Every problem of the export (for n-gram: of its settings), in the order a reader fixes them."""

    def capture_layers(self, cfg: dict) -> list[int] | None:
        """The target layers the export declares it reads (0-based), None when it declares none."""

    def draft_len_cap(self, block_size: int | None = None) -> int | None:
        """The most tokens one step can draft (None: no structural cap)."""
