"""The `tune` artifact: `tuning.json` (the draft-length schedule the deployment runs, its limits, the table)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import read_json

INFO = "tuning.json"
REQUIRED = ("deployment", "draft_schedule", "max_batch_size")


@dataclass(frozen=True)
class TuningInfo:
    """tuning.json, read once (`read_tuning`); `raw` is the whole document (the draft-schedule check in
    runtime/trtllm/draft_schedule.py takes it, the report renders it)."""

    deployment: dict                      # trtllm_version, mode, algorithm, the schedule policy and its note
    draft_schedule: dict                  # DraftSchedule.to_json
    max_batch_size: int                   # 64 where tuning.json holds none
    max_num_tokens: int | None
    cuda_graph_batch_sizes: list[int]     # [1, 2, 4, 8] where tuning.json holds none
    predicted: list                       # the per-batch table; [] where tuning.json has none
    raw: dict

    @property
    def note(self) -> str:
        return self.deployment.get("note") or "see tuning.json"

    @classmethod
    def from_json(cls, doc: dict) -> TuningInfo:
        acc = doc.get("acceptance")
        if isinstance(acc, dict) and "K" in acc:     # written before the glossary's renames: `report` of an old workdir
            doc = {**doc, "acceptance": {("draft_len" if k == "K" else "measured_draft_len" if k == "source_max_draft_len"
                                          else k): v for k, v in acc.items()}}
        return cls(deployment=dict(doc["deployment"] or {}), draft_schedule=doc["draft_schedule"],
                   max_batch_size=int(doc["max_batch_size"] or 64),
                   max_num_tokens=doc.get("max_num_tokens"),
                   cuda_graph_batch_sizes=[int(b) for b in doc.get("cuda_graph_batch_sizes") or [1, 2, 4, 8]],
                   predicted=list(doc.get("predicted") or []), raw=doc)


def read_tuning(art: Path) -> TuningInfo:
    """tuning.json; StageError naming the file and the missing field (rerun tune) when the contract is broken."""
    return TuningInfo.from_json(read_json(art, INFO, REQUIRED))
