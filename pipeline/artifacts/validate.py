"""The `validate` artifact: `acceptance.json` (per domain and pair: acceptance, per position; gates; lossless)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.artifacts import read_record
from runtime.records_validate import AcceptanceInfo

if TYPE_CHECKING:
    from pipeline.stage import Artifact

INFO = "acceptance.json"
REQUIRED = ("domains", "overall", "gates")      # and measured_draft_len (an older acceptance.json: max_draft_len)


def read_acceptance(art: Path) -> AcceptanceInfo:
    """acceptance.json; StageError naming the file and the missing field (rerun validate) when the contract is
    broken."""
    return read_record(art, INFO, AcceptanceInfo, REQUIRED)


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
               "per_category": {d: v.fp8.prompts if v.fp8 else None for d, v in acc.domains.items()},
               "data_fingerprint": ((prov.get("inputs") or {}).get("data") or {}).get("fingerprint")}
    conditions = {
        "pair": {"target": pair.get("target_dir"), "draft": pair.get("draft_dir"), "target_precision": q.quant_algo,
                 "kv_cache": q.kv_cache, "draft_precision": q.draft_format,
                 "first_layer_norm": acc.draft.get("first_layer_norm")},
        "num_speculative_tokens": acc.measured_draft_len, "draft_schedule": draft_schedule, "prompts": prompts,
        "versions": {"specpipe": prov.get("specpipe_version"), "torch": pk.get("torch"),
                     "transformers": pk.get("transformers"), "modelopt": mo.get("nvidia-modelopt")}}
    from pipeline.artifacts import train_draft as train_draft_artifact

    block_size = train_draft_artifact.read_info(train_draft.path).block_size
    return P.build_profile(acc, method=algorithm or "", conditions=conditions, block_size=block_size,
                           target={"path": pair.get("target_dir"), "precision": q.quant_algo, "kv_cache": q.kv_cache},
                           draft={"path": pair.get("draft_dir"), "precision": q.draft_format, "algorithm": algorithm},
                           deployed_draft_len=deployed_draft_len)
