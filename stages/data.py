"""Stage `data`: draft-training data, calibration data and per-domain evaluation prompts.

Sources (a closed set, `kind`): local JSONL in the two common shapes (`{"messages": [...]}` conversations,
`{"prompt": ...}` / `{"text": ...}`), Hugging Face `datasets` by name (split + column mapping), and, for the
tiny default, code cut from the bootstrap target's corpus (its held-out files feed only the eval domains).

Conversations are rendered with the target's chat template (or `data.chat_template`, a Jinja file, which then
also renders the eval prompts) and trained on the assistant's tokens only: every assistant turn's content and its
end-of-turn token, nothing of the system or user turns or the assistant header. Templates with `{% generation %}`
tags are used as tagged; any other template's assistant spans are derived from its own renderings and checked
for consistency (runtime/text/chat_template.py); a template that cannot give a trustworthy mask is refused, naming the
sample, the message and the text that differs.

Optionally the target regenerates the responses (what makes a draft match its target, the EAGLE recipe): from
prompt-only chats, or replacing a conversation's last assistant turn given the earlier ones. Regeneration runs the
project's own runtime (batched KV-cache decoding, prompts sorted by length into batches), stops at the target's
stop ids (`target.json["eos_token_ids"]`), and resumes from finished batches in the scratch dir after an
interruption. Artifact: see docs/architecture.md (data); what each check proves: docs/stages/data.md.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator

from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import target as target_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict

NAME = "data"
CONSUMES = ("target",)
VERSION = "2"   # 2: masks from any chat template, regeneration through the runtime, chat_template.jinja
PACKAGES = ("transformers", "tokenizers", "datasets", "torch")

Format = Literal["auto", "messages", "prompt", "text"]


class BootstrapSource(Strict):
    """Code from the tiny target's corpus: its training files for `sources`, held-out files for `eval_domains`."""

    kind: Literal["bootstrap"]
    style: Literal["code", "prose", "any"] = Field("any", description="eval prompts ending inside code, or inside "
                                                                      "docstrings/comments")
    domain: str | None = None


class JsonlSource(Strict):
    kind: Literal["jsonl"]
    path: Path
    format: Format = "auto"
    chat: bool | None = Field(None, description="render prompt/text samples as a user turn (default: for prompt samples when a "
                                                "chat template exists)")
    domain: str | None = None
    max_samples: int | None = Field(None, ge=1)


class HFSource(Strict):
    kind: Literal["hf"]
    name: str = Field(description="hub dataset id or a local dataset directory")
    subset: str | None = None
    split: str = "train"
    revision: str | None = None
    columns: dict[Literal["messages", "prompt", "text"], str] = Field(default_factory=dict, description="our field -> dataset "
                                                                                                        "column")
    where: dict[str, str | int | bool] = Field(default_factory=dict, description="keep rows whose columns equal these values, "
                                                                                 "e.g. {category: coding}")
    format: Format = "auto"
    chat: bool | None = None
    domain: str | None = None
    max_samples: int | None = Field(None, ge=1)
    trust_remote_code: bool = False


Source = Annotated[Union[BootstrapSource, JsonlSource, HFSource], Field(discriminator="kind")]


class RegenerateConfig(Strict):
    enabled: bool = Field(False, description="replace responses by the target's own: prompt-only chats get one, a chat's last "
                                             "assistant turn is rewritten")
    mode: Literal["greedy", "sample"] = Field("greedy", description="greedy decoding, or sampling with temperature/top_p (seeded "
                                                                    "by data.seed)")
    temperature: float = Field(0.8, gt=0, description="sampling temperature (mode: sample)")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling mass (mode: sample)")
    max_new_tokens: int = Field(128, ge=1, description="tokens generated per response at most; prompts longer than "
                                                       "data.max_length minus this are skipped")
    batch_size: int = Field(16, ge=1, description="prompts decoded together (sorted by length to limit padding); 16 suits a CPU, "
                                                  "larger suits a GPU")


def _default_sources():
    return [BootstrapSource(kind="bootstrap")]


def _default_domains():
    return {"code": BootstrapSource(kind="bootstrap", style="code"), "prose": BootstrapSource(kind="bootstrap", style="prose")}


class Config(StageSection):
    sources: list[Source] = Field(default_factory=_default_sources, min_length=1, description="training data sources (kind: "
                                                                                              "bootstrap | jsonl | hf)")
    eval_domains: dict[str, Source] = Field(default_factory=_default_domains, min_length=1, description="domain name -> prompt "
                                                                                                        "source; acceptance is "
                                                                                                        "measured and gated per "
                                                                                                        "domain")
    max_samples: int = Field(2000, ge=1, description="training samples kept after dedup (a deterministic subset)")
    max_length: int = Field(256, ge=16, description="tokens per training sample (longer ones are truncated)")
    min_length: int = Field(16, ge=1, description="shorter samples are dropped")
    eval_fraction: float = Field(0.05, ge=0, lt=0.5, description="share of samples held out for quality measurement")
    calib_samples: int = Field(64, ge=1, description="size of the calibration split (FP8 scales)")
    eval_prompts: int = Field(32, ge=1, description="prompts per evaluation domain")
    max_prompt_tokens: int = Field(128, ge=8, description="eval prompts keep their last N tokens")
    dedup: bool = Field(True, description="drop exact duplicate samples")
    max_malformed: int = Field(0, ge=0, description="malformed input lines tolerated before the stage fails")
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig, description="replace responses by the target's own "
                                                                                       "generations")
    chat_template: Path | None = Field(None, description="a Jinja chat template file used instead of the target's own for "
                                                         "training samples and eval prompts; deploy with the same template")
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
    if sec.chat_template is not None:
        p = Path(sec.chat_template).expanduser()
        if not p.is_file():
            problems.append(("data.chat_template", f"file not found: {sec.chat_template}"))
        else:
            from runtime.text.chat_template import check_template_syntax

            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                problems.append(("data.chat_template", f"{sec.chat_template} is not a readable UTF-8 text file ({e})"))
            else:
                err = check_template_syntax(text) if text.strip() else "the file is empty"
                if err:
                    problems.append(("data.chat_template", f"{sec.chat_template} is not a valid Jinja chat template: {err}"))
    if sec.regenerate.enabled and sec.regenerate.max_new_tokens >= sec.max_length:
        problems.append(("data.regenerate.max_new_tokens", f"{sec.regenerate.max_new_tokens} leaves no room for a prompt within "
                         f"data.max_length={sec.max_length}; lower it or raise data.max_length"))
    return problems


def fingerprint_extra(section: Config) -> dict | None:
    files = {}
    paths = [s.path for s in [*section.sources, *section.eval_domains.values()] if s.kind == "jsonl"]
    for path in paths + ([section.chat_template] if section.chat_template is not None else []):
        p = Path(path).expanduser()
        if p.is_file():
            st = p.stat()
            files[str(path)] = [st.st_size, int(st.st_mtime)]
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
        raise StageError(f"data: dataset '{src.name}' has no column(s) {missing}; it has {ds.column_names} (set "
                         "data.sources.*.columns)")
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


# ---------------------------------------------------------------------------------------------- chat template


def _bucket(key: str, seed: int) -> float:
    return int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def _load_renderer(tok, sec: Config):
    """The chat template this run renders with (data.chat_template, else the target's own), checked to render a
    [user, assistant] conversation, and what the artifact records about it. (None, info) when there is none."""
    from runtime.text.chat_template import ChatRenderer, ChatTemplateError

    if sec.chat_template is not None:
        text: str | None = Path(sec.chat_template).expanduser().read_text(encoding="utf-8")
        source, field_name = f"data.chat_template ({sec.chat_template})", "data.chat_template"
    elif getattr(tok, "chat_template", None):
        text, source, field_name = None, "the target's tokenizer", "the target's chat template"
    else:
        return None, {"source": None}
    r = ChatRenderer(tok, text)
    try:
        r.render([{"role": "user", "content": "Hello."}], add_generation_prompt=True)
        r.render([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}])
        end = r.end_of_turn()
    except Exception as e:  # jinja raises many types
        raise StageError(f"data: {field_name} ({source}) does not render a [user, assistant] conversation "
                         f"({type(e).__name__}: {str(e)[:300]}); fix it, or set data.chat_template to a template that "
                         "renders") from None
    try:
        header = r.generation_prompt()
    except ChatTemplateError:
        header = None               # refused later, with the sample, if a mask or a prompt needs it
    info = {"source": source, "sha256": hashlib.sha256(r.template.encode()).hexdigest(), "mask_method": r.method,
            "end_of_turn": end.token if end else None, "end_of_turn_id": end.token_id if end else None,
            "generation_prompt": header}
    return r, info


def _need_template(r, s: Sample) -> None:
    if r is None:
        raise StageError(f"data: conversation samples (e.g. {s.origin}) need a chat template, and the target's tokenizer has "
                         "none; set data.chat_template to a Jinja template file")


def _template_error(s: Sample, err, info: dict) -> StageError:
    return StageError(
        f"data: {s.origin}: the loss mask cannot be derived from the chat template of {info['source']}: {err}. Nothing was "
        "masked; to proceed, set data.chat_template to a Jinja template whose renderings of a conversation and its "
        "prefixes agree (it then also renders the eval prompts: deploy with the same template), or give conversations "
        "whose only assistant turn is the last message")


def _has_assistant(s: Sample) -> bool:
    return s.fmt == "messages" and any(m["role"] == "assistant" for m in s.content)


def _encode_train(r, tok, s: Sample, eos_id: int) -> tuple[list[int], list[int]] | None:
    """(input_ids, loss_mask), untruncated; None for samples without a response (prompt-only)."""
    if s.fmt == "messages":
        _need_template(r, s)
        return r.encode(s.content) if _has_assistant(s) else None
    if s.fmt == "text":
        if s.chat:
            _need_template(r, s)
            return r.encode([{"role": "assistant", "content": s.content}])
        ids = tok(s.content, add_special_tokens=False)["input_ids"] + [eos_id]
        return ids, [1] * len(ids)
    return None  # a prompt without a response: only usable after regeneration


def _encode_samples(r, tok, samples: list[Sample], max_length: int, eos_id: int, bad: Malformed, info: dict) -> list:
    """Every sample's (ids, mask) truncated to max_length, or None. Checks every conversation's mask, not one: a
    template error stops the stage (naming the sample); a sample-level one is counted as malformed."""
    from runtime.text.chat_template import ChatTemplateError

    out, empty, full = [], [], []
    for s in samples:
        try:
            e = _encode_train(r, tok, s, eos_id)
        except ChatTemplateError as err:
            if err.kind == "template":
                raise _template_error(s, err, info) from None
            bad.add(s.origin, f"loss mask: {err}")
            out.append(None)
            continue
        if e is None:
            out.append(None)
            continue
        ids, mask = e
        if s.fmt == "messages" or s.chat:
            if sum(mask) == 0:
                empty.append(s)
            elif sum(mask) == len(mask):
                full.append(s)
        out.append((ids[:max_length], mask[:max_length]))
    if empty:
        raise StageError(f"data: the chat template ({info['source']}) marks no assistant token in {len(empty)} conversation(s) "
                         f"with assistant turns (first: {empty[0].origin}), so their loss mask would be empty: its "
                         "{% generation %} ... {% endgeneration %} blocks do not cover the assistant messages; fix them, or "
                         "remove the tags (the assistant spans are then derived from the template's own renderings)")
    if full:
        raise StageError(f"data: the chat template ({info['source']}) marks every token of {len(full)} conversation(s) as "
                         f"the assistant's (first: {full[0].origin}), so the loss mask would be all ones (training on prompts "
                         "too); fix the template's {% generation %} tags")
    return out


def _render_prompt(r, tok, s: Sample) -> str:
    if s.fmt == "messages":
        _need_template(r, s)
        msgs = list(s.content)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise StageError(f"data: {s.origin}: a conversation with no user turn cannot be an evaluation prompt")
        return r.render(msgs, add_generation_prompt=True)
    if s.fmt == "text":
        text = s.content
        cut = text.rfind("\n", 0, max(1, len(text) // 2))
        text = text[: cut if cut > 0 else len(text) // 2]
        if s.chat:
            _need_template(r, s)
            return r.render([{"role": "user", "content": text}], add_generation_prompt=True)
        return text
    if s.chat:
        _need_template(r, s)
        return r.render([{"role": "user", "content": s.content}], add_generation_prompt=True)
    return s.content


# ---------------------------------------------------------------------------------------------- regeneration


@dataclass
class RegenJob:
    sample: Sample
    prompt: list[int]
    context: list[dict] | None      # the messages the prompt renders (chat prompts): the template consistency check


def _regen_job(r, tok, s: Sample, max_length: int) -> RegenJob:
    """What the target continues: the conversation without its last assistant turn (earlier turns stay as context),
    a prompt as a user turn (or raw), the first half of a text sample."""
    if s.fmt == "messages":
        _need_template(r, s)
        msgs = list(s.content)
        if msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs:
            raise ValueError("a conversation of one assistant message has no prompt to regenerate from")
    elif s.fmt == "prompt" and s.chat or s.fmt == "text" and s.chat:
        _need_template(r, s)
        text = s.content if s.fmt == "prompt" else _render_prompt(None, tok, Sample("text", s.content, s.domain, s.origin))
        msgs = [{"role": "user", "content": text}]
    elif s.fmt == "prompt":
        return RegenJob(s, tok(s.content, add_special_tokens=False)["input_ids"], None)
    else:
        ids = tok(s.content, add_special_tokens=False)["input_ids"]
        return RegenJob(s, ids[: max(4, min(len(ids) // 2, max_length // 2))], None)
    return RegenJob(s, r.prompt_ids(msgs), msgs)


def _select_jobs(r, tok, candidates: list[Sample], limit: int, budget: int, max_length: int, bad: Malformed,
                 info: dict) -> tuple[list[RegenJob], int]:
    """Up to `limit` jobs from `candidates` in order; prompts longer than `budget` tokens are skipped (counted)."""
    import jinja2

    from runtime.text.chat_template import ChatTemplateError

    jobs, skipped = [], 0
    for s in candidates:
        if len(jobs) >= limit:
            break
        try:
            job = _regen_job(r, tok, s, max_length)
        except ChatTemplateError as e:
            if e.kind == "template":
                raise _template_error(s, e, info) from None
            bad.add(s.origin, f"regeneration prompt: {e}")
            continue
        except (ValueError, jinja2.TemplateError) as e:
            bad.add(s.origin, f"regeneration prompt: {e}")
            continue
        if not job.prompt:
            bad.add(s.origin, "regeneration prompt: empty")
        elif len(job.prompt) > budget:
            skipped += 1
        else:
            jobs.append(job)
    return jobs, skipped


def regenerate(model_dir: Path, prompts: list[list[int]], keys: list[str], *, batch_size: int, max_new_tokens: int,
               temperature: float, top_p: float, stop_ids: list[int], seed: int, scratch: Path | None, log,
               stage: str = NAME) -> tuple[list[list[int]], dict]:
    """The target's continuation of every prompt, through specpipe's runtime (`runtime.engine.speculative`: batched
    KV-cache decoding, draft_len 0). Prompts are sorted by (length, key) into batches of `batch_size`; batch b is
    decoded with seed `seed + b`; each finished batch is written to `scratch` and reused on a rerun (an interrupted
    regeneration continues where it stopped). Returns (generated ids per prompt, cut after the first stop id, and
    statistics)."""
    n = len(prompts)
    order = sorted(range(n), key=lambda j: (len(prompts[j]), keys[j]))
    batches = [order[i: i + batch_size] for i in range(0, n, batch_size)]
    results: list[list[int] | None] = [None] * n
    todo, resumed, resumed_batches = _resume_batches(batches, keys, scratch, results, log)
    if resumed:
        log.info("regeneration: resumed %d finished batches (%d prompts) from %s; %d prompts left", resumed_batches, resumed,
                 scratch, n - resumed)
    run = _generate_batches(model_dir, prompts, keys, todo, results, resumed=resumed, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_p=top_p, stop_ids=stop_ids, seed=seed, scratch=scratch,
                            log=log, stage=stage)
    stop = set(stop_ids)
    outs = [t or [] for t in results]
    ended = sum(1 for t in outs if t and t[-1] in stop)
    gen_s, new_tokens, generated = run["gen_s"], run["new_tokens"], run["generated"]
    stats = {
        "engine": "runtime.engine.speculative (autoregressive, KV cache, draft_len 0)",
        "prompts": n, "batches": len(batches), "batch_size": batch_size, "resumed_prompts": resumed,
        "resumed_batches": resumed_batches, "generated_prompts": generated, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "top_p": top_p, "stop_ids": list(stop_ids),
        "load_seconds": round(run["load_s"], 3), "seconds": round(gen_s, 3),
        "new_tokens": new_tokens,
        "prompts_per_s": round(generated / gen_s, 4) if gen_s else None,
        "new_tokens_per_s": round(new_tokens / gen_s, 3) if gen_s else None,
        "mean_new_tokens": round(sum(len(t) for t in outs) / n, 2) if n else 0.0,
        "ended_at_stop": ended,
        "hit_max_new_tokens": sum(1 for t in outs if len(t) >= max_new_tokens and not (t and t[-1] in stop)),
        "prefill_padding_fraction": round(run["padded"] / max(1, run["padded"] + sum(len(prompts[j]) for _, idx in todo
                                                                                     for j in idx)), 4),
    }
    return outs, stats


def _resume_batches(batches: list[list[int]], keys: list[str], scratch: Path | None, results: list, log):
    """Fill `results` from the batches a previous run finished (`scratch/batch-<b>.json` with this plan's keys).
    Returns (the batches left as (b, prompt indices), prompts resumed, batches resumed)."""
    todo, resumed, resumed_batches = [], 0, 0
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    for b, idx in enumerate(batches):
        f = scratch / f"batch-{b:05d}.json" if scratch is not None else None
        if f is not None and f.exists():
            try:
                rec = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                rec = None
            if rec and rec.get("keys") == [keys[j] for j in idx] and len(rec.get("tokens", [])) == len(idx):
                for j, t in zip(idx, rec["tokens"]):
                    results[j] = t
                resumed += len(idx)
                resumed_batches += 1
                continue
            log.warning("regeneration: %s does not match this run's batch plan; generating that batch again", f)
        todo.append((b, idx))
    return todo, resumed, resumed_batches


def _generate_batches(model_dir: Path, prompts: list[list[int]], keys: list[str], todo: list, results: list, *,
                      resumed: int, max_new_tokens: int, temperature: float, top_p: float, stop_ids: list[int],
                      seed: int, scratch: Path | None, log, stage: str) -> dict:
    """Decode the batches in `todo` into `results` (the target is loaded at the first batch), each written to
    `scratch` when finished. Returns the counters {"load_s", "gen_s", "new_tokens", "padded", "generated"}."""
    from pipeline.progress import Progress
    from pipeline.store import atomic_write_text, fault_point

    engine, load_s, gen_s, new_tokens, padded, done, generated = None, 0.0, 0.0, 0, 0, 0, 0
    with Progress(log, total=len(prompts), desc="regenerate with target") as bar:
        if resumed:
            bar.update(resumed)
        for b, idx in todo:
            if engine is None:
                from runtime.engine.speculative import SpeculativeEngine, load_target

                t0 = time.perf_counter()
                engine = SpeculativeEngine(load_target(model_dir))
                load_s = time.perf_counter() - t0
                log.info("regeneration: target loaded through runtime.engine.speculative in %.1fs", load_s)
            batch = [prompts[j] for j in idx]
            t0 = time.perf_counter()
            g = engine.generate(batch, max_new_tokens=max_new_tokens, draft_len=0, temperature=temperature, top_p=top_p,
                                eos_token_id=stop_ids, seed=seed + b)
            dt = time.perf_counter() - t0
            for j, t in zip(idx, g.tokens):
                results[j] = t
            if scratch is not None:
                atomic_write_text(scratch / f"batch-{b:05d}.json",
                                  json.dumps({"keys": [keys[j] for j in idx], "tokens": g.tokens, "seconds": round(dt, 3)}))
            gen_s += dt
            generated += len(idx)
            new_tokens += sum(len(t) for t in g.tokens)
            width = max(len(p) for p in batch)
            padded += sum(width - len(p) for p in batch)
            done += 1
            bar.update(len(idx), tok_s=f"{new_tokens / gen_s:.1f}" if gen_s else "-")
            fault_point(stage, f"regenerate-batch-{done}")
    return {"load_s": load_s, "gen_s": gen_s, "new_tokens": new_tokens, "padded": padded, "generated": generated}


def _regenerated_rows(jobs: list[RegenJob], gens: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """prompt ids + generated ids exactly as the target produced them; loss on the generated ids (end of turn included)."""
    return [(j.prompt + g, [0] * len(j.prompt) + [1] * len(g)) for j, g in zip(jobs, gens)]


def _template_consistency(r, tok, jobs: list[RegenJob], gens: list[list[int]], eot_id: int | None) -> dict:
    """For responses that ended at the template's end of turn: does the template, rendering the conversation with
    the decoded response as the assistant turn, give exactly this sample (ids and mask, up to the end of turn)?
    A mismatch is not an error (a model may emit a non-canonical tokenization); it is counted and shown."""
    from runtime.text.chat_template import ChatTemplateError

    checked, same, first = 0, 0, None
    for j, g in zip(jobs, gens):
        if j.context is None or eot_id is None or not g or g[-1] != eot_id:
            continue
        checked += 1
        content = tok.decode(g[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        row = j.prompt + g
        try:
            ids, mask = r.encode([*j.context, {"role": "assistant", "content": content}])
            ok = ids[: len(row)] == row and mask[: len(row)] == [0] * len(j.prompt) + [1] * len(g)
        except ChatTemplateError:
            ok = False
        same += ok
        if not ok and first is None:
            first = j.sample.origin
    return {"checked": checked, "consistent": same, "first_inconsistent": first}


# ---------------------------------------------------------------------------------------------- run


def _check_malformed(bad: Malformed, sec: Config, log, shown: int) -> int:
    for item in bad.items[shown:20]:
        log.warning("malformed: %s", item)
    if len(bad.items) > sec.max_malformed:
        raise StageError(f"data: {len(bad.items)} malformed input lines (limit data.max_malformed={sec.max_malformed}); first: "
                         + "; ".join(bad.items[:5]))
    return len(bad.items)


def run(ctx: StageContext) -> dict:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()

    sec: Config = ctx.section
    target = ctx.input("target")
    model_dir = target_artifact.model_dir(target.path)
    tinfo = target_artifact.read_info(target.path)
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=ctx.config.target.trust_remote_code)
    renderer, tmpl_info = _load_renderer(tok, sec)
    if renderer is not None:
        ctx.log.info("chat template: %s; loss masks by %s; end of turn %s; assistant header %r", tmpl_info["source"],
                     tmpl_info["mask_method"], tmpl_info["end_of_turn"], tmpl_info["generation_prompt"])
    bad = Malformed(sec.max_malformed)

    train, evals = _load_sources(ctx, sec, target.path, bad)
    shown = _check_malformed(bad, sec, ctx.log, 0)
    domain_stats, chosen_keys = _write_eval_prompts(ctx, sec, renderer, tok, evals)
    train, heldout, split_counts = _split(sec, train, chosen_keys)
    if sec.regenerate.enabled:
        train, encoded, heldout, held_enc, regen_stats, shown = _regenerate_splits(
            ctx, sec, renderer, tok, tinfo, tmpl_info, model_dir, train, heldout, bad, shown)
    else:
        train = train[: sec.max_samples]
        regen_stats = None
        no_response = [s for s in train if s.fmt == "prompt" or (s.fmt == "messages" and not _has_assistant(s))]
        if no_response:
            raise StageError(f"data: {len(no_response)} training samples have no response to train on (prompts, or conversations "
                             f"without an assistant turn; e.g. {no_response[0].origin}); enable data.regenerate to let the "
                             "target "
                             "write the responses, or give text/messages samples with responses")
        eos_id = tinfo.get("eos_token_id", tok.eos_token_id)
        encoded = _encode_samples(renderer, tok, train, sec.max_length, eos_id, bad, tmpl_info)
        held_enc = _encode_samples(renderer, tok, heldout, sec.max_length, eos_id, bad, tmpl_info)
        shown = _check_malformed(bad, sec, ctx.log, shown)

    splits = _write_splits(ctx, sec, renderer, _rows(train, encoded, sec.min_length), _rows(heldout, held_enc, sec.min_length))
    stats = {
        "splits": {name: _split_stats(r) for name, r in splits.items()},
        "domains": domain_stats,
        **split_counts, "subsampled_to": sec.max_samples,
        "malformed": len(bad.items), "malformed_examples": bad.items[:20],
        "regenerated": sec.regenerate.enabled, "regeneration": regen_stats, "chat_template": tmpl_info,
    }
    (ctx.out_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    ctx.log.info("train %d samples / %d tokens (%d trained on), heldout %d, calib %d; eval domains: %s",
                 stats["splits"]["train"]["samples"], stats["splits"]["train"]["tokens"], stats["splits"]["train"]["loss_tokens"],
                 stats["splits"]["heldout"]["samples"], stats["splits"]["calib"]["samples"],
                 ", ".join(f"{k} ({v['prompts']})" for k, v in domain_stats.items()))
    return _metrics(stats, tmpl_info)


def _load_sources(ctx: StageContext, sec: Config, target_path: Path, bad: Malformed):
    """The training samples of every source (in order) and the candidate prompts of every eval domain."""
    max_chars = sec.max_length * 4
    train: list[Sample] = []
    for i, src in enumerate(sec.sources):
        domain = src.domain or ("code" if src.kind == "bootstrap" else f"source{i}")
        if src.kind == "bootstrap":
            got = _read_bootstrap(target_path, src, domain, "train", max_chars)
        elif src.kind == "jsonl":
            got = _read_jsonl(src, domain, bad)
        else:
            got = _read_hf(src, domain, bad)
        ctx.log.info("source %d (%s): %d samples", i, src.kind, len(got))
        train += got
    evals: dict[str, list[Sample]] = {}
    for name, src in sec.eval_domains.items():
        if src.kind == "bootstrap":
            evals[name] = _read_bootstrap(target_path, src, name, "heldout", min(max_chars, sec.max_prompt_tokens * 4))
        elif src.kind == "jsonl":
            evals[name] = _read_jsonl(src, name, bad)
        else:
            evals[name] = _read_hf(src, name, bad)
        ctx.log.info("eval domain %s (%s): %d candidate prompts", name, src.kind, len(evals[name]))
    return train, evals


def _write_eval_prompts(ctx: StageContext, sec: Config, renderer, tok, evals: dict[str, list[Sample]]):
    """eval/<domain>.jsonl (rendered, cut to the last max_prompt_tokens, at least 4 tokens each). Returns the
    per-domain stats and the keys of every sample looked at, which never train the draft."""
    (ctx.out_dir / data_artifact.EVAL_DIR).mkdir()
    domain_stats = {}
    chosen_keys: set[str] = set()
    for name, samples in evals.items():
        samples = sorted({s.key: s for s in samples}.values(), key=lambda s: _bucket(s.key, sec.seed))
        prompts: list[data_artifact.EvalPrompt] = []
        for s in samples:
            chosen_keys.add(s.key)
            prompt = _render_prompt(renderer, tok, s)
            ids = tok(prompt, add_special_tokens=False)["input_ids"][-sec.max_prompt_tokens:]
            if len(ids) < 4:
                continue
            ref = s.content[-1]["content"] if s.fmt == "messages" and s.content[-1]["role"] == "assistant" else None
            prompts.append(data_artifact.EvalPrompt(id=f"{name}-{len(prompts)}", prompt=tok.decode(ids), prompt_ids=ids,
                                                    reference=ref))
            if len(prompts) >= sec.eval_prompts:
                break
        if not prompts:
            raise StageError(f"data.eval_domains.{name}: no usable prompts (need at least 4 tokens each)")
        data_artifact.write_eval(ctx.out_dir, name, prompts)
        domain_stats[name] = {"prompts": len(prompts),
                              "mean_prompt_tokens": round(sum(len(p.prompt_ids) for p in prompts) / len(prompts), 1)}
    return domain_stats, chosen_keys


def _split(sec: Config, train: list[Sample], chosen_keys: set[str]):
    """Dedup, drop what the eval prompts came from, and split into train / held-out by a seeded hash."""
    n_raw, n_dup = len(train), 0
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
    train = [s for s in train if _bucket("heldout:" + s.key, sec.seed) >= sec.eval_fraction]
    if not train:
        raise StageError("data: no training samples left after dedup and split; add sources or lower data.eval_fraction")
    return train, heldout, {"raw_samples": n_raw, "dedup_removed": n_dup, "eval_overlap_removed": len(overlap)}


def _regenerate_splits(ctx: StageContext, sec: Config, renderer, tok, tinfo: dict, tmpl_info: dict, model_dir: Path,
                       train: list[Sample], heldout: list[Sample], bad: Malformed, shown: int):
    """The target writes the responses (data.regenerate): (train, its rows, heldout, its rows, stats, shown)."""
    rc = sec.regenerate
    budget = sec.max_length - rc.max_new_tokens
    train_jobs, skip_t = _select_jobs(renderer, tok, train, sec.max_samples, budget, sec.max_length, bad, tmpl_info)
    n_held = math.ceil(len(train_jobs) * sec.eval_fraction / (1 - sec.eval_fraction)) if sec.eval_fraction else 0
    held_jobs, skip_h = _select_jobs(renderer, tok, heldout, n_held, budget, sec.max_length, bad, tmpl_info)
    shown = _check_malformed(bad, sec, ctx.log, shown)
    if not train_jobs:
        raise StageError(f"data: no training prompt fits data.max_length - data.regenerate.max_new_tokens = {budget} tokens "
                         f"({skip_t} were longer); raise data.max_length or lower data.regenerate.max_new_tokens")
    if skip_t or skip_h:
        ctx.log.info("regeneration: %d prompts longer than %d tokens (data.max_length %d - max_new_tokens %d) skipped",
                     skip_t + skip_h, budget, sec.max_length, rc.max_new_tokens)
    stop_ids = target_artifact.stop_ids(tinfo)
    if renderer is not None and tmpl_info["end_of_turn_id"] is not None and tmpl_info["end_of_turn_id"] not in stop_ids:
        stop_ids.append(tmpl_info["end_of_turn_id"])      # data.chat_template's end of turn
    greedy = rc.mode == "greedy"
    ctx.log.info("regeneration: %d train + %d held-out prompts, batches of %d sorted by length, up to %d new tokens, %s, "
                 "stop ids %s", len(train_jobs), len(held_jobs), rc.batch_size, rc.max_new_tokens,
                 "greedy" if greedy else f"sampling T={rc.temperature} top_p={rc.top_p} seed={sec.seed}",
                 [f"{i} ({tok.convert_ids_to_tokens(i)})" for i in stop_ids])
    jobs = train_jobs + held_jobs
    gens, rs = regenerate(
        model_dir, [j.prompt for j in jobs], [j.sample.key for j in jobs], batch_size=rc.batch_size,
        max_new_tokens=rc.max_new_tokens, temperature=0.0 if greedy else rc.temperature, top_p=1.0 if greedy else rc.top_p,
        stop_ids=stop_ids, seed=sec.seed, scratch=ctx.scratch_dir / "regenerate", log=ctx.log)
    rs.update(skipped_long_prompts=skip_t + skip_h, prompt_budget=budget, mode=rc.mode)
    rs["template"] = (_template_consistency(renderer, tok, jobs, gens, tmpl_info.get("end_of_turn_id"))
                      if renderer is not None else None)
    ctx.log.info("regeneration: %d prompts, %d resumed from scratch, %d generated in %.1fs: %s prompts/s, %s new tokens/s; "
                 "mean %.1f new tokens per response; %d ended at a stop id, %d hit max_new_tokens=%d; prefill padding %.1f%%",
                 rs["prompts"], rs["resumed_prompts"], rs["generated_prompts"], rs["seconds"], rs["prompts_per_s"],
                 rs["new_tokens_per_s"], rs["mean_new_tokens"], rs["ended_at_stop"], rs["hit_max_new_tokens"],
                 rc.max_new_tokens, 100 * rs["prefill_padding_fraction"])
    if rs["template"] and rs["template"]["checked"]:
        t = rs["template"]
        (ctx.log.info if t["consistent"] == t["checked"] else ctx.log.warning)(
            "regeneration: %d of %d responses that ended at the end of turn are exactly what the chat template renders for "
            "that assistant turn%s", t["consistent"], t["checked"],
            "" if t["consistent"] == t["checked"] else
            f" (first that is not: {t['first_inconsistent']}; the sample keeps the target's own tokens)")
    rows_all = _regenerated_rows(jobs, gens)
    return ([j.sample for j in train_jobs], rows_all[: len(train_jobs)], [j.sample for j in held_jobs],
            rows_all[len(train_jobs):], rs, shown)


def _rows(samples: list[Sample], enc: list, min_length: int) -> dict:
    """Parquet columns of the encoded samples that meet the data contract's row rule (>= min_length tokens, at
    least one trained on)."""
    keep = [(s, e) for s, e in zip(samples, enc) if e and len(e[0]) >= min_length and sum(e[1]) > 0]
    return {"input_ids": [e[0] for _, e in keep], "loss_mask": [e[1] for _, e in keep],
            "domain": [s.domain for s, _ in keep], "source": [s.origin for s, _ in keep]}


def _write_splits(ctx: StageContext, sec: Config, renderer, train_rows: dict, held_rows: dict) -> dict[str, dict]:
    from datasets import Dataset

    if not train_rows["input_ids"]:
        raise StageError(f"data: every training sample is shorter than data.min_length={sec.min_length} tokens or has no "
                         "token to train on (a conversation whose assistant turns lie beyond data.max_length)")
    splits = {"train": train_rows, "heldout": held_rows,
              "calib": {k: v[: sec.calib_samples] for k, v in train_rows.items()}}
    for name, r in splits.items():
        Dataset.from_dict(r).to_parquet(str(data_artifact.split_path(ctx.out_dir, name)))
    if renderer is not None:
        (ctx.out_dir / data_artifact.CHAT_TEMPLATE).write_text(renderer.template)
    return splits


def _split_stats(r: dict) -> dict:
    lens = [len(x) for x in r["input_ids"]]
    return {"samples": len(lens), "tokens": sum(lens), "loss_tokens": sum(sum(m) for m in r["loss_mask"]),
            "min_len": min(lens, default=0), "mean_len": round(sum(lens) / max(1, len(lens)), 1), "max_len": max(lens, default=0)}


def _metrics(stats: dict, tmpl_info: dict) -> dict:
    sp, regen = stats["splits"], stats["regeneration"]
    metrics = {
        "train_samples": sp["train"]["samples"], "train_tokens": sp["train"]["tokens"],
        "train_loss_tokens": sp["train"]["loss_tokens"], "heldout_samples": sp["heldout"]["samples"],
        "calib_samples": sp["calib"]["samples"], "malformed": stats["malformed"],
        "eval_domains": {k: v["prompts"] for k, v in stats["domains"].items()}, "regenerated": stats["regenerated"],
        "mask_method": tmpl_info.get("mask_method"),
    }
    if regen:
        metrics["regeneration"] = {k: regen[k] for k in ("prompts", "resumed_prompts", "seconds", "prompts_per_s",
                                                         "new_tokens_per_s", "mean_new_tokens", "ended_at_stop",
                                                         "hit_max_new_tokens")}
    return metrics


def report(artifact) -> str:
    from pipeline.report import esc, table

    s = artifact.read_json("stats.json")
    rows = [[k, v["samples"], v["tokens"], v["loss_tokens"], v["mean_len"], v["max_len"]] for k, v in s["splits"].items()]
    out = table(rows, ["split", "samples", "tokens", "loss tokens", "mean length", "max length"])
    out += table([[k, v["prompts"], v["mean_prompt_tokens"]] for k, v in s["domains"].items()], ["eval domain", "prompts",
                                                                                                 "mean prompt tokens"])
    t = s.get("chat_template") or {}
    if t.get("source"):
        out += table([["template", t["source"]], ["loss masks", t["mask_method"]], ["end of turn", t["end_of_turn"]],
                      ["assistant header", repr(t["generation_prompt"])]], ["chat template", ""])
    g = s.get("regeneration")
    if g:
        rows = [["prompts (resumed)", f"{g['prompts']} ({g['resumed_prompts']})"], ["seconds", g["seconds"]],
                ["prompts/s", g["prompts_per_s"]], ["new tokens/s", g["new_tokens_per_s"]],
                ["mean new tokens", g["mean_new_tokens"]], ["ended at a stop id", g["ended_at_stop"]],
                ["hit max_new_tokens", f"{g['hit_max_new_tokens']} (max {g['max_new_tokens']})"],
                ["long prompts skipped", g.get("skipped_long_prompts")]]
        if g.get("template"):
            rows.append(["equal to the template's rendering", f"{g['template']['consistent']} of {g['template']['checked']}"])
        out += table(rows, ["regeneration", ""])
    if s.get("malformed"):
        out += "<p>malformed lines: " + esc(", ".join(s["malformed_examples"][:5])) + "</p>"
    return out
