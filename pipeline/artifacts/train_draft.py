"""The `train_draft` artifact: `draft/` (the exported draft checkpoint), `draft.json`, `curve.json`."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.artifacts import read_json
from pipeline.errors import StageError

DRAFT_DIR = "draft"
INFO = "draft.json"


def draft_dir(art: Path) -> Path:
    return Path(art) / DRAFT_DIR


def read_info(art: Path) -> dict:
    return read_json(art, INFO)


def read_draft_config(art: Path) -> dict:
    f = draft_dir(art) / "config.json"
    if not f.is_file():
        raise StageError(f"train_draft artifact has no draft/config.json at {f}; rerun train_draft")
    return json.loads(f.read_text())
