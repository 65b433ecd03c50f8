"""The exported draft in the speculators format (vllm-project/speculators 0.9.0), which vLLM serves natively.

Source: the draft exactly as ModelOpt 0.47's `export_speculative_decoding` writes it (`train_draft/draft/`).
Everything below was read from the speculators 0.9.0 wheel (`speculators/models/eagle3/{config,core,
model_definitions}.py`, `speculators/models/dflash/{config,core,model_definitions,attention}.py`,
`speculators/model.py`, `speculators/config.py`, `speculators/models/utils.py`) and from vLLM's loader
(`vllm/transformers_utils/configs/speculators/{base,algos}.py`, `vllm/model_executor/models/llama_eagle3.py`,
`vllm/model_executor/models/qwen3_dflash.py`, `vllm/v1/spec_decode/dflash.py`; commits named in
tests/e2e/runtime/vllm/test_speculators.py).

EAGLE-3 (`speculators_model_type: eagle3`, `architectures: ["Eagle3Speculator"]`):
- tensor names are ModelOpt's own: `fc.weight`, `layers.{i}.*` (HF Llama decoder names, `layers.0.hidden_norm`,
  first-layer q/k/v over 2H), `norm.weight`, `lm_head.weight` (draft vocabulary), `d2t` (int64, target id = draft
  id + d2t[draft id]); speculators also wants `t2d` (bool over the target vocabulary, True at every id the draft
  can propose) when the draft vocabulary is reduced. vLLM renames `d2t` to `draft_id_to_target_id` and skips `t2d`.
- `embed_tokens.weight` is the verifier's, copied bit for bit from the target checkpoint (ModelOpt trains with the
  target's frozen embeddings and does not export them). speculators' own EAGLE-3 checkpoints carry it, and its
  loader needs it: without it speculators 0.9.0 (transformers 5.19) leaves the embedding uninitialized (its NaN
  sentinel does not survive the meta-device construction, so the reload from the verifier does not fire). vLLM
  loads it and, finding it equal to the target's (`torch.equal`), shares the target's instead of keeping a copy.
- capture layers: speculators and vLLM number an aux hidden state by the decoder layer it ENTERS (vLLM captures
  `hidden_states + residual` before layer idx; default (2, L//2, L-3), id L = the final hidden state), ModelOpt
  and TensorRT-LLM by the layer it LEAVES (hooks on layer outputs; default {1, L//2-1, L-4}). So
  `eagle_aux_hidden_state_layer_ids` = ModelOpt's ids + 1. speculators sizes `fc` from their number.
- `norm_before_residual: false` (ModelOpt's residual is the un-normalized fc output); vLLM defaults it to TRUE
  when the key is absent, so it is always written.
- first layer: speculators and vLLM compute `hidden_norm(h)` for the hidden half; ModelOpt's HF module trained
  `hidden_norm(input_layernorm(h))` (see runtime/engine/drafts/). The format cannot express the latter, so the vLLM
  draft computes what specpipe's runtime calls `first_layer_norm="serving"` (TensorRT-LLM's computation too).

DFlash (`speculators_model_type: dflash`, `architectures: ["DFlashSpeculator"]`):
- tensor names are ModelOpt's (`fc`, `hidden_norm`, `norm`, `layers.{i}.*` with q/k norms); no embeddings and no
  lm_head (full vocabulary): speculators reloads both from the verifier, vLLM shares the target's.
- `aux_hidden_state_layer_ids` = ModelOpt's `target_layer_ids` + 1 (vLLM maps them back: capture ids as they are,
  `dflash_config.target_layer_ids = [i - 1 ...]`).
- block attention: full-attention layers are bidirectional in speculators, and vLLM sets `dflash_config.causal =
  not sliding_window_non_causal`, so `sliding_window_non_causal: true` keeps vLLM bidirectional as ModelOpt trained.
- vLLM queries 1 + num_speculative_tokens positions per request, not `block_size`: with fewer speculative tokens
  than `block_size - 1` its (bidirectional) block is shorter than the one the draft was trained and validated with.

Proposal settings: one greedy proposal method with `speculative_tokens` = the tuned draft length; vLLM takes
`num_speculative_tokens` from it; the per-batch draft length (vLLM 0.32) goes into the serve command's speculative
config (runtime/vllm/serve.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from runtime.algorithms import dflash
from runtime.algorithms.base import Algorithm
from runtime.algorithms.dflash import DFLASH
from runtime.algorithms.eagle3 import EAGLE3
from runtime.algorithms.registry import of_config
from runtime.vllm import speculators_weights as W
from runtime.vllm.speculators_config import (
    SPECULATORS_VERSION,
    SpeculatorsFormatError,
    Verifier,
    check_dflash_config,
    check_eagle3_config,
    check_verifier_vocab,
    dflash_config,
    eagle3_config,
    eagle3_notes,
    read_verifier,
    speculators_config,
)


@dataclass
class SpeculatorsExport:
    """What `write_speculators_draft` wrote: enough for export.json, a README and the tests."""

    path: Path
    algorithm: str
    speculative_tokens: int
    aux_hidden_state_layer_ids: list[int]      # speculators / vLLM numbering (the layer a state enters)
    modelopt_layer_ids: list[int]              # ModelOpt / TensorRT-LLM numbering (the layer it leaves)
    draft_vocab_size: int
    vocab_size: int
    has_d2t: bool
    verifier: str
    block_size: int | None = None
    tensors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"dir": self.path.name, "format": f"speculators {SPECULATORS_VERSION}",
                "speculators_model_type": self.algorithm, "speculative_tokens": self.speculative_tokens,
                "aux_hidden_state_layer_ids": self.aux_hidden_state_layer_ids,
                "modelopt_layer_ids": self.modelopt_layer_ids, "draft_vocab_size": self.draft_vocab_size,
                "vocab_size": self.vocab_size, "has_d2t": self.has_d2t, "block_size": self.block_size,
                "verifier": self.verifier, "tensors": len(self.tensors), "notes": self.notes}


@dataclass
class _Converted:
    """One algorithm's speculators form of the draft: config.json (less `speculators_config`) and the tensors."""

    algorithm: str
    doc: dict
    tensors: dict
    modelopt_layer_ids: list[int]
    draft_vocab_size: int
    vocab_size: int
    has_d2t: bool = False
    block_size: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def aux_hidden_state_layer_ids(self) -> list[int]:
        """speculators / vLLM number a state by the layer it enters, ModelOpt by the layer it leaves."""
        return [i + 1 for i in self.modelopt_layer_ids]


def _eagle3(cfg: dict, sd: dict, verifier: Verifier, dtype: str | None, speculative_tokens: int, where: str) -> _Converted:
    W.check_draft(cfg, sd, EAGLE3, where)      # what an EAGLE-3 export is first, then what speculators can express
    mo_ids = check_eagle3_config(cfg, verifier.num_layers, where)
    H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    dv = int(cfg.get("draft_vocab_size") or V)
    check_verifier_vocab(verifier, V, where)
    tensors = {k: v.contiguous() for k, v in sd.items() if k != "d2t"}
    tensors["embed_tokens.weight"] = W.verifier_embeddings(verifier.dir, V, H)
    tensors.update(W.vocab_map(sd, dv, V))
    conv = _Converted(EAGLE3.speculators_model_type, {}, tensors, mo_ids, dv, V, has_d2t=dv < V)
    ids = conv.aux_hidden_state_layer_ids
    conv.notes = eagle3_notes(ids, mo_ids, verifier.num_layers)
    conv.doc = eagle3_config(cfg, verifier, ids, dv, dtype)
    return conv


def _dflash(cfg: dict, sd: dict, verifier: Verifier, dtype: str | None, speculative_tokens: int,
            where: str) -> _Converted:
    W.check_draft(cfg, sd, DFLASH, where)      # what a DFlash export is first, then what speculators can express
    mo_ids = check_dflash_config(cfg, verifier.num_layers, where)
    V = int(cfg["vocab_size"])
    block_size = int(cfg["block_size"])
    if speculative_tokens > dflash.max_draft_len(block_size):
        raise SpeculatorsFormatError(f"speculative_tokens {speculative_tokens} > block_size - 1 = {block_size - 1}, "
                                     "what one DFlash block drafts")
    check_verifier_vocab(verifier, V, where)
    conv = _Converted(DFLASH.speculators_model_type, {}, {k: v.contiguous() for k, v in sd.items()}, mo_ids, V, V,
                      block_size=block_size)
    if speculative_tokens < dflash.max_draft_len(block_size):
        conv.notes.append(f"vLLM queries 1 + num_speculative_tokens = {speculative_tokens + 1} positions per request, "
                          f"the draft was trained and validated with blocks of {block_size}: its drafts can differ "
                          f"from the validated ones unless num_speculative_tokens is {block_size - 1}")
    conv.doc = dflash_config(cfg, verifier, conv.aux_hidden_state_layer_ids, dtype)
    return conv


# the conversion per algorithm with a speculators form (Algorithm.speculators_model_type; speculators registers one
# config class per name, speculators 0.9.0 speculators/config.py SpeculatorModelConfig.register)
_CONVERTERS: dict[Algorithm, object] = {EAGLE3: _eagle3, DFLASH: _dflash}


def write_speculators_draft(draft_dir: str | Path, out_dir: str | Path, *, target_dir: str | Path,
                            speculative_tokens: int, verifier_name_or_path: str | None = None) -> SpeculatorsExport:
    """Write `out_dir/config.json` + `out_dir/model.safetensors`: the ModelOpt draft in `draft_dir` in the
    speculators format, for the verifier (target) in `target_dir`, proposing `speculative_tokens` tokens.
    `verifier_name_or_path` (default: `target_dir` resolved) is what `vllm serve <out_dir>` and speculators'
    loader open as the verifier."""
    draft_dir, out_dir, target_dir = Path(draft_dir), Path(out_dir), Path(target_dir)
    if speculative_tokens < 1:
        raise SpeculatorsFormatError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    cfg, sd = W.read_draft(draft_dir)
    verifier = read_verifier(target_dir, verifier_name_or_path)
    where = str(draft_dir)
    dtype = W.stored_dtype(cfg, sd)
    algo = of_config(cfg)
    if algo not in _CONVERTERS:
        raise SpeculatorsFormatError(f"{where}: architectures {cfg.get('architectures') or []} is none of "
                                     f"{', '.join(a.architecture for a in _CONVERTERS)} (the drafts speculators expresses)")
    conv = _CONVERTERS[algo](cfg, sd, verifier, dtype, speculative_tokens, where)
    conv.doc["speculators_config"] = speculators_config(conv.algorithm, speculative_tokens, verifier)
    W.save(out_dir, conv.tensors, conv.doc)
    return SpeculatorsExport(path=out_dir, algorithm=conv.algorithm, speculative_tokens=int(speculative_tokens),
                             aux_hidden_state_layer_ids=conv.aux_hidden_state_layer_ids,
                             modelopt_layer_ids=conv.modelopt_layer_ids, draft_vocab_size=conv.draft_vocab_size,
                             vocab_size=conv.vocab_size, has_d2t=conv.has_d2t, verifier=verifier.name_or_path,
                             block_size=conv.block_size, tensors=sorted(conv.tensors), notes=conv.notes)
