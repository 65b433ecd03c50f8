"""Stage `data`: draft-training data, calibration data and per-domain evaluation prompts.

Sources (a closed set, `kind`): local JSONL in the two common shapes (`{"messages": [...]}` conversations,
`{"prompt": ...}` / `{"text": ...}`), Hugging Face `datasets` by name (split + column mapping), and, for the
tiny default, code cut from the bootstrap target's corpus (its held-out files feed only the eval domains).

Optionally the target regenerates the responses (what makes a draft match its target). Conversations are
tokenized with the target's chat template and trained on assistant tokens only; a template that marks no
assistant tokens (or every token) is refused. Artifact: see docs/architecture.md (data).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator

from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict

NAME = "data"
CONSUMES = ("target",)
VERSION = "1"
PACKAGES = ("transformers", "tokenizers", "datasets", "torch")

Format = Literal["auto", "messages", "prompt", "text"]


class BootstrapSource(Strict):
    """Code from the tiny target's corpus: its training files for `sources`, held-out files for `eval_domains`."""

    kind: Literal["bootstrap"]
    style: Literal["code", "prose", "any"] = Field("any", description="eval prompts ending inside code, or inside docstrings/comments")
    domain: str | None = None


class JsonlSource(Strict):
    kind: Literal["jsonl"]
    path: Path
    format: Format = "auto"
    chat: bool | None = Field(None, description="render prompt/text samples as a user turn (default: for prompt samples when a chat template exists)")
    domain: str | None = None
    max_samples: int | None = Field(None, ge=1)


class HFSource(Strict):
    kind: Literal["hf"]
    name: str = Field(description="hub dataset id or a local dataset directory")
    subset: str | None = None
    split: str = "train"
    revision: str | None = None
    columns: dict[Literal["messages", "prompt", "text"], str] = Field(default_factory=dict, description="our field -> dataset column")
    where: dict[str, str | int | bool] = Field(default_factory=dict, description="keep rows whose columns equal these values, e.g. {category: coding}")
    format: Format = "auto"
    chat: bool | None = None
    domain: str | None = None
    max_samples: int | None = Field(None, ge=1)
    trust_remote_code: bool = False


Source = Annotated[Union[BootstrapSource, JsonlSource, HFSource], Field(discriminator="kind")]


class RegenerateConfig(Strict):
    enabled: bool = False
    mode: Literal["greedy", "sample"] = "greedy"
    temperature: float = Field(0.8, gt=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(16, ge=1)


def _default_sources():
    return [BootstrapSource(kind="bootstrap")]


def _default_domains():
    return {"code": BootstrapSource(kind="bootstrap", style="code"), "prose": BootstrapSource(kind="bootstrap", style="prose")}


class Config(StageSection):
    sources: list[Source] = Field(default_factory=_default_sources, min_length=1, description="training data sources (kind: bootstrap | jsonl | hf)")
    eval_domains: dict[str, Source] = Field(default_factory=_default_domains, min_length=1, description="domain name -> prompt source; acceptance is measured and gated per domain")
    max_samples: int = Field(2000, ge=1, description="training samples kept after dedup (a deterministic subset)")
    max_length: int = Field(256, ge=16, description="tokens per training sample (longer ones are truncated)")
    min_length: int = Field(16, ge=1, description="shorter samples are dropped")
    eval_fraction: float = Field(0.05, ge=0, lt=0.5, description="share of samples held out for quality measurement")
    calib_samples: int = Field(64, ge=1, description="size of the calibration split (FP8 scales)")
    eval_prompts: int = Field(32, ge=1, description="prompts per evaluation domain")
    max_prompt_tokens: int = Field(128, ge=8, description="eval prompts keep their last N tokens")
    dedup: bool = Field(True, description="drop exact duplicate samples")
    max_malformed: int = Field(0, ge=0, description="malformed input lines tolerated before the stage fails")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="replace responses by the target's own generations")
    seed: int = Field(0, description="split and subsample seed")

    @field_validator("eval_domains")
    @classmethod
    def _names(cls, v: dict) -> dict:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"domain name '{name}' must use letters, digits, '_', '-', '.' only (it names a file)")
        return v


def check(cfg) -> list[tuple[str, str]]:
    problems = []
    sec: Config = cfg.data
    boot = cfg.target.bootstrap is not None
    for i, s in enumerate(sec.sources):
        if s.kind == "bootstrap" and not boot:
            problems.append((f"data.sources.{i}.kind", "'bootstrap' needs target.bootstrap: tiny (there is no corpus otherwise)"))
        if s.kind == "jsonl" and not Path(s.path).expanduser().is_file():
            problems.append((f"data.sources.{i}.path", f"file not found: {s.path}"))
    for name, s in sec.eval_domains.items():
        if s.kind == "bootstrap" and not boot:
            problems.append((f"data.eval_domains.{name}.kind", "'bootstrap' needs target.bootstrap: tiny"))
        if s.kind == "jsonl" and not Path(s.path).expanduser().is_file():
            problems.append((f"data.eval_domains.{name}.path", f"file not found: {s.path}"))
    return problems


def fingerprint_extra(section: Config) -> dict | None:
    files = {}
    for s in [*section.sources, *section.eval_domains.values()]:
        if s.kind == "jsonl":
            p = Path(s.path).expanduser()
            if p.is_file():
                st = p.stat()
                files[str(s.path)] = [st.st_size, int(st.st_mtime)]
    return files or None


# ---------------------------------------------------------------------------------------------- samples


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


def _read_jsonl(src: JsonlSource, domain: str, bad: Malformed) -> list[Sample]:
    out = []
    path = Path(src.path).expanduser()
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


def _read_hf(src: HFSource, domain: str, bad: Malformed) -> list[Sample]:
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
        raise StageError(f"data: could not load dataset '{src.name}' split '{src.split}' ({type(e).__name__}: {str(e)[:300]}); "
                         "check the name, split and network, or use a local JSONL source") from None
    missing = [c for c in [*src.columns.values(), *src.where] if c not in ds.column_names]
    if missing:
        raise StageError(f"data: dataset '{src.name}' has no column(s) {missing}; it has {ds.column_names} (set data.sources.*.columns)")
    if src.where:
        ds = ds.filter(lambda row: all(row[k] == v for k, v in src.where.items()))
        if len(ds) == 0:
            raise StageError(f"data: dataset '{src.name}' has no rows where {src.where}")
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


def _read_bootstrap(target_dir: Path, src: BootstrapSource, domain: str, split: str, max_chars: int) -> list[Sample]:
    path = target_dir / "corpus" / f"{split}.jsonl"
    if not path.exists():
        raise StageError(f"data: the target artifact has no {path.name}; 'bootstrap' sources need target.bootstrap: tiny")
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


# ---------------------------------------------------------------------------------------------- tokenization


def _bucket(key: str, seed: int) -> float:
    return int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def _encode_train(tok, s: Sample, max_length: int) -> tuple[list[int], list[int]] | None:
    if s.fmt == "messages":
        enc = tok.apply_chat_template(s.content, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    elif s.fmt == "text":
        if s.chat:
            return _encode_train(tok, Sample("messages", [{"role": "assistant", "content": s.content}], s.domain, s.origin), max_length)
        ids = tok(s.content, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        mask = [1] * len(ids)
    else:
        return None  # a prompt without a response: only usable after regeneration
    return ids[:max_length], mask[:max_length]


def _render_prompt(tok, s: Sample) -> str:
    if s.fmt == "messages":
        msgs = list(s.content)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise StageError(f"data: {s.origin}: a conversation with no user turn cannot be an evaluation prompt")
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if s.fmt == "text":
        text = s.content
        cut = text.rfind("\n", 0, max(1, len(text) // 2))
        text = text[: cut if cut > 0 else len(text) // 2]
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True) if s.chat else text
    return tok.apply_chat_template([{"role": "user", "content": s.content}], tokenize=False, add_generation_prompt=True) if s.chat else s.content


def _check_template(tok, samples: list[Sample]) -> None:
    first = next((s for s in samples if s.fmt == "messages" or (s.fmt == "text" and s.chat)), None)
    if first is None:
        return
    if not getattr(tok, "chat_template", None):
        raise StageError(f"data: conversation samples (e.g. {first.origin}) need a chat template, and the target's tokenizer has none")
    msgs = first.content if first.fmt == "messages" else [{"role": "assistant", "content": first.content}]
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    mask = list(enc["assistant_masks"])
    if sum(mask) == 0:
        raise StageError("data: the target's chat template marks no assistant tokens (it has no {% generation %} ... "
                         "{% endgeneration %} block), so the loss mask would be empty; add generation tags to the template")
    if sum(mask) == len(mask):
        raise StageError("data: the target's chat template marks every token as an assistant token, so the loss mask would be "
                         "all ones (training on prompts too); fix the template's {% generation %} tags")


# ---------------------------------------------------------------------------------------------- regeneration


def _regenerate(ctx: StageContext, model_dir: Path, tok, samples: list[Sample], rc: RegenerateConfig, max_length: int):
    """Replace responses with the target's own generations. Returns (input_ids, loss_mask) per sample."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(ctx.section.seed)
    prompts: list[list[int]] = []
    for s in samples:
        if s.fmt == "messages":
            msgs = list(s.content)
            while msgs and msgs[-1]["role"] == "assistant":
                msgs.pop()
            prompts.append(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
        elif s.fmt == "text" and not s.chat:
            ids = tok(s.content, add_special_tokens=False)["input_ids"]
            prompts.append(ids[: max(4, min(len(ids) // 2, max_length // 2))])
        else:
            prompts.append(tok(_render_prompt(tok, s), add_special_tokens=False)["input_ids"])
    prompts = [p[-(max_length - rc.max_new_tokens):] if len(p) > max_length - rc.max_new_tokens else p for p in prompts]
    out = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with ctx.progress(total=len(prompts), desc="regenerate with target") as bar, torch.no_grad():
        for i in range(0, len(prompts), rc.batch_size):
            batch = prompts[i: i + rc.batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=rc.max_new_tokens,
                                 do_sample=rc.mode == "sample", temperature=rc.temperature if rc.mode == "sample" else None,
                                 top_p=rc.top_p if rc.mode == "sample" else None, pad_token_id=pad,
                                 eos_token_id=tok.eos_token_id)
            for p, g in zip(batch, gen[:, width:].tolist()):
                if tok.eos_token_id in g:
                    g = g[: g.index(tok.eos_token_id) + 1]
                out.append((p + g, [0] * len(p) + [1] * len(g)))
            bar.update(len(batch))
    return out


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    import datasets
    from datasets import Dataset
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()

    sec: Config = ctx.section
    target = ctx.input("target")
    model_dir = target.path / "model"
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=ctx.config.target.trust_remote_code)
    max_chars = sec.max_length * 4
    bad = Malformed(sec.max_malformed)

    # load -----------------------------------------------------------------------------------
    train: list[Sample] = []
    for i, src in enumerate(sec.sources):
        domain = src.domain or ("code" if src.kind == "bootstrap" else f"source{i}")
        if src.kind == "bootstrap":
            got = _read_bootstrap(target.path, src, domain, "train", max_chars)
        elif src.kind == "jsonl":
            got = _read_jsonl(src, domain, bad)
        else:
            got = _read_hf(src, domain, bad)
        ctx.log.info("source %d (%s): %d samples", i, src.kind, len(got))
        train += got
    evals: dict[str, list[Sample]] = {}
    for name, src in sec.eval_domains.items():
        if src.kind == "bootstrap":
            evals[name] = _read_bootstrap(target.path, src, name, "heldout", min(max_chars, sec.max_prompt_tokens * 4))
        elif src.kind == "jsonl":
            evals[name] = _read_jsonl(src, name, bad)
        else:
            evals[name] = _read_hf(src, name, bad)
        ctx.log.info("eval domain %s (%s): %d candidate prompts", name, src.kind, len(evals[name]))
    if bad.items:
        for item in bad.items[:20]:
            ctx.log.warning("malformed: %s", item)
        if len(bad.items) > sec.max_malformed:
            raise StageError(f"data: {len(bad.items)} malformed input lines (limit data.max_malformed={sec.max_malformed}); first: "
                             + "; ".join(bad.items[:5]))

    # eval prompts -------------------------------------------------------------------------------
    (ctx.out_dir / "eval").mkdir()
    domain_stats = {}
    chosen_keys: set[str] = set()   # eval prompts (or the samples they were cut from) never train the draft
    for name, samples in evals.items():
        samples = sorted({s.key: s for s in samples}.values(), key=lambda s: _bucket(s.key, sec.seed))
        lines = []
        for s in samples:
            chosen_keys.add(s.key)
            prompt = _render_prompt(tok, s)
            ids = tok(prompt, add_special_tokens=False)["input_ids"][-sec.max_prompt_tokens:]
            if len(ids) < 4:
                continue
            ref = s.content[-1]["content"] if s.fmt == "messages" and s.content[-1]["role"] == "assistant" else None
            lines.append({"id": f"{name}-{len(lines)}", "prompt": tok.decode(ids), "prompt_ids": ids, "reference": ref})
            if len(lines) >= sec.eval_prompts:
                break
        if not lines:
            raise StageError(f"data.eval_domains.{name}: no usable prompts (need at least 4 tokens each)")
        with open(ctx.out_dir / "eval" / f"{name}.jsonl", "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
        domain_stats[name] = {"prompts": len(lines), "mean_prompt_tokens": round(sum(len(x["prompt_ids"]) for x in lines) / len(lines), 1)}

    # dedup, split, subsample -----------------------------------------------------------------
    n_raw = len(train)
    n_dup = 0
    if sec.dedup:
        seen, uniq = set(), []
        for s in train:
            if s.key not in seen:
                seen.add(s.key)
                uniq.append(s)
        n_dup = len(train) - len(uniq)
        train = uniq
    overlap = [s for s in train if s.key in chosen_keys]
    train = [s for s in train if s.key not in chosen_keys]
    train.sort(key=lambda s: _bucket(s.key, sec.seed))
    heldout = [s for s in train if _bucket("heldout:" + s.key, sec.seed) < sec.eval_fraction]
    train = [s for s in train if _bucket("heldout:" + s.key, sec.seed) >= sec.eval_fraction][: sec.max_samples]
    if not train:
        raise StageError("data: no training samples left after dedup and split; add sources or lower data.eval_fraction")

    # tokenize (or regenerate) ------------------------------------------------------------------
    _check_template(tok, train)
    if sec.regenerate.enabled:
        encoded = _regenerate(ctx, model_dir, tok, train, sec.regenerate, sec.max_length)
    else:
        if any(s.fmt == "prompt" for s in train):
            first = next(s for s in train if s.fmt == "prompt")
            raise StageError(f"data: prompt-only samples (e.g. {first.origin}) have no response to train on; "
                             "enable data.regenerate to let the target write the responses, or give text/messages samples")
        encoded = [_encode_train(tok, s, sec.max_length) for s in train]
    held_enc = [_encode_train(tok, s, sec.max_length) for s in heldout if s.fmt != "prompt"]

    def rows(samples, enc):
        keep = [(s, e) for s, e in zip(samples, enc) if e and len(e[0]) >= sec.min_length and sum(e[1]) > 0]
        return {"input_ids": [e[0] for _, e in keep], "loss_mask": [e[1] for _, e in keep],
                "domain": [s.domain for s, _ in keep], "source": [s.origin for s, _ in keep]}

    train_rows = rows(train, encoded)
    held_rows = rows([s for s in heldout if s.fmt != "prompt"], held_enc)
    if not train_rows["input_ids"]:
        raise StageError(f"data: every training sample is shorter than data.min_length={sec.min_length} tokens")
    calib_rows = {k: v[: sec.calib_samples] for k, v in train_rows.items()}
    for name, r in (("train", train_rows), ("heldout", held_rows), ("calib", calib_rows)):
        Dataset.from_dict(r).to_parquet(str(ctx.out_dir / f"{name}.parquet"))

    def split_stats(r):
        lens = [len(x) for x in r["input_ids"]]
        return {"samples": len(lens), "tokens": sum(lens), "loss_tokens": sum(sum(m) for m in r["loss_mask"]),
                "min_len": min(lens, default=0), "mean_len": round(sum(lens) / max(1, len(lens)), 1), "max_len": max(lens, default=0)}

    stats = {
        "splits": {"train": split_stats(train_rows), "heldout": split_stats(held_rows), "calib": split_stats(calib_rows)},
        "domains": domain_stats,
        "raw_samples": n_raw, "dedup_removed": n_dup, "subsampled_to": sec.max_samples,
        "eval_overlap_removed": len(overlap), "malformed": len(bad.items), "malformed_examples": bad.items[:20],
        "regenerated": sec.regenerate.enabled,
    }
    (ctx.out_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    ctx.log.info("train %d samples / %d tokens, heldout %d, calib %d; eval domains: %s",
                 stats["splits"]["train"]["samples"], stats["splits"]["train"]["tokens"], stats["splits"]["heldout"]["samples"],
                 stats["splits"]["calib"]["samples"], ", ".join(f"{k} ({v['prompts']})" for k, v in domain_stats.items()))
    return {
        "train_samples": stats["splits"]["train"]["samples"], "train_tokens": stats["splits"]["train"]["tokens"],
        "train_loss_tokens": stats["splits"]["train"]["loss_tokens"], "heldout_samples": stats["splits"]["heldout"]["samples"],
        "calib_samples": stats["splits"]["calib"]["samples"], "malformed": len(bad.items),
        "eval_domains": {k: v["prompts"] for k, v in domain_stats.items()}, "regenerated": sec.regenerate.enabled,
    }


def report(artifact) -> str:
    from pipeline.report import table

    s = artifact.read_json("stats.json")
    rows = [[k, v["samples"], v["tokens"], v["loss_tokens"], v["mean_len"], v["max_len"]] for k, v in s["splits"].items()]
    out = table(rows, ["split", "samples", "tokens", "loss tokens", "mean length", "max length"])
    out += table([[k, v["prompts"], v["mean_prompt_tokens"]] for k, v in s["domains"].items()], ["eval domain", "prompts", "mean prompt tokens"])
    if s.get("malformed"):
        out += "<p>malformed lines: " + ", ".join(s["malformed_examples"][:5]) + "</p>"
    return out
