"""What `specpipe monitor` compares against: the baseline (the exported speculation profile, else validate's
acceptance.json) and the prompt format clients are told to use, read from a run's artifacts."""
from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import export as export_artifact
from pipeline.artifacts import validate as validate_artifact
from pipeline.errors import StageError, UsageError


def check_prompt_format(arts: Path, fmt: dict | None) -> None:
    """The probes are validate's prompts, rendered by `data` with data/chat_template.jinja; clients are told (export's
    README, prompt_format.json) to render with the template export shipped. They must be the same template."""
    from runtime.serving.prompt_format import template_sha256

    if fmt is None:
        return
    f = arts / "data" / data_artifact.CHAT_TEMPLATE
    data_sha = template_sha256(f.read_text()) if f.is_file() else None
    if data_sha != fmt.get("chat_template_sha256"):
        raise UsageError(f"{arts.parent}: the exported repository tells clients to render prompts with the chat template "
                         f"of sha256 {str(fmt.get('chat_template_sha256'))[:16]}, but validate's prompts were rendered with "
                         f"{'sha256 ' + data_sha[:16] if data_sha else 'no template'} ({f}): the probes would not be "
                         "what clients send; rerun `specpipe build` so that export and data agree")


def read_baseline(arts: Path, acc: validate_artifact.AcceptanceInfo) -> tuple[dict[str, list], list | None, str, str]:
    """(per-domain conditional acceptance, overall, where it came from, digest of that file): the exported
    speculation profile when export wrote one, else validate's acceptance.json (the FP8 pair)."""
    from runtime.validate import profile as P

    files = []
    if (arts / "export" / export_artifact.INFO).exists():
        try:
            files = (export_artifact.read_export(arts / "export").speculation_profile or {}).get("files") or []
        except StageError as e:
            raise UsageError(str(e)) from None
    if files:
        f = arts / "export" / files[0]
        try:
            per, overall, engine = P.baseline(P.read_profile(f), f)
        except P.ProfileError as e:
            raise UsageError(f"{e} (rerun `specpipe build <config> --force export` to rewrite it)") from None
        return per, overall, f"{f.relative_to(arts.parent)} ({engine})", hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    per = {d: v.fp8.per_position for d, v in acc.domains.items() if v.fp8 is not None}
    overall = acc.overall.fp8.per_position if acc.overall.fp8 is not None else None
    acc_f = arts / "validate" / validate_artifact.INFO
    return per, overall, str(acc_f.relative_to(arts.parent)), hashlib.sha256(acc_f.read_bytes()).hexdigest()[:16]
