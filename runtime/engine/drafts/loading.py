"""Loading an exported draft directory: its algorithm's format checks (and the pairing with the target), the
capture layers it was trained on, then the module; and the facts a report shows about a loaded draft."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from runtime.algorithms.export import TargetShape
from runtime.engine.drafts.dflash import DFlashDraft, check_dflash
from runtime.engine.drafts.eagle3 import Eagle3Draft, check_eagle3
from runtime.engine.drafts.format import DraftFormatError, draft_traits, read_draft_dir

log = logging.getLogger("specpipe.runtime")


# The scale of the draft's FP8 KV cache in TensorRT-LLM's one-model mode: the draft's attention layers get the
# target's kv_cache_quant_algo (modeling_speculative.py SpecDecOneEngineForCausalLM.__init__, 1.2-era
# byshiue/TensorRT-LLM@022e9f62: `draft_config.quant_config.kv_cache_quant_algo =
# model_config.quant_config.kv_cache_quant_algo`, and its attention layers join the target's `attn_layers`), and
# the 1.2 PyTorch attention backend applies unit KV scales (runtime.engine.fp8.kv_cache.attach_kv_scales).
DRAFT_KV_FP8_SCALE = 1.0
DRAFT_KV_CACHES = ("bf16", "fp8")


def load_draft(path: str | Path, target: TargetShape | None = None, *, compute_dtype=torch.float32,
               device="cpu", strict: bool = True, first_layer_norm: str = "modelopt",
               expected_capture_layers: list[int] | None = None, kv_cache: str = "bf16"):
    """Load a draft directory exactly as exported. `target` enables the pairing checks;
    `expected_capture_layers` (the aux / target layer ids training used, e.g. from draft.json) must match the
    ids the export declares: an edited or stale config.json would otherwise feed the draft the wrong layers.
    `kv_cache`: "bf16" (the cache in the compute dtype) or "fp8" (E4M3 with unit scale, as TensorRT-LLM runs
    the draft in one-model mode next to a target with an FP8 KV cache)."""
    if first_layer_norm not in ("modelopt", "serving"):
        raise ValueError(f"first_layer_norm must be 'modelopt' or 'serving', not {first_layer_norm!r}")
    if kv_cache not in DRAFT_KV_CACHES:
        raise ValueError(f"kv_cache must be one of {DRAFT_KV_CACHES}, not {kv_cache!r}")
    path = Path(path)
    cfg, sd = read_draft_dir(path)
    algo = draft_traits(path)
    if expected_capture_layers is not None:
        declared = algo.capture_layers(cfg)
        if declared is None or sorted(map(int, declared)) != sorted(map(int, expected_capture_layers)):
            raise DraftFormatError(f"{path}: config.json declares capture layers {declared}, but the draft was trained "
                                   f"on target layers {list(expected_capture_layers)}")
    if algo.drafts_block:         # DFlash: one block per pass; else EAGLE-3: chain drafting
        m = DFlashDraft(check_dflash(cfg, sd, path, target), sd, compute_dtype)
    else:
        m = Eagle3Draft(check_eagle3(cfg, sd, path, target, strict), sd, compute_dtype, first_layer_norm)
    m.kv_fp8_scale = DRAFT_KV_FP8_SCALE if kv_cache == "fp8" else None
    quant = (path / "hf_quant_config.json").exists()
    log.info("loaded %s draft %s (%d layers%s, %s KV cache)", algo.name, path, m.num_layers, ", FP8" if quant else "",
             kv_cache.upper())
    return m.to(device).eval()


def summarize(draft) -> dict:
    """The facts a report shows about a loaded draft."""
    if not draft.traits.drafts_block:
        return {"algorithm": draft.algorithm, "num_layers": draft.num_layers, "aux_layer_ids": draft.aux_layer_ids,
                "draft_vocab_size": draft.draft_vocab_size, "has_d2t": draft.d2t is not None,
                "rope_scaling": draft.cfg.get("rope_scaling"), "first_layer_norm": draft.first_layer_norm,
                "kv_cache": "fp8" if draft.kv_fp8_scale is not None else "bf16"}
    return {"algorithm": draft.algorithm, "num_layers": draft.num_layers, "target_layer_ids": draft.target_layer_ids,
            "block_size": draft.block_size, "mask_token_id": draft.mask_token_id, "causal": draft.causal,
            "rope_scaling": draft.cfg.get("rope_scaling"), "kv_cache": "fp8" if draft.kv_fp8_scale is not None else "bf16"}
