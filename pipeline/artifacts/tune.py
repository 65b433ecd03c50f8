"""The `tune` artifact: `tuning.json` (the draft-length schedule the deployment runs, its limits, the table)."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_json

INFO = "tuning.json"


def read_tuning(art: Path) -> dict:
    return read_json(art, INFO, ("deployment", "draft_schedule", "max_batch_size"))
