"""The artifact records: what each stage's JSON contract holds, as frozen types, one per document
(docs/architecture.md "Artifact contracts"). They live here, below pipeline/ and stages/, so that runtime/ code takes
the record a stage read (`tuning.deployment(target, draft, ...)`, `build_profile(acceptance, ...)`) instead of the
document as a dict, and every default is decided once, in `from_json`.

The readers that open the files, check the fields the contract requires and raise StageError naming the file and the
stage to rerun are pipeline/artifacts/<stage>.py; `raw` keeps the whole document for the report, which renders it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ------------------------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class EvalPrompt:
    """One line of the data artifact's eval/<domain>.jsonl."""

    id: str
    prompt: str                 # already rendered with the chat template when the source was a conversation
    prompt_ids: list[int]
    reference: str | None = None


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
    """target.json: the model's shapes (what the cost model prices) and its stop ids."""

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int | None
    num_key_value_heads: int | None       # = num_attention_heads where target.json does not say
    intermediate_size: int | None
    head_dim: int | None                  # None: hidden_size // num_attention_heads
    dtype: str                            # the checkpoint's torch dtype; bfloat16 where target.json does not say
    eos_token_id: int | None              # target.json's eos_token_id (the first of a list); None when absent
    stop_ids: tuple[int, ...]             # every id that ends a generation (`stop_ids`)
    max_position_embeddings: int | None
    mask_token_id: int | None
    raw: dict

    @classmethod
    def from_json(cls, doc: dict) -> TargetInfo:
        eos = doc.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos          # some HF configs write a list
        heads = doc.get("num_attention_heads")
        return cls(architecture=str(doc["architecture"]), num_layers=int(doc["num_layers"]),
                   hidden_size=int(doc["hidden_size"]), vocab_size=int(doc["vocab_size"]),
                   num_attention_heads=heads, num_key_value_heads=doc.get("num_key_value_heads") or heads,
                   intermediate_size=doc.get("intermediate_size"), head_dim=doc.get("head_dim"),
                   dtype=doc.get("dtype") or "bfloat16", eos_token_id=eos if isinstance(eos, int) else None,
                   stop_ids=tuple(stop_ids(doc)), max_position_embeddings=doc.get("max_position_embeddings"),
                   mask_token_id=doc.get("mask_token_id"), raw=doc)


# ------------------------------------------------------------------------------------------------ train_draft


@dataclass(frozen=True)
class DraftInfo:
    """draft.json. `algorithm` is required (no reader guesses it)."""

    algorithm: str                        # eagle3 | dflash, lower case
    num_layers: int | None
    block_size: int | None                # DFlash's block; None for EAGLE-3
    capture_layers: list[int] | None      # the target layers training captured (EAGLE-3 aux_layer_ids, DFlash
                                          # target_layer_ids); None when draft.json does not say
    draft_vocab_size: int | None          # EAGLE-3's reduced vocabulary (d2t); None for DFlash or when not said
    vocab_size: int | None                # the target's vocabulary, as draft.json records it
    max_position_embeddings: int | None
    raw: dict

    @classmethod
    def from_json(cls, doc: dict) -> DraftInfo:
        algo = str(doc["algorithm"]).lower()
        layers = doc.get("aux_layer_ids", doc.get("target_layer_ids"))   # draft.json holds the one its algorithm names
        return cls(algorithm=algo, num_layers=doc.get("num_layers"), block_size=doc.get("block_size"),
                   capture_layers=list(layers) if layers is not None else None,
                   draft_vocab_size=doc.get("draft_vocab_size"), vocab_size=doc.get("vocab_size"),
                   max_position_embeddings=doc.get("max_position_embeddings"), raw=doc)


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

    @classmethod
    def from_json(cls, q: dict) -> QuantizeInfo:
        return cls(format=q["format"], quant_algo=q.get("quant_algo"), kv_cache=q["kv_cache"],
                   target_rel=q["target_dir"], draft_rel=q["draft_dir"], draft_format=q["draft_format"], raw=q)


# ------------------------------------------------------------------------------------------------ validate


@dataclass(frozen=True)
class AcceptanceInfo:
    """acceptance.json. Consumers read different parts (tune the per-position curves, export the gates and the
    speculation profile, monitor the baseline, build the n-gram comparison); the per-domain statistics stay the
    nested entries validate wrote (runtime/engine/stats.py's shape)."""

    max_draft_len: int                    # the draft length validate measured at
    domains: dict                         # domain -> {"fp8": {...}, "bf16": {...}, "retention": ...}
    overall: dict
    gates: dict                           # {"passed": bool, "rows": [...]}
    pairs: dict                           # {"fp8": {"target_dir", "draft_dir"}, "bf16": ...} relative to the artifacts
    max_new_tokens: int                   # 48 where acceptance.json does not say
    temperature: float                    # 0.0 (greedy) where acceptance.json does not say
    batch_size: int | None
    runtime: str | None                   # which runtime measured (reference | trtllm | vllm ...)
    runtime_reason: str | None
    eos_token_ids: list[int]              # the stop ids validate decoded with (target.json's); [] when absent
    draft: dict                           # what validate found in the draft (first_layer_norm, ...); {} when absent
    engines: dict                         # engine name -> its own measurement (vLLM's counters); {} when absent
    ngram: dict | None                    # the n-gram comparison when validate.ngram ran
    raw: dict
    hybrid: dict | None = None            # the trained draft + SA enhancer (validate.hybrid): thresholds, comparison

    @property
    def passed(self) -> bool:
        return self.gates.get("passed") is True

    @classmethod
    def from_json(cls, doc: dict) -> AcceptanceInfo:
        return cls(max_draft_len=int(doc["max_draft_len"]), domains=dict(doc["domains"] or {}), overall=doc["overall"],
                   gates=doc["gates"] if isinstance(doc["gates"], dict) else {"passed": False, "detail": doc["gates"]},
                   pairs=doc.get("pairs") or {}, max_new_tokens=int(doc.get("max_new_tokens") or 48),
                   temperature=float(doc.get("temperature") or 0.0), batch_size=doc.get("batch_size"),
                   runtime=doc.get("runtime"), runtime_reason=doc.get("runtime_reason"),
                   eos_token_ids=list(doc.get("eos_token_ids") or []), draft=doc.get("draft") or {},
                   engines=doc.get("engines") or {}, ngram=doc.get("ngram"), raw=doc,
                   hybrid=doc.get("hybrid"))


# ------------------------------------------------------------------------------------------------ tune


@dataclass(frozen=True)
class TuningInfo:
    """tuning.json: the draft-length schedule the deployment runs, its limits, the predicted table."""

    deployment: dict                      # trtllm_version, mode, algorithm, the schedule policy and its note
    draft_schedule: dict                  # DraftSchedule.to_json
    max_batch_size: int                   # 64 where tuning.json holds none
    max_num_tokens: int | None
    cuda_graph_batch_sizes: list[int]     # [1, 2, 4, 8] where tuning.json holds none
    predicted: list                       # the per-batch table; [] where tuning.json has none
    raw: dict

    @property
    def note(self) -> str:
        return self.deployment.get("note") or "see tuning.json"

    @classmethod
    def from_json(cls, doc: dict) -> TuningInfo:
        acc = doc.get("acceptance")
        if isinstance(acc, dict) and "K" in acc:     # written before the glossary's renames: `report` of an old workdir
            doc = {**doc, "acceptance": {("draft_len" if k == "K" else "measured_draft_len" if k == "source_max_draft_len"
                                          else k): v for k, v in acc.items()}}
        return cls(deployment=dict(doc["deployment"] or {}), draft_schedule=doc["draft_schedule"],
                   max_batch_size=int(doc["max_batch_size"] or 64),
                   max_num_tokens=doc.get("max_num_tokens"),
                   cuda_graph_batch_sizes=[int(b) for b in doc.get("cuda_graph_batch_sizes") or [1, 2, 4, 8]],
                   predicted=list(doc.get("predicted") or []), raw=doc)


# ------------------------------------------------------------------------------------------------ build


@dataclass(frozen=True)
class DeploymentInfo:
    """deployment.json: what build deployed (the LLM-API options file, the draft TensorRT-LLM loads, the schedule)."""

    trtllm_version: str
    serving_image: str
    algorithm: str | None                 # eagle3 | dflash; None where deployment.json does not say
    mode: str | None
    speculation: bool                     # whether a draft is deployed (True where deployment.json does not say)
    decoding_type: str | None
    target_dir: str                       # absolute, as build resolved them
    draft_dir: str | None                 # the draft as train_draft/quantize wrote it; None without speculation
    trtllm_draft_dir: str | None          # the draft TensorRT-LLM loads (renamed layers); else `draft_dir`
    options_file: str                     # relative to the artifact
    draft_schedule: dict                  # DraftSchedule.to_json
    max_draft_len: int | None
    max_seq_len: int | None
    raw: dict

    @classmethod
    def from_json(cls, doc: dict) -> DeploymentInfo:
        return cls(trtllm_version=doc["trtllm_version"], serving_image=doc["serving_image"],
                   algorithm=doc.get("algorithm"), mode=doc.get("mode"), speculation=bool(doc.get("speculation", True)),
                   decoding_type=doc.get("decoding_type"), target_dir=doc["target_dir"], draft_dir=doc["draft_dir"],
                   trtllm_draft_dir=doc.get("trtllm_draft_dir") or doc["draft_dir"], options_file=doc["options_file"],
                   draft_schedule=doc["draft_schedule"], max_draft_len=doc.get("max_draft_len"),
                   max_seq_len=doc.get("max_seq_len"), raw=doc)

    def schedule(self):
        """The draft length per batch size the deployment runs, as the one schedule type
        (`runtime.algorithms.schedule.DraftSchedule`; `k_at(batch)`)."""
        from runtime.algorithms.schedule import DraftSchedule

        return DraftSchedule.from_json(self.draft_schedule)
