"""How far apart two engines' acceptance lengths may be on the same prompts before it is a real disagreement.

Two engines decoding the same pair greedily do not decode the same text: vLLM computes in bf16 with its own kernels,
specpipe's runtime in fp32, so at near-ties their greedy paths part and each engine's acceptance length (AL) is then
measured on partly different text. How much that alone moves AL is measured, not assumed: the prompts are resampled
with replacement (paired: the same prompts for both engines) and the relative difference of the two ALs recomputed;
the (1 - alpha) quantile of its distance from the measured difference is the noise half-width. The gate fails a
domain only when the difference exceeds the configured tolerance by more than that noise (a significant excess);
with many prompts the noise shrinks and the gate tends to the tolerance.

A row is [verification steps, accepted draft tokens] for one prompt: AL = (steps + accepted) / steps, pooled over
prompts as each engine reports it (TensorRT-LLM's and vLLM's definition)."""
from __future__ import annotations

import numpy as np

RESAMPLES = 2000


def pooled_al(rows) -> float:
    a = np.asarray(rows, dtype=float).reshape(-1, 2)
    steps = a[:, 0].sum()
    return float((steps + a[:, 1].sum()) / steps) if steps else float("nan")


def relative_noise(engine_rows, ref_rows, *, alpha: float = 0.01, resamples: int = RESAMPLES,
                   seed: int = 0) -> float | None:
    """The (1 - alpha) half-width of |relative difference of AL| under a paired bootstrap over prompts, or None
    when the rows do not pair up (different prompt counts) or fewer than 2 prompts have steps."""
    e = np.asarray(engine_rows, dtype=float).reshape(-1, 2)
    r = np.asarray(ref_rows, dtype=float).reshape(-1, 2)
    if len(e) != len(r) or len(e) < 2 or (e[:, 0] > 0).sum() < 2 or (r[:, 0] > 0).sum() < 2:
        return None
    rel = pooled_al(e) / pooled_al(r) - 1.0
    idx = np.random.default_rng(seed).integers(0, len(e), size=(resamples, len(e)))
    es, ea, rs, ra = (e[:, 0][idx].sum(1), e[:, 1][idx].sum(1), r[:, 0][idx].sum(1), r[:, 1][idx].sum(1))
    ok = (es > 0) & (rs > 0)
    rel_b = ((es[ok] + ea[ok]) / es[ok]) / ((rs[ok] + ra[ok]) / rs[ok]) - 1.0
    return float(np.quantile(np.abs(rel_b - rel), 1.0 - alpha))
