"""Free n-gram (prompt-lookup) drafting measured beside the trained draft: the deployed target, the same runtime,
the same prompts, batch size, token budget and seeds, with `runtime.engine.ngram_drafter.NgramDrafter` (vLLM 0.32.0's
rule) as the drafter. Per domain: acceptance length (tokens per verification step, every step counted, those
without a proposal too), tokens/s, how often a proposal was found; then which of the two pays more and by how
much, judged on AL (tokens/s on a shared CPU is noisy; it is reported beside it). What `validate.ngram` asks."""
from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.validate.decode import Measurement, measure


@dataclass(frozen=True)
class NgramSettings:
    min_n: int
    max_n: int
    k: int            # draft tokens per step (validate's max_draft_len unless the section says)


def measure_ngram(m: Measurement, model, ng: NgramSettings, prompts: dict, res: dict, bar) -> None:
    """Decode every domain's prompts on `model` (the deployed target) with n-gram drafts: res["domains"][d]["ngram"],
    res["overall"]["ngram"] and res["ngram"] (settings and the per-domain comparison with res[...]["fp8"])."""
    from runtime.engine.ngram_drafter import VLLM_RULE, NgramDrafter
    from runtime.engine.speculative import SpeculativeEngine

    log, m = m.log, replace(m, K=ng.k)
    total = None
    for d, ps in prompts.items():
        drafter = NgramDrafter(ng.min_n, ng.max_n, model.config.vocab_size)
        eng = SpeculativeEngine(model, drafter=drafter)
        st = measure(eng, ps, m, speculative=True, run=f"ngram/{d}")[0]
        total = st if total is None else total.merge(st)
        res["domains"][d]["ngram"] = {**st.as_dict(), "prompts": len(ps),
                                      "proposal_rate": round(drafter.proposals / drafter.lookups, 4) if drafter.lookups else None}
        log.info("ngram %s: AL %.3f (trained draft %.3f), proposals in %s of steps", d, st.acceptance_length,
                 res["domains"][d]["fp8"]["acceptance_length"], res["domains"][d]["ngram"]["proposal_rate"])
        bar.update(1)
    res["overall"]["ngram"] = total.as_dict()
    res["ngram"] = {"min_n": ng.min_n, "max_n": ng.max_n, "k": ng.k, "rule": VLLM_RULE,
                    "comparison": compare(res)}


def _side(v: dict) -> dict:
    return {"acceptance_length": v["acceptance_length"], "decode_tokens_per_s": v.get("decode_tokens_per_s")}


def compare(res: dict) -> dict:
    """Per domain and overall: the trained draft's and n-gram drafting's AL and tokens/s, which pays more (on AL)
    and by how much (AL difference and ratio n-gram / trained)."""
    out = {}
    for d, v in [*res["domains"].items(), ("overall", res["overall"])]:
        if "ngram" not in v or "fp8" not in v:
            continue
        t, n = _side(v["fp8"]), _side(v["ngram"])
        al_t, al_n = t["acceptance_length"], n["acceptance_length"]
        tps = n["decode_tokens_per_s"] / t["decode_tokens_per_s"] if t["decode_tokens_per_s"] and n["decode_tokens_per_s"] \
            else None
        out[d] = {"trained": t, "ngram": n, "pays_more": "ngram" if al_n > al_t else "trained",
                  "al_difference": round(al_n - al_t, 4), "al_ratio": round(al_n / al_t, 4),
                  "tokens_per_s_ratio": round(tps, 4) if tps else None}
    return out


def summary(res: dict) -> dict | None:
    """Stage metrics: per domain (and overall) which pays more, the two ALs and the ratio."""
    cmp = (res.get("ngram") or {}).get("comparison")
    if not cmp:
        return None
    return {d: {"pays_more": c["pays_more"], "al_trained": c["trained"]["acceptance_length"],
                "al_ngram": c["ngram"]["acceptance_length"], "al_ratio": c["al_ratio"]} for d, c in cmp.items()}


def table_rows(res: dict) -> tuple[list[list], list[str]] | None:
    """The report's table (rows, header), None when n-gram drafting was not measured."""
    ng = res.get("ngram") or {}
    if not ng.get("comparison"):
        return None
    rows = [[d, c["trained"]["acceptance_length"], c["ngram"]["acceptance_length"], c["al_difference"], c["al_ratio"],
             (res["domains"].get(d) or {}).get("ngram", {}).get("proposal_rate", ""),
             c["trained"]["decode_tokens_per_s"], c["ngram"]["decode_tokens_per_s"], c["pays_more"]]
            for d, c in ng["comparison"].items()]
    return rows, ["domain", "AL trained draft", f"AL n-gram (n {ng['min_n']}-{ng['max_n']}, k {ng['k']})",
                  "AL n-gram - trained", "AL ratio", "steps with a proposal", "tokens/s trained", "tokens/s n-gram",
                  "pays more (on AL)"]
