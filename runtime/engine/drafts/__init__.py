"""Draft models read exactly as ModelOpt 0.47 exports them.

Two formats (see `export/plugins/hf_spec_export.py` in ModelOpt):

- EAGLE-3 (`architectures: ["LlamaForCausalLMEagle3"]`): `fc` over the concatenated outputs of the target
  layers `eagle_config.eagle_aux_hidden_state_layer_ids` (concatenated in ascending layer order: ModelOpt
  collects them with forward hooks, which fire in execution order), Llama decoder layers whose first layer
  takes `cat(input_layernorm(embed(token)), hidden_norm(...))` (width 2H) for q/k/v, a final `norm`, its own
  `lm_head` of `draft_vocab_size` rows and, when that is smaller than the target vocabulary, `d2t`
  (target_id = draft_id + d2t[draft_id]). Token embeddings are the target's.
- DFlash (`architectures: ["DFlashDraftModel"]`, Qwen3-style): `fc` + `hidden_norm` over the outputs of
  `dflash_config.target_layer_ids` (in listed order) give a context that every draft layer projects to K/V
  (with `k_norm`); a block `[anchor, mask, ..., mask]` embedded with the target's embeddings supplies Q and
  its own K/V; positions continue the context; logits come from the target's `lm_head` on the draft `norm`.

First-layer norm of EAGLE-3: ModelOpt's HF module computes `hidden_norm(input_layernorm(h))` for the hidden
half (the first decoder layer normalizes `h` before the attention pre-hook applies `hidden_norm`), while
TensorRT-LLM, vLLM and SGLang compute `hidden_norm(h)`. `first_layer_norm="modelopt"` (default) reproduces
the trained model exactly; `"serving"` reproduces the serving engines, so the difference can be measured.

Every format problem raises `DraftFormatError` with what was expected and what was found, unless the
loader is told to behave like TensorRT-LLM (`strict=False`): then a missing `d2t` maps draft ids as target
ids, as TensorRT-LLM does, and the acceptance collapse shows up in the measurement instead.

What a valid export is (tensors, d2t, capture layers, config keys) lives in runtime/algorithms/{eagle3,dflash}.py;
this package's checks call their `check_export`. Modules: `format` (the directory: architectures, config.json and
weights, `DraftFormatError`),
`blocks` (linears, norms and decoder layers read from the exported tensors; the fused `DraftPlan`), `eagle3` and
`dflash` (each format's module; the checks of its export), `loading` (`load_draft`, `summarize`). The
primitives the drafts share with the target runner live beside this package: `runtime.engine.layers` (KV cache,
masks, RoPE, attention), `runtime.engine.fused` (fused GEMMs and layers), `runtime.engine.compute` (compute modes).
"""
from runtime.algorithms.export import TargetShape
from runtime.engine.drafts.dflash import DFlashDraft
from runtime.engine.drafts.eagle3 import Eagle3Draft
from runtime.engine.drafts.format import (
    DFLASH_ARCH,
    EAGLE3_ARCH,
    DraftFormatError,
    draft_algorithm,
    read_draft_dir,
)
from runtime.engine.drafts.loading import load_draft, summarize

__all__ = ["DFLASH_ARCH", "EAGLE3_ARCH", "DFlashDraft", "DraftFormatError", "Eagle3Draft", "TargetShape",
           "draft_algorithm", "load_draft", "read_draft_dir", "summarize"]
