"""`specpipe build --keep STAGE`: accept a committed artifact as current across a code change, logged.

An artifact whose fingerprint differs from the plan's only in its code (the files of its closure,
pipeline/codehash.py) can be kept: days of draft training are not thrown away by an upgrade that changed an export
check. Refused (UsageError, exit 2) where anything else differs (config, inputs, packages, what the machine resolves,
local input files), where the stage's VERSION differs (its artifact's format changed), or where the contract's
reader rejects the committed files (pipeline/artifacts/).

A keep is recorded in the artifact's manifest (`kept`: one entry per keep, appended): the fingerprint and the
fingerprint inputs it was kept under, the code files that changed, when, who asked (user@host) and the command.
The artifact keeps its identity, the fingerprint it was produced under: the stages that consume it hash that one
(runner.make_plan), so they see the kept artifact as their input and do not rerun because of the keep.
`specpipe status` and the HTML report show the keeps.
"""
from __future__ import annotations

import getpass
import shlex
import socket
from datetime import datetime, timezone
from pathlib import Path

from pipeline import codehash
from pipeline.errors import StageError, UsageError

# the fingerprint inputs a keep allows to differ: only the code
CODE_ONLY = ("code",)
_CODE_DIRS = ("runtime/", "stages/", "pipeline/artifacts/")


def accepted(manifest: dict) -> list[tuple[str, dict]]:
    """(fingerprint, fingerprint inputs) a committed artifact is current under: the one it was produced under, then
    each keep's, oldest first."""
    out = [(manifest["fingerprint"], manifest.get("fingerprint_inputs") or {})]
    out += [(k["fingerprint"], k.get("fingerprint_inputs") or {}) for k in manifest.get("kept", []) if "fingerprint" in k]
    return out


def latest_doc(manifest: dict) -> dict:
    """The fingerprint inputs the artifact was last accepted under (what a stale reason compares against)."""
    return accepted(manifest)[-1][1]


def _code_only(external) -> object:
    """A stage's `fingerprint_extra` without the code digests in it (`.py` paths under _CODE_DIRS, pipeline/codehash.py);
    the rest (local input files, a copied file's bytes) is what a keep may not see change."""
    if not isinstance(external, dict):
        return external
    return {k: v for k, v in external.items() if not (k.endswith(".py") and k.startswith(_CODE_DIRS))}


def refusal(stage: str, old_doc: dict, new_doc: dict, stale_reason) -> str | None:
    """Why the artifact cannot be kept under `new_doc` (None: it can): its VERSION, or anything but the code."""
    if old_doc.get("version") != new_doc.get("version"):
        return (f"--keep {stage}: its artifact format changed (VERSION {old_doc.get('version')} -> "
                f"{new_doc.get('version')}); it must be rebuilt")
    other = {k for k in set(old_doc) | set(new_doc) if k not in CODE_ONLY and old_doc.get(k) != new_doc.get(k)}
    if "external" in other and _code_only(old_doc.get("external")) == _code_only(new_doc.get("external")):
        other.discard("external")       # export's: the code its copied serving model runs (codehash digests)
    if other:
        masked = {**new_doc, "code": old_doc.get("code")}
        return (f"--keep {stage}: more than its code changed ({stale_reason(old_doc, masked)}); --keep accepts a "
                f"committed artifact across a code change only")
    return None


def _check_contract(stage: str, art: Path) -> None:
    """The contract's reader on the committed files (pipeline/artifacts/); StageError when it rejects them."""
    if stage == "target":
        from pipeline.artifacts import target
        target.read_info(art)
    elif stage == "data":
        from pipeline.artifacts import data
        for split in data.SPLITS:
            data.read_rows(art, split, limit=1)
        data.read_eval(art, per_domain=1)
    elif stage == "train_draft":
        from pipeline.artifacts import train_draft
        train_draft.read_info(art)
        train_draft.read_draft_config(art)
    elif stage == "quantize":
        from pipeline.artifacts import quantize
        quantize.read_info(art)
    elif stage == "validate":
        from pipeline.artifacts import validate
        validate.read_acceptance(art)
    elif stage == "tune":
        from pipeline.artifacts import tune
        tune.read_tuning(art)
    elif stage == "build":
        from pipeline.artifacts import build
        build.read_deployment(art)
    elif stage == "export":
        from pipeline.artifacts import export
        export.read_export(art)


def check_readable(stage: str, art: Path) -> None:
    """UsageError when the contract's reader rejects the committed artifact."""
    try:
        _check_contract(stage, art)
    except StageError as e:
        raise UsageError(f"--keep {stage}: the committed artifact does not read as its contract says ({e}); "
                         f"it must be rebuilt") from None


def record(old_doc: dict, new_doc: dict, fingerprint: str, argv: list[str]) -> dict:
    """The manifest's entry for one keep."""
    files = codehash.changed_files(old_doc.get("code"), new_doc.get("code") or {})
    same = codehash.same_bytes(old_doc.get("code"), files, new_doc.get("code") or {})
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return {
        "fingerprint": fingerprint,
        "fingerprint_inputs": new_doc,
        "code_changed": [f for f in files if f not in same],
        "redigested": len(same),        # files of the same bytes whose digest is now of the AST (codehash.py)
        "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "by": f"{user}@{socket.gethostname()}",
        "command": shlex.join(argv),
    }


def describe(entry: dict) -> str:
    """One line for status and the report: when, by whom, which code changed."""
    files = entry.get("code_changed") or []
    shown = ", ".join(files[:4]) + (f" (+{len(files) - 4} more)" if len(files) > 4 else "")
    if entry.get("redigested"):
        shown += f"{'; ' if shown else ''}{entry['redigested']} file(s) only re-digested (now of the AST)"
    return f"kept across a code change at {entry.get('at')} by {entry.get('by')}: {shown or 'code'}"
