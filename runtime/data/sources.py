"""Where the data stage's samples come from: local JSONL in the two common shapes (`{"messages": [...]}`
conversations, `{"prompt": ...}` / `{"text": ...}`), Hugging Face `datasets` by name or local directory (column
mapping, row filters), and the tiny target's corpus (code chunks of its training files; prompts cut from its held-out
files, ending inside code or inside a docstring/comment). Each becomes a `Sample`; a line or row that is not one is
counted in `Malformed` (the stage decides how many it tolerates)."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import RuntimeFailure


@dataclass
class Sample:
    fmt: str                        # messages | prompt | text
    content: object                 # list of {"role","content"} or str
    domain: str
    origin: str                     # file:line or dataset:index, for messages about this sample
    chat: bool = False
    key: str = field(default="")

    def __post_init__(self):
        self.key = hashlib.sha256(json.dumps([self.fmt, self.content], sort_keys=True).encode()).hexdigest()


class Malformed:
    def __init__(self, limit: int):
        self.limit = limit
        self.items: list[str] = []

    def add(self, where: str, why: str) -> None:
        self.items.append(f"{where}: {why}")


def _normalize(rec, fmt: str, where: str, bad: Malformed, columns: dict | None = None):
    if not isinstance(rec, dict):
        bad.add(where, f"expected a JSON object, found {type(rec).__name__}")
        return None
    if columns:
        rec = {ours: rec.get(col) for ours, col in columns.items()}
    if fmt == "auto":
        fmt = next((f for f in ("messages", "prompt", "text") if rec.get(f) is not None), "")
        if not fmt:
            bad.add(where, "no 'messages', 'prompt' or 'text' field")
            return None
    val = rec.get(fmt)
    if fmt == "prompt" and isinstance(val, list) and val and all(isinstance(x, str) for x in val):
        val = val[0]   # multi-turn benchmarks (MT-Bench, SPEED-Bench `turns`): the first turn is the prompt
    if fmt == "messages":
        if not isinstance(val, list) or not val or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in val):
            bad.add(where, "'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
            return None
        return fmt, [{"role": m["role"], "content": m["content"]} for m in val]
    if not isinstance(val, str) or not val.strip():
        bad.add(where, f"'{fmt}' must be a non-empty string")
        return None
    return fmt, val


def source_of(origin: str) -> str:
    """The source (file or dataset) of a sample's origin: `file:line`, `dataset[index]` or `file#chunk`."""
    return re.sub(r"(:\d+|\[\d+\]|#\d+)$", "", origin)


def jsonl_problem(path: str | Path) -> str | None:
    """What makes an existing JSONL source file unusable before any line is parsed: empty, or blank lines only."""
    p = Path(path).expanduser()
    if p.stat().st_size == 0:
        return f"{path} is empty (0 bytes): no sample in it"
    n = 0
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return None
            n += 1
    return f"{path} has {n} line(s), all blank: no sample in it"


def read_jsonl(src, domain: str, bad: Malformed) -> list[Sample]:
    """The samples of a local JSONL file (`src`: the stage's `jsonl` source: path, format, chat, max_samples); a
    line that is not a sample is counted in `bad`. RuntimeFailure for a file that is empty or blank."""
    out = []
    path = Path(src.path).expanduser()
    if why := jsonl_problem(path):
        raise RuntimeFailure(why)
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{src.path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                bad.add(where, f"invalid JSON ({e.msg})")
                continue
            r = _normalize(rec, src.format, where, bad)
            if r:
                out.append(Sample(r[0], r[1], domain, where, chat=_chat_default(src.chat, r[0])))
            if src.max_samples and len(out) >= src.max_samples:
                break
    return out


def _chat_default(chat: bool | None, fmt: str) -> bool:
    return fmt == "prompt" if chat is None else chat


def read_hf(src, domain: str, bad: Malformed) -> list[Sample]:
    """The samples of a Hugging Face dataset, by name or a local `save_to_disk` directory (`src`: the stage's `hf`
    source: split, revision, columns, where, format, chat, max_samples, trust_remote_code)."""
    import datasets

    try:
        local = Path(src.name).expanduser()
        if local.is_dir() and (local / "dataset_info.json").exists():
            ds = datasets.load_from_disk(str(local))
            ds = ds[src.split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(src.name, src.subset, split=src.split, revision=src.revision,
                                       trust_remote_code=src.trust_remote_code)
    except Exception as e:
        raise RuntimeFailure(f"could not load dataset '{src.name}' split '{src.split}' ({type(e).__name__}: {str(e)[:300]}); "
                             "check the name, split and network, or use a local JSONL source") from None
    missing = [c for c in [*src.columns.values(), *src.where] if c not in ds.column_names]
    if missing:
        raise RuntimeFailure(f"dataset '{src.name}' has no column(s) {missing}; it has {ds.column_names} (set "
                             "data.sources.*.columns)")
    if src.where:
        ds = ds.filter(lambda row: all(row[k] == v for k, v in src.where.items()))
        if len(ds) == 0:
            raise RuntimeFailure(f"dataset '{src.name}' has no rows where {src.where}")
    if src.max_samples:
        ds = ds.select(range(min(len(ds), src.max_samples)))
    out = []
    for i, rec in enumerate(ds):
        r = _normalize(rec, src.format, f"{src.name}[{i}]", bad, src.columns or None)
        if r:
            out.append(Sample(r[0], r[1], domain, f"{src.name}[{i}]", chat=_chat_default(src.chat, r[0])))
    return out


_TOP = re.compile(r"\n(?=(?:def |class |async def |@))")


def _code_chunks(text: str, max_chars: int) -> list[str]:
    """Split a source file at top-level definitions, then pack pieces up to max_chars."""
    out, cur = [], ""
    for piece in _TOP.split(text):
        if len(cur) + len(piece) > max_chars and cur.strip():
            out.append(cur)
            cur = ""
        cur += piece if not cur else "\n" + piece
        while len(cur) > max_chars:
            cut = cur.rfind("\n", 0, max_chars)
            cut = cut if cut > max_chars // 4 else max_chars
            out.append(cur[:cut])
            cur = cur[cut:].lstrip("\n")
    if cur.strip():
        out.append(cur)
    return [c for c in out if c.strip()]


_PROSE = re.compile(r'("""|\'\'\'|# )(?=[A-Za-z])')


def _bootstrap_prompts(text: str, style: str, max_chars: int) -> list[str]:
    """Prompts cut from one held-out file: ending inside code, or right inside a docstring/comment."""
    out = []
    if style in ("prose", "any"):
        for m in _PROSE.finditer(text):
            start = max(0, m.end() - max_chars)
            words = text[m.end(): m.end() + 40].split(" ")
            prefix = text[start: m.end()] + " ".join(words[:3])
            nl = prefix.find("\n")
            out.append(prefix[nl + 1:] if 0 <= nl < len(prefix) // 2 else prefix)
    if style in ("code", "any"):
        lines = text.split("\n")
        for i in range(8, len(lines), 12):
            line = lines[i]
            s = line.strip()
            if not s or s.startswith(("#", '"', "'")) or len(s) < 8:
                continue
            cut = len(line) - len(line.lstrip()) + max(2, len(s) // 3)   # inside the line's code
            prefix = "\n".join(lines[max(0, i - 30): i]) + "\n" + line[:cut]
            out.append(prefix[-max_chars:])
    return out


def read_bootstrap(target_dir: Path, src, domain: str, split: str, max_chars: int) -> list[Sample]:
    """Samples cut from the tiny target's corpus (`target_dir/corpus/<split>.jsonl`): code chunks of its training
    files, or eval prompts of its held-out files (`src.style`: code, prose or any)."""
    path = target_dir / "corpus" / f"{split}.jsonl"
    if not path.exists():
        raise RuntimeFailure(f"the target artifact has no {path.name}; 'bootstrap' sources need target.bootstrap: tiny")
    out = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if split == "train":
                for j, chunk in enumerate(_code_chunks(rec["text"], max_chars)):
                    out.append(Sample("text", chunk, domain, f"{rec['path']}#{j}"))
            else:
                for j, p in enumerate(_bootstrap_prompts(rec["text"], src.style, max_chars)):
                    out.append(Sample("prompt", p, domain, f"{rec['path']}#{j}", chat=False))
    return out
