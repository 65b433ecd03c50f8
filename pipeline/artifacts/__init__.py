"""Typed readers (and writers) of the artifact contracts in docs/architecture.md, one small module per stage's
artifact. Every consumer (a later stage, `specpipe monitor`, `specpipe profile`) reads another stage's files only
through these, so a file's parsing and its row rules live in one place; the producing stage writes through the
same module where the contract has more than one reader.

Each reader takes the artifact's directory (`Artifact.path`, or `<workdir>/artifacts/<stage>`) and returns a frozen
record (runtime/records.py `TargetInfo`, `DraftInfo`, `QuantizeInfo`, `EvalPrompt`; runtime/records_validate.py
`AcceptanceInfo`; runtime/records_deploy.py `TuningInfo`, `DeploymentInfo`, `ExportInfo`): every field the stage
writes, typed, with the defaults decided in the record's `from_json`, and `.raw`, the document as read; runtime/
functions take the record. The stage writes the same record (`to_json`), so a schema is spelled once. The reader
raises `StageError` naming the file, the missing field and the stage to rerun when the contract is broken. No heavy
imports at module level."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import StageError


def read_json(art: Path, name: str, required: tuple[str, ...] = ()) -> dict:
    """A JSON file of an artifact with the keys its contract promises; StageError naming the file otherwise."""
    f = Path(art) / name
    stage = Path(art).name
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"{f}: not readable ({type(e).__name__}: {e}); rerun `specpipe build CONFIG --force {stage}`") from None
    missing = [k for k in required if k not in doc]
    if missing:
        raise StageError(f"{f} lacks {missing}, which its artifact contract promises (docs/architecture.md); "
                         f"rerun `specpipe build CONFIG --force {stage}`")
    return doc


def read_record(art: Path, name: str, record, required: tuple[str, ...] = ()):
    """`record.from_json` of an artifact's JSON file; StageError naming the file, what is wrong and the stage to
    rerun when the document breaks the contract (a missing field, a value of the wrong shape)."""
    doc = read_json(art, name, required)
    try:
        return record.from_json(doc)
    except (KeyError, TypeError, ValueError) as e:
        raise StageError(f"{Path(art) / name}: not a {name} of the artifact contract ({type(e).__name__}: {e}); "
                         f"rerun `specpipe build CONFIG --force {Path(art).name}`") from None
