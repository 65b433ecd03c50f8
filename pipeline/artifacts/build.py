"""The `build` artifact: `deployment/` (LLM-API options, commands, the draft TensorRT-LLM loads) and
`deployment.json`."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_json

INFO = "deployment.json"


def read_deployment(art: Path) -> dict:
    return read_json(art, INFO, ("trtllm_version", "target_dir", "draft_dir", "options_file", "serving_image",
                                 "draft_schedule"))


def read_options(art: Path, deployment: dict) -> dict:
    """The LLM-API options build wrote (`deployment.json` `options_file`, relative to the artifact)."""
    import yaml

    return yaml.safe_load((Path(art) / deployment["options_file"]).read_text())


def draft_schedule(deployment: dict):
    """The draft length per batch size the deployment runs (`deployment.json` `draft_schedule`), as the one
    schedule type (`runtime.trtllm.DraftSchedule`; `k_at(batch)`)."""
    from runtime.algorithms.schedule import DraftSchedule

    return DraftSchedule.from_json(deployment["draft_schedule"])
