"""The `target` artifact: `model/` (the HF checkpoint) and `target.json` (the model's shapes and stop ids)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import read_json

MODEL_DIR = "model"
INFO = "target.json"
REQUIRED = ("architecture", "num_layers", "hidden_size", "vocab_size")


def model_dir(art: Path) -> Path:
    return Path(art) / MODEL_DIR


@dataclass(frozen=True)
class TargetInfo:
    """target.json, read once (`read_info`): the fields later stages use, defaults decided here; `raw` is the whole
    document (runtime/ code that takes target.json's shapes as a dict, the report)."""

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str                            # the checkpoint's torch dtype; bfloat16 where target.json does not say
    eos_token_id: int | None              # target.json's eos_token_id (the first of a list); None when absent
    stop_ids: tuple[int, ...]             # every id that ends a generation (`stop_ids`)
    max_position_embeddings: int | None
    mask_token_id: int | None
    raw: dict

    @classmethod
    def from_json(cls, doc: dict) -> TargetInfo:
        eos = doc.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos          # some HF configs write a list
        return cls(architecture=str(doc["architecture"]), num_layers=int(doc["num_layers"]),
                   hidden_size=int(doc["hidden_size"]), vocab_size=int(doc["vocab_size"]),
                   dtype=doc.get("dtype") or "bfloat16", eos_token_id=eos if isinstance(eos, int) else None,
                   stop_ids=tuple(stop_ids(doc)), max_position_embeddings=doc.get("max_position_embeddings"),
                   mask_token_id=doc.get("mask_token_id"), raw=doc)


def read_info(art: Path) -> TargetInfo:
    """target.json; StageError naming the file and the missing field (rerun target) when the contract is broken."""
    return TargetInfo.from_json(read_json(art, INFO, REQUIRED))


def stop_ids(info: dict) -> list[int]:
    """Every id that ends a generation: `eos_token_ids` (an instruct model's end of turn first, then its eos), else
    `eos_token_id` (one id, or a list as some HF configs write it); each id once, sorted (a set of stop ids)."""
    ids = info.get("eos_token_ids") or info.get("eos_token_id")
    if ids is None:
        return []
    ids = [ids] if isinstance(ids, int) else list(ids)
    return sorted({int(i) for i in ids if i is not None})
