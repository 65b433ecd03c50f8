"""The draft-length optimiser: expected tokens per step from the measured acceptance, the best draft length at
each batch size from the step-cost model (runtime.cost.costmodel), and the schedule the deployment runs.

Speculation (one verification step with draft length k at batch B, context L):
  tokens/step E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j   (a_j: conditional acceptance at draft position j)
  speedup S(B, k) = E(k) * T_target(B, 1) / (T_target(B, 1+k) + T_draft(B, k))
The per-batch optimum is then fitted to what the targeted TensorRT-LLM version does in the deployment's mode
(`choose_schedule`): one draft length at every batch size, a per-batch schedule that may switch speculation off,
or one that must never reach 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.cost.costmodel import Deployment

# ------------------------------------------------------------------------------------------ acceptance


def expected_tokens(per_position: list[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j: tokens emitted per verification step with draft length k."""
    e, run = 1.0, 1.0
    for a in per_position[:k]:
        run *= min(1.0, max(0.0, float(a)))
        e += run
    return e


def flat_acceptance(acceptance_length: float, k: int) -> float:
    """The constant per-position rate a with E(k) = (1 - a^(k+1)) / (1 - a) = acceptance_length."""
    target = min(max(acceptance_length, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens([mid] * k, k) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mix_expected_tokens(curves: dict[str, list[float]], weights: dict[str, float], k: int) -> float:
    tot = sum(weights.values())
    return sum(w / tot * expected_tokens(curves[d], k) for d, w in weights.items() if w > 0)


# ------------------------------------------------------------------------------------------ optimiser


@dataclass
class Choice:
    batch: int
    k: int
    speedup: float                    # predicted for the traffic mix at the chosen k (1.0 when k == 0)
    speedups: list[float]             # mix speedup for k = 0..K
    rows_over_ridge: float            # B (1+k) / M* at the chosen k
    domain_speedups: dict = field(default_factory=dict)   # domain -> speedup at the chosen k


def choose_k(dep: Deployment, curves: dict[str, list[float]], weights: dict[str, float], batch: int, K: int,
             *, min_speedup: float = 1.0, tie_tolerance: float = 0.01, min_k: int = 0) -> Choice:
    """The best draft length at one batch size.

    Among k = 1..K take the best predicted speedup, then prefer a shorter k while it stays within
    `tie_tolerance` of the best (a draft token that buys almost nothing still costs token budget and is
    the first to hurt when acceptance drifts). Speculation is off (k = 0) when even the best falls below
    `min_speedup`, unless `min_k` >= 1: a deployment that cannot switch speculation off at one batch size
    (TensorRT-LLM one-engine mode, see runtime.trtllm.compat) gets the best k >= min_k there instead.
    """
    base = dep.target_time(batch, 1)
    sp = [1.0] + [mix_expected_tokens(curves, weights, k) * base / dep.spec_time(batch, k) for k in range(1, K + 1)]
    lo = min(max(0, min_k), K)      # 0: "no speculation" competes (its speedup is 1.0)
    best = max(range(lo, K + 1), key=lambda k: (sp[k], -k)) if K else 0
    k = best
    while k > max(1, min_k) and sp[k - 1] >= sp[best] * (1 - tie_tolerance):
        k -= 1
    if min_k == 0 and (k == 0 or sp[k] < min_speedup):
        k = 0
    ridge = dep.machine.ridge_rows(dep.target_prec)
    dom = {d: (expected_tokens(c, k) * base / dep.spec_time(batch, k) if k else 1.0) for d, c in curves.items()}
    return Choice(batch, k, sp[k], sp, batch * (1 + k) / ridge, dom)


def k_by_batch(dep: Deployment, curves, weights, max_batch: int, K: int, **kw) -> list[int]:
    """Chosen k at every batch size 1..max_batch (index 0 = batch 1), made non-increasing: a longer draft at a
    larger batch only happens through model noise, and TensorRT-LLM's schedule formats are read as steps."""
    ks = [choose_k(dep, curves, weights, b, K, **kw).k for b in range(1, max_batch + 1)]
    out, cur = [], K
    for k in ks:
        cur = min(cur, k)
        out.append(cur)
    return out


def best_constant_k(dep: Deployment, curves, weights, batches: list[int], K: int, *, min_speedup: float = 1.0,
                    tie_tolerance: float = 0.01) -> tuple[int, float]:
    """One draft length for every batch size (a deployment that applies no per-batch schedule): the k in 1..K
    with the best geometric-mean predicted speedup over `batches` (each listed batch size weighs the same), the
    shortest within `tie_tolerance` of it; 0 (no speculation) when that mean is below `min_speedup`.
    Returns (k, geometric-mean speedup at k)."""
    if not K or not batches:
        return 0, 1.0
    logs = [0.0] * (K + 1)
    for b in batches:
        sp = choose_k(dep, curves, weights, b, K, min_speedup=0.0).speedups
        for k in range(1, K + 1):
            logs[k] += math.log(max(sp[k], 1e-12)) / len(batches)
    gm = [1.0] + [math.exp(x) for x in logs[1:]]
    best = max(range(1, K + 1), key=lambda k: (gm[k], -k))
    k = best
    while k > 1 and gm[k - 1] >= gm[best] * (1 - tie_tolerance):
        k -= 1
    if gm[k] < min_speedup:
        return 0, 1.0
    return k, gm[k]


# ------------------------------------------------------------------------------------------ deployed schedule


@dataclass(frozen=True)
class TrtllmMode:
    """The TensorRT-LLM release (runtime/trtllm/compat.py `Release`) and decoding mode a schedule is fitted to."""

    rel: object
    mode: str


def choose_schedule(dep: Deployment, curves, weights, max_batch: int, K: int, serving: TrtllmMode, batch_sizes: list[int],
                    kw: dict):
    """The draft length per batch size the deployment runs, fitted to what `serving.rel` does in `serving.mode`
    (runtime/trtllm/compat.py, SOURCES per_batch_draft_len_1_2 and zero_draft_len_one_engine), and a description.
    `batch_sizes`: the predicted table's (a constant draft length is the best mean over those up to max_batch)."""
    from runtime.algorithms.schedule import DraftSchedule

    rel, mode = serving.rel, serving.mode
    line = f"TensorRT-LLM {rel.line}"
    if mode not in rel.per_batch_draft_len:
        batches = [b for b in batch_sizes if b <= max_batch] or [max_batch]
        k, gm = best_constant_k(dep, curves, weights, batches, K, **kw)
        return DraftSchedule.constant(k), {
            "name": "constant", "per_batch_draft_len": False,
            "note": (f"{line} in {mode.replace('_', '-')} mode uses one draft length at every batch size (it applies "
                     "draft_len_schedule and max_concurrency only with a two-model drafter): "
                     + (f"k={k} at every batch size, the best geometric-mean predicted speedup ({gm:.3f}x) over batch "
                        f"sizes {batches}" if k else "no constant draft length pays on average: no speculation"))}
    ideal = k_by_batch(dep, curves, weights, max_batch, K, **kw)
    if mode in rel.zero_draft_len_ok or not any(ideal):
        sched = DraftSchedule.from_ks(ideal)
        return sched, {"name": "per_batch", "per_batch_draft_len": True,
                       "note": f"{line} applies the draft length per batch size: {sched.describe(max_batch)}"}
    floored = k_by_batch(dep, curves, weights, max_batch, K, **kw, min_k=1)
    sched = DraftSchedule.from_ks(floored)
    off = [b for b, k in enumerate(ideal, start=1) if k == 0]
    note = f"{line} applies the draft length per batch size: {sched.describe(max_batch)}"
    if off:
        note += (f"; batch sizes {off[0]}-{off[-1]} would do better without speculation, but a draft length of 0 in "
                 "one-engine mode corrupts the drafter's state and acceptance collapses once speculation resumes "
                 "(TensorRT-LLM PR #16888), and max_concurrency is translated into such a schedule: they keep the "
                 "best k >= 1 instead")
    return sched, {"name": "per_batch_min1", "per_batch_draft_len": True, "note": note}
