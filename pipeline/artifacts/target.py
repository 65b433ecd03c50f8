"""The `target` artifact: `model/` (the HF checkpoint) and `target.json` (the model's shapes and stop ids)."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_record
from runtime.records import TargetInfo

MODEL_DIR = "model"
INFO = "target.json"
REQUIRED = ("architecture", "num_layers", "hidden_size", "vocab_size")


def model_dir(art: Path) -> Path:
    return Path(art) / MODEL_DIR


def read_info(art: Path) -> TargetInfo:
    """target.json; StageError naming the file and the missing field (rerun target) when the contract is broken."""
    return read_record(art, INFO, TargetInfo, REQUIRED)
