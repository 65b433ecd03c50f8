"""The `data` artifact: token rows (`train.parquet`, `heldout.parquet`, `calib.parquet`: `input_ids`, `loss_mask`,
`domain`, `source`) and per-domain eval prompts (`eval/<domain>.jsonl`). The row rule is the contract's: a row has
at least 2 tokens and at least one token to train on (the data stage writes nothing else); an eval prompt has its
`prompt_ids`. Readers check the rule instead of silently filtering rows out."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import StageError

SPLITS = ("train", "heldout", "calib")
EVAL_DIR = "eval"
CHAT_TEMPLATE = "chat_template.jinja"


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    prompt: str                 # already rendered with the chat template when the source was a conversation
    prompt_ids: list[int]
    reference: str | None = None


def split_path(art: Path, split: str) -> Path:
    if split not in SPLITS:
        raise ValueError(f"unknown data split {split!r}; the data artifact has {SPLITS}")
    return Path(art) / f"{split}.parquet"


def read_rows(art: Path, split: str, *, limit: int | None = None,
              max_len: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of the first `limit` rows of a split, each truncated to `max_len` tokens."""
    import pyarrow.parquet as pq

    path = split_path(art, split)
    if not path.is_file():
        raise StageError(f"{path} is missing; the data stage's artifact contract promises it")
    table = pq.read_table(str(path), columns=["input_ids", "loss_mask"])
    if limit is not None:
        table = table.slice(0, limit)
    out = []
    for i, (ids, mask) in enumerate(zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist())):
        if len(ids) < 2 or len(mask) != len(ids) or not any(mask):
            raise StageError(f"{path} row {i}: {len(ids)} tokens, {len(mask)} mask entries, {sum(mask)} trained on; "
                             "the data contract needs >= 2 tokens, one mask entry per token and one token to train on: "
                             "rerun `specpipe build CONFIG --force data`")
        out.append((ids[:max_len], mask[:max_len]))
    return out


def eval_files(art: Path) -> dict[str, Path]:
    """domain -> its eval/<domain>.jsonl, sorted by domain."""
    return {f.stem: f for f in sorted((Path(art) / EVAL_DIR).glob("*.jsonl"))}


def read_eval(art: Path, *, domains=None, per_domain: int | None = None) -> dict[str, list[EvalPrompt]]:
    """The eval prompts per domain (the first `per_domain` of each; only `domains` when given). StageError when
    there is no domain, a domain has no prompt, or a line breaks the contract."""
    files = eval_files(art)
    if not files:
        raise StageError(f"no evaluation domains in {Path(art) / EVAL_DIR}")
    out: dict[str, list[EvalPrompt]] = {}
    for domain, f in files.items():
        if domains is not None and domain not in domains:
            continue
        prompts = []
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                p = EvalPrompt(id=str(r["id"]), prompt=r["prompt"], prompt_ids=[int(i) for i in r["prompt_ids"]],
                               reference=r.get("reference"))
            except (ValueError, KeyError, TypeError) as e:
                raise StageError(f"{f}:{n}: not an eval prompt of the data contract ({type(e).__name__}: {e}); "
                                 "rerun `specpipe build CONFIG --force data`") from None
            if not p.prompt_ids:
                raise StageError(f"{f}:{n}: empty prompt_ids; rerun `specpipe build CONFIG --force data`")
            prompts.append(p)
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
            fh.write(json.dumps(asdict(p)) + "\n")
    return f
