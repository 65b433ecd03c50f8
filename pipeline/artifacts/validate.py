"""The `validate` artifact: `acceptance.json` (per domain and pair: acceptance, per position; gates; lossless)."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_json

INFO = "acceptance.json"


def read_acceptance(art: Path) -> dict:
    """acceptance.json as a dict (consumers read different parts: tune the per-position curves, export the gates,
    monitor the baseline)."""
    return read_json(art, INFO)
