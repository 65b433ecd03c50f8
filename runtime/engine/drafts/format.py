"""Reading an exported draft directory: its architecture (EAGLE-3 or DFlash), its config.json and weights as
ModelOpt's export_speculative_decoding writes them, and the error the loader raises. What a valid export is lives in
runtime/algorithms/ (`TargetShape`, the shape of the target a draft is paired with, too)."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.algorithms import dflash, eagle3
from runtime.algorithms.base import Algorithm
from runtime.algorithms.export import DraftExportError
from runtime.algorithms.registry import EXPORTED, of_config

EAGLE3_ARCH = eagle3.ARCHITECTURE
DFLASH_ARCH = dflash.ARCHITECTURE


class DraftFormatError(DraftExportError):
    """The draft directory does not match the exported format (runtime/algorithms/: what a valid draft is) or the
    target it is paired with."""


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


def draft_traits(path: str | Path) -> Algorithm:
    """The algorithm a draft directory's config.json declares (runtime/algorithms/registry.py `of_config`)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    algo = of_config(cfg)
    if algo is None:
        raise DraftFormatError(f"{path}: architectures {cfg.get('architectures') or []} is none of "
                               f"{', '.join(a.architecture for a in EXPORTED)}")
    return algo


def draft_algorithm(path: str | Path) -> str:
    """The name of the algorithm a draft directory's config.json declares (`draft_traits`)."""
    return draft_traits(path).name
