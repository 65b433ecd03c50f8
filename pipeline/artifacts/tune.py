"""The `tune` artifact: `tuning.json` (the draft-length schedule the deployment runs, its limits, the table)."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_record
from runtime.records_deploy import TuningInfo

INFO = "tuning.json"
REQUIRED = ("deployment", "draft_schedule", "max_batch_size")


def read_tuning(art: Path) -> TuningInfo:
    """tuning.json; StageError naming the file and the missing field (rerun tune) when the contract is broken."""
    return read_record(art, INFO, TuningInfo, REQUIRED)
