"""Stage `validate`: acceptance of the deployed pair, per evaluation domain, against gates.

Measured on what will be deployed: the target and draft directories named by `quantize.json` (the FP8 target,
and the draft to deploy), read from their exported files by `runtime.engine.speculative`. The unquantized pair
(`target/model` + `train_draft/draft`) is measured the same way, so retention = AL(deployed) / AL(BF16) shows
what quantization cost (a draft trained on BF16 hidden states can lose acceptance on an FP8 target).

Per domain and pair: acceptance length (TensorRT-LLM's definition), per-position conditional acceptance up to
`validate.max_draft_len` (the `tune` stage derives the deployed length from these curves), draft acceptance
rate, drafted/accepted totals. Also tokens/s of speculative vs autoregressive decoding and the step costs.

The lossless check has three parts (`runtime/engine/lossless.py`, docs/stages/validate.md says what each proves):
exact on the unquantized pair (greedy speculative == autoregressive, token for token, fp32 ties excepted);
the acceptance-rule invariant on every decoding run of both pairs (each emitted token is what the rule picks
from the logits of the same verification forward; the stream and the cache length are continuous); and
statistical on the deployed pair (speculative output diverges from batch-1 autoregressive output no faster
than the FP8 target's own noise floor: autoregressive decoding at another batch size and with a chunked
prefill).

Gates (`validate.gates`): a per-domain minimum AL, an overall minimum AL, a minimum retention, and the
lossless check (`require_lossless`: all three parts must pass). A failed gate fails the stage (nothing
downstream runs); the table of measured vs required is in the error message, the stage log and
`<scratch>/acceptance.json` (a failed stage commits nothing).

`validate.runtime`: `reference` (this project's runtime, CPU or CUDA), `tensorrt_llm` (the TensorRT-LLM LLM
API with the same speculative config; only where tensorrt_llm imports and a GPU exists), `auto` (tensorrt_llm
there, reference elsewhere). The artifact records which ran.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import quantize as quantize_artifact
from pipeline.artifacts import target as target_artifact
from pipeline.artifacts import train_draft as train_draft_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict

NAME = "validate"
CONSUMES: tuple[str, ...] = ("target", "data", "train_draft", "quantize")
VERSION = "2"
PACKAGES = ("torch", "transformers", "safetensors")


class Gates(Strict):
    """Minimums the deployed pair must reach. AL is measured with `validate.max_draft_len` draft tokens."""

    min_acceptance_length: float | dict[str, float] | None = Field(
        None, description="per-domain minimum AL: one number for every domain, or {domain: minimum}")
    min_overall_acceptance_length: float | None = Field(None, ge=1.0, description="minimum AL over all domains")
    min_retention: float | None = Field(None, gt=0, le=1.5, description="minimum AL(deployed)/AL(BF16) per domain and overall")
    require_lossless: bool = Field(True, description=(
        "fail unless the lossless check passes: exact on the unquantized pair, the acceptance-rule invariant on "
        "every run, and the deployed pair's divergence within the target's noise floor"))
    tie_margin: float = Field(1e-3, ge=0, description=(
        "unquantized pair only: a divergence between the two tokens whose logits (one fresh forward) differ by "
        "less than this is an fp32 accumulation-order tie (reported, not failed); measured noise is ~1e-4"))
    max_divergence_ratio: float = Field(1.0, gt=0, description=(
        "deployed pair: the speculative divergence rate (first divergences per compared token, vs batch-1 "
        "autoregressive) may be at most this times the noise floor's rate (H0 of the test)"))
    divergence_alpha: float = Field(0.01, gt=0, lt=1, description=(
        "deployed pair: fail when the one-sided exact test rejects H0 (rate <= ratio x noise) at this p-value"))


class Config(StageSection):
    runtime: Literal["auto", "reference", "tensorrt_llm"] = "auto"
    max_draft_len: int = Field(4, ge=1, le=16, description="draft tokens per step while measuring (DFlash: capped at "
                                                           "block_size-1)")
    max_new_tokens: int = Field(48, ge=1)
    num_prompts: int = Field(16, ge=1, description="prompts per domain (at most what `data` wrote)")
    batch_size: int = Field(4, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy acceptance; > 0 = rejection sampling")
    lossless_prompts: int = Field(8, ge=0, description=(
        "prompts per domain for the exact and statistical lossless checks (0: skip them; the invariant still "
        "checks every run)"))
    noise_prefill_chunk: int = Field(16, ge=1, description=(
        "noise floor: the chunk size of the chunked-prefill autoregressive arm"))
    measure_bf16: bool = Field(True, description="also measure the unquantized pair (needed for retention)")
    first_layer_norm: Literal["modelopt", "serving"] = Field(
        "modelopt", description="EAGLE-3 first-layer norm: as ModelOpt trains it, or as serving engines compute it")
    measure_other_norm: bool = Field(
        True, description="EAGLE-3: also measure the deployed pair with the other first-layer norm (informative, not gated)")
    seed: int = 0
    gates: Gates = Field(default_factory=Gates)


def check(cfg) -> list[tuple[str, str]]:
    problems = []
    sec: Config = cfg.validate
    data = getattr(cfg, "data", None)
    domains = set(getattr(data, "eval_domains", {}) or {})
    g = sec.gates.min_acceptance_length
    if isinstance(g, dict):
        for d, v in g.items():
            if domains and d not in domains:
                problems.append((f"validate.gates.min_acceptance_length.{d}",
                                 f"unknown domain; data.eval_domains has {', '.join(sorted(domains))}"))
            if v < 1.0:
                problems.append((f"validate.gates.min_acceptance_length.{d}", f"{v} < 1: AL is at least 1 by definition"))
    elif g is not None and g < 1.0:
        problems.append(("validate.gates.min_acceptance_length", f"{g} < 1: AL is at least 1 by definition"))
    if g is not None and not isinstance(g, dict) and g > sec.max_draft_len + 1:
        problems.append(("validate.gates.min_acceptance_length",
                         f"{g} > max_draft_len + 1 = {sec.max_draft_len + 1}: no draft can reach it"))
    mo = sec.gates.min_overall_acceptance_length
    if mo is not None and mo > sec.max_draft_len + 1:
        problems.append(("validate.gates.min_overall_acceptance_length",
                         f"{mo} > max_draft_len + 1 = {sec.max_draft_len + 1}: no draft can reach it"))
    if sec.gates.min_retention is not None and not sec.measure_bf16:
        problems.append(("validate.gates.min_retention", "needs validate.measure_bf16: true"))
    return problems


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    sec: Config = ctx.section
    runtime, why = _choose_runtime(sec.runtime)
    ctx.log.info("runtime: %s (%s)", runtime, why)
    arts = ctx.input("quantize").path.parent
    q = quantize_artifact.read_info(ctx.input("quantize").path)
    deployed = {"target_dir": arts / q.target_rel, "draft_dir": arts / q.draft_rel}
    bf16 = {"target_dir": target_artifact.model_dir(ctx.input("target").path),
            "draft_dir": train_draft_artifact.draft_dir(ctx.input("train_draft").path)}
    for pair in (deployed, bf16):
        for k, p in pair.items():
            if not Path(p).is_dir():
                raise StageError(f"validate: {k} {p} does not exist (quantize.json or the train_draft artifact is incomplete)")
    same = all(Path(deployed[k]).resolve() == Path(bf16[k]).resolve() for k in deployed)
    eos = target_artifact.stop_ids(target_artifact.read_info(ctx.input("target").path))
    ctx.log.info("generation stops at token ids %s (target.json)", eos)
    prompts = _read_prompts(ctx, sec)

    # the unquantized pair runs when it is measured, and for the exact lossless check
    need_bf16 = not same and (sec.measure_bf16 or sec.lossless_prompts > 0)
    if runtime == "tensorrt_llm":
        res = _run_trtllm(ctx, sec, deployed, bf16 if sec.measure_bf16 and not same else None, prompts, eos)
    else:
        res = _run_reference(ctx, sec, deployed, bf16 if need_bf16 else None, prompts, eos, same=same)
    if sec.measure_bf16 and same:
        ctx.log.info("quantize deployed the unquantized pair: the BF16 figures are the deployed ones")
        for d in res["domains"].values():
            d["bf16"] = d["fp8"]
        res["overall"]["bf16"] = res["overall"]["fp8"]
    _add_retention(res)
    res.update({"runtime": runtime, "runtime_reason": why, "max_draft_len": res.pop("draft_len"),
                "requested_max_draft_len": sec.max_draft_len, "temperature": sec.temperature,
                "max_new_tokens": sec.max_new_tokens, "batch_size": sec.batch_size, "eos_token_ids": eos,
                "pairs": {"fp8": {k: str(Path(v).relative_to(arts)) for k, v in deployed.items()},
                          "bf16": {k: str(Path(v).relative_to(arts)) for k, v in bf16.items()}},
                "same_pair": same})
    res["gates"] = evaluate_gates(res, sec.gates)
    table = gate_table(res["gates"]["rows"])
    text = json.dumps(res, indent=2)
    (ctx.scratch_dir / "acceptance.json").write_text(text)
    ctx.log.info("gates:\n%s", table)
    if not res["gates"]["passed"]:
        # failed_metrics (status --json, report) keep the whole measurement, table included
        raise StageError("validate: acceptance gate failed; the pair is not deployed.\n" + table +
                         f"\n(full measurements: {ctx.scratch_dir / 'acceptance.json'}; lower validate.gates or "
                         "train a better draft / keep the draft BF16 / quantize with calibration data of the domain; "
                         "a failed lossless row is a defect of the decoding engine or of the deployed checkpoints, "
                         "see docs/stages/validate.md)",
                         metrics=res)
    (ctx.out_dir / "acceptance.json").write_text(text)
    metrics = {"runtime": runtime, "max_draft_len": res["max_draft_len"], "gates_passed": True,
               "lossless": res["lossless"].get("passed"),
               "lossless_check": lossless_summary(res["lossless"]),
               "overall_acceptance_length": res["overall"]["fp8"]["acceptance_length"],
               "overall_retention": res["overall"].get("retention"),
               "acceptance_length": {d: v["fp8"]["acceptance_length"] for d, v in res["domains"].items()},
               "retention": {d: v.get("retention") for d, v in res["domains"].items()},
               "speedup_measured": res.get("tokens_per_s", {}).get("speedup")}
    return metrics


def lossless_summary(ll: dict) -> dict:
    """The lossless check in a few numbers, each part with what it measured and what it required (stage
    metrics, so `status --json` shows the statistic and its threshold)."""
    out: dict = {"passed": ll.get("passed")}
    if ex := ll.get("exact"):
        out["exact"] = {k: ex.get(k) for k in ("pair", "passed", "compared_prompts", "generated_tokens", "differ",
                                               "numerical_ties", "tie_margin")}
    if inv := ll.get("invariant"):
        out["invariant"] = {"passed": inv.get("passed"),
                            **{p: {k: v.get(k) for k in ("rows_checked", "forwards", "violations", "by_kind")}
                               for p, v in inv.get("pairs", {}).items()}}
    if st := ll.get("statistical"):
        out["statistical"] = {k: st.get(k) for k in ("pair", "statistic", "reference", "threshold", "test", "passed",
                                                     "p_value", "ratio", "alpha")}
        out["statistical"]["rate_speculative"] = st["speculative"]["rate_per_token"]
        out["statistical"]["rate_noise"] = st["noise"]["pooled"]["rate_per_token"]
        out["statistical"]["share_diverging_speculative"] = st["speculative"]["share_diverging"]
        out["statistical"]["share_diverging_noise"] = st["noise"]["pooled"]["share_diverging"]
    return out


def _choose_runtime(want: str) -> tuple[str, str]:
    ok, why = trtllm_available()
    if want == "tensorrt_llm" and not ok:
        raise StageError(f"validate.runtime: tensorrt_llm requested but not usable here ({why}); "
                         "use runtime: auto or reference, or run in a TensorRT-LLM container with a GPU")
    if want == "reference":
        return "reference", "configured"
    if ok:
        return "tensorrt_llm", "tensorrt_llm importable and a CUDA GPU present"
    return "reference", f"auto: {why}"


def trtllm_available() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None:
        return False, "tensorrt_llm is not installed"
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    return True, "available"


def _read_prompts(ctx: StageContext, sec: Config) -> dict[str, list[list[int]]]:
    out = {d: [p.prompt_ids for p in ps]
           for d, ps in data_artifact.read_eval(ctx.input("data").path, per_domain=sec.num_prompts).items()}
    g = sec.gates.min_acceptance_length
    if isinstance(g, dict) and (missing := sorted(set(g) - set(out))):
        raise StageError(f"validate.gates.min_acceptance_length names domains {missing} that data did not write")
    return out


def _device(ctx) -> str:
    """`run.device` (not part of any fingerprint): auto = CUDA when present."""
    import torch

    want = getattr(getattr(ctx.config, "run", None), "device", "auto")
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise StageError("run.device: cuda requested but no CUDA GPU is available")
    return want


def _run_reference(ctx, sec: Config, deployed: dict, bf16: dict | None, prompts: dict, eos, *, same: bool = False) -> dict:
    import torch

    from runtime.engine.drafts import summarize
    from runtime.engine.lossless import InvariantTally
    from runtime.engine.speculative import SpeculativeEngine

    dev = _device(ctx)
    pairs = [("fp8", deployed)] + ([("bf16", bf16)] if bf16 else [])
    expected = _trained_layers(ctx)
    res: dict = {"domains": {d: {} for d in prompts}, "overall": {}}
    tallies = {label: InvariantTally() for label, _ in pairs}
    ll: dict = {}
    K = sec.max_draft_len
    measured = [label for label, _ in pairs if label == "fp8" or sec.measure_bf16]
    n_runs = len(measured) * len(prompts) + (len(pairs) * len(prompts) if sec.lossless_prompts else 0)
    with ctx.progress(total=n_runs, desc="validate") as bar:
        for label, pair in pairs:
            model, draft = _load_measured_pair(sec, label, pair, dev, expected)
            K = _dflash_draft_len(ctx, draft, K)
            res.setdefault("draft", summarize(draft))
            res.setdefault("fp8_info", getattr(model, "fp8_info", {}))
            eng = SpeculativeEngine(model, draft)
            tally = tallies[label]
            if label in measured:
                res["overall"][label] = _acceptance_per_domain(ctx, eng, sec, K, eos, prompts, tally, label, res, bar)
            if label == "fp8":
                ll, res["tokens_per_s"], res["step_ms"] = _lossless_and_speed(
                    ctx, eng, sec, K, eos, prompts, bar, draft.algorithm, tally, exact=same)
                if draft.algorithm == "eagle3" and sec.measure_other_norm:
                    _other_norm(ctx, sec, model, pair, expected, K, eos, prompts, res, dev, tally)
            elif sec.lossless_prompts:
                ll["exact"] = _exact(ctx, eng, sec, K, eos, _lossless_subset(prompts, sec), tally, "bf16")
                bar.update(len(prompts))
            ctx.log.info("acceptance-rule invariant on the %s pair: %d violations in %d verification rows of %d runs",
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


def _load_measured_pair(sec: Config, label: str, pair: dict, dev, expected):
    """(target, draft) of one pair through runtime.engine.speculative; StageError when the draft does not load."""
    from runtime.engine.drafts import DraftFormatError
    from runtime.engine.speculative import load_pair

    try:
        return load_pair(pair["target_dir"], pair["draft_dir"], device=dev, first_layer_norm=sec.first_layer_norm,
                         expected_capture_layers=expected)
    except DraftFormatError as e:
        raise StageError(f"validate: the {label} draft does not load as exported: {e}") from None


def _dflash_draft_len(ctx, draft, K: int) -> int:
    """`K`, or the most a DFlash draft of its block size drafts when that is fewer (logged)."""
    from runtime.trtllm.draft_schedule import dflash_max_draft_len

    if draft.algorithm == "dflash" and K > dflash_max_draft_len(draft.block_size):
        kmax = dflash_max_draft_len(draft.block_size)
        ctx.log.warning("DFlash block_size %d drafts at most %d tokens: measuring %d positions, not %d",
                        draft.block_size, kmax, kmax, K)
        return kmax
    return K


def _acceptance_per_domain(ctx, eng, sec: Config, K: int, eos, prompts: dict, tally, label: str, res: dict, bar) -> dict:
    """Speculative decoding of every domain's prompts with the pair `label`: each domain's statistics into
    res["domains"][domain][label]; returns the statistics over all domains."""
    total = None
    for d, ps in prompts.items():
        st = _measure(eng, ps, sec, K, eos, speculative=True, tally=tally, run=f"{label}/{d}")[0]
        res["domains"][d][label] = st.as_dict()
        total = st if total is None else total.merge(st)
        ctx.log.info("%s %s: AL %.3f over %d steps, acceptance rate %s, per position %s", label, d,
                     st.acceptance_length, st.steps, res["domains"][d][label]["draft_acceptance_rate"],
                     res["domains"][d][label]["per_position"])
        bar.update(1)
    return total.as_dict()


def _other_norm(ctx, sec: Config, model, pair, expected, K, eos, prompts, res, dev, tally) -> None:
    """The deployed pair once more with the other EAGLE-3 first-layer norm: ModelOpt trains with
    hidden_norm(input_layernorm(h)), TensorRT-LLM/vLLM/SGLang serve hidden_norm(h) (docs/stages/validate.md)."""
    from runtime.engine.drafts import load_draft
    from runtime.engine.speculative import SpeculativeEngine, target_shape

    other = "serving" if sec.first_layer_norm == "modelopt" else "modelopt"
    draft = load_draft(pair["draft_dir"], target_shape(model), device=dev, first_layer_norm=other,
                       expected_capture_layers=expected)
    eng = SpeculativeEngine(model, draft)
    for d, ps in prompts.items():
        st = _measure(eng, ps, sec, K, eos, speculative=True, tally=tally, run=f"fp8_{other}_norm/{d}")[0]
        res["domains"][d]["fp8_other_norm"] = {"first_layer_norm": other, "acceptance_length": round(st.acceptance_length, 6),
                                               "per_position": st.as_dict()["per_position"]}
        ctx.log.info("fp8 %s with first_layer_norm=%s: AL %.3f (vs %.3f with %s)", d, other, st.acceptance_length,
                     res["domains"][d]["fp8"]["acceptance_length"], sec.first_layer_norm)


def _trained_layers(ctx) -> list[int] | None:
    """The capture layers training used, from train_draft's draft.json (None when it does not say)."""
    f = ctx.input("train_draft").path / "draft.json"
    if not f.exists():
        return None
    info = json.loads(f.read_text())
    return info.get("aux_layer_ids") if info.get("algorithm") == "eagle3" else info.get("target_layer_ids")


def _measure(eng, prompts, sec: Config, K: int, eos, *, speculative: bool, temperature: float | None = None,
             batch_size: int | None = None, tally=None, run: str = ""):
    """Decode `prompts` in batches; every generate call is checked by the acceptance-rule invariant (`tally`)."""
    from runtime.engine.lossless import checked_generate
    from runtime.engine.speculative import RunStats

    bs = batch_size or sec.batch_size
    total, outs = RunStats(K if speculative else 0), []
    for i in range(0, len(prompts), bs):
        g, _ = checked_generate(eng, prompts[i:i + bs], tally=tally, run=run, max_new_tokens=sec.max_new_tokens,
                                draft_len=K if speculative else 0,
                                temperature=sec.temperature if temperature is None else temperature,
                                eos_token_id=eos, seed=sec.seed + i, speculative=speculative)
        total = total.merge(g.stats)
        outs += g.tokens
    return total, outs


def _lossless_subset(prompts: dict, sec: Config) -> list[list[int]]:
    return [p for ps in prompts.values() for p in ps[:sec.lossless_prompts]]


def _exact(ctx, eng, sec: Config, K: int, eos, sub, tally, label: str, spec_out=None, ar1_out=None) -> dict:
    """Unquantized pair: greedy speculative (batch `batch_size`) == autoregressive (batch 1), token for token.
    The one tolerance: at a divergence, the two tokens' logits from one fresh forward over the reference prefix
    differ by less than `gates.tie_margin` (an fp32 accumulation-order tie; see docs/stages/validate.md)."""
    from runtime.engine.speculative import lossless_diff, tie_margins

    if spec_out is None:
        spec_out = _measure(eng, sub, sec, K, eos, speculative=True, temperature=0.0, tally=tally, run=f"{label}/exact")[1]
    if ar1_out is None:
        ar1_out = _measure(eng, sub, sec, K, eos, speculative=False, temperature=0.0, batch_size=1, tally=tally,
                           run=f"{label}/ar_b1")[1]
    bad = tie_margins(eng.target.model, sub, ar1_out, lossless_diff(spec_out, ar1_out))
    tm = sec.gates.tie_margin
    for b in bad:
        b["tie"] = b.get("gap") is not None and abs(b["gap"]) < tm
    real = [b for b in bad if not b["tie"]]
    out = {"pair": label, "passed": not real, "identical": not bad, "compared_prompts": len(sub),
           "generated_tokens": sum(map(len, ar1_out)), "differ": len(real), "numerical_ties": len(bad) - len(real),
           "tie_margin": tm, "mismatches": bad[:10],
           "rule": f"speculative (batch {sec.batch_size}, k={K}) == autoregressive (batch 1) token for token; a "
                   f"divergence counts as an fp32 tie only where the two tokens' logits differ by < {tm}"}
    ctx.log.info("exact lossless check on the %s pair, %d prompts: %s", label, len(sub),
                 "identical" if not bad else f"{len(real)} differ, {len(bad) - len(real)} at fp32 ties: {bad[:3]}")
    return out


def _lossless_and_speed(ctx, eng, sec: Config, K: int, eos, prompts: dict, bar, algorithm: str, tally,
                        exact: bool = False):
    """Deployed pair, greedy: speculative and autoregressive decoding (tokens/s, step costs), the batch-1
    autoregressive reference and the noise-floor arms, the statistical check; `exact` (the deployed pair is
    the unquantized one): the exact check too."""
    from runtime.engine.lossless import decode_chunked_prefill
    from runtime.engine.speculative import predicted_speedup

    n = sec.lossless_prompts
    if n == 0:
        return {"checked_prompts": 0, "passed": None}, {}, {}
    sub = _lossless_subset(prompts, sec)
    _measure(eng, sub[:1], sec, K, eos, speculative=True, temperature=0.0)    # warm-up (allocator, kernels)
    t0 = time.perf_counter()
    spec, spec_out = _measure(eng, sub, sec, K, eos, speculative=True, temperature=0.0, tally=tally, run="fp8/speculative")
    t1 = time.perf_counter()
    ar, ar_out = _measure(eng, sub, sec, K, eos, speculative=False, temperature=0.0, tally=tally, run="fp8/ar_batch")
    t2 = time.perf_counter()
    ar1_out = _measure(eng, sub, sec, K, eos, speculative=False, temperature=0.0, batch_size=1, tally=tally,
                       run="fp8/ar_b1")[1]
    chunked = decode_chunked_prefill(eng.target.model, sub, max_new_tokens=sec.max_new_tokens, eos=eos,
                                     chunk=sec.noise_prefill_chunk)
    bar.update(len(prompts))
    ll: dict = {"checked_prompts": len(sub), "generated_tokens": sum(map(len, ar1_out)), "max_new_tokens": sec.max_new_tokens}
    nb = sec.batch_size if sec.batch_size > 1 else 2              # batch 1 is the reference itself
    ar_noise = ar_out if sec.batch_size > 1 else _measure(eng, sub, sec, K, eos, speculative=False, temperature=0.0,
                                                          batch_size=2, tally=tally, run="fp8/ar_b2")[1]
    ll["statistical"] = _statistical(ctx, eng.target.model, sec, K, sub, spec_out, ar1_out,
                                     {f"autoregressive_batch{nb}": ar_noise,
                                      f"autoregressive_prefill_chunk{sec.noise_prefill_chunk}": chunked})
    if exact:
        ll["exact"] = _exact(ctx, eng, sec, K, eos, sub, tally, "fp8", spec_out=spec_out, ar1_out=ar1_out)
    sd, ad = spec.as_dict(), ar.as_dict()
    ar_fwd = len(ar.rows_per_step)
    t_ar = ar.target_s / ar_fwd if ar_fwd else None
    t_ver = spec.target_s / len(spec.rows_per_step) if spec.rows_per_step else None
    t_draft = spec.draft_s / len(spec.rows_per_step) if spec.rows_per_step else None
    passes = 1 if algorithm == "dflash" else K
    step_ms = {"batch_size": sec.batch_size, "draft_len": K, "target_ar": _ms(t_ar), "target_verify": _ms(t_ver),
               "draft_step": _ms(t_draft), "draft_pass": _ms(t_draft / passes if t_draft else None),
               "draft_passes_per_step": passes, "overhead_per_step": sd["overhead_ms_per_step"]}
    tps = {"speculative": round(spec.output_tokens / (t1 - t0), 2), "autoregressive": round(ar.output_tokens / (t2 - t1), 2),
           "decode_speculative": sd["decode_tokens_per_s"], "decode_autoregressive": ad["decode_tokens_per_s"]}
    tps["speedup"] = round(tps["speculative"] / tps["autoregressive"], 3)
    if t_ar and t_ver and t_draft:
        tps["predicted_speedup"] = round(predicted_speedup(spec.acceptance_length, K, t_ar, t_draft / passes, t_ver,
                                                           parallel_draft=algorithm == "dflash"), 3)
    ctx.log.info("tokens/s: speculative %.1f vs autoregressive %.1f (x%.2f; predicted x%s from AL and step costs)",
                 tps["speculative"], tps["autoregressive"], tps["speedup"], tps.get("predicted_speedup"))
    return ll, tps, step_ms


STATISTIC = ("first-divergence rate per compared token of greedy output vs batch-1 autoregressive output "
             "(diverging prompts / token positions compared up to and including each first divergence)")


def _statistical(ctx, model, sec: Config, K: int, sub, spec_out, ref, noise_arms: dict) -> dict:
    """Deployed pair: the speculative arm's first-divergence rate against batch-1 autoregressive decoding,
    tested against the pooled rate of the noise arms (the same target and prompts, autoregressive, other
    forward shapes)."""
    from runtime.engine.lossless import divergence, rate_test
    from runtime.engine.speculative import lossless_diff, tie_margins

    g = sec.gates
    spec = divergence(spec_out, ref)
    noise = {name: divergence(outs, ref) for name, outs in noise_arms.items()}
    d_n = sum(v["diverging"] for v in noise.values())
    e_n = sum(v["exposure"] for v in noise.values())
    n_p = sum(v["prompts"] for v in noise.values())
    noise["pooled"] = {"prompts": n_p, "diverging": d_n, "share_diverging": round(d_n / n_p, 4) if n_p else 0.0,
                       "exposure": e_n, "rate_per_token": round(d_n / e_n, 6) if e_n else 0.0}
    t = rate_test(spec["diverging"], spec["exposure"], d_n, e_n, ratio=g.max_divergence_ratio, alpha=g.divergence_alpha)
    # the target's own top-2 margin where speculative decoding diverged (informative: FP8 noise flips tokens
    # far beyond fp32 ties)
    def margins(outs):
        return [round(b["margin"], 4) for b in tie_margins(model, sub, ref, lossless_diff(outs, ref)[:4])]

    out = {"pair": "fp8", "statistic": STATISTIC, "reference": "autoregressive, batch 1, one prefill forward",
           "speculative_arm": f"speculative, batch {sec.batch_size}, k={K}", "speculative": spec, "noise": noise,
           "test": "one-sided exact conditional binomial test of two Poisson rates, H0: rate_speculative <= ratio x "
                   "rate_noise (pooled arms)",
           "ratio": g.max_divergence_ratio, "alpha": g.divergence_alpha,
           "threshold": f"p >= {g.divergence_alpha} for H0 rate_speculative <= {g.max_divergence_ratio} x rate_noise",
           "p_value": t["p_value"], "passed": t["passed"], "speculative_divergence_margins": margins(spec_out),
           "noise_divergence_margins": [m for outs in noise_arms.values() for m in margins(outs)]}
    ctx.log.info("statistical lossless check (deployed pair, %d prompts): speculative diverges on %d (rate %.4f/token), "
                 "noise floor %d of %d arm-prompts (rate %.4f/token: %s); p = %.4g for H0 rate <= %.2f x noise -> %s",
                 len(sub), spec["diverging"], spec["rate_per_token"], d_n, n_p, noise["pooled"]["rate_per_token"],
                 ", ".join(f"{k} {v['diverging']}/{v['prompts']}" for k, v in noise.items() if k != "pooled"),
                 t["p_value"], g.max_divergence_ratio, "pass" if t["passed"] else "FAIL")
    ctx.log.info("top-2 logit margins where the outputs diverged: speculative %s, noise arms %s (an fp32 tie is < 1e-3)",
                 out["speculative_divergence_margins"], out["noise_divergence_margins"])
    return out


def _ms(s):
    return None if s is None else round(1000 * s, 4)


def _add_retention(res: dict) -> None:
    for d in [*res["domains"].values(), res["overall"]]:
        if "bf16" in d and d["bf16"]["acceptance_length"]:
            d["retention"] = round(d["fp8"]["acceptance_length"] / d["bf16"]["acceptance_length"], 4)


def evaluate_gates(res: dict, g: Gates) -> dict:
    rows = []
    per = g.min_acceptance_length
    for d, v in res["domains"].items():
        req = per.get(d) if isinstance(per, dict) else per
        if req is not None:
            m = v["fp8"]["acceptance_length"]
            rows.append({"domain": d, "metric": "acceptance_length", "measured": m, "required": req, "passed": m >= req})
        if g.min_retention is not None and v.get("retention") is not None:
            rows.append({"domain": d, "metric": "retention", "measured": v["retention"], "required": g.min_retention,
                         "passed": v["retention"] >= g.min_retention})
    if g.min_overall_acceptance_length is not None:
        m = res["overall"]["fp8"]["acceptance_length"]
        rows.append({"domain": "overall", "metric": "acceptance_length", "measured": m,
                     "required": g.min_overall_acceptance_length, "passed": m >= g.min_overall_acceptance_length})
    if g.min_retention is not None and res["overall"].get("retention") is not None:
        rows.append({"domain": "overall", "metric": "retention", "measured": res["overall"]["retention"],
                     "required": g.min_retention, "passed": res["overall"]["retention"] >= g.min_retention})
    if g.require_lossless:
        rows += lossless_rows(res.get("lossless") or {})
    return {"passed": all(r["passed"] for r in rows), "rows": rows}


def lossless_rows(ll: dict) -> list[dict]:
    """One gate row per part of the lossless check that ran."""
    rows = []
    ex = ll.get("exact")
    if ex and ex.get("passed") is not None:
        m = "identical" if ex.get("identical") else (f"{ex['differ']} differ" if ex["differ"] else
                                                     f"{ex['numerical_ties']} fp32 ties")
        rows.append({"domain": "unquantized", "metric": "lossless_exact", "measured": m,
                     "required": f"identical (ties < {ex['tie_margin']:g})", "passed": ex["passed"]})
    inv = ll.get("invariant")
    if inv and inv.get("pairs"):
        n = sum(v["violations"] for v in inv["pairs"].values())
        rows_checked = sum(v["rows_checked"] for v in inv["pairs"].values())
        rows.append({"domain": "all runs", "metric": "acceptance_rule", "measured": f"{n} of {rows_checked} rows",
                     "required": "0 violations", "passed": inv["passed"]})
    st = ll.get("statistical")
    if st and st.get("passed") is not None:
        rows.append({"domain": "deployed", "metric": "divergence_rate",
                     "measured": f"{st['speculative']['rate_per_token']:.4f} vs {st['noise']['pooled']['rate_per_token']:.4f} "
                                 f"noise, p={st['p_value']:.3g}",
                     "required": f"<= {st['ratio']:g}x noise at p>={st['alpha']:g}", "passed": st["passed"]})
    return rows


def gate_table(rows: list[dict]) -> str:
    if not rows:
        return "  (no gates configured)"
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    wm = max([10] + [len(fmt(r["measured"])) for r in rows])
    wq = max([10] + [len(fmt(r["required"])) for r in rows])
    wd = max([12] + [len(r["domain"]) for r in rows])
    head = f"  {'domain':<{wd}} {'metric':<18} {'measured':>{wm}}  {'required':>{wq}}  result"
    lines = [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        lines.append(f"  {r['domain']:<{wd}} {r['metric']:<18} {fmt(r['measured']):>{wm}}  {fmt(r['required']):>{wq}}  "
                     f"{'pass' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- TensorRT-LLM


TRTLLM_SPEC_CLASSES = {"Eagle3": "Eagle3DecodingConfig", "DFlash": "DFlashDecodingConfig"}


def trtllm_llm_kwargs(target_dir, draft_dir, *, algorithm: str, max_draft_len: int, num_target_layers: int,
                      aux_layer_ids: list[int] | None, batch_size: int, max_seq_len: int) -> dict:
    """LLM(...) arguments for measuring acceptance with TensorRT-LLM (PyTorch backend, LLM API), field names
    as in `schemas/trtllm-1.2-llmapi.json` (DFlash needs 1.3+)."""
    spec: dict = {"decoding_type": "Eagle3" if algorithm == "eagle3" else "DFlash",
                  "max_draft_len": max_draft_len, "speculative_model": str(draft_dir)}
    if algorithm == "eagle3":
        spec["eagle3_one_model"] = True
        if aux_layer_ids is None:
            raise ValueError("the EAGLE-3 draft's config.json names no eagle_aux_hidden_state_layer_ids")
        # always: unset, TensorRT-LLM captures (1, L//2-1, L-4) and sizes fc for 3 layers, whatever the draft was
        # trained on (runtime/trtllm/compat.py SOURCES["layers_to_capture"])
        spec["eagle3_layers_to_capture"] = list(aux_layer_ids)
    return {
        "model": str(target_dir), "backend": "pytorch", "max_batch_size": batch_size,
        "max_num_tokens": max(8192, batch_size * (1 + max_draft_len), batch_size * max_seq_len),
        "max_seq_len": max_seq_len, "kv_cache_config": {"free_gpu_memory_fraction": 0.7},
        "enable_iter_perf_stats": True, "speculative_config": spec,
    }


def trtllm_sampling_kwargs(*, max_new_tokens: int, temperature: float, seed: int,
                           stop_token_ids: list[int] | None = None) -> dict:
    """SamplingParams(...) arguments (end token: the tokenizer's eos, TensorRT-LLM's default; `stop_token_ids`:
    every id that ends a generation, e.g. an instruct model's end-of-turn, SamplingParams.stop_token_ids in
    tensorrt_llm/sampling_params.py)."""
    kw = {"max_tokens": max_new_tokens, "return_perf_metrics": True, "seed": seed}
    if stop_token_ids:
        kw["stop_token_ids"] = list(stop_token_ids)
    if temperature > 0:
        kw["temperature"] = temperature
    else:
        kw["top_k"] = 1                  # greedy
    return kw


def _run_trtllm(ctx, sec: Config, deployed: dict, bf16: dict | None, prompts: dict,
                eos) -> dict:  # pragma: no cover - needs a GPU
    """Runs only inside a TensorRT-LLM installation with a GPU; this machine never gets here."""
    import tensorrt_llm
    from tensorrt_llm import LLM, SamplingParams, llmapi

    from runtime.engine.drafts import draft_algorithm
    from runtime.trtllm import compat
    from runtime.trtllm.draft_schedule import dflash_max_draft_len
    from runtime.trtllm.draft_weights import trtllm_draft_dir

    res: dict = {"domains": {d: {} for d in prompts}, "overall": {}, "trtllm_version": tensorrt_llm.__version__,
                 "lossless": {"checked_prompts": 0, "passed": None, "note": "not checked by the tensorrt_llm runtime"}}
    for label, pair in [("fp8", deployed)] + ([("bf16", bf16)] if bf16 else []):
        dcfg = json.loads((Path(pair["draft_dir"]) / "config.json").read_text())
        tcfg = json.loads((Path(pair["target_dir"]) / "config.json").read_text())
        algo = draft_algorithm(pair["draft_dir"])
        K = min(sec.max_draft_len, dflash_max_draft_len(dcfg["block_size"])) if algo == "dflash" else sec.max_draft_len
        longest = max(len(p) for ps in prompts.values() for p in ps)
        draft_dir = Path(pair["draft_dir"])
        if algo == "eagle3":   # the layer names the installed loader reads (build does the same for the deployment)
            draft_dir, _ = trtllm_draft_dir(draft_dir, ctx.scratch_dir / f"trtllm_draft_{label}",
                                            compat.release(compat.normalize_version(tensorrt_llm.__version__)),
                                            int(dcfg.get("num_hidden_layers") or 1))
        kw = trtllm_llm_kwargs(pair["target_dir"], draft_dir, algorithm=algo, max_draft_len=K,
                               num_target_layers=tcfg["num_hidden_layers"],
                               aux_layer_ids=(dcfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
                               batch_size=sec.batch_size, max_seq_len=longest + sec.max_new_tokens + K + 8)
        spec = kw.pop("speculative_config")
        cls = getattr(llmapi, TRTLLM_SPEC_CLASSES[spec.pop("decoding_type")])
        llm = LLM(**kw, speculative_config=cls(**spec))
        sp = SamplingParams(**trtllm_sampling_kwargs(max_new_tokens=sec.max_new_tokens, temperature=sec.temperature,
                                                     seed=sec.seed, stop_token_ids=eos))
        tot = {"drafted": 0, "accepted": 0, "tokens": 0}
        for d, ps in prompts.items():
            t0 = time.perf_counter()
            outs = llm.generate(ps, sampling_params=sp)
            wall = time.perf_counter() - t0
            drafted = sum(o.request_perf_metrics.speculative_decoding.total_draft_tokens for o in outs)
            accepted = sum(o.request_perf_metrics.speculative_decoding.total_accepted_draft_tokens for o in outs)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = drafted / K if K else 0
            res["domains"][d][label] = {"acceptance_length": round(1 + accepted / steps, 6) if steps else 1.0,
                                        "draft_acceptance_rate": round(accepted / drafted, 6) if drafted else None,
                                        "drafted": drafted, "accepted": accepted, "steps": steps, "output_tokens": tokens,
                                        "per_position": None, "wall_s": round(wall, 3)}
            tot["drafted"] += drafted
            tot["accepted"] += accepted
            tot["tokens"] += tokens
        steps = tot["drafted"] / K if K else 0
        res["overall"][label] = {"acceptance_length": round(1 + tot["accepted"] / steps, 6) if steps else 1.0,
                                 "draft_acceptance_rate": round(tot["accepted"] / tot["drafted"], 6) if tot["drafted"] else None,
                                 "drafted": tot["drafted"], "accepted": tot["accepted"], "output_tokens": tot["tokens"],
                                 "per_position": None}
        res["draft_len"] = K
        del llm
    return res


# ---------------------------------------------------------------------------------------------- report


def report(artifact) -> str:
    return _render(artifact.read_json("acceptance.json"))


def report_failed(metrics: dict) -> str:
    """The same section for a failed gate (the runner keeps the StageError's metrics: the whole measurement)."""
    return _render(metrics) if "domains" in metrics else ""


def _render(a: dict) -> str:
    from pipeline.report import esc, figure, table

    parts = [f"<p>runtime <b>{esc(a['runtime'])}</b> ({esc(a.get('runtime_reason', ''))}); "
             f"draft length {a['max_draft_len']}, temperature {a['temperature']}, "
             f"{a['max_new_tokens']} new tokens per prompt, batch {a['batch_size']}; deployed pair "
             f"<code>{esc(a['pairs']['fp8']['target_dir'])}</code> + <code>{esc(a['pairs']['fp8']['draft_dir'])}</code></p>"]
    rows = []
    other = next((v["fp8_other_norm"]["first_layer_norm"] for v in a["domains"].values() if v.get("fp8_other_norm")), None)
    for d, v in [*a["domains"].items(), ("overall", a["overall"])]:
        f, b = v["fp8"], v.get("bf16") or {}
        rows.append([d, f["acceptance_length"], b.get("acceptance_length", ""), v.get("retention", ""),
                     f.get("draft_acceptance_rate"), f.get("accepted"), f.get("drafted")]
                    + ([(v.get("fp8_other_norm") or {}).get("acceptance_length", "")] if other else []))
    parts.append(table(rows, ["domain", "AL deployed (FP8)", "AL BF16", "retention", "acceptance rate", "accepted",
                              "drafted"] + ([f"AL FP8, {other} first-layer norm"] if other else [])))
    g = a["gates"]
    parts.append("<p>gates: <span "
                 f"class='{'pass' if g['passed'] else 'fail'}'>{'passed' if g['passed'] else 'FAILED'}</span></p>")
    if g["rows"]:
        parts.append(table([[r["domain"], r["metric"], r["measured"], r["required"], "pass" if r["passed"] else "FAIL"]
                            for r in g["rows"]], ["domain", "metric", "measured", "required", "result"]))
    parts.append(_render_lossless(a.get("lossless") or {}))
    tps = a.get("tokens_per_s") or {}
    if tps:
        parts.append(table([[k, v] for k, v in tps.items()] + [[f"step ms {k}", v] for k, v in (a.get("step_ms") or {}).items()],
                           ["", ""]))
    curves = [(d, v) for d, v in a["domains"].items() if v["fp8"].get("per_position")]
    if curves:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.4))
        for i, (d, v) in enumerate(curves):
            for label, style in (("fp8", "-"), ("bf16", "--")):
                pp = (v.get(label) or {}).get("per_position")
                if pp:
                    ax.plot(range(1, len(pp) + 1), [p if p is not None else float("nan") for p in pp], style,
                            marker="o", color=f"C{i}", label=f"{d} {label}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | previous accepted)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
        ax.set_title("per-position conditional acceptance")
        parts.append(figure(fig))
    return "".join(parts)


def _render_lossless(ll: dict) -> str:
    """The lossless check, each part with its numbers (docs/stages/validate.md says what each proves)."""
    from pipeline.report import esc, table

    parts = [f"<p>lossless check: <b>{esc(str(ll.get('passed')))}</b> "
             f"({ll.get('checked_prompts', 0)} prompts x {ll.get('max_new_tokens', '?')} new tokens, greedy)"
             + (f"; {esc(ll['note'])}" if ll.get("note") else "") + "</p>"]
    rows = []
    if ex := ll.get("exact"):
        rows.append(["exact", f"{ex['pair']} pair (unquantized)", ex["rule"],
                     f"{ex['compared_prompts']} prompts, {ex['generated_tokens']} tokens: {ex['differ']} differ, "
                     f"{ex['numerical_ties']} fp32 ties", ex["passed"]])
    if inv := ll.get("invariant"):
        for p, v in inv.get("pairs", {}).items():
            kinds = ", ".join(f"{k}: {n}" for k, n in v["by_kind"].items()) or "none"
            rows.append(["acceptance rule", f"{p} pair, every run",
                         "each emitted token = the rule's choice from the same verification forward's logits; "
                         "each step verifies the last emitted token; cache advances by accepted + 1",
                         f"{v['rows_checked']} rows in {v['forwards']} forwards of {v['generations']} runs: "
                         f"{v['violations']} violations ({kinds})", v["passed"]])
    if st := ll.get("statistical"):
        s, nz = st["speculative"], st["noise"]["pooled"]
        rows.append(["statistical", f"{st['pair']} pair (deployed)", st["statistic"] + "; " + st["test"],
                     f"speculative {s['rate_per_token']:.4f}/token ({s['diverging']}/{s['prompts']} prompts) vs noise "
                     f"{nz['rate_per_token']:.4f}/token ({nz['diverging']}/{nz['prompts']}); p = {st['p_value']:.3g}, "
                     f"required {st['threshold']}", st["passed"]])
    if rows:
        parts.append(table(rows, ["part", "on", "checks", "measured", "passed"]))
    if st := ll.get("statistical"):
        arms = [["speculative: " + st["speculative_arm"], st["speculative"]]] + \
               [[k, v] for k, v in st["noise"].items()]
        parts.append(table([[name, v["prompts"], v["diverging"], v["share_diverging"], v["exposure"], v["rate_per_token"],
                             "" if v.get("mean_first_divergence") is None else v["mean_first_divergence"]]
                            for name, v in arms],
                           ["arm (vs " + st["reference"] + ")", "prompts", "diverging", "share", "tokens compared",
                            "divergences / token", "mean first divergence"]))
        if st.get("speculative_divergence_margins") or st.get("noise_divergence_margins"):
            parts.append(f"<p>the target's top-2 logit margin where the outputs diverged (an fp32 tie is below "
                         f"1e-3): speculative {esc(str(st.get('speculative_divergence_margins')))}, noise arms "
                         f"{esc(str(st.get('noise_divergence_margins')))}</p>")
    return "".join(parts)
