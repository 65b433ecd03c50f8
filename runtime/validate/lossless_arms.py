"""The exact and statistical parts of validate's lossless check, run on a pair (docs/stages/validate.md says what
each proves), and the speed figures measured on the same runs. Exact (unquantized pair): greedy speculative decoding
== batch-1 autoregressive decoding token for token, fp32 ties excepted. Statistical (deployed pair): speculative
output diverges from batch-1 autoregressive output no faster than the target's own noise floor (autoregressive at
another batch size and with a chunked prefill). The primitives (divergence, the rate test, the invariant) are
runtime/engine/lossless.py."""
from __future__ import annotations

import time
from dataclasses import replace

from runtime.algorithms.registry import get as get_algorithm
from runtime.validate.decode import Measurement, lossless_subset, measure


def exact_check(m: Measurement, eng, sub, label: str, spec_out=None, ar1_out=None) -> dict:
    """Unquantized pair: greedy speculative (batch `batch_size`) == autoregressive (batch 1), token for token.
    The one tolerance: at a divergence, the two tokens' logits from one fresh forward over the reference prefix
    differ by less than `gates.tie_margin` (an fp32 accumulation-order tie; see docs/stages/validate.md)."""
    from runtime.engine.lossless import lossless_diff, tie_margins

    log, s, K = m.log, m.s, m.K
    if spec_out is None:
        spec_out = measure(eng, sub, m, speculative=True, temperature=0.0, run=f"{label}/exact")[1]
    if ar1_out is None:
        ar1_out = measure(eng, sub, m, speculative=False, temperature=0.0, batch_size=1,
                          run=f"{label}/ar_b1")[1]
    bad = tie_margins(eng.target.model, sub, ar1_out, lossless_diff(spec_out, ar1_out))
    tm = s.tie_margin
    for b in bad:
        b["tie"] = b.get("gap") is not None and abs(b["gap"]) < tm
    real = [b for b in bad if not b["tie"]]
    out = {"pair": label, "passed": not real, "identical": not bad, "compared_prompts": len(sub),
           "generated_tokens": sum(map(len, ar1_out)), "differ": len(real), "numerical_ties": len(bad) - len(real),
           "tie_margin": tm, "mismatches": bad[:10],
           "rule": f"speculative (batch {s.batch_size}, k={K}) == autoregressive (batch 1) token for token; a "
                   f"divergence counts as an fp32 tie only where the two tokens' logits differ by < {tm}"}
    log.info("exact lossless check on the %s pair, %d prompts: %s", label, len(sub),
             "identical" if not bad else f"{len(real)} differ, {len(bad) - len(real)} at fp32 ties: {bad[:3]}")
    return out


def lossless_and_speed(m: Measurement, eng, prompts: dict, bar, algorithm: str, exact: bool = False):
    """Deployed pair, greedy: speculative and autoregressive decoding (tokens/s, step costs), the batch-1
    autoregressive reference and the noise-floor arms, the statistical check; `exact` (the deployed pair is
    the unquantized one): the exact check too."""
    from runtime.engine.lossless import decode_chunked_prefill
    from runtime.engine.stats import predicted_speedup

    log, s, K, eos = m.log, m.s, m.K, m.eos
    n = s.lossless_prompts
    if n == 0:
        return {"checked_prompts": 0, "passed": None}, {}, {}
    sub = lossless_subset(prompts, s)
    measure(eng, sub[:1], replace(m, tally=None), speculative=True, temperature=0.0)    # warm-up (allocator, kernels)
    t0 = time.perf_counter()
    spec, spec_out = measure(eng, sub, m, speculative=True, temperature=0.0, run="fp8/speculative")
    t1 = time.perf_counter()
    ar, ar_out = measure(eng, sub, m, speculative=False, temperature=0.0, run="fp8/ar_batch")
    t2 = time.perf_counter()
    ar1_out = measure(eng, sub, m, speculative=False, temperature=0.0, batch_size=1,
                      run="fp8/ar_b1")[1]
    chunked = decode_chunked_prefill(eng.target.model, sub, max_new_tokens=s.max_new_tokens, eos=eos,
                                     chunk=s.noise_prefill_chunk)
    bar.update(len(prompts))
    ll: dict = {"checked_prompts": len(sub), "generated_tokens": sum(map(len, ar1_out)), "max_new_tokens": s.max_new_tokens}
    nb = s.batch_size if s.batch_size > 1 else 2              # batch 1 is the reference itself
    ar_noise = ar_out if s.batch_size > 1 else measure(eng, sub, m, speculative=False, temperature=0.0,
                                                       batch_size=2, run="fp8/ar_b2")[1]
    ll["statistical"] = statistical_check(m, eng.target.model, sub, spec_out, ar1_out,
                                          {f"autoregressive_batch{nb}": ar_noise,
                                           f"autoregressive_prefill_chunk{s.noise_prefill_chunk}": chunked})
    if exact:
        ll["exact"] = exact_check(m, eng, sub, "fp8", spec_out=spec_out, ar1_out=ar1_out)
    sd, ad = spec.as_dict(), ar.as_dict()
    ar_fwd = len(ar.rows_per_step)
    t_ar = ar.target_s / ar_fwd if ar_fwd else None
    t_ver = spec.target_s / len(spec.rows_per_step) if spec.rows_per_step else None
    t_draft = spec.draft_s / len(spec.rows_per_step) if spec.rows_per_step else None
    block = get_algorithm(algorithm).drafts_block      # the whole draft in one pass (DFlash)
    passes = 1 if block else K
    step_ms = {"batch_size": s.batch_size, "draft_len": K, "target_ar": _ms(t_ar), "target_verify": _ms(t_ver),
               "draft_step": _ms(t_draft), "draft_pass": _ms(t_draft / passes if t_draft else None),
               "draft_passes_per_step": passes, "overhead_per_step": sd["overhead_ms_per_step"]}
    tps = {"speculative": round(spec.output_tokens / (t1 - t0), 2), "autoregressive": round(ar.output_tokens / (t2 - t1), 2),
           "decode_speculative": sd["decode_tokens_per_s"], "decode_autoregressive": ad["decode_tokens_per_s"]}
    tps["speedup"] = round(tps["speculative"] / tps["autoregressive"], 3)
    if t_ar and t_ver and t_draft:
        tps["predicted_speedup"] = round(predicted_speedup(spec.acceptance_length, K, t_ar, t_draft / passes, t_ver,
                                                           parallel_draft=block), 3)
    log.info("tokens/s: speculative %.1f vs autoregressive %.1f (x%.2f; predicted x%s from AL and step costs)",
             tps["speculative"], tps["autoregressive"], tps["speedup"], tps.get("predicted_speedup"))
    return ll, tps, step_ms


STATISTIC = ("first-divergence rate per compared token of greedy output vs batch-1 autoregressive output "
             "(diverging prompts / token positions compared up to and including each first divergence)")


def statistical_check(m: Measurement, model, sub, spec_out, ref, noise_arms: dict) -> dict:
    """Deployed pair: the speculative arm's first-divergence rate against batch-1 autoregressive decoding,
    tested against the pooled rate of the noise arms (the same target and prompts, autoregressive, other
    forward shapes)."""
    from runtime.engine.lossless import divergence, lossless_diff, rate_test, tie_margins

    log, s, K = m.log, m.s, m.K
    spec = divergence(spec_out, ref)
    noise = {name: divergence(outs, ref) for name, outs in noise_arms.items()}
    d_n = sum(v["diverging"] for v in noise.values())
    e_n = sum(v["exposure"] for v in noise.values())
    n_p = sum(v["prompts"] for v in noise.values())
    noise["pooled"] = {"prompts": n_p, "diverging": d_n, "share_diverging": round(d_n / n_p, 4) if n_p else 0.0,
                       "exposure": e_n, "rate_per_token": round(d_n / e_n, 6) if e_n else 0.0}
    t = rate_test(spec["diverging"], spec["exposure"], d_n, e_n, ratio=s.max_divergence_ratio, alpha=s.divergence_alpha)
    # the target's own top-2 margin where speculative decoding diverged (informative: FP8 noise flips tokens
    # far beyond fp32 ties)
    def margins(outs):
        return [round(b["margin"], 4) for b in tie_margins(model, sub, ref, lossless_diff(outs, ref)[:4])]

    out = {"pair": "fp8", "statistic": STATISTIC, "reference": "autoregressive, batch 1, one prefill forward",
           "speculative_arm": f"speculative, batch {s.batch_size}, k={K}", "speculative": spec, "noise": noise,
           "test": "one-sided exact conditional binomial test of two Poisson rates, H0: rate_speculative <= ratio x "
                   "rate_noise (pooled arms)",
           "ratio": s.max_divergence_ratio, "alpha": s.divergence_alpha,
           "threshold": f"p >= {s.divergence_alpha} for H0 rate_speculative <= {s.max_divergence_ratio} x rate_noise",
           "p_value": t["p_value"], "passed": t["passed"], "speculative_divergence_margins": margins(spec_out),
           "noise_divergence_margins": [m for outs in noise_arms.values() for m in margins(outs)]}
    log.info("statistical lossless check (deployed pair, %d prompts): speculative diverges on %d (rate %.4f/token), "
             "noise floor %d of %d arm-prompts (rate %.4f/token: %s); p = %.4g for H0 rate <= %.2f x noise -> %s",
             len(sub), spec["diverging"], spec["rate_per_token"], d_n, n_p, noise["pooled"]["rate_per_token"],
             ", ".join(f"{k} {v['diverging']}/{v['prompts']}" for k, v in noise.items() if k != "pooled"),
             t["p_value"], s.max_divergence_ratio, "pass" if t["passed"] else "FAIL")
    log.info("top-2 logit margins where the outputs diverged: speculative %s, noise arms %s (an fp32 tie is < 1e-3)",
             out["speculative_divergence_margins"], out["noise_divergence_margins"])
    return out


def _ms(secs):
    return None if secs is None else round(1000 * secs, 4)


