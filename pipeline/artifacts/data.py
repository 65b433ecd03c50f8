"""The `data` artifact: token rows (`train.parquet`, `heldout.parquet`, `calib.parquet`: `input_ids`, `loss_mask`,
`domain`, `source`) and per-domain eval prompts (`eval/<domain>.jsonl`). The row rule is the contract's: a row has
at least 2 tokens and at least one token to train on (the data stage writes nothing else); an eval prompt has its
`prompt_ids`. Readers check the rule instead of silently filtering rows out."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import StageError
from runtime.records import EvalPrompt

SPLITS = ("train", "heldout", "calib")
EVAL_DIR = "eval"
CHAT_TEMPLATE = "chat_template.jinja"


def split_path(art: Path, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"unknown data split {split!r}; the data artifact has {SPLITS}")
    return Path(art) / f"{split}.parquet"


def read_rows(art: Path, split: str, *, limit: int | None = None,
              max_len: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of the first `limit` rows of a split, each truncated to `max_len` tokens
    (`runtime.data.rows.read_token_rows`: the row rule, checked)."""
    from runtime.data.rows import read_token_rows
    from runtime.errors import RuntimeFailure

    try:
        return read_token_rows(split_path(art, split), limit=limit, max_len=max_len)
    except RuntimeFailure as e:
        raise StageError(str(e)) from None


def eval_files(art: Path) -> dict[str, Path]:
    """domain -> its eval/<domain>.jsonl, sorted by domain."""
    return {f.stem: f for f in sorted((Path(art) / EVAL_DIR).glob("*.jsonl"))}


def read_eval(art: Path, *, domains=None, per_domain: int | None = None) -> dict[str, list[EvalPrompt]]:
    """The eval prompts per domain (the first `per_domain` of each; only `domains` when given). StageError when
    there is no domain, a domain has no prompt, or a line breaks the contract (`runtime.data.rows.read_eval_lines`)."""
    from runtime.data.rows import read_eval_lines
    from runtime.errors import RuntimeFailure

    files = eval_files(art)
    if not files:
        raise StageError(f"no evaluation domains in {Path(art) / EVAL_DIR}")
    out: dict[str, list[EvalPrompt]] = {}
    for domain, f in files.items():
        if domains is not None and domain not in domains:
            continue
        try:
            prompts = [EvalPrompt.from_json(r) for r in read_eval_lines(f)]
        except RuntimeFailure as e:
            raise StageError(str(e)) from None
        if not prompts:
            raise StageError(f"{f} has no prompts")
        out[domain] = prompts[:per_domain] if per_domain else prompts
    return out


def write_eval(out_dir: Path, domain: str, prompts: list[EvalPrompt]) -> Path:
    d = Path(out_dir) / EVAL_DIR
    d.mkdir(exist_ok=True)
    f = d / f"{domain}.jsonl"
    with open(f, "w") as fh:
        for p in prompts:
            fh.write(json.dumps(p.to_json()) + "\n")
    return f
