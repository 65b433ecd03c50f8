"""The measurement settings of the validate stage and the one way it decodes: a prompt set in batches, every
generate call checked by the acceptance-rule invariant (`runtime.engine.lossless.checked_generate`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeasureSettings:
    """What a measurement runs with (the validate stage builds it from its section and gates)."""

    max_draft_len: int
    max_new_tokens: int
    batch_size: int
    temperature: float
    seed: int
    lossless_prompts: int          # per domain, for the exact and statistical checks (0: skip them)
    noise_prefill_chunk: int       # the chunk size of the noise floor's chunked-prefill arm
    measure_bf16: bool             # also measure the unquantized pair's acceptance
    first_layer_norm: str          # EAGLE-3 first-layer norm: "modelopt" or "serving"
    measure_other_norm: bool       # EAGLE-3: the deployed pair once more with the other norm
    tie_margin: float              # exact check: a divergence below this logit gap is an fp32 tie
    max_divergence_ratio: float    # statistical check: H0 rate_speculative <= ratio x rate_noise
    divergence_alpha: float        # statistical check: fail when H0 is rejected at this p-value
    draft_kv_cache: str = "bf16"   # the deployed pair's draft KV cache as the engine runs it: "bf16" or "fp8"
    ngram: object = None           # runtime.validate.ngram_arm.NgramSettings: also measure n-gram drafting (None: not)
    hybrid: object = None          # runtime.validate.hybrid.HybridSettings: the trained draft + SA enhancer (None: not)


@dataclass(frozen=True)
class Measurement:
    """One pair being measured: the settings, the draft length `K` it decodes at, the end-of-sequence id(s), the
    acceptance-rule invariant tally its generate calls are checked by (None: unchecked) and the stage's log."""

    s: MeasureSettings
    K: int
    eos: object
    tally: object = None
    log: object = None


def measure(eng, prompts, m: Measurement, *, speculative: bool, temperature: float | None = None,
            batch_size: int | None = None, run: str = "", per_prompt: list | None = None):
    """Decode `prompts` in batches; every generate call is checked by the acceptance-rule invariant (`m.tally`).
    Returns (the merged RunStats, the output tokens per prompt); `per_prompt` (a list) gets one
    [verification steps, accepted draft tokens] row per prompt, in order."""
    from runtime.engine.lossless import checked_generate
    from runtime.engine.sampling import Sampling
    from runtime.engine.stats import RunStats

    s, K, eos, tally = m.s, m.K, m.eos, m.tally
    bs = batch_size or s.batch_size
    total, outs = RunStats(K if speculative else 0), []
    for i in range(0, len(prompts), bs):
        g, _ = checked_generate(eng, prompts[i:i + bs], tally=tally, run=run, max_new_tokens=s.max_new_tokens,
                                draft_len=K if speculative else 0, eos_token_id=eos,
                                sampling=Sampling(s.temperature if temperature is None else temperature, seed=s.seed + i))
        total = total.merge(g.stats)
        outs += g.tokens
        if per_prompt is not None:
            per_prompt += [[r.steps, r.accepted] for r in g.requests]
    return total, outs


def lossless_subset(prompts: dict, s: MeasureSettings) -> list[list[int]]:
    """The first `lossless_prompts` prompts of every domain: what the exact and statistical checks decode."""
    return [p for ps in prompts.values() for p in ps[:s.lossless_prompts]]
