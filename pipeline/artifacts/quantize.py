"""The `quantize` artifact: `target_fp8/`, optional `draft_fp8/`, `quantize.json`, `quality.json`.

`quantize.json`'s `target_dir` and `draft_dir` are relative to the workdir's artifacts directory (the draft to
deploy is `train_draft/draft` or `quantize/draft_fp8`); `draft_format` says whether that draft is FP8."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StageError

INFO = "quantize.json"


@dataclass(frozen=True)
class QuantizeInfo:
    format: str                   # the shipped recipe: fp8 | fp8_per_channel_per_token
    quant_algo: str | None        # hf_quant_config.json's: FP8 | FP8_PER_CHANNEL_PER_TOKEN
    kv_cache: str                 # fp8 | none
    target_rel: str               # relative to the artifacts directory
    draft_rel: str
    draft_format: str             # fp8 | bf16: the precision of the draft to deploy
    raw: dict

    @property
    def draft_is_fp8(self) -> bool:
        return self.draft_format == "fp8"

    @property
    def kv_cache_fp8(self) -> bool:
        return self.kv_cache == "fp8"

    def target_dir(self, artifacts: Path) -> Path:
        return (Path(artifacts) / self.target_rel).resolve()

    def draft_dir(self, artifacts: Path) -> Path:
        return (Path(artifacts) / self.draft_rel).resolve()


def read_info(art: Path) -> QuantizeInfo:
    f = Path(art) / INFO
    try:
        q = json.loads(f.read_text())
        return QuantizeInfo(format=q["format"], quant_algo=q.get("quant_algo"), kv_cache=q["kv_cache"],
                            target_rel=q["target_dir"], draft_rel=q["draft_dir"], draft_format=q["draft_format"], raw=q)
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"{f}: not a quantize.json of the artifact contract ({type(e).__name__}: {e}); "
                         "rerun `specpipe build CONFIG --force quantize`") from None
