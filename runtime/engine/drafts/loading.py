"""Loading an exported draft directory: its algorithm's format checks (and the pairing with the target), the
capture layers it was trained on, then the module; and the facts a report shows about a loaded draft."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from runtime.engine.drafts.dflash import DFlashDraft, check_dflash
from runtime.engine.drafts.eagle3 import Eagle3Draft, check_eagle3
from runtime.engine.drafts.format import DraftFormatError, TargetShape, draft_algorithm, read_draft_dir

log = logging.getLogger("specpipe.runtime")


def load_draft(path: str | Path, target: TargetShape | None = None, *, compute_dtype=torch.float32,
               device="cpu", strict: bool = True, first_layer_norm: str = "modelopt",
               expected_capture_layers: list[int] | None = None):
    """Load a draft directory exactly as exported. `target` enables the pairing checks;
    `expected_capture_layers` (the aux / target layer ids training used, e.g. from draft.json) must match the
    ids the export declares: an edited or stale config.json would otherwise feed the draft the wrong layers."""
    if first_layer_norm not in ("modelopt", "serving"):
        raise ValueError(f"first_layer_norm must be 'modelopt' or 'serving', not {first_layer_norm!r}")
    path = Path(path)
    cfg, sd = read_draft_dir(path)
    algo = draft_algorithm(path)
    if expected_capture_layers is not None:
        declared = ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if algo == "eagle3"
                    else (cfg.get("dflash_config") or {}).get("target_layer_ids"))
        if declared is None or sorted(map(int, declared)) != sorted(map(int, expected_capture_layers)):
            raise DraftFormatError(f"{path}: config.json declares capture layers {declared}, but the draft was trained "
                                   f"on target layers {list(expected_capture_layers)}")
    if algo == "eagle3":
        cfg = check_eagle3(cfg, sd, path, target, strict)
        m = Eagle3Draft(cfg, sd, compute_dtype, first_layer_norm)
    else:
        cfg = check_dflash(cfg, sd, path, target)
        m = DFlashDraft(cfg, sd, compute_dtype)
    quant = (path / "hf_quant_config.json").exists()
    log.info("loaded %s draft %s (%d layers%s)", algo, path, m.num_layers, ", FP8" if quant else "")
    return m.to(device).eval()


def summarize(draft) -> dict:
    """The facts a report shows about a loaded draft."""
    if draft.algorithm == "eagle3":
        return {"algorithm": "eagle3", "num_layers": draft.num_layers, "aux_layer_ids": draft.aux_layer_ids,
                "draft_vocab_size": draft.draft_vocab_size, "has_d2t": draft.d2t is not None,
                "rope_scaling": draft.cfg.get("rope_scaling"), "first_layer_norm": draft.first_layer_norm}
    return {"algorithm": "dflash", "num_layers": draft.num_layers, "target_layer_ids": draft.target_layer_ids,
            "block_size": draft.block_size, "mask_token_id": draft.mask_token_id, "causal": draft.causal,
            "rope_scaling": draft.cfg.get("rope_scaling")}
