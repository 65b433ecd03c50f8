"""DFlash: what a valid draft export is, in one place, and the draft-length cap.

The export is what ModelOpt 0.47's `export_speculative_decoding` writes (`DFlashExporter`,
modelopt/torch/export/plugins/hf_spec_export.py; the module in modelopt/torch/speculative/plugins/modeling_dflash.py,
nvidia-modelopt 0.47.0 as installed):

- config.json: `architectures: ["DFlashDraftModel"]`, `block_size`, `dflash_config.{mask_token_id,
  target_layer_ids}`, hidden_size, num_hidden_layers, vocab_size, and `num_target_layers` (the target it was trained
  on) (`CONFIG_KEYS`).
- tensors: the draft module with its prefix stripped and the rotary buffers skipped: fc ([hidden, len(target_layer_ids)
  x hidden], DFlashModule: `nn.Linear(num_fused_layers * hidden, hidden)`), hidden_norm, norm, and per layer the HF
  decoder tensors plus Qwen3's q_norm/k_norm. No embeddings and no lm_head: the draft reuses the target's; no d2t
  (the full vocabulary). Bias tensors and quantization scales may sit beside any weight.
- capture layers: `dflash_config.target_layer_ids` (0-based, ModelOpt / TensorRT-LLM numbering).
- draft length: one block of `block_size` slots whose first is the last verified token drafts at most
  block_size - 1 tokens (`max_draft_len`).
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.algorithms.export import LAYER_TENSORS, DraftExportError, Export, Problem, TargetShape

ARCHITECTURE = "DFlashDraftModel"
UPSTREAM = "modelopt 0.47.0 modelopt/torch/export/plugins/hf_spec_export.py DFlashExporter"
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "block_size", "dflash_config")
# where config.json declares the capture layers (runtime/training/model.py writes ModelOpt's input from here)
CAPTURE_SECTION, CAPTURE_KEY = "dflash_config", "target_layer_ids"
DFLASH_CONFIG_KEYS = ("mask_token_id", CAPTURE_KEY)


def max_draft_len(block_size: int) -> int:
    """A DFlash draft fills one block of `block_size` slots, the first being the last verified token: it drafts
    at most block_size - 1 tokens per step (TensorRT-LLM 1.3 DFlashDecodingConfig: max_draft_len <= block_size - 1,
    runtime.trtllm.compat.SOURCES['dflash_block_size']; ModelOpt's DFlash trains exactly that many)."""
    if int(block_size) < 2:
        raise ValueError(f"DFlash block_size {block_size} < 2 drafts nothing")
    return int(block_size) - 1


def default_target_layer_ids(n_layers: int, draft_layers: int) -> tuple[list[int], list[int] | None]:
    """(the target layers a DFlash draft reads by default, ModelOpt's own choice when it was replaced else None).
    ModelOpt's `build_target_layer_ids` spread skips the first layer and the last 2 and repeats layers on shallow
    targets (4 layers, 2 draft layers -> [1, 1]); then the ids are spread over the stack below its last layer instead
    (-> [0, 2]): ModelOpt's training reads the last layer after the final norm, the engines before it
    (runtime/training/algorithm.py `_LAST_LAYER`)."""
    from modelopt.torch.speculative.plugins.modeling_dflash import build_target_layer_ids

    ids = list(build_target_layer_ids(n_layers, draft_layers))
    if len(set(ids)) == len(ids) and n_layers - 1 not in ids:
        return ids, None
    top = max(n_layers - 2, 0)
    spread = [round(i * top / (draft_layers - 1)) for i in range(draft_layers)] if draft_layers > 1 else [top // 2]
    return spread, ids


def required_tensors(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in (*LAYER_TENSORS, "self_attn.q_norm", "self_attn.k_norm")}
    return names


def capture_layer_ids(cfg: dict) -> list[int] | None:
    ids = (cfg.get(CAPTURE_SECTION) or {}).get(CAPTURE_KEY)
    return [int(i) for i in ids] if ids else None


def check_export(ex: Export, *, target: TargetShape | None = None) -> list[Problem]:
    """Every problem of a DFlash export: config keys, tensors, fc's shape, then the pairing with `target`."""
    cfg, out = ex.cfg, []
    archs = cfg.get("architectures")
    if ARCHITECTURE not in (archs or []):
        out.append(Problem("config", f"{ex.where}: config.json architectures is {archs}, expected ['{ARCHITECTURE}'] "
                                     "(TensorRT-LLM picks the draft implementation from it)"))
    dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    missing = [k for k in CONFIG_KEYS if cfg.get(k) is None] + [f"dflash_config.{k}" for k in DFLASH_CONFIG_KEYS
                                                                 if dc.get(k) is None and cfg.get("dflash_config")]
    if missing:
        return out + [Problem("config_keys", f"{ex.where}: config.json lacks {missing}, which ModelOpt's DFlash export "
                                             "writes and every consumer reads; re-export with export_speculative_decoding")]
    if int(cfg["block_size"]) < 2:
        out.append(Problem("block_size", f"{ex.where}: block_size must be >= 2, found {cfg['block_size']}"))
    H, L = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    ids = [int(i) for i in dc[CAPTURE_KEY]]
    required = required_tensors(L)
    keys = ex.names()
    if miss := sorted(required - keys):
        out.append(Problem("required_tensors", f"{ex.where}: missing {len(miss)} tensor(s) {miss[:8]}"
                                               f"{' ...' if len(miss) > 8 else ''} for a {L}-layer DFlash draft"))
    if unexpected := sorted(keys - required - {k.replace(".weight", ".bias") for k in required}):
        out.append(Problem("unexpected_tensors", f"{ex.where}: unexpected tensors {unexpected[:8]} (embeddings and "
                                                 "lm_head come from the target)"))
    fc = ex.shapes.get("fc.weight")
    if fc is not None and len(fc[0]) == 2 and fc[0][1] != len(ids) * H:
        out.append(Problem("fc_shape", f"{ex.where}: fc.weight takes {fc[0][1]} inputs but target_layer_ids {ids} x "
                                       f"hidden {H} = {len(ids) * H}"))
    if target is not None:
        out += _pairing_problems(ex, dc, ids, target)
    return out


def _pairing_problems(ex: Export, dc: dict, ids: list[int], target: TargetShape) -> list[Problem]:
    H, out = int(ex.cfg["hidden_size"]), []
    if H != target.hidden_size:
        out.append(Problem("pairing", f"{ex.where}: draft hidden_size {H} != target hidden_size {target.hidden_size}"))
    if not 0 <= int(dc["mask_token_id"]) < target.vocab_size:
        out.append(Problem("pairing", f"{ex.where}: mask_token_id {dc['mask_token_id']} is outside the target vocabulary"))
    if bad := [i for i in ids if not 0 <= i < target.num_layers]:
        out.append(Problem("pairing", f"{ex.where}: target_layer_ids {bad} are outside the target's {target.num_layers} "
                                      "layers"))
    n = ex.cfg.get("num_target_layers")
    if n is not None and int(n) != target.num_layers:
        out.append(Problem("pairing", f"{ex.where}: exported for a {n}-layer target, paired with a "
                                      f"{target.num_layers}-layer one"))
    return out


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash export's config.json as its consumers read it (`DFLASH.parse`)."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    capture_layers: tuple[int, ...]      # in the export's order, 0-based
    causal: bool
    raw: dict

    @property
    def max_draft_len(self) -> int:
        return max_draft_len(self.block_size)


@dataclass(frozen=True)
class DFlash:
    """DFlash as the `Algorithm` protocol (runtime/algorithms/base.py) answers it."""

    name: str = "dflash"
    title: str = "DFlash"
    architecture: str | None = ARCHITECTURE
    needs_trained_draft: bool = True
    takes_hidden_states: bool = True
    drafts_block: bool = True                # one forward drafts the whole block
    has_draft_vocab: bool = False
    shares_target_head: bool = True
    first_layer_norm_choice: bool = False
    capture_key: str | None = f"{CAPTURE_SECTION}.{CAPTURE_KEY}"
    capture_field: str | None = "target_layer_ids"
    capture_count: int | None = None
    trtllm_decoding_type: str = "DFlash"
    trtllm_two_model: bool = False           # always one engine (runtime/trtllm/compat.py Release.mode)
    trtllm_layers_to_capture: bool = False
    trtllm_renamed_weights: bool = False
    fp8_draft: bool = False
    vllm_method: str = "dflash"
    speculators_model_type: str | None = "dflash"

    def parse(self, cfg: dict) -> DFlashConfig:
        dc = cfg.get(CAPTURE_SECTION) if isinstance(cfg.get(CAPTURE_SECTION), dict) else {}
        missing = [k for k in CONFIG_KEYS if cfg.get(k) is None] + [f"{CAPTURE_SECTION}.{k}" for k in DFLASH_CONFIG_KEYS
                                                                    if dc.get(k) is None]
        if missing:
            raise DraftExportError(f"DFlash config.json lacks {missing}; re-export with ModelOpt's "
                                   "export_speculative_decoding")
        return DFlashConfig(int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"]),
                            int(cfg["block_size"]), int(dc["mask_token_id"]), tuple(int(i) for i in dc[CAPTURE_KEY]),
                            bool(dc.get("causal", False)), cfg)

    def check_export(self, ex: Export, *, target: TargetShape | None = None) -> list[Problem]:
        return check_export(ex, target=target)

    def capture_layers(self, cfg: dict) -> list[int] | None:
        return capture_layer_ids(cfg)

    def draft_len_cap(self, block_size: int | None = None) -> int | None:
        return max_draft_len(block_size) if block_size else None


DFLASH = DFlash()
