"""The `quantize` artifact: `target_fp8/`, optional `draft_fp8/`, `quantize.json`, `quality.json`.

`quantize.json`'s `target_dir` and `draft_dir` are relative to the workdir's artifacts directory (the draft to
deploy is `train_draft/draft` or `quantize/draft_fp8`); `draft_format` says whether that draft is FP8."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import StageError
from runtime.records import QuantizeInfo

INFO = "quantize.json"


def read_info(art: Path) -> QuantizeInfo:
    f = Path(art) / INFO
    try:
        return QuantizeInfo.from_json(json.loads(f.read_text()))
    except (OSError, ValueError, KeyError) as e:
        raise StageError(f"{f}: not a quantize.json of the artifact contract ({type(e).__name__}: {e}); "
                         "rerun `specpipe build CONFIG --force quantize`") from None
