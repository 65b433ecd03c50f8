"""The trained draft with TensorRT-LLM's suffix-automaton enhancer (`sa_config`) measured beside the trained draft and
free n-gram drafting: the deployed pair, the same runtime, prompts, batch size, token budget and seeds, with
`runtime.engine.suffix.SuffixEnhancedDrafter` wrapping the trained drafter, once per candidate threshold (tune
chooses among them). Per domain: acceptance length and per-position acceptance (RunStats' definitions), how often
the SA draft replaced the trained one and how much of it was kept, and what training buys (hybrid - n-gram) and
what matching adds (hybrid - trained). What `validate.hybrid` asks; every run is checked by the acceptance-rule
invariant like the others."""
from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.validate.decode import Measurement, measure


@dataclass(frozen=True)
class HybridSettings:
    thresholds: tuple[int, ...]     # SAEnhancerConfig.threshold candidates
    k: int                          # draft tokens per step (validate's max_draft_len)


def _domain_entry(st, dr, prompts: int, threshold: int) -> dict:
    c = dr.counters()
    looked = c["lookups"] or 0
    return {**st.as_dict(), "prompts": prompts, "threshold": threshold, **c,
            "sa_step_share": round(c["sa_steps"] / looked, 4) if looked else None,
            "sa_acceptance_rate": round(c["sa_accepted"] / c["sa_drafted"], 4) if c["sa_drafted"] else None,
            "trained_acceptance_rate": round(c["trained_accepted"] / c["trained_drafted"], 4) if c["trained_drafted"] else None}


def measure_hybrid(m: Measurement, model, draft, hs: HybridSettings, prompts: dict, res: dict, bar) -> None:
    """Decode every domain's prompts with the enhanced trained drafter at each threshold: res["hybrid"] (settings,
    every threshold's figures, the best threshold on overall AL, the per-domain comparison), and at that threshold
    res["domains"][d]["hybrid"] and res["overall"]["hybrid"] (the same keys as "fp8", plus the SA counters)."""
    from runtime.engine.speculative import SpeculativeEngine
    from runtime.engine.suffix import UPSTREAM_RULE, SuffixEnhancedDrafter

    log, m = m.log, replace(m, K=hs.k)
    by_thr: dict = {}
    eng = SpeculativeEngine(model, draft)
    inner = eng.drafter
    for thr in hs.thresholds:
        doms, total = {}, None
        for d, ps in prompts.items():
            eng.drafter = dr = SuffixEnhancedDrafter(inner, threshold=thr)
            st = measure(eng, ps, m, speculative=True, run=f"hybrid{thr}/{d}")[0]
            total = st if total is None else total.merge(st)
            doms[d] = _domain_entry(st, dr, len(ps), thr)
            log.info("hybrid (threshold %d) %s: AL %.3f (trained %.3f), SA draft in %s of steps, %s of its tokens kept",
                     thr, d, st.acceptance_length, res["domains"][d]["fp8"]["acceptance_length"],
                     doms[d]["sa_step_share"], doms[d]["sa_acceptance_rate"])
            bar.update(1)
        by_thr[str(thr)] = {"domains": doms, "overall": total.as_dict()}
    best = max(hs.thresholds, key=lambda t: (by_thr[str(t)]["overall"]["acceptance_length"], t))
    for d in prompts:
        res["domains"][d]["hybrid"] = by_thr[str(best)]["domains"][d]
    res["overall"]["hybrid"] = {**by_thr[str(best)]["overall"], "threshold": best}
    res["hybrid"] = {"k": hs.k, "thresholds": list(hs.thresholds), "enable_global_pool": False, "rule": UPSTREAM_RULE,
                     "best_threshold": best, "by_threshold": by_thr, "comparison": compare(res)}


def compare(res: dict) -> dict:
    """Per domain and overall: AL of the trained draft, n-gram drafting (where measured) and the hybrid; what
    training buys over free matching (hybrid - n-gram), what matching adds to training (hybrid - trained), and
    whether the hybrid reaches the better of the two."""
    out = {}
    for d, v in [*res["domains"].items(), ("overall", res["overall"])]:
        if "hybrid" not in v or "fp8" not in v:
            continue
        t, h = v["fp8"]["acceptance_length"], v["hybrid"]["acceptance_length"]
        n = (v.get("ngram") or {}).get("acceptance_length")
        best = max(t, n) if n is not None else t
        out[d] = {"trained": round(t, 4), "ngram": None if n is None else round(n, 4), "hybrid": round(h, 4),
                  "training_buys": None if n is None else round(h - n, 4), "matching_adds": round(h - t, 4),
                  "reaches_better_of_both": h >= best - 1e-9}
    return out


def summary(res: dict) -> dict | None:
    """Stage metrics: the best threshold and per domain the three ALs."""
    hy = res.get("hybrid")
    if not hy:
        return None
    return {"threshold": hy["best_threshold"],
            "acceptance_length": {d: {"trained": c["trained"], "ngram": c["ngram"], "hybrid": c["hybrid"]}
                                  for d, c in hy["comparison"].items()}}


def table_rows(res: dict) -> tuple[list[list], list[str]] | None:
    """The report's table (rows, header), None when the hybrid was not measured."""
    hy = res.get("hybrid") or {}
    if not hy.get("comparison"):
        return None
    rows = []
    for d, c in hy["comparison"].items():
        e = res["domains"].get(d, {}).get("hybrid", {}) if d != "overall" else {}
        rows.append([d, c["trained"], c["ngram"], c["hybrid"], c["training_buys"], c["matching_adds"],
                     e.get("sa_step_share", ""), e.get("sa_acceptance_rate", ""), c["reaches_better_of_both"]])
    return rows, ["domain", "AL trained draft", "AL n-gram", f"AL hybrid (SA threshold {hy['best_threshold']})",
                  "training buys (hybrid - n-gram)", "matching adds (hybrid - trained)", "steps with the SA draft",
                  "SA tokens kept", "hybrid >= better of both"]
