"""The `train_draft` artifact: `draft/` (the exported draft checkpoint), `draft.json`, `curve.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import read_json
from pipeline.errors import StageError

DRAFT_DIR = "draft"
INFO = "draft.json"
REQUIRED = ("algorithm",)


def draft_dir(art: Path) -> Path:
    return Path(art) / DRAFT_DIR


@dataclass(frozen=True)
class DraftInfo:
    """draft.json, read once (`read_info`). `algorithm` is required (no reader guesses it); `raw` is the whole
    document (runtime/ code that prices the draft from it, the report)."""

    algorithm: str                        # eagle3 | dflash, lower case
    num_layers: int | None
    block_size: int | None                # DFlash's block; None for EAGLE-3
    capture_layers: list[int] | None      # the target layers training captured (EAGLE-3 aux_layer_ids, DFlash
                                          # target_layer_ids); None when draft.json does not say
    max_position_embeddings: int | None
    raw: dict

    @classmethod
    def from_json(cls, doc: dict) -> DraftInfo:
        algo = str(doc["algorithm"]).lower()
        layers = doc.get("aux_layer_ids") if algo == "eagle3" else doc.get("target_layer_ids")
        return cls(algorithm=algo, num_layers=doc.get("num_layers"), block_size=doc.get("block_size"),
                   capture_layers=list(layers) if layers is not None else None,
                   max_position_embeddings=doc.get("max_position_embeddings"), raw=doc)


@dataclass(frozen=True)
class DraftConfig:
    """A draft checkpoint's config.json (train_draft's `draft/`, or quantize's `draft_fp8/`): the fields readers use
    and the whole document (`raw`) for the shape and rope checks in runtime/."""

    num_hidden_layers: int | None
    max_position_embeddings: int | None
    raw: dict

    @classmethod
    def read(cls, directory: Path, stage: str = "train_draft") -> DraftConfig:
        f = Path(directory) / "config.json"
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise StageError(f"{f}: the draft checkpoint's config.json is not readable ({type(e).__name__}: {e}); "
                             f"rerun `specpipe build CONFIG --force {stage}`") from None
        return cls(num_hidden_layers=doc.get("num_hidden_layers"),
                   max_position_embeddings=doc.get("max_position_embeddings"), raw=doc)


def read_info(art: Path) -> DraftInfo:
    """draft.json; StageError naming the file and the missing field (rerun train_draft) when the contract is broken."""
    return DraftInfo.from_json(read_json(art, INFO, REQUIRED))


def read_draft_config(art: Path) -> DraftConfig:
    """The exported draft's config.json (`draft/config.json` of the train_draft artifact)."""
    return DraftConfig.read(draft_dir(art))
