"""The `build` artifact: `deployment/` (LLM-API options, commands, the draft TensorRT-LLM loads) and
`deployment.json`."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import read_record
from pipeline.errors import StageError
from runtime.records_deploy import DeploymentInfo

INFO = "deployment.json"
REQUIRED = ("trtllm_version", "target_dir", "draft_dir", "options_file", "serving_image", "draft_schedule")


def read_deployment(art: Path) -> DeploymentInfo:
    """deployment.json; StageError naming the file and the missing field (rerun build) when the contract is broken."""
    return read_record(art, INFO, DeploymentInfo, REQUIRED)


def read_options(art: Path, deployment: DeploymentInfo) -> dict:
    """The LLM-API options build wrote (`deployment.json` `options_file`, relative to the artifact)."""
    import yaml

    f = Path(art) / deployment.options_file
    try:
        options = yaml.safe_load(f.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise StageError(f"{f}: the LLM-API options deployment.json names are not readable ({type(e).__name__}: {e}); "
                         "rerun `specpipe build CONFIG --force build`") from None
    if not isinstance(options, dict):
        raise StageError(f"{f}: the LLM-API options are not a mapping; rerun `specpipe build CONFIG --force build`")
    return options


def draft_schedule(deployment: DeploymentInfo):
    """The draft length per batch size the deployment runs (`DeploymentInfo.schedule`)."""
    return deployment.schedule()
