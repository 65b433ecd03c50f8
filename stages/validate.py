"""Stage `validate`: acceptance of the deployed pair, per evaluation domain, against gates.

Measured on what will be deployed: the target and draft directories named by `quantize.json` (the FP8 target,
and the draft to deploy), read from their exported files by `runtime.engine.speculative`. The unquantized pair
(`target/model` + `train_draft/draft`) is measured the same way, so retention = AL(deployed) / AL(BF16) shows
what quantization cost (a draft trained on BF16 hidden states can lose acceptance on an FP8 target).

Per domain and pair: acceptance length (TensorRT-LLM's definition), per-position conditional acceptance up to
`validate.max_draft_len` (the `tune` stage derives the deployed length from these curves), draft acceptance
rate, drafted/accepted totals. Also tokens/s of speculative vs autoregressive decoding and the step costs.
The measurement is the runtime's (runtime/validate: reference.py, trtllm.py); this module keeps the contract, the
orchestration, the gates and the report.

The lossless check has three parts (runtime/validate/lossless_arms.py over the primitives of
`runtime/engine/lossless.py`; docs/stages/validate.md says what each proves):
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
from pathlib import Path
from typing import Literal

from pydantic import Field

from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import quantize as quantize_artifact
from pipeline.artifacts import target as target_artifact
from pipeline.artifacts import train_draft as train_draft_artifact
from pipeline.artifacts import validate as validate_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict
from runtime.records_validate import AcceptanceInfo, DomainAcceptance
from runtime.validate.decode import MeasureSettings
from runtime.validate.gates import evaluate_gates, gate_table, lossless_summary, lossless_tables
from runtime.validate.trtllm import run_trtllm, trtllm_available

NAME = "validate"
CONSUMES: tuple[str, ...] = ("target", "data", "train_draft", "quantize")
VERSION = "4"
USES = ("vllm",)   # validate measures the pair in vLLM too when the `vllm` section enables it
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


class NgramMeasure(Strict):
    """Free n-gram (prompt-lookup) drafting measured beside the trained draft (runtime/validate/ngram_arm.py)."""

    enabled: bool = Field(True, description="measure n-gram drafting on every domain (reference runtime)")
    min_n: int = Field(1, ge=1, description="shortest n-gram matched (vLLM prompt_lookup_min)")
    max_n: int = Field(4, ge=1, description="longest n-gram matched (vLLM prompt_lookup_max)")
    k: int | None = Field(None, ge=1, le=16, description="draft tokens per step; default validate.max_draft_len")


class HybridMeasure(Strict):
    """The trained draft with TensorRT-LLM's suffix-automaton enhancer (sa_config), runtime/validate/hybrid.py."""

    enabled: bool = Field(True, description="measure the trained draft + SA enhancer on every domain (reference runtime)")
    thresholds: list[int] = Field(default_factory=lambda: [2, 4, 8], min_length=1, description=(
        "SAEnhancerConfig.threshold candidates (min match length for the SA draft to replace the trained one; "
        "TensorRT-LLM's default 4); one decode of every domain each; tune chooses among them"))


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
    draft_kv_cache: Literal["auto", "bf16", "fp8"] = Field("auto", description=(
        "the deployed draft's KV cache: auto = FP8 (unit scale) when the deployed target's KV cache is FP8, as "
        "TensorRT-LLM runs the draft in one-model mode; the gate is on it, the BF16-KV figure is reported beside it"))
    seed: int = 0
    ngram: NgramMeasure = Field(default_factory=NgramMeasure)
    hybrid: HybridMeasure = Field(default_factory=HybridMeasure)
    gates: Gates = Field(default_factory=Gates)


def check(cfg) -> list[tuple[str, str]]:
    problems = []
    sec: Config = cfg.validate
    domains = set(cfg.data.eval_domains or {})
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
    if sec.ngram.min_n > sec.ngram.max_n:
        problems.append(("validate.ngram.min_n", f"{sec.ngram.min_n} > validate.ngram.max_n = {sec.ngram.max_n}"))
    if any(t < 1 for t in sec.hybrid.thresholds):
        problems.append(("validate.hybrid.thresholds", f"{sec.hybrid.thresholds}: each threshold must be >= 1"))
    if sec.gates.min_retention is not None and not sec.measure_bf16:
        problems.append(("validate.gates.min_retention", "needs validate.measure_bf16: true"))
    return problems


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    from runtime.validate.reference import DraftLoadError, PairLoading, Pairs, run_reference

    sec: Config = ctx.section
    runtime, why = _choose_runtime(sec.runtime)
    ctx.log.info("runtime: %s (%s)", runtime, why)
    arts, deployed, bf16, same = _pairs(ctx)
    draft_kv = draft_kv_cache(sec, quantize_artifact.read_info(ctx.input("quantize").path).kv_cache_fp8)
    ctx.log.info("deployed draft's KV cache: %s (%s)", draft_kv["dtype"], draft_kv["why"])
    eos = list(target_artifact.read_info(ctx.input("target").path).stop_ids)
    ctx.log.info("generation stops at token ids %s (target.json)", eos)
    prompts = _read_prompts(ctx, sec)

    # the unquantized pair runs when it is measured, and for the exact lossless check
    need_bf16 = not same and (sec.measure_bf16 or sec.lossless_prompts > 0)
    s = measure_settings(sec, draft_kv_cache=draft_kv["dtype"])
    if runtime == "tensorrt_llm":
        res = run_trtllm(s, deployed, bf16 if sec.measure_bf16 and not same else None, prompts, eos,
                         scratch_dir=ctx.scratch_dir)
    else:
        try:
            res = run_reference(s, Pairs(deployed, bf16 if need_bf16 else None, same), prompts, eos,
                                load=PairLoading(ctx.device.type, _trained_layers(ctx)), log=ctx.log, progress=ctx.progress)
        except DraftLoadError as e:
            raise StageError(f"validate: {e}") from None
    if sec.measure_bf16 and same:
        ctx.log.info("quantize deployed the unquantized pair: the BF16 figures are the deployed ones")
        for d in res["domains"].values():
            d["bf16"] = d["fp8"]
        res["overall"]["bf16"] = res["overall"]["fp8"]
    _add_retention(res)
    measured = res.pop("draft_len")
    res["engines"] = {"vllm": _vllm(ctx, sec, prompts, deployed, bf16, res, measured)}
    acc = AcceptanceInfo(
        measured_draft_len=measured, domains={d: DomainAcceptance.from_json(v) for d, v in res["domains"].items()},
        overall=DomainAcceptance.from_json(res["overall"]), gates=evaluate_gates(res, sec.gates),
        pairs={"fp8": {k: str(Path(v).relative_to(arts)) for k, v in deployed.items()},
               "bf16": {k: str(Path(v).relative_to(arts)) for k, v in bf16.items()}},
        max_new_tokens=sec.max_new_tokens, temperature=sec.temperature, batch_size=sec.batch_size, runtime=runtime,
        runtime_reason=why, requested_max_draft_len=sec.max_draft_len, eos_token_ids=eos, same_pair=same,
        draft=res.get("draft") or {}, draft_kv_cache=draft_kv, lossless=res.get("lossless"),
        tokens_per_s=res.get("tokens_per_s"), step_ms=res.get("step_ms"), fp8_info=res.get("fp8_info"),
        trtllm_version=res.get("trtllm_version"), engines=res["engines"], ngram=res.get("ngram"), hybrid=res.get("hybrid"))
    doc = acc.to_json()
    table = gate_table(acc.gates.rows)
    text = json.dumps(doc, indent=2)
    (ctx.scratch_dir / validate_artifact.INFO).write_text(text)
    ctx.log.info("gates:\n%s", table)
    if not acc.passed:
        # failed_metrics (status --json, report) keep the whole measurement, table included
        raise StageError("validate: acceptance gate failed; the pair is not deployed.\n" + table +
                         f"\n(full measurements: {ctx.scratch_dir / 'acceptance.json'}; lower validate.gates or "
                         "train a better draft / keep the draft BF16 / quantize with calibration data of the domain; "
                         "a failed lossless row is a defect of the decoding engine or of the deployed checkpoints, "
                         "see docs/stages/validate.md)",
                         metrics=doc)
    (ctx.out_dir / validate_artifact.INFO).write_text(text)
    return _metrics(runtime, doc)


def _pairs(ctx: StageContext) -> tuple[Path, dict, dict, bool]:
    """The deployed (quantize's) and the unquantized (target, train_draft) pair's directories, each checked to exist,
    and whether they are the same pair."""
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
    return arts, deployed, bf16, same


def _metrics(runtime: str, res: dict) -> dict:
    """The stage's metrics from a passed measurement: the gates, the lossless check, acceptance and retention."""
    from runtime.validate import hybrid as HY
    from runtime.validate import ngram_arm as NG
    from runtime.validate import vllm_arm as V

    return {"runtime": runtime, "measured_draft_len": res["measured_draft_len"], "gates_passed": True,
            "lossless": res["lossless"].get("passed"),
            "lossless_check": lossless_summary(res["lossless"]),
            "overall_acceptance_length": res["overall"]["fp8"]["acceptance_length"],
            "overall_retention": res["overall"].get("retention"),
            "acceptance_length": {d: v["fp8"]["acceptance_length"] for d, v in res["domains"].items()},
            "retention": {d: v.get("retention") for d, v in res["domains"].items()},
            "speedup_measured": res.get("tokens_per_s", {}).get("speedup"), "ngram": NG.summary(res),
            "hybrid": HY.summary(res), "vllm": V.summary((res.get("engines") or {}).get("vllm") or {})}


def _vllm(ctx: StageContext, sec: Config, prompts: dict, deployed: dict, bf16: dict, res: dict, k: int) -> dict:
    """The pair measured in vLLM too (runtime/validate/vllm_arm.py), as the `vllm` section asks: where vLLM is
    missing or cannot run the pair, a plain skip with the reason, or (on_unavailable: fail) a failed stage."""
    from runtime.validate import vllm_arm as V

    vc = ctx.config.vllm
    s = V.ArmSettings(python=vc.python, kv_cache_gib=vc.kv_cache_gib, ready_timeout=vc.ready_timeout_s,
                      tolerance=vc.tolerance, draft_len=k, max_new_tokens=sec.max_new_tokens,
                      batch=sec.batch_size, try_fp8=vc.try_fp8, first_layer_norm=sec.first_layer_norm,
                      enabled=vc.enabled, on_unavailable=vc.on_unavailable)
    try:
        out = V.measure(s, deployed, bf16, prompts, ctx.scratch_dir / "vllm", res, log=ctx.log)
    except V.VllmArmError as e:
        raise StageError(f"validate: {e}") from None
    arts = ctx.input("quantize").path.parent
    for k in ("target_dir", "draft_dir") if out.get("ran") else ():
        out["pair"][k] = str(Path(out["pair"][k]).relative_to(arts))
    return out


def draft_kv_cache(sec: Config, target_kv_fp8: bool) -> dict:
    """The deployed draft's KV cache as the engine runs it ({"dtype", "scale", "why"}): in one-model mode (the
    default; the only mode of DFlash and of EAGLE-3 on 1.3) TensorRT-LLM gives the draft the target's KV-cache
    quantization with unit scales (runtime.engine.drafts.loading.DRAFT_KV_FP8_SCALE)."""
    if sec.draft_kv_cache != "auto":
        why = "validate.draft_kv_cache"
        dtype = sec.draft_kv_cache
    else:
        dtype = "fp8" if target_kv_fp8 else "bf16"
        why = "auto: the deployed target's KV cache is " + ("FP8; one-model TensorRT-LLM runs the draft's with it"
                                                           if target_kv_fp8 else "not FP8")
    return {"dtype": dtype, "scale": 1.0 if dtype == "fp8" else None, "why": why}


def measure_settings(sec: Config, draft_kv_cache: str = "bf16") -> MeasureSettings:
    """What runtime.validate measures with: the section's decoding settings and the lossless gates' parameters."""
    from runtime.validate import hybrid as HY
    from runtime.validate import ngram_arm as NG

    g, n, h = sec.gates, sec.ngram, sec.hybrid
    return MeasureSettings(max_draft_len=sec.max_draft_len, max_new_tokens=sec.max_new_tokens, batch_size=sec.batch_size,
                           temperature=sec.temperature, seed=sec.seed, lossless_prompts=sec.lossless_prompts,
                           noise_prefill_chunk=sec.noise_prefill_chunk, measure_bf16=sec.measure_bf16,
                           first_layer_norm=sec.first_layer_norm, measure_other_norm=sec.measure_other_norm,
                           tie_margin=g.tie_margin, max_divergence_ratio=g.max_divergence_ratio,
                           divergence_alpha=g.divergence_alpha, draft_kv_cache=draft_kv_cache,
                           ngram=NG.NgramSettings(n.min_n, n.max_n, n.k or sec.max_draft_len) if n.enabled else None,
                           hybrid=HY.HybridSettings(tuple(sorted(set(h.thresholds))), sec.max_draft_len) if h.enabled else None)


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


def _read_prompts(ctx: StageContext, sec: Config) -> dict[str, list[list[int]]]:
    out = {d: [p.prompt_ids for p in ps]
           for d, ps in data_artifact.read_eval(ctx.input("data").path, per_domain=sec.num_prompts).items()}
    g = sec.gates.min_acceptance_length
    if isinstance(g, dict) and (missing := sorted(set(g) - set(out))):
        raise StageError(f"validate.gates.min_acceptance_length names domains {missing} that data did not write")
    return out


def _trained_layers(ctx) -> list[int] | None:
    """The capture layers training used, from train_draft's draft.json (None when it does not say)."""
    art = ctx.input("train_draft").path
    if not (art / train_draft_artifact.INFO).exists():
        return None
    return train_draft_artifact.read_info(art).capture_layers


def _add_retention(res: dict) -> None:
    for d in [*res["domains"].values(), res["overall"]]:
        if "bf16" in d and d["bf16"]["acceptance_length"]:
            d["retention"] = round(d["fp8"]["acceptance_length"] / d["bf16"]["acceptance_length"], 4)


# ---------------------------------------------------------------------------------------------- report


def report(artifact) -> str:
    return _render(validate_artifact.read_acceptance(artifact.path).raw)


def report_failed(metrics: dict) -> str:
    """The same section for a failed gate (the runner keeps the StageError's metrics: the whole measurement)."""
    return _render(metrics) if "domains" in metrics else ""


def _render(a: dict) -> str:
    from pipeline.report import esc, figure, table
    from runtime.validate import hybrid as HY
    from runtime.validate import ngram_arm as NG
    from runtime.validate import vllm_arm as V

    parts = [f"<p>runtime <b>{esc(a['runtime'])}</b> ({esc(a.get('runtime_reason', ''))}); "
             f"draft length {a.get('measured_draft_len', a.get('max_draft_len'))}, temperature {a['temperature']}, "
             f"{a['max_new_tokens']} new tokens per prompt, batch {a['batch_size']}; deployed pair "
             f"<code>{esc(a['pairs']['fp8']['target_dir'])}</code> + <code>{esc(a['pairs']['fp8']['draft_dir'])}</code></p>"]
    rows = []
    other = next((v["fp8_other_norm"]["first_layer_norm"] for v in a["domains"].values() if v.get("fp8_other_norm")), None)
    kv_arm = any(v.get("fp8_other_draft_kv") for v in a["domains"].values())
    parts.append(_draft_kv_note(a.get("draft_kv_cache") or {}, kv_arm))
    for d, v in [*a["domains"].items(), ("overall", a["overall"])]:
        f, b = v["fp8"], v.get("bf16") or {}
        rows.append([d, f["acceptance_length"], b.get("acceptance_length", ""), v.get("retention", ""),
                     f.get("draft_acceptance_rate"), f.get("accepted"), f.get("drafted"), f.get("outside_draft_vocab", "")]
                    + ([(v.get("fp8_other_norm") or {}).get("acceptance_length", "")] if other else [])
                    + ([(v.get("fp8_other_draft_kv") or {}).get("acceptance_length", "")] if kv_arm else []))
    parts.append(table(rows, ["domain", "AL deployed (FP8)", "AL BF16", "retention", "acceptance rate", "accepted",
                              "drafted", "outside draft vocab"] + ([f"AL FP8, {other} first-layer norm"] if other else [])
                       + (["AL FP8, draft BF16 KV"] if kv_arm else [])))
    if ng := NG.table_rows(a):
        parts.append("<p>free n-gram (prompt-lookup) drafting on the deployed target, same runtime and prompts:</p>" + table(*ng))
    if hy := HY.table_rows(a):
        parts.append("<p>the trained draft with TensorRT-LLM's suffix-automaton enhancer (sa_config):</p>" + table(*hy))
    g = a["gates"]
    parts.append("<p>gates: <span "
                 f"class='{'pass' if g['passed'] else 'fail'}'>{'passed' if g['passed'] else 'FAILED'}</span></p>")
    if g["rows"]:
        parts.append(table([[r["domain"], r["metric"], r["measured"], r["required"], "pass" if r["passed"] else "FAIL"]
                            for r in g["rows"]], ["domain", "metric", "measured", "required", "result"]))
    parts.append(_render_lossless(a.get("lossless") or {}))
    if v := (a.get("engines") or {}).get("vllm"):
        parts.append(f"<p>vLLM: {esc(V.headline(v))}</p>" + (table(*V.table_rows(v)) if v.get("ran") else ""))
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


def _draft_kv_note(kv: dict, kv_arm: bool) -> str:
    """How the deployed draft's KV cache was computed (what the gates use), and what the extra column is."""
    from pipeline.report import esc

    if not kv:
        return ""
    return (f"<p>deployed draft's KV cache: <b>{esc(kv['dtype'].upper())}</b>"
            + (f" (scale {kv['scale']:g})" if kv.get("scale") else "") + f", {esc(kv['why'])}; the gates use it"
            + ("; the column 'AL FP8, draft BF16 KV' is the same pair with the draft's KV cache in BF16" if kv_arm
               else "") + "</p>")


def _render_lossless(ll: dict) -> str:
    """The lossless check, each part with its numbers (docs/stages/validate.md says what each proves)."""
    from pipeline.report import esc, table

    parts = [f"<p>lossless check: <b>{esc(str(ll.get('passed')))}</b> "
             f"({ll.get('checked_prompts', 0)} prompts x {ll.get('max_new_tokens', '?')} new tokens, greedy)"
             + (f"; {esc(ll['note'])}" if ll.get("note") else "") + "</p>"]
    parts += [table(rows, header) for rows, header in lossless_tables(ll) if rows]
    if (st := ll.get("statistical")) and (st.get("speculative_divergence_margins") or st.get("noise_divergence_margins")):
        parts.append(f"<p>the target's top-2 logit margin where the outputs diverged (an fp32 tie is below "
                     f"1e-3): speculative {esc(str(st.get('speculative_divergence_margins')))}, noise arms "
                     f"{esc(str(st.get('noise_divergence_margins')))}</p>")
    return "".join(parts)
