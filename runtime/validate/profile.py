"""`speculation_profile.json`: the draft's measured acceptance, shipped beside every draft export writes.

The schema is the one NVIDIA ModelOpt proposes for exported drafts (PRs #2247 #2313 #2315 #2316;
`examples/specdec_bench/specdec_bench/speculation_profile.py` of NVIDIA/Model-Optimizer, read at commit
edf879d3daf7879acdeb2dab9f54a591837da7b0, `SCHEMA_VERSION = "1.0"`): its top-level fields carry the deployed
pair's overall measurement in ModelOpt's names and conventions, so a consumer of ModelOpt's profiles (Dynamo's
simulator, vLLM's synthetic sampler) reads specpipe's unchanged:

- `conditional_accept_rates[i]` = P(draft position i+1 accepted | positions 1..i accepted),
  `marginal_accept_rates[i]` = P(positions 1..i+1 all accepted); both dense, `num_speculative_tokens` long;
  conditionals are ratios of consecutive marginals (0.0 after a marginal of 0), as ModelOpt computes them.
- `acceptance_length_histogram` is keyed by acceptance LENGTH, the tokens one verification step emits
  (accepted draft tokens + the target's bonus token): key "1" = steps that accepted nothing. Counts of steps.
- `mean_accept_length` is the per-step mean of that histogram; `validation.mean_consistency` checks
  `1 + sum(marginal_accept_rates)` against the AL the engine reported (ModelOpt's tolerance 0.02) and
  `validation.marginal_monotonicity` that the marginals do not increase.
- `per_category`: ModelOpt's optional `{category: {mean_accept_length, ...}}`; specpipe fills it per domain with
  the same fields as the top level.

ModelOpt's `accept_length_by_k` holds one entry (the measured K) and is "only meaningful once measured at more than one
K"; specpipe fills every k <= K from the measured chain, AL(k) = 1 + sum(marginal_accept_rates[:k]) (exact for a
draft whose first k tokens do not depend on K: EAGLE-3's chain, and specpipe's DFlash drafter, which drafts the whole
block and keeps its first k), and names each entry's source in `accept_length_by_k_source`. ModelOpt's schema has no
field for the draft length a deployment runs (read at 095124e9d582ea52b3aeb636efc281919f3aa4db as at edf879d3):
specpipe's `deployed_draft_len` says it, `deployed_accept_length` is accept_length_by_k at it. `block_size` and
`max_supported_k` (block_size - 1) are ModelOpt's fields for block-parallel DFlash. `mean_accept_length_per_request`
is ModelOpt's per-request mean (its AcceptanceRate `Average_AL`: each request's tokens per step, averaged over
requests), from validate's per-prompt [steps, accepted] rows where recorded (else null).

specpipe adds (documented in docs/stages/build_export.md, versioned by `specpipe_profile_version`):
`measurements`, the list of every measurement of this pair, each with the engine that made it (specpipe's
reference runtime from validate; entries an engine measured, from acceptance.json's `engines`), its own
`overall`, `per_category` and `measurement_conditions`; the top level mirrors `measurements[0]`. `sa_enhancer`
(where validate.hybrid ran): the same pair with TensorRT-LLM's suffix-automaton enhancer, one measurement per
threshold validate tried (`by_threshold`, per-position figures per domain as above), and the best one on AL.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.algorithms.registry import ALGORITHMS

if TYPE_CHECKING:
    from runtime.records_validate import AcceptanceInfo

SCHEMA_VERSION = "1.0"            # ModelOpt's speculation_profile schema version
SPECPIPE_PROFILE_VERSION = 2      # specpipe's extension fields (measurements, histogram_source, deployed_draft_len;
#                                   2: accept_length_by_k_source, deployed_accept_length, served_computation)
FILENAME = "speculation_profile.json"
_CHAIN_METHODS = frozenset({"eagle", "eagle1", "eagle2", "eagle3", "draft_model"})   # ModelOpt's _CHAIN_DRAFTING_METHODS
ENGINE_NAMES = {"reference": "specpipe", "tensorrt_llm": "tensorrt_llm"}


class ProfileError(ValueError):
    """A speculation profile that cannot be read or does not follow the schema."""


# ---------------------------------------------------------------------------------------------- the numbers


def histogram_of(entry: dict, K: int) -> tuple[list[int] | None, str | None]:
    """The accepted count per verification step, [a] = steps that accepted exactly a of K draft tokens, and where it
    came from: validate's `accepted_per_step` when recorded, else derived from the conditional `per_position` and
    `steps` (exact for a fixed draft length, as validate decodes); (None, None) without per-position data."""
    hist = entry.get("accepted_per_step")
    if hist:
        return [int(x) for x in hist] + [0] * (K + 1 - len(hist)), "measured"
    pp, steps = entry.get("per_position"), entry.get("steps")
    if not pp or not steps:
        return None, None
    surv, m = [1.0], 1.0
    for c in list(pp)[:K] + [0.0] * (K - len(pp)):
        m *= float(c or 0.0)
        surv.append(m)
    counts = [round(steps * (surv[a] - surv[a + 1])) for a in range(K)] + [round(steps * surv[K])]
    return counts, "derived from per_position and steps"


def vectors(hist: list[int]) -> tuple[list[float], list[float], float]:
    """(conditional, marginal, mean acceptance length) of a histogram of accepted counts (ModelOpt's definitions)."""
    n = sum(hist)
    if n == 0:
        return [], [], 1.0
    K = len(hist) - 1
    marginal = [sum(hist[j:]) / n for j in range(1, K + 1)]
    conditional, prev = [], 1.0
    for m in marginal:
        conditional.append(m / prev if prev > 0 else 0.0)
        prev = m
    mean = sum((a + 1) * c for a, c in enumerate(hist)) / n
    return conditional, marginal, mean


def accept_length_by_k(marginal: list[float], mean: float) -> dict[str, float]:
    """AL at every k <= K from the measured chain: 1 + sum(marginal[:k]); the entry at K is the measured per-step mean
    (equal to 1 + sum(marginal) for a dense histogram, validation.mean_consistency)."""
    K = len(marginal)
    out = {str(k): round(1.0 + sum(marginal[:k]), 6) for k in range(1, K)}
    out[str(K)] = round(mean, 6)
    return out


def per_request_mean(rows) -> float | None:
    """ModelOpt's mean_accept_length_per_request (AcceptanceRate `Average_AL`): the mean over requests of each
    request's tokens per verification step, (steps + accepted) / steps, from validate's per-prompt [steps, accepted]
    rows; None where they were not recorded."""
    per = [(int(st) + int(a)) / int(st) for st, a in (rows or []) if st]
    return round(sum(per) / len(per), 6) if per else None


def block(entry: dict, K: int) -> dict:
    """One measurement of one domain (or overall) in the profile's fields."""
    hist, source = histogram_of(entry, K)
    out: dict = {"num_speculative_tokens": K, "steps": entry.get("steps"), "prompts": entry.get("prompts"),
                 "reported_mean_accept_length": entry.get("acceptance_length"),
                 "mean_accept_length_per_request": per_request_mean(entry.get("per_prompt"))}
    if hist is None:
        al = entry.get("acceptance_length")
        return {**out, "measured": False, "mean_accept_length": al, "conditional_accept_rates": None,
                "marginal_accept_rates": None, "acceptance_length_histogram": None, "histogram_source": None,
                "accept_length_by_k": {}}
    cond, marg, mean = vectors(hist)
    reported = float(entry.get("acceptance_length") or mean)
    implied = 1.0 + sum(marg)
    bad = [{"position": i, "value": marg[i], "previous": marg[i - 1]} for i in range(1, len(marg))
           if marg[i] > marg[i - 1] + 1e-9]
    return {**out, "measured": True, "mean_accept_length": round(mean, 6),
            "conditional_accept_rates": [round(x, 6) for x in cond],
            "marginal_accept_rates": [round(x, 6) for x in marg],
            "acceptance_length_histogram": {str(a + 1): c for a, c in enumerate(hist) if c},
            "histogram_source": source, "accept_length_by_k": accept_length_by_k(marg, mean) if marg else {},
            "validation": {"mean_consistency": {"implied_mean_accept_length": round(implied, 6),
                                                "reported_mean_accept_length": round(reported, 6),
                                                "abs_delta": round(abs(implied - reported), 6), "tolerance": 0.02,
                                                "passed": abs(implied - reported) <= 0.02},
                           "marginal_monotonicity": {"passed": not bad, "violations": bad}}}


# ---------------------------------------------------------------------------------------------- measurements


def measurement(engine: str, domains: dict[str, dict], overall: dict, K: int, conditions: dict) -> dict:
    """One engine's measurement: overall and per domain (each an acceptance.json statistics entry)."""
    return {"engine": engine, "overall": block(overall, K),
            "per_category": {d: block(e, K) for d, e in domains.items()},
            "measurement_conditions": {"engine": engine, **conditions}}


def validate_measurement(acc: AcceptanceInfo, conditions: dict) -> dict:
    """validate's measurement of the deployed (FP8) pair, from acceptance.json (the overall per-prompt rows are the
    domains' together)."""
    domains = {d: v.entry("fp8") for d, v in acc.domains.items()}
    engine = ENGINE_NAMES.get(str(acc.runtime), str(acc.runtime or "specpipe"))
    cond = {**conditions, "runtime_reason": acc.runtime_reason,
            "sampling": {"temperature": acc.temperature, "max_new_tokens": acc.max_new_tokens,
                         "batch_size": acc.batch_size}}
    overall = acc.overall.entry("fp8")
    if "per_prompt" not in overall and domains and all(e.get("per_prompt") for e in domains.values()):
        overall["per_prompt"] = [r for e in domains.values() for r in e["per_prompt"]]
    return measurement(engine, domains, overall, acc.measured_draft_len, cond)


def engine_measurements(acc: AcceptanceInfo, conditions: dict) -> list[dict]:
    """Entries an inference engine measured (vLLM, TensorRT-LLM), from acceptance.json's optional `engines`:
    {name: {"version", "draft_len", "domains": {domain: stats}, "overall": stats, "conditions": {...}}}, each stats
    entry with `acceptance_length`, `steps` and `accepted_per_step` or `per_position` (docs/stages/build_export.md)."""
    out = []
    for name, e in sorted(acc.engines.items()):
        if not isinstance(e, dict):
            continue
        K = int(e.get("draft_len") or acc.measured_draft_len)
        cond = {**conditions, "engine_version": e.get("version"), **(e.get("conditions") or {})}
        out.append(measurement(str(name), e.get("domains") or {}, e.get("overall") or {}, K, cond))
    return out


def hybrid_measurements(acc: AcceptanceInfo, conditions: dict) -> dict | None:
    """The trained draft + SA enhancer (acceptance.json `hybrid`), one measurement per threshold; None: not measured."""
    hy = acc.hybrid
    if not hy or not hy.get("by_threshold"):
        return None
    engine = ENGINE_NAMES.get(str(acc.runtime), str(acc.runtime or "specpipe"))
    K = int(hy.get("k") or acc.measured_draft_len)
    return {"rule": hy.get("rule"), "enable_global_pool": False, "best_threshold": hy.get("best_threshold"),
            "by_threshold": {t: measurement(engine, m["domains"], m["overall"], K, {**conditions, "sa_threshold": int(t)})
                             for t, m in hy["by_threshold"].items()}}


def build_profile(acc: AcceptanceInfo, *, method: str, target: dict, draft: dict, conditions: dict,
                  deployed_draft_len: int | None = None, block_size: int | None = None) -> dict:
    """The profile of the pair validate measured (acceptance.json `acc`). `conditions`: what every measurement
    shares (pair and precisions, prompts, versions); `target`/`draft`: what was measured (no absolute paths);
    `block_size`: DFlash's trained block (its drafts are at most block_size - 1 long: `max_supported_k`)."""
    ms = [validate_measurement(acc, conditions), *engine_measurements(acc, conditions)]
    main = ms[0]
    top = main["overall"]
    K = top["num_speculative_tokens"]
    meth = (method or "").lower() or None
    by_k = top.get("accept_length_by_k") or {}
    algo = ALGORITHMS.get(meth or "")
    block_k = algo.draft_len_cap(int(block_size)) if algo and block_size else None
    return {
        "schema_version": SCHEMA_VERSION, "measured": bool(top.get("measured")), "method": meth,
        "draft_checkpoint": draft, "target_model": target, "num_speculative_tokens": K,
        "block_size": int(block_size) if algo and algo.drafts_block and block_size else None,
        "max_supported_k": block_k if block_k is not None else K, "verification_method": "longest_prefix",
        "conditional_accept_rates": top.get("conditional_accept_rates"),
        "marginal_accept_rates": top.get("marginal_accept_rates"),
        "mean_accept_length": top.get("mean_accept_length"),
        "mean_accept_length_per_request": top.get("mean_accept_length_per_request"),
        "accept_length_model": "chain_analytic" if meth in _CHAIN_METHODS else "measured_per_k",
        "accept_length_by_k": by_k,
        "acceptance_length_histogram": top.get("acceptance_length_histogram"),
        "per_category": main["per_category"], "measurement_conditions": main["measurement_conditions"],
        "validation": top.get("validation"),
        "specpipe_profile_version": SPECPIPE_PROFILE_VERSION, "deployed_draft_len": deployed_draft_len,
        "accept_length_by_k_source": _by_k_source(by_k, K, meth),
        "deployed_accept_length": by_k.get(str(deployed_draft_len)) if deployed_draft_len else None,
        "served_computation": served_computation(acc, meth),
        "measurements": ms,
        **({"sa_enhancer": sa} if (sa := hybrid_measurements(acc, conditions)) else {}),
    }


def served_computation(acc: AcceptanceInfo, meth: str | None) -> dict | None:
    """EAGLE-3: the acceptance length for the first-layer computation the engines run, `hidden_norm(h)` (TensorRT-LLM,
    vLLM, SGLang; validate's `first_layer_norm: serving`), beside the one validate gated on when that was ModelOpt's
    training form `hidden_norm(input_layernorm(h))` (docs/stages/validate.md). Per domain from validate's
    `fp8_other_norm` arm, or from the main measurement when validate ran the serving form; overall only then (the other
    arm records no step counts). None for other methods (DFlash has no such choice)."""
    algo = ALGORITHMS.get(meth or "")
    if not (algo and algo.first_layer_norm_choice):
        return None
    norm = (acc.draft or {}).get("first_layer_norm") or "modelopt"
    key = "fp8" if norm == "serving" else "fp8_other_norm"
    per = {d: v.entry(key).get("acceptance_length") for d, v in acc.domains.items()}
    main = {d: v.entry("fp8").get("acceptance_length") for d, v in acc.domains.items()}
    measured = any(x is not None for x in per.values())
    return {"first_layer_norm": "serving", "computation": "hidden_norm(h), as TensorRT-LLM, vLLM and SGLang compute it",
            "measured": measured, "per_category": per if measured else None,
            "mean_accept_length": acc.overall.entry("fp8").get("acceptance_length") if norm == "serving" else None,
            "source": ("validate's measurement (validate.first_layer_norm: serving)" if norm == "serving" else
                       "validate's fp8_other_norm arm" if measured else "not measured (validate.measure_other_norm: false)"),
            "validate_first_layer_norm": norm,
            "validate_per_category": main if norm != "serving" else None}


def _by_k_source(by_k: dict, K: int, meth: str | None) -> dict[str, str]:
    """Where each accept_length_by_k entry comes from: the measurement (k = K) or the measured chain (k < K)."""
    chain = ("chain: 1 + sum(marginal_accept_rates[:k]); " + ("EAGLE-3's first k drafts are the same at every K" if
             meth in _CHAIN_METHODS else "specpipe's DFlash drafter drafts the whole block and keeps its first k"))
    return {k: ("measured" if int(k) == K else chain) for k in by_k}


# ---------------------------------------------------------------------------------------------- files


def write_profile(profile: dict, dirs: list[Path]) -> list[Path]:
    """Write the profile into each directory (beside the draft it describes); world-readable."""
    text = json.dumps(profile, indent=2) + "\n"
    out = []
    for d in dirs:
        p = Path(d) / FILENAME
        p.parent.mkdir(parents=True, exist_ok=True)
        p.unlink(missing_ok=True)      # never write through a hard link into the artifact it was linked from
        p.write_text(text)
        p.chmod(0o644)
        out.append(p)
    return out


def read_profile(path: Path) -> dict:
    """A speculation profile, checked for what a baseline needs; ProfileError naming the file and field."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path}: not a readable JSON speculation profile ({e})") from None
    if not isinstance(doc, dict) or not doc.get("schema_version"):
        raise ProfileError(f"{path}: no schema_version: not a speculation profile")
    if str(doc["schema_version"]).split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ProfileError(f"{path}: schema_version {doc['schema_version']} is not {SCHEMA_VERSION}: written by another "
                           "version; rerun `specpipe build` to rewrite it")
    if not isinstance(doc.get("per_category"), dict) or not doc["per_category"]:
        raise ProfileError(f"{path}: per_category is missing or empty: the baseline is per domain")
    return doc


def baseline(doc: dict, path: Path | str = FILENAME) -> tuple[dict[str, list[float]], list[float] | None, str]:
    """(conditional acceptance per domain, overall, engine) of a profile's first measurement: the baseline
    `specpipe monitor` tests live traffic against."""
    per = {}
    for d, b in doc["per_category"].items():
        rates = (b or {}).get("conditional_accept_rates")
        if not rates:
            raise ProfileError(f"{path}: per_category.{d}.conditional_accept_rates is missing: no per-position baseline")
        per[d] = [float(x) for x in rates]
    overall = doc.get("conditional_accept_rates")
    engine = (doc.get("measurement_conditions") or {}).get("engine") or "unknown"
    return per, [float(x) for x in overall] if overall else None, str(engine)
