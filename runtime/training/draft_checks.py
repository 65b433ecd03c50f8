"""Checks of an exported draft directory (EAGLE-3 or DFlash) before anything deploys it.

`check_draft(draft_dir, expect)` returns one `Check` per named check; each failure message says what was
expected, what was found and what it breaks at serving time. What a valid export is (tensors, d2t, config keys)
is runtime/algorithms/{eagle3,dflash}.py's `check_export`; this module adds what training used (capture layers,
draft vocabulary, block size, mask token), the serving context and the tokenizer. Pure file reads (config.json, safetensors
headers, tokenizer files): cheap enough to run in the stage, in later stages, and in tests on a
deliberately broken export.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.algorithms import dflash, eagle3
from runtime.algorithms.export import DraftExportError, Export, read_export
from runtime.algorithms.registry import ALGORITHMS
from runtime.algorithms.registry import get as get_algorithm
from runtime.text.tokenizer_files import TOKENIZER_FILES, same_tokenizer_config

# the named checks every report lists (passed or not); other problems of check_export join them by their own name
_ALWAYS = {"eagle3": ("config", "required_tensors", "draft_vocab_size", "d2t"), "dflash": ("config", "required_tensors")}


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


def format_checks(ex: Export, algorithm: str) -> list[Check]:
    """The export's problems as its algorithm's `check_export` reports them (runtime/algorithms/), one named Check
    per rule: those in `_ALWAYS` whether they pass or not, any other only when it fails."""
    probs = ALGORITHMS[algorithm].check_export(ex)
    names = list(_ALWAYS[algorithm]) + [p.check for p in probs if p.check not in _ALWAYS[algorithm]]
    out = []
    for n in dict.fromkeys(names):
        msgs = [p.message for p in probs if p.check == n]
        out.append(Check(n, not msgs, "; ".join(msgs)))
    for c in out:
        if c.name == "required_tensors":
            c.details = {"tensors": len(ex.shapes)}
        if c.name == "d2t":
            c.details = {"needed": ex.cfg.get("draft_vocab_size") not in (None, ex.cfg.get("vocab_size"))}
    return out


def check_draft(draft_dir: Path, e: Expect) -> list[Check]:
    draft_dir = Path(draft_dir)
    try:
        ex = read_export(draft_dir)
    except DraftExportError as x:
        return [Check("config", False, str(x))]
    cfg = ex.cfg
    out = format_checks(ex, e.algorithm)
    if not get_algorithm(e.algorithm).drafts_block:
        fc = ex.shapes.get("fc.weight")
        if fc is not None:   # a missing fc is required_tensors' failure
            n_in = fc[0][1] if len(fc[0]) == 2 else None
            msg = eagle3.deployable_fc(n_in, e.hidden_size)
            out.append(Check("fc_in_features", not msg, msg, {"in_features": n_in,
                                                              "expected": eagle3.CAPTURE_LAYERS * e.hidden_size}))
        out += _eagle_checks(cfg, e)
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


def _eagle_checks(cfg: dict, e: Expect) -> list[Check]:
    """The export against what training used (its format is `format_checks`')."""
    out = []
    dvs, want_dvs = cfg.get("draft_vocab_size"), e.draft_vocab_size or e.vocab_size
    if dvs is not None and dvs != want_dvs:
        out.append(Check("draft_vocab_size_value", False, f"config.json draft_vocab_size is {dvs}, training used {want_dvs}"))
    ids = eagle3.capture_layer_ids(cfg)
    ok = ids is not None and ids == list(e.capture_layer_ids)
    out.append(Check("aux_layer_ids", ok,
                     "" if ok else f"{eagle3.EAGLE3.capture_key} is {ids}, training captured "
                                   f"{list(e.capture_layer_ids)}; pass the trained set as eagle3_layers_to_capture"))
    return out


def _dflash_checks(cfg: dict, e: Expect) -> list[Check]:
    out = []
    dc = cfg.get(dflash.CAPTURE_SECTION) or {}
    ids = dflash.capture_layer_ids(cfg)
    ok = ids is not None and list(ids) == list(e.capture_layer_ids)
    out.append(Check("target_layer_ids", ok, "" if ok else f"{dflash.DFLASH.capture_key} is {ids}, training used "
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
