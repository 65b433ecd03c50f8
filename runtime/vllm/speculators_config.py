"""The speculators config.json of a draft (speculators 0.9.0): ModelOpt's draft config checked against what the
speculators EAGLE-3 and DFlash models can express, the `transformer_layer_config` (decoder fields, RoPE both
ways), capture layers in speculators/vLLM numbering, and the `speculators_config` proposal. The format's facts and
their upstream sources are in runtime/vllm/speculators_format.py's docstring."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runtime.algorithms import dflash, eagle3

SPECULATORS_VERSION = "0.9.0"
# speculators' own name for the capture layers (speculators 0.9.0 speculators/models/eagle3/config.py,
# Eagle3SpeculatorConfig.eagle_aux_hidden_state_layer_ids, numbered from 1): a field of the format this package
# writes, spelled like ModelOpt's key (runtime/algorithms/eagle3.py CAPTURE_KEY) but not the same fact
SPECULATORS_CAPTURE_KEY = "eagle_aux_hidden_state_layer_ids"
# vLLM's llama_eagle3.py sizes fc as this many x hidden (vllm-project/vllm 00bd1493): a fact of that vLLM, not the
# count specpipe trains (runtime/algorithms/eagle3.py CAPTURE_LAYERS)
VLLM_FC_CAPTURE_LAYERS = 3
# The first vLLM release that captures the target's final hidden state, capture id == number of target layers: vLLM's
# LlamaModel.forward appends the residual stream after layer i as id i + 1 (id 0 before the first layer) since
# vllm-project/vllm 8b346309a5efbe80ee64f7d3633d2d7dedcc202b (PR #36063 "Consolidate SupportsEagle", merged 2026-03-13,
# after the 0.17 branch: 0.17.1 was out by 2026-03-17), so from 0.18.0; before it the state *entering* layer i was
# captured as id i, ids stop at L - 1 and a draft asking for id L gets one aux state fewer than its fc expects. Read in
# vLLM 0.32.0: model_executor/models/llama.py LlamaModel.forward, model_executor/models/interfaces.py
# EagleModelMixin._maybe_add_hidden_state (tests/integration/runtime/vllm/test_vllm_capture.py).
VLLM_MIN_FINAL_LAYER_CAPTURE = "0.18.0"
# decoder fields of the transformer_layer_config, copied from the draft's config.json when present
_DECODER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias",
                 "attention_dropout", "mlp_bias", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")


class SpeculatorsFormatError(ValueError):
    """The draft cannot be written in the speculators format (the message says what and why)."""


@dataclass
class Verifier:
    """The target checkpoint the draft is written for (speculators' `verifier`)."""

    dir: Path
    cfg: dict                 # its config.json (the text model's, for a multimodal checkpoint)
    name_or_path: str         # what vLLM and speculators' loader open as the verifier
    architectures: list

    @property
    def num_layers(self) -> int | None:
        return self.cfg.get("num_hidden_layers")

    def as_config(self) -> dict:
        return {"name_or_path": self.name_or_path, "architectures": self.architectures}


def read_verifier(target_dir: Path, name_or_path: str | None) -> Verifier:
    path = target_dir / "config.json"
    if not path.exists():
        raise SpeculatorsFormatError(f"{target_dir}: no config.json; the verifier must be a checkpoint directory")
    full = json.loads(path.read_text())
    return Verifier(dir=target_dir, cfg=full.get("text_config") or full,
                    name_or_path=name_or_path or str(target_dir.resolve()),
                    architectures=full.get("architectures") or [])


def require_keys(cfg: dict, keys, where: str) -> None:
    if missing := [k for k in keys if cfg.get(k) is None]:
        raise SpeculatorsFormatError(f"{where}: config.json lacks {missing}, which the speculators format's "
                                     "transformer_layer_config needs; is this a complete ModelOpt export?")


def rope(cfg: dict) -> dict:
    """RoPE of the draft as config.json states it (`rope_theta` + legacy `rope_scaling`, or transformers 5's
    `rope_parameters`), written both ways: transformers 5 (speculators 0.9) reads `rope_parameters`, older
    consumers `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta") or params.get("rope_theta") or scaling.get("rope_theta")
    if theta is None:
        raise SpeculatorsFormatError("the draft's config.json states no rope_theta (nor rope_parameters.rope_theta)")
    rope_type = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type") or "default"
    extra = {k: v for src in (params, scaling) for k, v in src.items() if k not in ("rope_type", "type", "rope_theta")}
    out = {"rope_theta": float(theta), "rope_parameters": {"rope_type": rope_type, "rope_theta": float(theta), **extra}}
    out["rope_scaling"] = {"rope_type": rope_type, **extra} if rope_type != "default" else None
    return out


def decoder_config(cfg: dict, model_type: str, vocab_size: int, dtype: str | None) -> dict:
    tl = {k: cfg[k] for k in _DECODER_KEYS if cfg.get(k) is not None}
    tl["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    tl.update(model_type=model_type, vocab_size=vocab_size, tie_word_embeddings=False, use_cache=True, **rope(cfg))
    if dtype:
        tl["dtype"] = dtype
    return tl


def check_layer_ids(ids: list[int], n_target_layers: int | None, what: str, where: str) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise SpeculatorsFormatError(f"{where}: {what} is empty")
    if len(set(ids)) != len(ids):
        raise SpeculatorsFormatError(f"{where}: {what} {ids} repeats a layer; speculators requires distinct ids and "
                                     "vLLM captures each layer once (fc would get fewer inputs than it has columns)")
    if ids != sorted(ids):
        raise SpeculatorsFormatError(f"{where}: {what} {ids} is not ascending; vLLM concatenates the captured states "
                                     "in layer order, so fc's input blocks would be permuted")
    if n_target_layers is not None and (min(ids) < 0 or max(ids) >= n_target_layers):
        raise SpeculatorsFormatError(f"{where}: {what} {ids} outside the target's {n_target_layers} layers")
    return ids


def check_verifier_vocab(verifier: Verifier, vocab_size: int, where: str) -> None:
    tv = verifier.cfg.get("vocab_size")
    if tv is not None and int(tv) != vocab_size:
        raise SpeculatorsFormatError(f"{where}: draft vocab_size {vocab_size} != the verifier's {tv}")


def check_eagle3_config(cfg: dict, n_target: int | None, where: str) -> list[int]:
    """ModelOpt's eagle_config as the speculators EAGLE-3 model can express it; returns the capture layers."""
    ec = cfg.get("eagle_config") or {}
    require_keys(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "intermediate_size", "vocab_size"), where)
    for flag, want in (("use_aux_hidden_state", True), ("use_last_layernorm", True),
                       ("use_input_layernorm_in_first_layer", True)):
        if bool(ec.get(flag, want)) != want:
            raise SpeculatorsFormatError(f"{where}: eagle_config.{flag} is {ec.get(flag)}; the speculators EAGLE-3 "
                                         f"model always behaves as {flag}={want}")
    if int(ec.get("parallel_draft_step", 1)) != 1:
        raise SpeculatorsFormatError(f"{where}: eagle_config.parallel_draft_step {ec['parallel_draft_step']} "
                                     "(parallel drafting) has no speculators EAGLE-3 equivalent")
    return check_layer_ids(eagle3.capture_layer_ids(cfg) or [], n_target, eagle3.EAGLE3.capture_key, where)


def eagle3_notes(ids: list[int], mo_ids: list[int], n_target: int | None) -> list[str]:
    notes = []
    if len(ids) != VLLM_FC_CAPTURE_LAYERS:
        notes.append(f"{len(ids)} capture layers: a vLLM whose llama_eagle3.py sizes fc as {VLLM_FC_CAPTURE_LAYERS} x hidden "
                     "(as at vllm-project/vllm 00bd1493) cannot load this draft; speculators 0.9 sizes fc from "
                     f"{SPECULATORS_CAPTURE_KEY}")
    if n_target is not None and max(ids) == int(n_target):
        notes.append(f"capture id {max(ids)} is the target's final hidden state (ModelOpt layer {max(mo_ids)}): it needs "
                     f"vLLM >= {VLLM_MIN_FINAL_LAYER_CAPTURE}, which captures after each layer (id i + 1 after layer i, "
                     "vllm-project/vllm 8b346309, PR #36063); older vLLM stops at id "
                     f"{int(n_target) - 1} and the draft gets one aux state fewer than its fc expects")
    notes.append("first layer: vLLM and speculators compute hidden_norm(h) for the hidden half; ModelOpt trained "
                 "hidden_norm(input_layernorm(h)) (validate's first_layer_norm `serving` measures this computation)")
    return notes


def check_dflash_config(cfg: dict, n_target: int | None, where: str) -> list[int]:
    """ModelOpt's dflash_config as the speculators DFlash model can express it; returns target_layer_ids. Runs after
    runtime/algorithms/dflash.py's check_export, which owns the export's own keys (mask_token_id, target_layer_ids)."""
    dc = cfg.get("dflash_config") or {}
    require_keys(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "intermediate_size", "vocab_size", "block_size"), where)
    if dc.get("causal"):
        raise SpeculatorsFormatError(f"{where}: dflash_config.causal is true; speculators' DFlash attends "
                                     "bidirectionally inside the block in full-attention layers, so a causal draft "
                                     "has no speculators form")
    if bad := [k for k in ("use_swa", "attention_sink_bias", "projector_type") if dc.get(k)]:
        raise SpeculatorsFormatError(f"{where}: dflash_config uses {bad}, which the speculators DFlash model "
                                     "does not implement")
    if any(t != "full_attention" for t in (cfg.get("layer_types") or [])):
        raise SpeculatorsFormatError(f"{where}: layer_types {cfg['layer_types']}: only full-attention DFlash "
                                     "drafts are written")
    return check_layer_ids(dflash.capture_layer_ids(cfg) or [], n_target, dflash.DFLASH.capture_key, where)


def speculators_config(algorithm: str, speculative_tokens: int, verifier: Verifier) -> dict:
    """One greedy proposal method with the tuned draft length (vLLM's num_speculative_tokens), and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": verifier.as_config(),
    }


def eagle3_config(cfg: dict, verifier: Verifier, ids: list[int], draft_vocab_size: int, dtype: str | None) -> dict:
    """config.json (less `speculators_config`) of an EAGLE-3 draft; `ids` in speculators numbering."""
    H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": decoder_config(cfg, "llama", V, dtype),
        "draft_vocab_size": draft_vocab_size, "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False,
        "target_hidden_size": int(verifier.cfg.get("hidden_size") or H), SPECULATORS_CAPTURE_KEY: ids,
    }


def dflash_config(cfg: dict, verifier: Verifier, ids: list[int], dtype: str | None) -> dict:
    """config.json (less `speculators_config`) of a DFlash draft (full attention, bidirectional in the block);
    `ids` in speculators numbering."""
    H, L, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    tl = decoder_config(cfg, "qwen3", V, dtype)
    tl.update(use_sliding_window=False, sliding_window=None, max_window_layers=L, layer_types=["full_attention"] * L)
    return {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": tl,
        "draft_vocab_size": V, "block_size": int(cfg["block_size"]),
        "target_hidden_size": int(verifier.cfg.get("hidden_size") or H),
        "aux_hidden_state_layer_ids": ids,
        "mask_token_id": int(cfg["dflash_config"]["mask_token_id"]),
        "sliding_window_non_causal": True, "sample_from_anchor": False,
    }
