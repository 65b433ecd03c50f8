"""What an exported draft directory is: its architecture (EAGLE-3 or DFlash), its config.json and weights as
ModelOpt's export_speculative_decoding writes them, the error every format check raises, and the shape of the
target a draft is paired with."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
DFLASH_ARCH = "DFlashDraftModel"
_SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "weight_scale_2", "pre_quant_scale")


class DraftFormatError(ValueError):
    """The draft directory does not match the exported format (or the target it is paired with)."""


def strip_scales(keys) -> set[str]:
    return {k for k in keys if k.rsplit(".", 1)[-1] not in _SCALE_SUFFIXES}


def read_draft_dir(path: Path) -> tuple[dict, dict]:
    """(config.json, every weight) of a draft directory as ModelOpt's export_speculative_decoding writes it (an
    adapter_model.safetensors beside the weights is not read)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise DraftFormatError(f"{path}: no config.json; expected a draft directory written by ModelOpt's "
                               "export_speculative_decoding")
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    files = [f for f in files if f.name != "adapter_model.safetensors"]
    if not files:
        raise DraftFormatError(f"{path}: no *.safetensors weights")
    sd: dict = {}
    for f in files:
        sd.update(load_file(str(f)))
    return cfg, sd


@dataclass
class TargetShape:
    """What a draft must agree with: read from the target's config."""

    hidden_size: int
    vocab_size: int
    num_layers: int


def draft_algorithm(path: str | Path) -> str:
    cfg = json.loads((Path(path) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if EAGLE3_ARCH in archs:
        return "eagle3"
    if DFLASH_ARCH in archs:
        return "dflash"
    raise DraftFormatError(f"{path}: architectures {archs} is neither {EAGLE3_ARCH} nor {DFLASH_ARCH}")
