"""The `train_draft` artifact: `draft/` (the exported draft checkpoint), `draft.json`, `curve.json`."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.artifacts import read_record
from pipeline.errors import StageError
from runtime.records import DraftConfig, DraftInfo

DRAFT_DIR = "draft"
INFO = "draft.json"
REQUIRED = ("algorithm",)


def draft_dir(art: Path) -> Path:
    return Path(art) / DRAFT_DIR


def read_info(art: Path) -> DraftInfo:
    """draft.json; StageError naming the file and the missing field (rerun train_draft) when the contract is broken."""
    return read_record(art, INFO, DraftInfo, REQUIRED)


def read_config(directory: Path) -> DraftConfig:
    """A draft checkpoint's config.json: train_draft's `draft/`, or quantize's `draft_fp8/` (the folder above names
    the stage to rerun when it is not readable, as `read_json`'s artifact directory does)."""
    f = Path(directory) / "config.json"
    stage = Path(directory).parent.name
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"{f}: the draft checkpoint's config.json is not readable ({type(e).__name__}: {e}); "
                         f"rerun `specpipe build CONFIG --force {stage}`") from None
    return DraftConfig.from_json(doc)


def read_draft_config(art: Path) -> DraftConfig:
    """The exported draft's config.json (`draft/config.json` of the train_draft artifact)."""
    return read_config(draft_dir(art))
