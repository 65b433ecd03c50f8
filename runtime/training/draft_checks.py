"""Checks of an exported draft directory (EAGLE-3 or DFlash) before anything deploys it.

`check_draft(draft_dir, expect)` returns one `Check` per named check; each failure message says what was
expected, what was found and what it breaks at serving time. Pure file reads (config.json, safetensors
headers, tokenizer files): cheap enough to run in the stage, in later stages, and in tests on a
deliberately broken export.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.text.tokenizer_files import TOKENIZER_FILES, same_tokenizer_config

ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "dflash": "DFlashDraftModel"}


@dataclass
class Expect:
    """What training used and what serving needs; the stage fills it from its job."""

    algorithm: str                       # eagle3 | dflash
    num_layers: int
    hidden_size: int
    vocab_size: int
    capture_layer_ids: list[int]         # EAGLE-3 aux layer ids / DFlash target layer ids
    serving_context: int
    target_dir: Path | None = None       # tokenizer source
    draft_vocab_size: int | None = None  # EAGLE-3; None = full vocabulary
    block_size: int | None = None        # DFlash
    mask_token_id: int | None = None     # DFlash


@dataclass
class Check:
    name: str
    passed: bool
    message: str = ""
    details: dict = field(default_factory=dict)


def _tensor_shapes(draft_dir: Path) -> dict[str, tuple[list[int], str]]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                shapes[k] = (list(sl.get_shape()), sl.get_dtype())
    return shapes


def required_tensors(e: Expect) -> list[str]:
    layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm"]
    if e.algorithm == "eagle3":
        names = ["fc", "norm", "lm_head", "layers.0.hidden_norm", "layers.0.input_layernorm"]
        names += [f"layers.{i}.{n}" for i in range(e.num_layers) for n in layer]
        names += [f"layers.{i}.input_layernorm" for i in range(1, e.num_layers)]
    else:  # DFlash reuses the target's embeddings and lm_head
        names = ["fc", "hidden_norm", "norm"]
        names += [f"layers.{i}.{n}" for i in range(e.num_layers)
                  for n in layer + ["input_layernorm", "self_attn.q_norm", "self_attn.k_norm"]]
    return [n + ".weight" for n in names]


def _covered_positions(cfg: dict) -> tuple[int, str]:
    """Positions the draft's RoPE covers: max_position_embeddings, or a scaling's factor x original length."""
    mpe = int(cfg.get("max_position_embeddings") or 0)
    rs = cfg.get("rope_scaling") or {}
    kind = rs.get("rope_type") or rs.get("type")
    if kind and kind != "default" and rs.get("factor"):
        orig = int(rs.get("original_max_position_embeddings") or mpe)
        scaled = int(float(rs["factor"]) * orig)
        if scaled > mpe:
            return scaled, f"{kind} rope_scaling x{rs['factor']} over {orig}"
    return mpe, "max_position_embeddings"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def check_draft(draft_dir: Path, e: Expect) -> list[Check]:
    draft_dir = Path(draft_dir)
    out: list[Check] = []
    cfg_path = draft_dir / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as ex:
        return [Check("config", False, f"{cfg_path}: cannot read the draft config ({ex})")]
    arch = (cfg.get("architectures") or [None])[0]
    want = ARCHITECTURES[e.algorithm]
    out.append(Check("config", arch == want,
                     "" if arch == want else f"config.json architectures is {cfg.get('architectures')}, expected ['{want}'] "
                                             f"(TensorRT-LLM picks the draft implementation from it)"))

    shapes = _tensor_shapes(draft_dir)
    missing = [n for n in required_tensors(e) if n not in shapes]
    out.append(Check("required_tensors", not missing,
                     "" if not missing else f"missing {len(missing)} tensor(s) in {draft_dir.name}/*.safetensors: "
                                            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}",
                     {"tensors": len(shapes)}))
    fc = shapes.get("fc.weight")
    n_cap = len(e.capture_layer_ids)
    if fc is not None and fc[0] != [e.hidden_size, n_cap * e.hidden_size]:
        out.append(Check("fc_shape", False, f"fc.weight has shape {fc[0]}, expected [{e.hidden_size}, {n_cap * e.hidden_size}] "
                                            f"for {n_cap} captured target layers of width {e.hidden_size}"))

    if e.algorithm == "eagle3":
        if fc is not None:   # a missing fc is required_tensors' failure
            out.append(_fc_in_features(fc, e.hidden_size))
        out += _eagle_checks(draft_dir, cfg, shapes, e)
    else:
        out += _dflash_checks(cfg, e)

    covered, how = _covered_positions(cfg)
    ok = covered >= e.serving_context
    out.append(Check("serving_context", ok,
                     "" if ok else f"the draft covers {covered} positions ({how}) but the serving context is "
                                   f"{e.serving_context}: RoPE would be clamped past {covered} tokens and acceptance "
                                   "collapses; set train_draft.rope_scaling (YaRN) or a smaller train_draft.serving_context",
                     {"covered": covered, "by": how, "serving_context": e.serving_context}))

    out.append(_tokenizer_check(draft_dir, e.target_dir))
    return out


# The capture-layer count every EAGLE-3 consumer builds its fc for: TensorRT-LLM (3 unless
# eagle3_layers_to_capture says otherwise; tensorrt_llm/_torch/speculative/eagle3.py), vLLM
# (vllm/model_executor/models/llama_eagle3.py: Linear(hidden_size * 3, hidden_size)), speculators' converter.
EAGLE3_FC_LAYERS = 3


def _fc_in_features(fc, hidden: int) -> Check:
    n_in = fc[0][1] if len(fc[0]) == 2 else None
    ok = n_in == EAGLE3_FC_LAYERS * hidden
    return Check("fc_in_features", ok,
                 "" if ok else f"fc.weight takes {n_in} inputs, expected {EAGLE3_FC_LAYERS} x hidden = "
                               f"{EAGLE3_FC_LAYERS * hidden}: TensorRT-LLM (default capture count), vLLM's llama_eagle3 and "
                               f"speculators build fc for {EAGLE3_FC_LAYERS} captured layers and refuse this shape at load; "
                               "train on 3 distinct capture layers (train_draft.algorithm.aux_layer_ids)",
                 {"in_features": n_in, "expected": EAGLE3_FC_LAYERS * hidden})


def _eagle_checks(draft_dir: Path, cfg: dict, shapes: dict, e: Expect) -> list[Check]:
    out = []
    dvs = cfg.get("draft_vocab_size")
    out.append(Check("draft_vocab_size", dvs is not None,
                     "" if dvs is not None else "config.json has no draft_vocab_size: TensorRT-LLM then assumes the full "
                                                "vocabulary, which is wrong for a reduced-vocabulary draft"))
    want_dvs = e.draft_vocab_size or e.vocab_size
    if dvs is not None and dvs != want_dvs:
        out.append(Check("draft_vocab_size_value", False, f"config.json draft_vocab_size is {dvs}, training used {want_dvs}"))
    dvs = dvs if dvs is not None else want_dvs
    lm = shapes.get("lm_head.weight")
    if lm is not None and lm[0][0] != dvs:
        out.append(Check("lm_head_rows", False, f"lm_head.weight has {lm[0][0]} rows but draft_vocab_size is {dvs}"))
    if dvs != e.vocab_size:
        d2t = shapes.get("d2t")
        if d2t is None:
            out.append(Check("d2t", False, f"draft_vocab_size {dvs} != vocab_size {e.vocab_size} but there is no d2t tensor: "
                                           "draft ids would be read as target ids and acceptance collapses silently"))
        elif d2t[0] != [dvs]:
            out.append(Check("d2t", False, f"d2t has shape {d2t[0]}, expected [{dvs}] (one offset per draft token)"))
        else:
            c = check_d2t_map(draft_dir, e.vocab_size)
            out.append(Check("d2t", c.passed, c.message, {"needed": True, "length": dvs}))
    else:
        out.append(Check("d2t", True, "", {"needed": False}))
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ok = ids is not None and list(ids) == list(e.capture_layer_ids)
    out.append(Check("aux_layer_ids", ok,
                     "" if ok else f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids}, training captured "
                                   f"{list(e.capture_layer_ids)}; pass the trained set as eagle3_layers_to_capture"))
    return out


def check_d2t_map(draft_dir: Path, vocab_size: int) -> Check:
    """Every draft id maps to a distinct target id inside the vocabulary."""
    import torch
    from safetensors import safe_open

    with safe_open(str(Path(draft_dir) / "model.safetensors"), "pt") as sf:
        if "d2t" not in sf.keys():
            return Check("d2t_map", True, "", {"needed": False})
        d2t = sf.get_tensor("d2t")

    tgt = torch.arange(len(d2t)) + d2t
    bad = int(((tgt < 0) | (tgt >= vocab_size)).sum())
    dup = len(tgt) - len(set(tgt.tolist()))
    ok = bad == 0 and dup == 0
    return Check("d2t_map", ok, "" if ok else f"d2t maps {bad} draft ids outside the vocabulary [0, {vocab_size}) "
                                              f"and {dup} onto an already-used target id")


def _dflash_checks(cfg: dict, e: Expect) -> list[Check]:
    out = []
    dc = cfg.get("dflash_config") or {}
    ids = dc.get("target_layer_ids")
    ok = ids is not None and list(ids) == list(e.capture_layer_ids)
    out.append(Check("target_layer_ids", ok, "" if ok else f"dflash_config.target_layer_ids is {ids}, training used "
                                                           f"{list(e.capture_layer_ids)}"))
    ok = cfg.get("block_size") == e.block_size
    out.append(Check("block_size", ok, "" if ok else f"block_size is {cfg.get('block_size')}, training used {e.block_size}"))
    ok = dc.get("mask_token_id") == e.mask_token_id
    out.append(Check("mask_token_id", ok, "" if ok else f"dflash_config.mask_token_id is {dc.get('mask_token_id')}, "
                                                        f"training used {e.mask_token_id}"))
    return out


def _same(a: Path, b: Path) -> bool:
    """Whichever tokenizer files the target ships must be copied unchanged; tokenizer_config.json must say the same once
    both are in the portable form (runtime/text/tokenizer_files.py)."""
    if a.name == "tokenizer_config.json":
        return same_tokenizer_config(a, b)
    return _sha(a) == _sha(b)


def _tokenizer_check(draft_dir: Path, target_dir: Path | None) -> Check:
    if target_dir is None:
        return Check("tokenizer", True, "", {"compared": False})
    target_dir = Path(target_dir)
    src = [n for n in TOKENIZER_FILES if (target_dir / n).exists()]
    if not src:
        return Check("tokenizer", False, f"the target {target_dir} has no tokenizer files to compare with")
    missing = [n for n in src if not (draft_dir / n).exists()]
    differ = [n for n in src if n not in missing and not _same(draft_dir / n, target_dir / n)]
    ok = not missing and not differ
    msg = ""
    if not ok:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(missing))
        if differ:
            parts.append("different from the target's: " + ", ".join(differ))
        msg = "draft tokenizer is not the target's (" + "; ".join(parts) + "); the draft must share the target's token ids"
    return Check("tokenizer", ok, msg, {"files": src})


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.passed]


def as_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
