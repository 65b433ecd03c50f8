"""The draft algorithm's options against the target's shape: which target layers an EAGLE-3 or DFlash draft reads
(their defaults), the options a target of that shape cannot take (`shape_problems`, also the stage's config check
for a tiny target), and the options resolved into the job (`resolve_algorithm`: capture layers, DFlash's mask
token id, the trained draft length). The algorithms' own facts (capture-layer defaults, the DFlash cap) are
runtime/algorithms/'s."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.algorithms import dflash, eagle3
from runtime.algorithms.registry import get as get_algorithm
from runtime.training.job import JobError

if TYPE_CHECKING:
    from runtime.records import TargetInfo

# Read from ModelOpt 0.47 (modelopt/torch/speculative/plugins/hf_dflash.py: `hidden_states[lid + 1]`, where
# transformers 5.14 ties the last entry to `last_hidden_state`, i.e. after the final norm) and vLLM 0.32
# (model_executor/models/llama.py `_maybe_add_hidden_state(..., hidden_states, residual)`: the layer's output before it).
_LAST_LAYER = ("includes layer {last}, the target's last ({src}): ModelOpt's DFlash training reads that one after the "
               "target's final norm, while vLLM and specpipe's runtime feed the draft its output before the norm, so the "
               "deployed draft would see other features than it trained on; pick layers below {last} (the default "
               "spread ends 2 layers below it)")


def shape_problems(a, n_layers: int, vocab: int, layers_src: str, vocab_src: str) -> list[tuple[str, str]]:
    """(dotted path, message) for each option of the algorithm section `a` that a target of `n_layers` layers and
    a `vocab` vocabulary cannot take; `layers_src`/`vocab_src` say where those figures come from."""
    p = "train_draft.algorithm"
    out = []
    if get_algorithm(a.kind).capture_count:      # EAGLE-3: a fixed number of distinct capture layers
        bad = [i for i in (a.aux_layer_ids or []) if i >= n_layers]
        if n_layers < eagle3.CAPTURE_LAYERS:
            out.append((f"{p}.kind", f"EAGLE-3 captures {eagle3.CAPTURE_LAYERS} distinct target layers, but the target has "
                        f"{n_layers} ({layers_src}); TensorRT-LLM and vLLM load no other shape: use DFlash or a deeper target"))
        elif bad:
            out.append(
                (f"{p}.aux_layer_ids", f"{bad} out of range: the target has {n_layers} layers (0..{n_layers - 1}; {layers_src})")
            )
        if a.draft_vocab_size and a.draft_vocab_size > vocab:
            out.append((f"{p}.draft_vocab_size", f"{a.draft_vocab_size} exceeds the target vocabulary of {vocab} ({vocab_src})"))
    else:
        if a.draft_layers > n_layers - 1:
            out.append(
                (
                    f"{p}.draft_layers",
                    f"{a.draft_layers} draft layers need as many distinct target layers below the last one to read, but "
                    f"the target has {n_layers} ({layers_src}): at most {n_layers - 1} draft layers",
                )
            )
        bad = [i for i in (a.target_layer_ids or []) if i >= n_layers]
        if bad:
            out.append(
                (
                    f"{p}.target_layer_ids",
                    f"{bad} out of range: the target has {n_layers} layers (0..{n_layers - 1}; {layers_src})",
                )
            )
        if not bad and n_layers - 1 in (a.target_layer_ids or []):
            out.append((f"{p}.target_layer_ids", _LAST_LAYER.format(last=n_layers - 1, src=layers_src)))
        if isinstance(a.mask_token, int) and not 0 <= a.mask_token < vocab:
            out.append((f"{p}.mask_token", f"id {a.mask_token} is not in the target vocabulary of {vocab} ({vocab_src})"))
    return out


def resolve_algorithm(a, target: TargetInfo, tok, log) -> dict:
    """Algorithm options (the section `a`) with the target's values filled in (target.json's record `target`, its
    tokenizer `tok`); raises JobError for impossible ones."""
    n_layers, vocab = target.num_layers, target.vocab_size
    probs = shape_problems(a, n_layers, vocab, f"target.json num_layers={n_layers}", f"target.json vocab_size={vocab}")
    if probs:
        raise JobError("; ".join(f"{k}: {m}" for k, m in probs))
    if not get_algorithm(a.kind).drafts_block:  # EAGLE-3's job; else DFlash's
        ids = a.aux_layer_ids or eagle3.default_aux_layer_ids(n_layers)
        log.info("EAGLE-3 capture layers %s of %d (%s)", ids, n_layers, "configured" if a.aux_layer_ids else
                 "TensorRT-LLM's default" if ids == sorted((1, n_layers // 2 - 1, n_layers - 4)) else
                 "spread over the target: TensorRT-LLM's default (1, L//2-1, L-4) is not 3 distinct layers here")
        return {"name": "eagle3", "draft_layers": a.draft_layers, "aux_layer_ids": ids, "ttt_steps": a.ttt_steps,
                "draft_vocab_size": a.draft_vocab_size or vocab, "intermediate_size": a.intermediate_size,
                "loss_decay_factor": a.loss_decay_factor, "loss": a.loss, "objective": a.loss, "lk_eta": a.lk_eta,
                "trained_draft_len": a.ttt_steps}
    ids = a.target_layer_ids
    if not ids:
        ids, modelopt_ids = dflash.default_target_layer_ids(n_layers, a.draft_layers)
        if modelopt_ids is not None:
            log.info("DFlash target layers: ModelOpt's default %s repeats a layer on a %d-layer target; using %s",
                     modelopt_ids, n_layers, ids)
    return {"name": "dflash", "draft_layers": a.draft_layers, "target_layer_ids": ids, "block_size": a.block_size,
            "mask_token_id": _mask_token_id(a.mask_token, tok), "num_anchors": a.num_anchors,
            "loss_objective": a.loss_objective, "objective": a.loss_objective, "loss_decay_factor": a.loss_decay_factor,
            "intermediate_size": a.intermediate_size, "trained_draft_len": dflash.max_draft_len(a.block_size)}


def _mask_token_id(mask, tok) -> int:
    """DFlash's mask token: the tokenizer's by default, a token string looked up in its vocabulary, or an id."""
    if mask is None:
        if tok.mask_token_id is None:
            raise JobError("train_draft.algorithm.mask_token: the target tokenizer has no mask token; name one of its "
                           "tokens (an unused special token) as mask_token")
        return tok.mask_token_id
    if isinstance(mask, str):
        mask_id = tok.get_vocab().get(mask)
        if mask_id is None:
            raise JobError(f"train_draft.algorithm.mask_token: '{mask}' is not a token of the target's vocabulary; "
                           f"the tokenizer's mask token is {tok.mask_token!r}")
        return mask_id
    return mask
