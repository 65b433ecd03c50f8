"""The `validate` artifact: `acceptance.json` (per domain and pair: acceptance, per position; gates; lossless)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.artifacts import read_json

if TYPE_CHECKING:
    from pipeline.stage import Artifact

INFO = "acceptance.json"
REQUIRED = ("max_draft_len", "domains", "overall", "gates")


@dataclass(frozen=True)
class AcceptanceInfo:
    """acceptance.json, read once (`read_acceptance`). Consumers read different parts (tune the per-position curves,
    export the gates, monitor the baseline, build the n-gram comparison): the parts are typed here, and `raw` is the
    whole document for the runtime/ code that takes it as validate wrote it (runtime/cost/tuning.py,
    runtime/validate/profile.py, runtime/trtllm/ngram.py)."""

    max_draft_len: int                    # the draft length validate measured at
    domains: dict                         # domain -> {"fp8": {...}, "bf16": {...}, "retention": ...}
    overall: dict
    gates: dict                           # {"passed": bool, "rows": [...]}
    pairs: dict                           # {"fp8": {"target_dir", "draft_dir"}, "bf16": ...} relative to the artifacts
    max_new_tokens: int                   # 48 where acceptance.json does not say
    temperature: float                    # 0.0 (greedy) where acceptance.json does not say
    eos_token_ids: list[int]              # the stop ids validate decoded with (target.json's); [] when absent
    draft: dict                           # what validate found in the draft (first_layer_norm, ...); {} when absent
    raw: dict

    @property
    def passed(self) -> bool:
        return self.gates.get("passed") is True

    @classmethod
    def from_json(cls, doc: dict) -> AcceptanceInfo:
        return cls(max_draft_len=int(doc["max_draft_len"]), domains=dict(doc["domains"] or {}), overall=doc["overall"],
                   gates=doc["gates"] if isinstance(doc["gates"], dict) else {"passed": False, "detail": doc["gates"]},
                   pairs=doc.get("pairs") or {}, max_new_tokens=int(doc.get("max_new_tokens") or 48),
                   temperature=float(doc.get("temperature") or 0.0), eos_token_ids=list(doc.get("eos_token_ids") or []),
                   draft=doc.get("draft") or {}, raw=doc)


def read_acceptance(art: Path) -> AcceptanceInfo:
    """acceptance.json; StageError naming the file and the missing field (rerun validate) when the contract is
    broken."""
    return AcceptanceInfo.from_json(read_json(art, INFO, REQUIRED))


def speculation_profile(validate: Artifact, quantize: Artifact, train_draft: Artifact, *, algorithm: str | None,
                        draft_schedule: dict | None, deployed_draft_len: int | None) -> dict:
    """The speculation_profile.json of the pair validate measured (runtime/validate/profile.py), with the conditions
    the artifacts record: the pair and its precisions, the prompts, the sampling, the versions that measured it."""
    from pipeline.artifacts import quantize as quantize_artifact
    from runtime.validate import profile as P

    acc = read_acceptance(validate.path)
    prov = validate.manifest.get("provenance", {})
    pk = prov.get("packages") or {}
    mo = {**train_draft.manifest.get("provenance", {}).get("packages", {}),
          **quantize.manifest.get("provenance", {}).get("packages", {})}
    q = quantize_artifact.read_info(quantize.path)
    pair = acc.pairs.get("fp8") or {"target_dir": q.target_rel, "draft_dir": q.draft_rel}
    prompts = {"source": "specpipe data stage eval/<domain>.jsonl: the first validate.num_prompts prompts of each domain",
               "num_prompts_per_domain": (prov.get("config") or {}).get("num_prompts"),
               "per_category": {d: (v.get("fp8") or {}).get("prompts") for d, v in acc.domains.items()},
               "data_fingerprint": ((prov.get("inputs") or {}).get("data") or {}).get("fingerprint")}
    conditions = {
        "pair": {"target": pair.get("target_dir"), "draft": pair.get("draft_dir"), "target_precision": q.quant_algo,
                 "kv_cache": q.kv_cache, "draft_precision": q.draft_format,
                 "first_layer_norm": acc.draft.get("first_layer_norm")},
        "num_speculative_tokens": acc.max_draft_len, "draft_schedule": draft_schedule, "prompts": prompts,
        "versions": {"specpipe": prov.get("specpipe_version"), "torch": pk.get("torch"),
                     "transformers": pk.get("transformers"), "modelopt": mo.get("nvidia-modelopt")}}
    return P.build_profile(acc.raw, method=algorithm or "", conditions=conditions,
                           target={"path": pair.get("target_dir"), "precision": q.quant_algo, "kv_cache": q.kv_cache},
                           draft={"path": pair.get("draft_dir"), "precision": q.draft_format, "algorithm": algorithm},
                           deployed_draft_len=deployed_draft_len)
