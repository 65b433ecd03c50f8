"""validate's record: acceptance.json as frozen types, with the nested parts its consumers read typed (the
measurement of one pair in one domain, a domain's arms, the gates and their rows). `to_json` writes the document the
stage commits and `from_json` reads it back, so its schema is spelled here once (docs/architecture.md "Artifact
contracts"); the reader that checks the file and names the stage to rerun is pipeline/artifacts/validate.py.

Draft-length names: `measured_draft_len` is the draft length validate decoded at (acceptance.json's
`measured_draft_len`; an acceptance.json written before that name says `max_draft_len`, read the same), never the
deployed one (tuning.json / deployment.json `max_draft_len`, runtime/records_deploy.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

PAIRS = ("fp8", "bf16")         # the deployed (quantized) pair and the unquantized one


@dataclass(frozen=True)
class PairAcceptance:
    """One pair's measurement in one domain (or overall): runtime/engine/stats.py's `RunStats.as_dict` shape, or the
    TensorRT-LLM arm's (no per-position curve)."""

    acceptance_length: float | None = None      # 1 + accepted draft tokens per verification step
    per_position: list | None = None      # conditional acceptance at positions 1..K (None where the engine has none)
    prompts: int | None = None
    figures: dict = field(default_factory=dict)   # the engine's other figures: drafted, accepted, step times, ...

    def to_json(self) -> dict:
        return {"acceptance_length": self.acceptance_length, "per_position": self.per_position,
                **({"prompts": self.prompts} if self.prompts is not None else {}), **self.figures}

    @classmethod
    def from_json(cls, doc: dict) -> PairAcceptance:
        rest = {k: v for k, v in doc.items() if k not in ("acceptance_length", "per_position", "prompts")}
        al = doc.get("acceptance_length")
        return cls(acceptance_length=float(al) if al is not None else None, per_position=doc.get("per_position"),
                   prompts=doc.get("prompts"), figures=rest)


@dataclass(frozen=True)
class DomainAcceptance:
    """A domain's entry (or `overall`): the deployed pair (`fp8`), the unquantized one (`bf16`, when measured), their
    ratio (`retention`), and the other arms validate ran there, by name (`fp8_other_norm`, `fp8_other_draft_kv`,
    `ngram`, `hybrid`), kept as the arms wrote them."""

    fp8: PairAcceptance | None = None
    bf16: PairAcceptance | None = None
    retention: float | None = None
    arms: dict = field(default_factory=dict)

    def pair(self, label: str) -> PairAcceptance | None:
        return self.fp8 if label == "fp8" else self.bf16 if label == "bf16" else None

    def entry(self, name: str) -> dict:
        """The entry `name` (a pair or an arm) as acceptance.json holds it; {} where it was not measured."""
        p = self.pair(name)
        return p.to_json() if p is not None else dict(self.arms.get(name) or {})

    def to_json(self) -> dict:
        out: dict = {p: getattr(self, p).to_json() for p in PAIRS if getattr(self, p) is not None}
        if self.retention is not None:
            out["retention"] = self.retention
        return {**out, **self.arms}

    @classmethod
    def from_json(cls, doc: dict | None) -> DomainAcceptance:
        doc = doc or {}
        pairs = {p: PairAcceptance.from_json(doc[p]) for p in PAIRS if isinstance(doc.get(p), dict)}
        return cls(**pairs, retention=doc.get("retention"),
                   arms={k: v for k, v in doc.items() if k not in (*PAIRS, "retention")})


@dataclass(frozen=True)
class GateRow:
    """One gate: what was measured against what was required (a number, or words for the lossless parts)."""

    domain: str                           # a domain, `overall`, `unquantized`, or an engine's row
    metric: str
    measured: float | int | str | None
    required: float | int | str | None
    passed: bool
    extra: dict = field(default_factory=dict)    # an engine's row may say more (vLLM's arm)

    def to_json(self) -> dict:
        return {"domain": self.domain, "metric": self.metric, "measured": self.measured, "required": self.required,
                "passed": self.passed, **self.extra}

    @classmethod
    def from_json(cls, doc: dict) -> GateRow:
        known = ("domain", "metric", "measured", "required", "passed")
        return cls(domain=str(doc["domain"]), metric=str(doc["metric"]), measured=doc.get("measured"),
                   required=doc.get("required"), passed=doc.get("passed") is True,
                   extra={k: v for k, v in doc.items() if k not in known})

    def failure(self) -> str:
        """The row in words (`export` refuses with the failed ones)."""
        return f"{self.domain} {self.metric}: measured {self.measured}, required {self.required}"


@dataclass(frozen=True)
class Gates:
    """acceptance.json's `gates`: passed only when every row passed (and there is no `detail`, the form of an old
    acceptance.json whose gates were not a mapping)."""

    passed: bool
    rows: tuple[GateRow, ...] = ()
    detail: object = None

    @classmethod
    def of(cls, rows: list[GateRow]) -> Gates:
        return cls(passed=all(r.passed for r in rows), rows=tuple(rows))

    def to_json(self) -> dict:
        out: dict = {"passed": self.passed, "rows": [r.to_json() for r in self.rows]}
        return {**out, "detail": self.detail} if self.detail is not None else out

    @classmethod
    def from_json(cls, doc) -> Gates:
        if not isinstance(doc, dict):
            return cls(passed=False, detail=doc)
        rest = {k: v for k, v in doc.items() if k not in ("passed", "rows")}     # an older shape: kept as the detail
        return cls(passed=doc.get("passed") is True, rows=tuple(GateRow.from_json(r) for r in doc.get("rows") or []),
                   detail=doc.get("detail", rest or None))


@dataclass(frozen=True)
class AcceptanceInfo:
    """acceptance.json. Consumers read different parts (tune the per-position curves, export the gates and the
    speculation profile, monitor the baseline, build the n-gram comparison)."""

    measured_draft_len: int               # the draft length validate decoded at (not the deployed one)
    domains: dict[str, DomainAcceptance]
    overall: DomainAcceptance
    gates: Gates
    pairs: dict                           # {"fp8": {"target_dir", "draft_dir"}, "bf16": ...} relative to the artifacts
    max_new_tokens: int = 48              # 48 where acceptance.json does not say
    temperature: float = 0.0              # 0.0 (greedy) where acceptance.json does not say
    batch_size: int | None = None
    runtime: str | None = None            # which runtime measured (reference | tensorrt_llm)
    runtime_reason: str | None = None
    requested_max_draft_len: int | None = None   # the config's validate.max_draft_len before the trained cap
    eos_token_ids: list[int] = field(default_factory=list)   # the stop ids validate decoded with (target.json's)
    same_pair: bool | None = None         # quantize deployed the unquantized pair
    draft: dict = field(default_factory=dict)      # what validate found in the draft (first_layer_norm, ...)
    draft_kv_cache: dict | None = None    # the deployed draft's KV cache dtype and why
    lossless: dict | None = None          # exact / invariant / statistical parts and `passed`
    tokens_per_s: dict | None = None
    step_ms: dict | None = None
    fp8_info: dict | None = None          # what the FP8 loader applied (reference runtime)
    trtllm_version: str | None = None     # the TensorRT-LLM runtime's version, when it measured
    engines: dict = field(default_factory=dict)    # engine name -> its own measurement (vLLM's counters)
    ngram: dict | None = None             # the n-gram comparison when validate.ngram ran
    hybrid: dict | None = None            # the trained draft + SA enhancer (validate.hybrid): thresholds, comparison
    raw: dict = field(default_factory=dict, compare=False, repr=False)   # the document as read (reports render it)

    @property
    def passed(self) -> bool:
        return self.gates.passed

    def to_json(self) -> dict:
        return {"runtime": self.runtime, "runtime_reason": self.runtime_reason,
                "measured_draft_len": self.measured_draft_len, "requested_max_draft_len": self.requested_max_draft_len,
                "temperature": self.temperature, "max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size,
                "eos_token_ids": list(self.eos_token_ids), "pairs": self.pairs, "same_pair": self.same_pair,
                "draft": self.draft, "draft_kv_cache": self.draft_kv_cache,
                "domains": {d: v.to_json() for d, v in self.domains.items()}, "overall": self.overall.to_json(),
                "lossless": self.lossless, "tokens_per_s": self.tokens_per_s, "step_ms": self.step_ms,
                "fp8_info": self.fp8_info, "trtllm_version": self.trtllm_version, "engines": self.engines,
                "ngram": self.ngram, "hybrid": self.hybrid, "gates": self.gates.to_json()}

    @classmethod
    def from_json(cls, doc: dict) -> AcceptanceInfo:
        old = "measured_draft_len" not in doc and "max_draft_len" in doc          # written before the rename
        k = doc["max_draft_len"] if old else doc["measured_draft_len"]
        domains = {d: DomainAcceptance.from_json(v) for d, v in (doc["domains"] or {}).items()}
        return cls(measured_draft_len=int(k), domains=domains,
                   overall=DomainAcceptance.from_json(doc["overall"]), gates=Gates.from_json(doc["gates"]),
                   pairs=doc.get("pairs") or {}, max_new_tokens=int(doc.get("max_new_tokens") or 48),
                   temperature=float(doc.get("temperature") or 0.0), batch_size=doc.get("batch_size"),
                   runtime=doc.get("runtime"), runtime_reason=doc.get("runtime_reason"),
                   requested_max_draft_len=doc.get("requested_max_draft_len"),
                   eos_token_ids=list(doc.get("eos_token_ids") or []), same_pair=doc.get("same_pair"),
                   draft=doc.get("draft") or {}, draft_kv_cache=doc.get("draft_kv_cache"), lossless=doc.get("lossless"),
                   tokens_per_s=doc.get("tokens_per_s"), step_ms=doc.get("step_ms"), fp8_info=doc.get("fp8_info"),
                   trtllm_version=doc.get("trtllm_version"), engines=doc.get("engines") or {}, ngram=doc.get("ngram"),
                   hybrid=doc.get("hybrid"), raw=doc)
