"""The draft algorithm's options against the target's shape: which target layers an EAGLE-3 or DFlash draft reads
(their defaults), the options a target of that shape cannot take (`shape_problems`, also the stage's config check
for a tiny target), and the options resolved into the job (`resolve_algorithm`: capture layers, DFlash's mask
token id, the trained draft length)."""
from __future__ import annotations

from runtime.training.job import JobError

# EAGLE-3 drafts read exactly this many target layers. TensorRT-LLM sizes the draft's fc as hidden x (number of
# capture layers), 3 when eagle3_layers_to_capture is unset (tensorrt_llm/_torch/speculative/eagle3.py,
# Eagle3SpecMetadata / _get_eagle3_default_capture_layers); vLLM's llama_eagle3.py builds
# fc = Linear(3 x hidden, hidden) (vllm-project/vllm vllm/model_executor/models/llama_eagle3.py at 583507d1) and
# speculators' converter does the same: any other count does not load there.
EAGLE3_CAPTURE_LAYERS = 3


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 capture layers when `aux_layer_ids` is not set (0-based, sorted).

    TensorRT-LLM's default tuple (1, L//2-1, L-4) when its three ids are distinct and inside the target;
    otherwise (L <= 6, where it collapses or leaves the stack) three distinct layers spread over the whole
    target: the first, the middle ((L-1)//2) and the last. ModelOpt 0.47's own default
    (`default_eagle_aux_layer_ids`: sorted({1, max(0, L//2-1), max(0, L-4)})) collapses to 2 layers on a 4-layer
    target, which gives fc [H, 2H]: a shape TensorRT-LLM and vLLM refuse, so it is never used."""
    if num_layers < EAGLE3_CAPTURE_LAYERS:
        raise ValueError(f"EAGLE-3 captures {EAGLE3_CAPTURE_LAYERS} distinct target layers; a {num_layers}-layer target "
                         "has too few")
    trt = (1, num_layers // 2 - 1, num_layers - 4)
    if len(set(trt)) == EAGLE3_CAPTURE_LAYERS and all(0 <= i < num_layers for i in trt):
        return sorted(trt)
    return [0, (num_layers - 1) // 2, num_layers - 1]


def shape_problems(a, n_layers: int, vocab: int, layers_src: str, vocab_src: str) -> list[tuple[str, str]]:
    """(dotted path, message) for each option of the algorithm section `a` that a target of `n_layers` layers and
    a `vocab` vocabulary cannot take; `layers_src`/`vocab_src` say where those figures come from."""
    p = "train_draft.algorithm"
    out = []
    if a.kind == "eagle3":
        bad = [i for i in (a.aux_layer_ids or []) if i >= n_layers]
        if n_layers < EAGLE3_CAPTURE_LAYERS:
            out.append((f"{p}.kind", f"EAGLE-3 captures {EAGLE3_CAPTURE_LAYERS} distinct target layers, but the target has "
                        f"{n_layers} ({layers_src}); TensorRT-LLM and vLLM load no other shape: use DFlash or a deeper target"))
        elif bad:
            out.append(
                (f"{p}.aux_layer_ids", f"{bad} out of range: the target has {n_layers} layers (0..{n_layers - 1}; {layers_src})")
            )
        if a.draft_vocab_size and a.draft_vocab_size > vocab:
            out.append((f"{p}.draft_vocab_size", f"{a.draft_vocab_size} exceeds the target vocabulary of {vocab} ({vocab_src})"))
    else:
        if a.draft_layers > n_layers:
            out.append(
                (
                    f"{p}.draft_layers",
                    f"{a.draft_layers} draft layers need as many target layers to read, but the target has "
                    f"{n_layers} ({layers_src})",
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
        if isinstance(a.mask_token, int) and not 0 <= a.mask_token < vocab:
            out.append((f"{p}.mask_token", f"id {a.mask_token} is not in the target vocabulary of {vocab} ({vocab_src})"))
    return out


def resolve_algorithm(a, summary: dict, tok, log) -> dict:
    """Algorithm options (the section `a`) with the target's values filled in (target.json's `summary`, its
    tokenizer `tok`); raises JobError for impossible ones."""
    from runtime.trtllm.draft_schedule import dflash_max_draft_len

    n_layers, vocab = summary["num_layers"], summary["vocab_size"]
    probs = shape_problems(a, n_layers, vocab, f"target.json num_layers={n_layers}", f"target.json vocab_size={vocab}")
    if probs:
        raise JobError("; ".join(f"{k}: {m}" for k, m in probs))
    if a.kind == "eagle3":
        ids = a.aux_layer_ids or default_aux_layer_ids(n_layers)
        log.info("EAGLE-3 capture layers %s of %d (%s)", ids, n_layers, "configured" if a.aux_layer_ids else
                 "TensorRT-LLM's default" if ids == sorted((1, n_layers // 2 - 1, n_layers - 4)) else
                 "spread over the target: TensorRT-LLM's default (1, L//2-1, L-4) is not 3 distinct layers here")
        return {"name": "eagle3", "draft_layers": a.draft_layers, "aux_layer_ids": ids, "ttt_steps": a.ttt_steps,
                "draft_vocab_size": a.draft_vocab_size or vocab, "intermediate_size": a.intermediate_size,
                "loss_decay_factor": a.loss_decay_factor, "trained_draft_len": a.ttt_steps}
    from modelopt.torch.speculative.plugins.modeling_dflash import build_target_layer_ids

    ids = a.target_layer_ids or build_target_layer_ids(n_layers, a.draft_layers)
    if len(set(ids)) != len(ids):
        # ModelOpt's spread skips the first and last 3 layers and repeats layers on shallow targets
        # (4 layers, 2 draft layers -> [1, 1]); spread over the whole stack instead.
        spread = [round(i * (n_layers - 1) / (a.draft_layers - 1)) for i in range(a.draft_layers)]
        log.info("DFlash target layers: ModelOpt's default %s repeats a layer on a %d-layer target; using %s",
                 ids, n_layers, spread)
        ids = spread
    return {"name": "dflash", "draft_layers": a.draft_layers, "target_layer_ids": ids, "block_size": a.block_size,
            "mask_token_id": _mask_token_id(a.mask_token, tok), "num_anchors": a.num_anchors,
            "loss_objective": a.loss_objective, "loss_decay_factor": a.loss_decay_factor,
            "intermediate_size": a.intermediate_size, "trained_draft_len": dflash_max_draft_len(a.block_size)}


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
