"""The `target` artifact: `model/` (the HF checkpoint) and `target.json` (the model's shapes and stop ids)."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import StageError

MODEL_DIR = "model"
INFO = "target.json"


def model_dir(art: Path) -> Path:
    return Path(art) / MODEL_DIR


def read_info(art: Path) -> dict:
    f = Path(art) / INFO
    if not f.is_file():
        raise StageError(f"{f} is missing: the target artifact is incomplete; rerun `specpipe build CONFIG --force target`")
    return json.loads(f.read_text())


def stop_ids(info: dict) -> list[int]:
    """Every id that ends a generation: `eos_token_ids` (an instruct model's end of turn first, then its eos), else
    `eos_token_id` (one id, or a list as some HF configs write it); each id once, sorted (a set of stop ids)."""
    ids = info.get("eos_token_ids") or info.get("eos_token_id")
    if ids is None:
        return []
    ids = [ids] if isinstance(ids, int) else list(ids)
    return sorted({int(i) for i in ids if i is not None})
