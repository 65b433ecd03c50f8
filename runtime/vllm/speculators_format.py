"""The exported draft in the speculators format (vllm-project/speculators 0.9.0), which vLLM serves natively.

Source: the draft exactly as ModelOpt 0.47's `export_speculative_decoding` writes it (`train_draft/draft/`).
Everything below was read from the speculators 0.9.0 wheel (`speculators/models/eagle3/{config,core,
model_definitions}.py`, `speculators/models/dflash/{config,core,model_definitions,attention}.py`,
`speculators/model.py`, `speculators/config.py`, `speculators/models/utils.py`) and from vLLM's loader
(`vllm/transformers_utils/configs/speculators/{base,algos}.py`, `vllm/model_executor/models/llama_eagle3.py`,
`vllm/model_executor/models/qwen3_dflash.py`, `vllm/v1/spec_decode/dflash.py`; commits named in
tests/test_speculators.py).

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
  `hidden_norm(input_layernorm(h))` (see runtime/engine/drafts.py). The format cannot express the latter, so the vLLM
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
`num_speculative_tokens` from it. vLLM has one draft length for all batch sizes.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from runtime.trtllm.draft_schedule import dflash_max_draft_len

SPECULATORS_VERSION = "0.9.0"
WEIGHTS_FILE = "model.safetensors"
_SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "weight_scale_2", "pre_quant_scale")
_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# decoder fields of the transformer_layer_config, copied from the draft's config.json when present
_DECODER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias",
                 "attention_dropout", "mlp_bias", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")


class SpeculatorsFormatError(ValueError):
    """The draft cannot be written in the speculators format (the message says what and why)."""


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


# ---------------------------------------------------------------------------------------------- reading


def _read_draft(draft_dir: Path) -> tuple[dict, dict]:
    from runtime.engine.drafts import DraftFormatError, read_draft_dir

    try:
        return read_draft_dir(draft_dir)
    except DraftFormatError as e:
        raise SpeculatorsFormatError(str(e)) from None


def _require(cfg: dict, keys, where: str) -> None:
    if missing := [k for k in keys if cfg.get(k) is None]:
        raise SpeculatorsFormatError(f"{where}: config.json lacks {missing}, which the speculators format's "
                                     "transformer_layer_config needs; is this a complete ModelOpt export?")


def _check_tensors(sd: dict, required: set[str], optional: set[str], where: str) -> None:
    import torch

    if quant := sorted(k for k in sd if k.rsplit(".", 1)[-1] in _SCALE_SUFFIXES or sd[k].dtype == torch.float8_e4m3fn):
        raise SpeculatorsFormatError(f"{where}: FP8-quantized tensors {quant[:4]}: the speculators library cannot run "
                                     "ModelOpt FP8 weights; write the speculators draft from the BF16 draft "
                                     "(train_draft/draft)")
    allowed = required | optional | {k[:-len(".weight")] + ".bias" for k in required if k.endswith(".weight")}
    if missing := sorted(required - set(sd)):
        raise SpeculatorsFormatError(f"{where}: missing tensors {missing[:8]}")
    if unexpected := sorted(set(sd) - allowed):
        raise SpeculatorsFormatError(f"{where}: tensors {unexpected[:8]} have no place in the speculators format "
                                     "(vLLM's loader would fail on an unknown name)")


def _verifier_tensor(target_dir: Path, suffix: str):
    """A tensor of the target checkpoint whose name ends with `suffix` (e.g. `model.embed_tokens.weight`), read
    from the safetensors shard that holds it; an FP8-quantized one is refused (ModelOpt keeps embeddings in BF16)."""
    import torch
    from safetensors import safe_open

    idx = target_dir / "model.safetensors.index.json"
    files = (sorted({target_dir / f for f in json.loads(idx.read_text())["weight_map"].values()}) if idx.exists()
             else sorted(target_dir.glob("*.safetensors")))
    for f in files:
        with safe_open(str(f), "pt") as h:
            names = sorted((k for k in h.keys() if k == suffix or k.endswith("." + suffix)), key=len)
            if names:
                t = h.get_tensor(names[0])
                if t.dtype == torch.float8_e4m3fn:
                    raise SpeculatorsFormatError(f"{f}: {names[0]} is FP8; the draft needs the BF16 embeddings")
                return t
    raise SpeculatorsFormatError(f"{target_dir}: no tensor named *{suffix} in {[f.name for f in files]}")


def _rope(cfg: dict) -> dict:
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


def _decoder_config(cfg: dict, model_type: str, vocab_size: int, dtype: str | None) -> dict:
    tl = {k: cfg[k] for k in _DECODER_KEYS if cfg.get(k) is not None}
    tl["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    tl.update(model_type=model_type, vocab_size=vocab_size, tie_word_embeddings=False, use_cache=True, **_rope(cfg))
    if dtype:
        tl["dtype"] = dtype
    return tl


def _check_layer_ids(ids: list[int], n_target_layers: int | None, what: str, where: str) -> list[int]:
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


# ---------------------------------------------------------------------------------------------- writing


@dataclass
class _Verifier:
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


def _read_verifier(target_dir: Path, name_or_path: str | None) -> _Verifier:
    path = target_dir / "config.json"
    if not path.exists():
        raise SpeculatorsFormatError(f"{target_dir}: no config.json; the verifier must be a checkpoint directory")
    full = json.loads(path.read_text())
    return _Verifier(dir=target_dir, cfg=full.get("text_config") or full,
                     name_or_path=name_or_path or str(target_dir.resolve()),
                     architectures=full.get("architectures") or [])


def _stored_dtype(cfg: dict, sd: dict) -> str | None:
    """The dtype the weights are stored in (a loader casts to the config's dtype: a wrong claim rounds them)."""
    stored = {str(v.dtype).replace("torch.", "") for v in sd.values() if v.is_floating_point()}
    return stored.pop() if len(stored) == 1 else (cfg.get("torch_dtype") or cfg.get("dtype"))


def _check_fc(sd: dict, hidden: int, mo_ids: list[int], layers: str, where: str) -> None:
    if tuple(sd["fc.weight"].shape) != (hidden, len(mo_ids) * hidden):
        raise SpeculatorsFormatError(f"{where}: fc.weight is {tuple(sd['fc.weight'].shape)}, expected "
                                     f"({hidden}, {len(mo_ids)} x {hidden}) for {layers}")


def _check_verifier_vocab(verifier: _Verifier, vocab_size: int, where: str) -> None:
    tv = verifier.cfg.get("vocab_size")
    if tv is not None and int(tv) != vocab_size:
        raise SpeculatorsFormatError(f"{where}: draft vocab_size {vocab_size} != the verifier's {tv}")


# -- EAGLE-3


def _check_eagle3_config(cfg: dict, n_target: int | None, where: str) -> list[int]:
    """ModelOpt's eagle_config as the speculators EAGLE-3 model can express it; returns the capture layers."""
    ec = cfg.get("eagle_config") or {}
    _require(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "intermediate_size", "vocab_size"), where)
    for flag, want in (("use_aux_hidden_state", True), ("use_last_layernorm", True),
                       ("use_input_layernorm_in_first_layer", True)):
        if bool(ec.get(flag, want)) != want:
            raise SpeculatorsFormatError(f"{where}: eagle_config.{flag} is {ec.get(flag)}; the speculators EAGLE-3 "
                                         f"model always behaves as {flag}={want}")
    if int(ec.get("parallel_draft_step", 1)) != 1:
        raise SpeculatorsFormatError(f"{where}: eagle_config.parallel_draft_step {ec['parallel_draft_step']} "
                                     "(parallel drafting) has no speculators EAGLE-3 equivalent")
    return _check_layer_ids(ec.get("eagle_aux_hidden_state_layer_ids") or [], n_target,
                            "eagle_config.eagle_aux_hidden_state_layer_ids", where)


def _check_eagle3_tensors(sd: dict, H: int, L: int, dv: int, mo_ids: list[int], where: str) -> None:
    required = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"}
    required |= {f"layers.{i}.{n}.weight" for i in range(L) for n in _LAYER_TENSORS}
    _check_tensors(sd, required, {"d2t"}, where)
    _check_fc(sd, H, mo_ids, f"the capture layers {mo_ids}", where)
    if sd["layers.0.self_attn.q_proj.weight"].shape[1] != 2 * H:
        raise SpeculatorsFormatError(f"{where}: layers.0.self_attn.q_proj takes "
                                     f"{sd['layers.0.self_attn.q_proj.weight'].shape[1]} inputs, expected 2 x {H}")
    if sd["lm_head.weight"].shape[0] != dv:
        raise SpeculatorsFormatError(f"{where}: lm_head has {sd['lm_head.weight'].shape[0]} rows, draft_vocab_size {dv}")


def _verifier_embeddings(target_dir: Path, V: int, H: int):
    embed = _verifier_tensor(target_dir, "embed_tokens.weight")
    if tuple(embed.shape) != (V, H):
        raise SpeculatorsFormatError(f"{target_dir}: embed_tokens is {tuple(embed.shape)}, the draft needs ({V}, {H})")
    return embed.contiguous()


def _vocab_map(sd: dict, dv: int, V: int, where: str) -> dict:
    """`d2t` (int64) and `t2d` (bool over the target vocabulary) for a reduced draft vocabulary; {} for a full one."""
    import torch

    if dv >= V:
        if "d2t" in sd and bool((sd["d2t"] != 0).any()):
            raise SpeculatorsFormatError(f"{where}: a non-zero d2t with draft_vocab_size == vocab_size")
        return {}
    if "d2t" not in sd:
        raise SpeculatorsFormatError(f"{where}: draft_vocab_size {dv} < vocab_size {V} but there is no d2t: "
                                     "draft ids cannot be mapped to target ids")
    d2t = sd["d2t"].to(torch.int64).contiguous()
    if tuple(d2t.shape) != (dv,):
        raise SpeculatorsFormatError(f"{where}: d2t has shape {tuple(d2t.shape)}, expected ({dv},)")
    target_ids = torch.arange(dv) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= V or target_ids.unique().numel() != dv:
        raise SpeculatorsFormatError(f"{where}: d2t does not map the {dv} draft ids to distinct target ids in [0, {V})")
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return {"d2t": d2t, "t2d": t2d}


def _eagle3_notes(ids: list[int], mo_ids: list[int], n_target: int | None) -> list[str]:
    notes = []
    if len(ids) != 3:
        notes.append(f"{len(ids)} capture layers: a vLLM whose llama_eagle3.py sizes fc as 3 x hidden (as at "
                     "vllm-project/vllm 00bd1493) cannot load this draft; speculators 0.9 sizes fc from "
                     "eagle_aux_hidden_state_layer_ids")
    if n_target is not None and max(ids) == int(n_target):
        notes.append(f"capture id {max(ids)} is the target's final hidden state (ModelOpt layer {max(mo_ids)}): only "
                     "vLLM versions that capture after a layer (`layer_idx + 1 in aux_hidden_state_layers`) provide it")
    notes.append("first layer: vLLM and speculators compute hidden_norm(h) for the hidden half; ModelOpt trained "
                 "hidden_norm(input_layernorm(h)) (validate's first_layer_norm `serving` measures this computation)")
    return notes


def _eagle3(cfg: dict, sd: dict, verifier: _Verifier, dtype: str | None, where: str) -> _Converted:
    mo_ids = _check_eagle3_config(cfg, verifier.num_layers, where)
    H, L, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    dv = int(cfg.get("draft_vocab_size") or V)
    _check_eagle3_tensors(sd, H, L, dv, mo_ids, where)
    _check_verifier_vocab(verifier, V, where)
    tensors = {k: v.contiguous() for k, v in sd.items() if k != "d2t"}
    tensors["embed_tokens.weight"] = _verifier_embeddings(verifier.dir, V, H)
    tensors.update(_vocab_map(sd, dv, V, where))
    conv = _Converted("eagle3", {}, tensors, mo_ids, dv, V, has_d2t=dv < V)
    ids = conv.aux_hidden_state_layer_ids
    conv.notes = _eagle3_notes(ids, mo_ids, verifier.num_layers)
    conv.doc = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _decoder_config(cfg, "llama", V, dtype),
        "draft_vocab_size": dv, "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False,
        "target_hidden_size": int(verifier.cfg.get("hidden_size") or H), "eagle_aux_hidden_state_layer_ids": ids,
    }
    return conv


# -- DFlash


def _check_dflash_config(cfg: dict, n_target: int | None, where: str) -> list[int]:
    """ModelOpt's dflash_config as the speculators DFlash model can express it; returns target_layer_ids."""
    dc = cfg.get("dflash_config") or {}
    _require(cfg, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                   "intermediate_size", "vocab_size", "block_size"), where)
    if dc.get("mask_token_id") is None:
        raise SpeculatorsFormatError(f"{where}: dflash_config.mask_token_id is missing")
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
    return _check_layer_ids(dc.get("target_layer_ids") or [], n_target, "dflash_config.target_layer_ids", where)


def _dflash(cfg: dict, sd: dict, verifier: _Verifier, dtype: str | None, speculative_tokens: int,
            where: str) -> _Converted:
    mo_ids = _check_dflash_config(cfg, verifier.num_layers, where)
    H, L, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    block_size = int(cfg["block_size"])
    if speculative_tokens > dflash_max_draft_len(block_size):
        raise SpeculatorsFormatError(f"speculative_tokens {speculative_tokens} > block_size - 1 = {block_size - 1}, "
                                     "what one DFlash block drafts")
    required = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    required |= {f"layers.{i}.{n}.weight" for i in range(L)
                 for n in (*_LAYER_TENSORS, "self_attn.q_norm", "self_attn.k_norm")}
    _check_tensors(sd, required, set(), where)
    _check_fc(sd, H, mo_ids, f"target_layer_ids {mo_ids}", where)
    _check_verifier_vocab(verifier, V, where)
    conv = _Converted("dflash", {}, {k: v.contiguous() for k, v in sd.items()}, mo_ids, V, V, block_size=block_size)
    tl = _decoder_config(cfg, "qwen3", V, dtype)
    tl.update(use_sliding_window=False, sliding_window=None, max_window_layers=L, layer_types=["full_attention"] * L)
    if speculative_tokens < dflash_max_draft_len(block_size):
        conv.notes.append(f"vLLM queries 1 + num_speculative_tokens = {speculative_tokens + 1} positions per request, "
                          f"the draft was trained and validated with blocks of {block_size}: its drafts can differ "
                          f"from the validated ones unless num_speculative_tokens is {block_size - 1}")
    conv.doc = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": tl,
        "draft_vocab_size": V, "block_size": block_size, "target_hidden_size": int(verifier.cfg.get("hidden_size") or H),
        "aux_hidden_state_layer_ids": conv.aux_hidden_state_layer_ids,
        "mask_token_id": int(cfg["dflash_config"]["mask_token_id"]),
        "sliding_window_non_causal": True, "sample_from_anchor": False,
    }
    return conv


# -- the files


def _speculators_config(algorithm: str, speculative_tokens: int, verifier: _Verifier) -> dict:
    """One greedy proposal method with the tuned draft length (vLLM's num_speculative_tokens), and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": verifier.as_config(),
    }


def _save(out_dir: Path, tensors: dict, doc: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / WEIGHTS_FILE).chmod(0o644)      # safetensors writes 0600: a container user other than ours must read it
    (out_dir / "config.json").write_text(json.dumps(doc, indent=2) + "\n")


def write_speculators_draft(draft_dir: str | Path, out_dir: str | Path, *, target_dir: str | Path,
                            speculative_tokens: int, verifier_name_or_path: str | None = None) -> SpeculatorsExport:
    """Write `out_dir/config.json` + `out_dir/model.safetensors`: the ModelOpt draft in `draft_dir` in the
    speculators format, for the verifier (target) in `target_dir`, proposing `speculative_tokens` tokens.
    `verifier_name_or_path` (default: `target_dir` resolved) is what `vllm serve <out_dir>` and speculators'
    loader open as the verifier."""
    from runtime.engine.drafts import DFLASH_ARCH, EAGLE3_ARCH

    draft_dir, out_dir, target_dir = Path(draft_dir), Path(out_dir), Path(target_dir)
    if speculative_tokens < 1:
        raise SpeculatorsFormatError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    cfg, sd = _read_draft(draft_dir)
    verifier = _read_verifier(target_dir, verifier_name_or_path)
    archs = cfg.get("architectures") or []
    where = str(draft_dir)
    dtype = _stored_dtype(cfg, sd)
    if EAGLE3_ARCH in archs:
        conv = _eagle3(cfg, sd, verifier, dtype, where)
    elif DFLASH_ARCH in archs:
        conv = _dflash(cfg, sd, verifier, dtype, speculative_tokens, where)
    else:
        raise SpeculatorsFormatError(f"{where}: architectures {archs} is neither {EAGLE3_ARCH} nor {DFLASH_ARCH}")
    conv.doc["speculators_config"] = _speculators_config(conv.algorithm, speculative_tokens, verifier)
    _save(out_dir, conv.tensors, conv.doc)
    return SpeculatorsExport(path=out_dir, algorithm=conv.algorithm, speculative_tokens=int(speculative_tokens),
                             aux_hidden_state_layer_ids=conv.aux_hidden_state_layer_ids,
                             modelopt_layer_ids=conv.modelopt_layer_ids, draft_vocab_size=conv.draft_vocab_size,
                             vocab_size=conv.vocab_size, has_d2t=conv.has_d2t, verifier=verifier.name_or_path,
                             block_size=conv.block_size, tensors=sorted(conv.tensors), notes=conv.notes)


# ---------------------------------------------------------------------------------------------- vLLM command


def vllm_serve_command(spec: SpeculatorsExport, *, target: str, draft: str, max_model_len: int | None = None,
                       kv_cache_fp8: bool = False, tensor_parallel_size: int = 1, port: int = 8000) -> list[str]:
    """`vllm serve <target> --speculative-config {"model": <draft>, ...}` (argv, for shlex.join). `draft` is where
    the speculators directory lives once committed (the stage writes into a temporary directory first)."""
    sc = {"model": draft, "method": spec.algorithm, "num_speculative_tokens": spec.speculative_tokens}
    argv = ["vllm", "serve", target, "--host", "127.0.0.1", "--port", str(port),
            "--speculative-config", json.dumps(sc, separators=(",", ":"))]
    if max_model_len:
        argv += ["--max-model-len", str(int(max_model_len))]
    if kv_cache_fp8:
        argv += ["--kv-cache-dtype", "fp8"]
    if tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(int(tensor_parallel_size))]
    return argv


def readme(spec: SpeculatorsExport, argv: list[str], *, draft: str, source_draft: str,
           deployed_draft: str | None = None) -> str:
    cmd = shlex.join(argv)
    kind = "EAGLE-3" if spec.algorithm == "eagle3" else f"DFlash (block {spec.block_size})"
    vocab = (f"Reduced draft vocabulary: {spec.draft_vocab_size} of {spec.vocab_size} tokens (`d2t`, `t2d`)"
             if spec.has_d2t else f"Full vocabulary ({spec.vocab_size} tokens)")
    shared = ("The token embeddings are the verifier's: `embed_tokens.weight` is a bit-exact copy of the target's, "
              "which vLLM\nfinds equal to the target's and shares." if spec.algorithm == "eagle3" else
              "Embeddings and LM head are the verifier's and not in this directory: vLLM shares the target's, the "
              f"speculators\nlibrary loads them from `speculators_config.verifier.name_or_path` = `{spec.verifier}`.")
    fp8 = ("" if deployed_draft in (None, source_draft) else
           f"\nThe TensorRT-LLM deployment uses the FP8 draft `{deployed_draft}`; vLLM gets the BF16 draft it was "
           "quantized from (the speculators library cannot run ModelOpt FP8 weights, so nothing here verifies one).\n")
    notes = "".join(f"- {n}\n" for n in spec.notes) or "- none\n"
    return f"""# {kind} draft in the speculators {SPECULATORS_VERSION} format (for vLLM)

`config.json` + `{WEIGHTS_FILE}`: the draft from `{source_draft}` (ModelOpt's export) in the format of
vllm-project/speculators, which vLLM reads natively. {vocab}; capture layers
`{spec.aux_hidden_state_layer_ids}` in speculators/vLLM numbering (the decoder layer a hidden state enters; ModelOpt
and TensorRT-LLM number the same states `{spec.modelopt_layer_ids}`, the layer they leave).
{shared}
{fp8}
## Serve
```bash
{cmd}
```
or, since `config.json` names the verifier, `vllm serve {shlex.quote(draft)}` (vLLM then serves
`{spec.verifier}` with this draft; the path must exist where vLLM runs). `num_speculative_tokens` =
{spec.speculative_tokens} is the tuned draft length (`speculators_config.proposal_methods[0].speculative_tokens`);
vLLM uses one draft length at every batch size, TensorRT-LLM's per-batch schedule has no vLLM equivalent.

## Notes
{notes}
## Check
tests/test_speculators.py loads this format with the speculators library (in its own environment) and checks
that its draft's argmax on the same target hidden states equals specpipe's runtime at every position. vLLM
itself was not run.
"""
