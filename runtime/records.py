"""The artifact records: what each stage's JSON contract holds, as frozen types, one per document
(docs/architecture.md "Artifact contracts"). They live here, below pipeline/ and stages/, so that runtime/ code takes
the record a stage read (`tuning.deployment(target, draft, ...)`, `build_profile(acceptance, ...)`) instead of the
document as a dict, and every default is decided once, in `from_json`.

Each record writes itself (`to_json`, the document its stage commits) and reads itself back (`from_json`), so a
schema is spelled once; the records of validate and of the deployment stages are runtime/records_validate.py and
runtime/records_deploy.py. The readers that open the files, check the fields the contract requires and raise
StageError naming the file and the stage to rerun are pipeline/artifacts/<stage>.py; `raw` keeps the document as read
for the report, which renders it (not part of the record's value: `==` ignores it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

# ------------------------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class EvalPrompt:
    """One line of the data artifact's eval/<domain>.jsonl."""

    id: str
    prompt: str                 # already rendered with the chat template when the source was a conversation
    prompt_ids: list[int]
    reference: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> EvalPrompt:
        return cls(id=str(doc["id"]), prompt=doc["prompt"], prompt_ids=list(doc["prompt_ids"]), reference=doc.get("reference"))


# ------------------------------------------------------------------------------------------------ target


def stop_ids(info: dict) -> list[int]:
    """Every id that ends a generation: `eos_token_ids` (an instruct model's end of turn first, then its eos), else
    `eos_token_id` (one id, or a list as some HF configs write it); each id once, sorted (a set of stop ids)."""
    ids = info.get("eos_token_ids") or info.get("eos_token_id")
    if ids is None:
        return []
    ids = [ids] if isinstance(ids, int) else list(ids)
    return sorted({int(i) for i in ids if i is not None})


@dataclass(frozen=True)
class TargetInfo:
    """target.json: the model's shapes (what the cost model prices), its stop ids and where they came from."""

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None   # = num_attention_heads where target.json does not say
    intermediate_size: int | None = None
    head_dim: int | None = None           # None: hidden_size // num_attention_heads
    dtype: str = "bfloat16"               # the checkpoint's torch dtype; bfloat16 where target.json does not say
    eos_token_ids: tuple[int, ...] = ()   # every id that ends a generation, the end of turn first (`stop_ids`)
    max_position_embeddings: int | None = None
    mask_token_id: int | None = None
    mask_token: str | None = None
    source: str | None = None             # bootstrap:tiny, a local path or a hub id
    model_type: str | None = None
    tokenizer_size: int | None = None
    end_of_turn: dict | None = None       # {"id", "token"} of the chat template's end of turn, or None
    eos_sources: dict = field(default_factory=dict)     # the ids each source declared
    eos_rejected: list = field(default_factory=list)    # {"id", "token", "source", "why"}
    pad_token_id: int | None = None
    has_chat_template: bool | None = None
    num_parameters: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        """The first stop id (target.json's `eos_token_id`, kept for older readers); None when there is none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, each once, sorted (a set of stop ids)."""
        return tuple(sorted(set(self.eos_token_ids)))

    def to_json(self) -> dict:
        return {"source": self.source, "architecture": self.architecture, "model_type": self.model_type,
                "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
                "tokenizer_size": self.tokenizer_size, "mask_token": self.mask_token,
                "mask_token_id": self.mask_token_id, "eos_token_id": self.eos_token_id,
                "eos_token_ids": list(self.eos_token_ids), "end_of_turn": self.end_of_turn,
                "eos_sources": self.eos_sources, "eos_rejected": self.eos_rejected, "pad_token_id": self.pad_token_id,
                "has_chat_template": self.has_chat_template, "num_parameters": self.num_parameters, "dtype": self.dtype}

    @classmethod
    def from_json(cls, doc: dict) -> TargetInfo:
        heads = doc.get("num_attention_heads")
        ids = doc.get("eos_token_ids") or doc.get("eos_token_id")       # an older target.json: eos_token_id alone
        ids = [] if ids is None else [ids] if isinstance(ids, int) else [int(i) for i in ids if i is not None]
        return cls(architecture=str(doc["architecture"]), num_layers=int(doc["num_layers"]),
                   hidden_size=int(doc["hidden_size"]), vocab_size=int(doc["vocab_size"]),
                   num_attention_heads=heads, num_key_value_heads=doc.get("num_key_value_heads") or heads,
                   intermediate_size=doc.get("intermediate_size"), head_dim=doc.get("head_dim"),
                   dtype=doc.get("dtype") or "bfloat16", eos_token_ids=tuple(ids),
                   max_position_embeddings=doc.get("max_position_embeddings"), mask_token_id=doc.get("mask_token_id"),
                   mask_token=doc.get("mask_token"), source=doc.get("source"), model_type=doc.get("model_type"),
                   tokenizer_size=doc.get("tokenizer_size"), end_of_turn=doc.get("end_of_turn"),
                   eos_sources=doc.get("eos_sources") or {}, eos_rejected=list(doc.get("eos_rejected") or []),
                   pad_token_id=doc.get("pad_token_id"), has_chat_template=doc.get("has_chat_template"),
                   num_parameters=doc.get("num_parameters"), raw=doc)


# ------------------------------------------------------------------------------------------------ train_draft


# draft.json's capture-layer field per algorithm, as train_draft writes it (the algorithm's `capture_field`,
# runtime/algorithms/; not imported here so that every stage reading a record does not reach every algorithm)
_DRAFT_JSON_CAPTURE_FIELD = {"eagle3": "aux_layer_ids", "dflash": "target_layer_ids"}


@dataclass(frozen=True)
class DraftInfo:
    """draft.json. `algorithm` is required (no reader guesses it)."""

    algorithm: str                        # eagle3 | dflash, lower case
    num_layers: int | None = None
    block_size: int | None = None         # DFlash's block; None for EAGLE-3
    capture_layers: list[int] | None = None   # the target layers training captured (EAGLE-3 aux_layer_ids, DFlash
                                          # target_layer_ids); None when draft.json does not say
    capture_field: str | None = None      # draft.json's field holding them: the algorithm's `capture_field`
                                          # (runtime/algorithms/, given by the writer), or the one a file holds
    draft_vocab_size: int | None = None   # EAGLE-3's reduced vocabulary (d2t); None for DFlash or when not said
    vocab_size: int | None = None         # the target's vocabulary, as draft.json records it
    max_position_embeddings: int | None = None
    has_d2t: bool | None = None
    mask_token_id: int | None = None
    trained_draft_len: int | None = None  # what training unrolled (EAGLE-3 ttt steps, DFlash block_size - 1)
    objective: str | None = None          # EAGLE-3 kl | lk_hybrid | nla, DFlash dpace | decay
    rope_scaling: dict | None = None
    serving_context: dict | None = None
    mode: str | None = None               # online | offline training
    acceptance_length: float | None = None   # training's held-out estimate, at `eval_draft_len`
    eval_draft_len: int | None = None
    acceptance_estimator: str | None = None  # runtime | modelopt | None
    exported_step: int | None = None
    export_reason: str | None = None
    draft_vocab: dict | None = None       # the reduced vocabulary's statistics
    budget: dict | None = None            # train_draft.max_minutes: the steps resolved on this machine (training/budget.py)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict:
        layers = {self.capture_field: self.capture_layers} if self.capture_field else {}
        return {"algorithm": self.algorithm, "num_layers": self.num_layers, **layers,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size, "has_d2t": self.has_d2t,
                "block_size": self.block_size, "mask_token_id": self.mask_token_id,
                "trained_draft_len": self.trained_draft_len, "max_position_embeddings": self.max_position_embeddings,
                "objective": self.objective, "rope_scaling": self.rope_scaling, "serving_context": self.serving_context,
                "mode": self.mode, "acceptance_length": self.acceptance_length, "eval_draft_len": self.eval_draft_len,
                "acceptance_estimator": self.acceptance_estimator, "exported_step": self.exported_step,
                "export_reason": self.export_reason, "draft_vocab": self.draft_vocab, "budget": self.budget}

    @classmethod
    def from_json(cls, doc: dict) -> DraftInfo:
        algo = str(doc["algorithm"]).lower()
        named = _DRAFT_JSON_CAPTURE_FIELD.get(algo)   # the field its algorithm writes, else whichever the file holds
        capture_field = named if named in doc else next((k for k in _DRAFT_JSON_CAPTURE_FIELD.values() if k in doc), None)
        layers = doc.get(capture_field) if capture_field else None
        return cls(algorithm=algo, num_layers=doc.get("num_layers"), block_size=doc.get("block_size"),
                   capture_layers=list(layers) if layers is not None else None, capture_field=capture_field,
                   draft_vocab_size=doc.get("draft_vocab_size"), vocab_size=doc.get("vocab_size"),
                   max_position_embeddings=doc.get("max_position_embeddings"), has_d2t=doc.get("has_d2t"),
                   mask_token_id=doc.get("mask_token_id"), trained_draft_len=doc.get("trained_draft_len"),
                   objective=doc.get("objective"), rope_scaling=doc.get("rope_scaling"),
                   serving_context=doc.get("serving_context"), mode=doc.get("mode"),
                   acceptance_length=doc.get("acceptance_length"), eval_draft_len=doc.get("eval_draft_len"),
                   acceptance_estimator=doc.get("acceptance_estimator"), exported_step=doc.get("exported_step"),
                   export_reason=doc.get("export_reason"), draft_vocab=doc.get("draft_vocab"),
                   budget=doc.get("budget"), raw=doc)


@dataclass(frozen=True)
class DraftConfig:
    """A draft checkpoint's config.json (train_draft's `draft/`, or quantize's `draft_fp8/`): the fields readers use;
    `raw` is the HF config itself, which the shape and rope checks in runtime/ read as the upstream format it is."""

    num_hidden_layers: int | None
    max_position_embeddings: int | None
    raw: dict

    @classmethod
    def from_json(cls, doc: dict) -> DraftConfig:
        return cls(num_hidden_layers=doc.get("num_hidden_layers"),
                   max_position_embeddings=doc.get("max_position_embeddings"), raw=doc)


# ------------------------------------------------------------------------------------------------ quantize


@dataclass(frozen=True)
class QuantizeInfo:
    """quantize.json. `target_dir` and `draft_dir` are relative to the workdir's artifacts directory."""

    format: str                   # the shipped recipe: fp8 | fp8_per_channel_per_token
    quant_algo: str | None        # hf_quant_config.json's: FP8 | FP8_PER_CHANNEL_PER_TOKEN
    kv_cache: str                 # fp8 | none
    target_rel: str               # relative to the artifacts directory (quantize.json `target_dir`)
    draft_rel: str                # (quantize.json `draft_dir`)
    draft_format: str             # fp8 | bf16: the precision of the draft to deploy
    exclude_modules: list | None = None   # hf_quant_config.json's: everything kept in high precision
    auto_excluded: list = field(default_factory=list)   # layers the search kept in BF16
    recipes_tried: list[str] = field(default_factory=list)
    calib_samples: int | None = None
    calib_seq_len: int | None = None
    checks: list = field(default_factory=list)   # the named export checks of the shipped checkpoint
    raw: dict = field(default_factory=dict, compare=False, repr=False)

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

    def to_json(self) -> dict:
        return {"format": self.format, "quant_algo": self.quant_algo, "kv_cache": self.kv_cache,
                "target_dir": self.target_rel, "draft_dir": self.draft_rel, "draft_format": self.draft_format,
                "exclude_modules": self.exclude_modules, "auto_excluded": self.auto_excluded,
                "recipes_tried": self.recipes_tried, "calib_samples": self.calib_samples,
                "calib_seq_len": self.calib_seq_len, "checks": self.checks}

    @classmethod
    def from_json(cls, q: dict) -> QuantizeInfo:
        return cls(format=q["format"], quant_algo=q.get("quant_algo"), kv_cache=q["kv_cache"],
                   target_rel=q["target_dir"], draft_rel=q["draft_dir"], draft_format=q["draft_format"],
                   exclude_modules=q.get("exclude_modules"), auto_excluded=list(q.get("auto_excluded") or []),
                   recipes_tried=list(q.get("recipes_tried") or []), calib_samples=q.get("calib_samples"),
                   calib_seq_len=q.get("calib_seq_len"), checks=list(q.get("checks") or []), raw=q)
