"""Whether the suffix-automaton enhancer pays, and at which threshold: the hybrid's measured per-position acceptance
(validate.hybrid, one curve per threshold and domain) priced with the same step-cost model and traffic mix as the
trained draft. In TensorRT-LLM a matched request still runs the draft loop (runtime/trtllm/sa_enhancer.py), so at
the same draft length the hybrid's step costs what the trained draft's does: it pays where it emits more tokens per
step on the traffic mix. (specpipe's own runtime skips the draft pass when every row matched; its batch-1 speed is
measured by bench/spec_vs_ar.py, not predicted here.)"""
from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.cost.draft_length import choose_k, mix_expected_tokens

if TYPE_CHECKING:
    from runtime.records_validate import AcceptanceInfo


def survival_curve(accepted_per_step: list[int]) -> list[float]:
    """Conditional acceptance per position over ALL steps, from the histogram of accepted counts: c_j = m_j / m_(j-1)
    with m_j = P(at least j accepted). The hybrid's proposals are ragged (an SA continuation may be shorter than k), so
    its `per_position` (rates over the steps that drafted position j) overstates what a step yields; this curve gives
    1 + sum(m_j) = AL, and its first k positions what the same drafts yield at a draft length k."""
    n = sum(accepted_per_step)
    out, prev = [], 1.0
    for j in range(1, len(accepted_per_step)):
        m = sum(accepted_per_step[j:]) / n if n else 0.0
        out.append(m / prev if prev > 0 else 0.0)
        prev = m
    return out


def hybrid_curves(acc: AcceptanceInfo, threshold: str, domains) -> dict[str, list[float]] | None:
    """Per-domain conditional acceptance of the hybrid at one threshold over all steps (`survival_curve` of the
    measured histogram), None if a domain lacks it."""
    doms = ((acc.hybrid or {}).get("by_threshold") or {}).get(threshold, {}).get("domains") or {}
    out = {}
    for d in domains:
        hist = (doms.get(d) or {}).get("accepted_per_step")
        if not hist or not sum(hist):
            return None
        out[d] = survival_curve([int(x) for x in hist])
    return out


def _speedups(dep, curves, weights, ks: dict[int, int]) -> dict[int, float]:
    out = {}
    for b, k in ks.items():
        out[b] = 1.0 if k == 0 else mix_expected_tokens(curves, weights, k) * dep.target_time(b, 1) / dep.spec_time(b, k)
    return out


def choose(dep, acc: AcceptanceInfo, mix: tuple, batch_sizes: list[int], kw: dict, target: dict) -> dict:
    """tuning.json's `sa_enhancer`: every measured threshold priced at the trained draft's chosen k per batch size, the
    best on the batch-1 mix, whether it pays over the trained draft, and whether build deploys it. `mix`: the trained
    draft's (curves, weights, K) as tune prices them; `target`: {"want": auto (where it pays and the version has
    sa_config) | always (where the version has it) | never, "problem": why the targeted version cannot take it (None: it
    can), "vllm_alternative": what vLLM runs instead}."""
    curves, weights, K = mix
    want, problem = target["want"], target["problem"]
    hy = acc.hybrid or {}
    base = {"want": want, "supported": problem is None, "unsupported_reason": problem,
            "vllm_alternative": target["vllm_alternative"], "draft_cost": "the trained draft's: TensorRT-LLM runs the draft loop "
            "for matched requests too and overrides afterwards", "deploy": False, "threshold": None}
    if want == "never":
        return {**base, "measured": bool(hy), "why": "tune.sa_enhancer: never"}
    ths = [t for t in (hy.get("by_threshold") or {}) if hybrid_curves(acc, t, weights)]
    if not ths:
        return {**base, "measured": False, "why": "validate.hybrid did not measure the enhancer (enable it to tune it)"}
    ks = {b: choose_k(dep, curves, weights, b, K, **kw).k for b in batch_sizes}
    trained = _speedups(dep, curves, weights, ks)
    cand, sp1 = {}, {}
    for t in ths:
        hc = hybrid_curves(acc, t, weights)
        sp = _speedups(dep, hc, weights, ks)
        sp1[t] = sp[batch_sizes[0]]
        cand[t] = {"tokens_per_step_mix": round(mix_expected_tokens(hc, weights, K), 4),
                   "speedup_by_batch": {str(b): round(s, 4) for b, s in sp.items()}}
    b1 = str(batch_sizes[0])
    best = max(ths, key=lambda t: (sp1[t], int(t)))
    pays = sp1[best] > trained[batch_sizes[0]] * (1 + 1e-6)
    deploy = problem is None and (pays or want == "always")
    why = (f"threshold {best}: predicted batch-{b1} speedup {cand[best]['speedup_by_batch'][b1]:.3f} vs trained draft "
           f"{trained[batch_sizes[0]]:.3f} on the traffic mix" + ("" if pays else " (does not pay)")
           + ("" if problem is None else f"; not deployable: {problem}"))
    return {**base, "measured": True, "threshold": int(best), "pays": pays, "deploy": deploy, "why": why,
            "trained": {"tokens_per_step_mix": round(mix_expected_tokens(curves, weights, K), 4),
                        "speedup_by_batch": {str(b): round(s, 4) for b, s in trained.items()}},
            "draft_len_by_batch": {str(b): k for b, k in ks.items()}, "candidates": cand}
