"""The `data` artifact's rows and eval lines as every consumer reads them: the row rule lives here once.

A token row (`train.parquet`, `heldout.parquet`, `calib.parquet`: `input_ids`, `loss_mask`) has at least 2 tokens,
one mask entry per token and at least one token to train on; an eval line (`eval/<domain>.jsonl`) has an `id`, a
`prompt` and non-empty `prompt_ids`. The data stage writes nothing else, so a reader that finds anything else
raises (naming the file and the row or line) instead of filtering it out. `runtime/` cannot import `pipeline/`:
`pipeline.artifacts.data` wraps these for the stages, the draft-training worker calls them directly."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.errors import RuntimeFailure

RERUN = "rerun `specpipe build CONFIG --force data`"


def read_token_rows(path: str | Path, *, limit: int | None = None, max_len: int | None = None,
                    skip_untrained: bool = False) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of the first `limit` rows of a token-row parquet, each truncated to `max_len`.
    `skip_untrained`: a row without a token to train on is left out instead of refused, and `limit` counts the rows
    kept (the draft-training worker also reads hand-made datasets, whose truncated rows can lose their response)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise RuntimeFailure(f"{path} is missing; the data stage's artifact contract promises it")
    table = pq.read_table(str(path), columns=["input_ids", "loss_mask"])
    if limit is not None and not skip_untrained:
        table = table.slice(0, limit)
    out = []
    columns = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    for i, (ids, mask) in enumerate(zip(*columns, strict=True)):
        if limit is not None and len(out) == limit:
            break
        if skip_untrained and not any(mask):
            continue
        if len(ids) < 2 or len(mask) != len(ids) or not any(mask):
            raise RuntimeFailure(f"{path} row {i}: {len(ids)} tokens, {len(mask)} mask entries, {sum(mask)} trained on; "
                                 f"the data contract needs >= 2 tokens, one mask entry per token and one token to train "
                                 f"on: {RERUN}")
        out.append((ids[:max_len], mask[:max_len]))
    return out


def read_eval_lines(path: str | Path) -> list[dict]:
    """The eval prompts of one domain file as dicts with `id` (str), `prompt`, `prompt_ids` (list[int]) and
    `reference` (or None), in file order."""
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            row = {"id": str(r["id"]), "prompt": r["prompt"], "prompt_ids": [int(i) for i in r["prompt_ids"]],
                   "reference": r.get("reference")}
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeFailure(f"{path}:{n}: not an eval prompt of the data contract ({type(e).__name__}: {e}); "
                                 f"{RERUN}") from None
        if not row["prompt_ids"]:
            raise RuntimeFailure(f"{path}:{n}: empty prompt_ids; {RERUN}")
        out.append(row)
    return out
