"""The `build` artifact: `deployment/` (LLM-API options, commands, the draft TensorRT-LLM loads) and
`deployment.json`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import read_json
from pipeline.errors import StageError

INFO = "deployment.json"
REQUIRED = ("trtllm_version", "target_dir", "draft_dir", "options_file", "serving_image", "draft_schedule")


@dataclass(frozen=True)
class DeploymentInfo:
    """deployment.json, read once (`read_deployment`); `raw` is the whole document (the report, the README)."""

    trtllm_version: str
    serving_image: str
    algorithm: str | None                 # eagle3 | dflash; None where deployment.json does not say
    mode: str | None
    speculation: bool                     # whether a draft is deployed (True where deployment.json does not say)
    decoding_type: str | None
    target_dir: str                       # absolute, as build resolved them
    draft_dir: str | None                 # the draft as train_draft/quantize wrote it; None without speculation
    trtllm_draft_dir: str | None          # the draft TensorRT-LLM loads (renamed layers); else `draft_dir`
    options_file: str                     # relative to the artifact
    draft_schedule: dict                  # DraftSchedule.to_json
    max_draft_len: int | None
    max_seq_len: int | None
    raw: dict

    @classmethod
    def from_json(cls, doc: dict) -> DeploymentInfo:
        return cls(trtllm_version=doc["trtllm_version"], serving_image=doc["serving_image"],
                   algorithm=doc.get("algorithm"), mode=doc.get("mode"), speculation=bool(doc.get("speculation", True)),
                   decoding_type=doc.get("decoding_type"), target_dir=doc["target_dir"], draft_dir=doc["draft_dir"],
                   trtllm_draft_dir=doc.get("trtllm_draft_dir") or doc["draft_dir"], options_file=doc["options_file"],
                   draft_schedule=doc["draft_schedule"], max_draft_len=doc.get("max_draft_len"),
                   max_seq_len=doc.get("max_seq_len"), raw=doc)

    def schedule(self):
        """The draft length per batch size the deployment runs, as the one schedule type
        (`runtime.algorithms.schedule.DraftSchedule`; `k_at(batch)`)."""
        from runtime.algorithms.schedule import DraftSchedule

        return DraftSchedule.from_json(self.draft_schedule)


def read_deployment(art: Path) -> DeploymentInfo:
    """deployment.json; StageError naming the file and the missing field (rerun build) when the contract is broken."""
    return DeploymentInfo.from_json(read_json(art, INFO, REQUIRED))


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
