"""The `export` artifact: `triton/`, `triton_cpu/`, `speculators/` and `export.json` (what was written, the
speculation profile and its alerts, and `served_identity`, the digests `specpipe monitor` compares the served files
with). Its consumers are the CLI commands (`monitor`, `serve --engine vllm`, the verdict), not a stage."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_record
from runtime.records_deploy import ExportInfo

INFO = "export.json"
REQUIRED = ("model_name", "trtllm_version", "serving_image")


def read_export(art: Path) -> ExportInfo:
    """export.json; StageError naming the file and the missing field (rerun export) when the contract is broken."""
    return read_record(art, INFO, ExportInfo, REQUIRED)
