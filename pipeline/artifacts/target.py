"""The `target` artifact: `model/` (the HF checkpoint) and `target.json` (the model's shapes and stop ids)."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_json

MODEL_DIR = "model"
INFO = "target.json"


def model_dir(art: Path) -> Path:
    return Path(art) / MODEL_DIR


def read_info(art: Path) -> dict:
    return read_json(art, INFO)


def stop_ids(info: dict) -> list[int]:
    """Every id that ends a generation: `eos_token_ids` (an instruct model's end of turn first, then its eos), else
    `eos_token_id` (one id, or a list as some HF configs write it); each id once, sorted (a set of stop ids)."""
    ids = info.get("eos_token_ids") or info.get("eos_token_id")
    if ids is None:
        return []
    ids = [ids] if isinstance(ids, int) else list(ids)
    return sorted({int(i) for i in ids if i is not None})
