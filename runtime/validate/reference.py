"""Acceptance of a target + draft pair per evaluation domain on specpipe's reference runtime
(`runtime.engine.speculative`): each pair loaded from its exported files, speculative decoding of every domain's
prompts (acceptance length, per-position acceptance), the lossless check and speed on the deployed pair
(lossless_arms.py), the other EAGLE-3 first-layer norm, n-gram drafting on the deployed target (ngram.py), the trained
draft with the suffix-automaton enhancer (hybrid.py), and the acceptance-rule invariant tallied over every run."""
from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.errors import RuntimeFailure
from runtime.validate.decode import Measurement, MeasureSettings, lossless_subset, measure
from runtime.validate.hybrid import measure_hybrid
from runtime.validate.lossless_arms import exact_check, lossless_and_speed
from runtime.validate.ngram_arm import measure_ngram


class DraftLoadError(RuntimeFailure):
    """A pair's draft does not load as exported (`runtime.engine.drafts.DraftFormatError`)."""


@dataclass(frozen=True)
class Pairs:
    """The pairs validate measures ({"target_dir", "draft_dir"} each): the deployed one, the unquantized one (None:
    not measured) and whether they are the same pair (quantize deployed the unquantized one)."""

    deployed: dict
    bf16: dict | None = None
    same: bool = False


@dataclass(frozen=True)
class PairLoading:
    """How a pair's files load: the device, and the capture layers training used (None: unchecked)."""

    device: str
    expected: object = None


def run_reference(s: MeasureSettings, pairs: Pairs, prompts: dict, eos, *, load: PairLoading, log, progress) -> dict:
    """Measure the deployed pair (label "fp8") and, when given, the unquantized pair ("bf16") on `prompts`
    ({domain: [prompt ids]}). `progress`: a progress-bar factory (`progress(total=, desc=)`, a context manager);
    `pairs.same`: the deployed pair is the unquantized one (the exact check runs on it). Returns {"domains",
    "overall", "lossless", "draft_len", ...}."""
    import torch

    from runtime.engine.drafts import summarize
    from runtime.engine.lossless import InvariantTally
    from runtime.engine.speculative import SpeculativeEngine

    dev = load.device
    labelled = [("fp8", pairs.deployed)] + ([("bf16", pairs.bf16)] if pairs.bf16 else [])
    res: dict = {"domains": {d: {} for d in prompts}, "overall": {}}
    tallies = {label: InvariantTally() for label, _ in labelled}
    ll: dict = {}
    K = s.max_draft_len
    measured = [label for label, _ in labelled if label == "fp8" or s.measure_bf16]
    n_runs = len(measured) * len(prompts) + (len(labelled) * len(prompts) if s.lossless_prompts else 0) \
        + (len(prompts) if s.draft_kv_cache == "fp8" else 0) + (len(prompts) if s.ngram else 0) \
        + (len(prompts) * len(s.hybrid.thresholds) if s.hybrid else 0)
    with progress(total=n_runs, desc="validate") as bar:
        for label, pair in labelled:
            model, draft = load_measured_pair(s, label, pair, load)
            K = dflash_draft_len(log, draft, K)
            m = Measurement(s, K, eos, tallies[label], log)
            res.setdefault("draft", summarize(draft))
            res.setdefault("fp8_info", getattr(model, "fp8_info", {}))
            eng = SpeculativeEngine(model, draft)
            tally = tallies[label]
            if label in measured:
                res["overall"][label] = acceptance_per_domain(m, eng, prompts, label, res, bar,
                                                              vocab=draft_vocab_ids(draft) if label == "fp8" else None)
            if label == "fp8" and s.ngram:
                measure_ngram(m, model, s.ngram, prompts, res, bar)
            if label == "fp8" and s.hybrid:
                measure_hybrid(m, model, draft, replace(s.hybrid, k=K), prompts, res, bar)
            if label == "fp8":
                ll, res["tokens_per_s"], res["step_ms"] = lossless_and_speed(
                    m, eng, prompts, bar, draft.algorithm, exact=pairs.same)
                if draft.traits.first_layer_norm_choice and s.measure_other_norm:
                    other_norm(m, model, pair, load, prompts, res)
                if s.draft_kv_cache == "fp8":
                    other_draft_kv(m, model, pair, load, prompts, res)
                    bar.update(len(prompts))
            elif s.lossless_prompts:
                ll["exact"] = exact_check(m, eng, lossless_subset(prompts, s), "bf16")
                bar.update(len(prompts))
            log.info("acceptance-rule invariant on the %s pair: %d violations in %d verification rows of %d runs",
                     label, tally.violations, tally.rows, tally.generations)
            del eng, model, draft
            if dev == "cuda":
                torch.cuda.empty_cache()
    inv = {label: t.as_dict() for label, t in tallies.items()}
    ll["invariant"] = {"passed": all(v["passed"] for v in inv.values()), "pairs": inv}
    ll["passed"] = all(part["passed"] for part in (ll.get("exact"), ll.get("statistical"), ll["invariant"])
                       if part is not None and part.get("passed") is not None)
    res["lossless"] = ll
    res["draft_len"] = K
    return res


def load_measured_pair(s: MeasureSettings, label: str, pair: dict, load: PairLoading):
    """(target, draft) of one pair through runtime.engine.speculative; DraftLoadError when the draft does not load."""
    from runtime.engine.drafts import DraftFormatError
    from runtime.engine.speculative import load_pair

    try:
        return load_pair(pair["target_dir"], pair["draft_dir"], device=load.device, first_layer_norm=s.first_layer_norm,
                         expected_capture_layers=load.expected, kv_cache=s.draft_kv_cache if label == "fp8" else "bf16")
    except DraftFormatError as e:
        raise DraftLoadError(f"the {label} draft does not load as exported: {e}") from None


def dflash_draft_len(log, draft, K: int) -> int:
    """`K`, or the most a DFlash draft of its block size drafts when that is fewer (logged)."""
    kmax = draft.traits.draft_len_cap(getattr(draft, "block_size", None))
    if kmax is not None and K > kmax:
        log.warning("DFlash block_size %d drafts at most %d tokens: measuring %d positions, not %d",
                    draft.block_size, kmax, kmax, K)
        return kmax
    return K


def draft_vocab_ids(draft) -> set[int] | None:
    """The target ids an EAGLE-3 draft with a reduced vocabulary can propose (target_id = draft_id + d2t[draft_id]);
    None for a draft that proposes any target token."""
    d2t = getattr(draft, "d2t", None)
    if d2t is None:
        return None
    return {i + int(o) for i, o in enumerate(d2t.tolist())}


def outside_share(vocab: set[int] | None, outs: list[list[int]]) -> float | None:
    """The share of the generated tokens `outs` outside the draft vocabulary `vocab` (0.0 for a full one)."""
    toks = [t for o in outs for t in o]
    if not toks:
        return None
    return 0.0 if vocab is None else round(sum(t not in vocab for t in toks) / len(toks), 4)


def acceptance_per_domain(m: Measurement, eng, prompts: dict, label: str, res: dict, bar,
                          vocab: set[int] | None = None) -> dict:
    """Speculative decoding of every domain's prompts with the pair `label`: each domain's statistics into
    res["domains"][domain][label] with `outside_draft_vocab`, the share of the generated tokens (the target's own,
    the decoding being lossless) that the draft's vocabulary `vocab` lacks, and `per_prompt` ([steps, accepted] per
    prompt: the agreement gate's noise, runtime/validate/agreement.py); returns the statistics over all domains."""
    total = None
    for d, ps in prompts.items():
        rows: list = []
        st, outs = measure(eng, ps, m, speculative=True, run=f"{label}/{d}", per_prompt=rows)
        res["domains"][d][label] = {**st.as_dict(), "prompts": len(ps), "outside_draft_vocab": outside_share(vocab, outs),
                                    "per_prompt": rows}
        total = st if total is None else total.merge(st)
        m.log.info("%s %s: AL %.3f over %d steps, acceptance rate %s, per position %s", label, d,
                 st.acceptance_length, st.steps, res["domains"][d][label]["draft_acceptance_rate"],
                 res["domains"][d][label]["per_position"])
        bar.update(1)
    return total.as_dict()


def other_norm(m: Measurement, model, pair: dict, load: PairLoading, prompts: dict, res: dict) -> None:
    """The deployed pair once more with the other EAGLE-3 first-layer norm: ModelOpt trains with
    hidden_norm(input_layernorm(h)), TensorRT-LLM/vLLM/SGLang serve hidden_norm(h) (docs/stages/validate.md)."""
    from runtime.engine.drafts import load_draft
    from runtime.engine.speculative import SpeculativeEngine
    from runtime.engine.target import target_shape

    log, s = m.log, m.s
    other = "serving" if s.first_layer_norm == "modelopt" else "modelopt"
    draft = load_draft(pair["draft_dir"], target_shape(model), device=load.device, first_layer_norm=other,
                       expected_capture_layers=load.expected, kv_cache=s.draft_kv_cache)
    eng = SpeculativeEngine(model, draft)
    for d, ps in prompts.items():
        st = measure(eng, ps, m, speculative=True, run=f"fp8_{other}_norm/{d}")[0]
        res["domains"][d]["fp8_other_norm"] = {"first_layer_norm": other, "acceptance_length": round(st.acceptance_length, 6),
                                               "per_position": st.as_dict()["per_position"]}
        log.info("fp8 %s with first_layer_norm=%s: AL %.3f (vs %.3f with %s)", d, other, st.acceptance_length,
                 res["domains"][d]["fp8"]["acceptance_length"], s.first_layer_norm)


def other_draft_kv(m: Measurement, model, pair: dict, load: PairLoading, prompts: dict, res: dict) -> None:
    """The deployed pair once more with the draft's KV cache in BF16, when the engine runs it in FP8 (one-model
    TensorRT-LLM next to an FP8-KV target, runtime.engine.drafts.loading.DRAFT_KV_FP8_SCALE): both figures are
    reported, the FP8 one is gated. res["domains"][d] / res["overall"] get "fp8_other_draft_kv"."""
    from runtime.engine.drafts import load_draft
    from runtime.engine.speculative import SpeculativeEngine
    from runtime.engine.target import target_shape

    log, s = m.log, m.s
    draft = load_draft(pair["draft_dir"], target_shape(model), device=load.device, first_layer_norm=s.first_layer_norm,
                       expected_capture_layers=load.expected, kv_cache="bf16")
    eng = SpeculativeEngine(model, draft)
    total = None
    for d, ps in prompts.items():
        st = measure(eng, ps, m, speculative=True, run=f"fp8_bf16_draft_kv/{d}")[0]
        total = st if total is None else total.merge(st)
        res["domains"][d]["fp8_other_draft_kv"] = _kv_arm(st)
        log.info("fp8 %s with the draft's KV cache in BF16: AL %.3f (FP8 KV, as the engine runs it: %.3f)", d,
                 st.acceptance_length, res["domains"][d]["fp8"]["acceptance_length"])
    res["overall"]["fp8_other_draft_kv"] = _kv_arm(total)


def _kv_arm(st) -> dict:
    return {"draft_kv_cache": "bf16", "acceptance_length": round(st.acceptance_length, 6),
            "per_position": st.as_dict()["per_position"]}
