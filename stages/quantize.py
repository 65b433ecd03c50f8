"""Stage `quantize`: FP8 post-training quantization of the target (and optionally the draft) with ModelOpt.

What it does, for the recipe in `format` (then each of `fallback_formats` while the gate is missed):
1. Loads the target in float32 (bfloat16 on CUDA), inserts ModelOpt quantizers (`mtq.quantize` with the recipe's
   preset: `fp8` = FP8_DEFAULT_CFG, per-tensor weights and static activations; `fp8_per_channel_per_token` =
   FP8_PER_CHANNEL_PER_TOKEN_CFG, per-channel weights and dynamic per-token activations; optionally FP8 KV) and
   calibrates them (max calibration) on the `data` stage's `calib.parquet` (runtime.quant.ptq).
2. Aligns the calibrated model with what TensorRT-LLM will execute (`align_with_deployment`, ptq): per-tensor q/k/v and
   gate/up share one weight scale (TensorRT-LLM fuses them into one GEMM and would re-quantize them at load),
   and the fake-quant weights are snapped to the exact E4M3 codes the export writes.
3. With `auto_exclude.enabled`: measures every decoder layer's sensitivity on calibration samples and keeps the
   fewest, most sensitive layers in BF16 until the calibration perplexity meets `max_ppl_increase`
   (`search_exclusions`, runtime.quant.exclusion; cost in forwards logged and recorded).
4. Exports a ModelOpt unified Hugging Face checkpoint (runtime.quant.export) with `hf_quant_config.json`
   (TensorRT-LLM 1.2 ignores the FP8 scales without it) and the target's tokenizer, and runs named format checks
   for the recipe (`check_checkpoint`, runtime.quant.checks).
5. Measures quality (runtime.quant.quality) by running the exported checkpoint itself through `runtime.engine.fp8`
   (TensorRT-LLM's arithmetic: E4M3 activations, fused-layer scales, FP8 KV with unit scales) against the
   unquantized target on `heldout.parquet`: perplexity before/after, next-token top-1 agreement, mean KL. The
   exported model is also compared with ModelOpt's own fake-quant model: layer by layer on the same inputs (the
   executor's exactness), end to end (top-1, KL), next to the FP8 model's own noise floor (its agreement with
   itself under a 1e-6 relative input perturbation). `max_ppl_increase` (relative) is the gate.
6. With `draft: fp8`, rebuilds ModelOpt's EAGLE-3 model around the target from the exported draft
   (`train_draft/draft`, verified by re-exporting it bit-exactly), quantizes only the draft part (per-tensor FP8),
   calibrates it with the training-time forward (all TTT steps) and exports it with `export_speculative_decoding`
   to `draft_fp8/` (runtime.quant.eagle_draft); `draft_fc: bf16` keeps its `fc` in BF16 (TensorRT-LLM 1.2 needs it).

Artifact (see docs/architecture.md): `target_fp8/` (the shipped recipe), `draft_fp8/` (only with `draft: fp8`),
`quantize.json`, `quality.json` (with `recipes`: one row per recipe tried).
"""
from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from pipeline.artifacts import data as data_artifact
from pipeline.artifacts import quantize as quantize_artifact
from pipeline.artifacts import target as target_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict
from runtime.errors import RuntimeFailure
from runtime.quant.ptq import RECIPES, QuantRun, align_with_deployment, disable_quantizers, kv_unit_scales, quantize_model
from runtime.quant.ptq import calib_dtype as calib_dtype_name
from runtime.quant.ptq import calibration_resolved as resolved  # noqa: F401  (the hook: calib dtype -> fingerprint)

NAME = "quantize"
CONSUMES: tuple[str, ...] = ("target", "data", "train_draft")
VERSION = "2"
PACKAGES = ("torch", "transformers", "nvidia-modelopt", "safetensors")

Recipe = Literal["fp8", "fp8_per_channel_per_token"]

class AutoExclude(Strict):
    """Automatic search for the fewest decoder layers to keep in BF16 so that FP8 meets `max_ppl_increase`."""

    enabled: bool = Field(False, description=(
        "opt-in: when the FP8 model misses max_ppl_increase on calibration samples, keep the most sensitive "
        "decoder layers in BF16 (they are named in hf_quant_config.json's exclude_modules)"))
    max_layers: int = Field(8, ge=1, description="never keep more than this many decoder layers in BF16")
    sensitivity_samples: int = Field(2, ge=1, description=(
        "calibration samples for the per-layer sensitivity (one partial forward per layer and sample)"))
    check_samples: int = Field(12, ge=1, description=(
        "calibration samples on which each candidate exclusion set is checked against the gate"))
    seq_len: int = Field(256, ge=16, description="the search's samples are truncated to this many tokens")
    headroom: float = Field(0.75, gt=0, le=1, description=(
        "aim for headroom * max_ppl_increase on calibration, leaving the rest for the held-out measurement"))


class Config(StageSection):
    """FP8 post-training quantization. Defaults follow ModelOpt's hf_ptq example (FP8 weights+activations, FP8 KV)."""

    format: Recipe = Field("fp8", description=(
        "the FP8 recipe: fp8 = per-tensor weight scales + static per-tensor activation scales (ModelOpt "
        "FP8_DEFAULT_CFG, quant_algo FP8); fp8_per_channel_per_token = per-channel weight scales + dynamic per-token "
        "activation scales (ModelOpt FP8_PER_CHANNEL_PER_TOKEN_CFG, quant_algo FP8_PER_CHANNEL_PER_TOKEN)"))
    fallback_formats: list[Recipe] = Field(default_factory=list, description=(
        "recipes tried in order when `format` misses the gate (each calibrated, searched and measured); the first "
        "that meets it ships, every one tried is reported"))
    kv_cache: Literal["fp8", "none"] = Field("fp8", description="fp8: calibrate and export FP8 KV-cache scales")
    exclude_modules: list[str] = Field(default_factory=list, description=(
        "module name patterns (fnmatch, e.g. 'model.layers.0.*' or '*down_proj') kept in high precision, "
        "in addition to ModelOpt's defaults (lm_head, embeddings, routers)"))
    auto_exclude: AutoExclude = Field(default_factory=AutoExclude, description=(
        "automatic BF16 exclusion search (opt-in; see docs/stages/quantize.md)"))
    calib_samples: int = Field(64, ge=1, description="calibration samples taken from data's calib.parquet")
    calib_seq_len: int = Field(256, ge=8, description="calibration samples are truncated to this many tokens")
    eval_samples: int = Field(64, ge=1, description="held-out samples for the quality measurement")
    fidelity_samples: int = Field(4, ge=1, description=(
        "held-out samples on which the exported checkpoint is compared with ModelOpt's fake-quant model"))
    max_ppl_increase: float = Field(0.02, ge=0, description="fail when ppl_fp8 / ppl_bf16 - 1 exceeds this")
    min_top1_agreement: float | None = Field(None, ge=0, le=1, description="optional gate on next-token top-1 agreement")
    draft: Literal["none", "fp8"] = Field("none", description=(
        "none: deploy train_draft's BF16 draft (NVIDIA's documented combination: FP8 target + BF16 draft); "
        "fp8: quantize the draft too (per-tensor FP8)"))
    draft_fc: Literal["fp8", "bf16"] = Field("fp8", description="with draft: fp8, the EAGLE-3 fc in FP8 or kept in BF16 "
                                             "(TensorRT-LLM 1.2 drops an FP8 fc's scale: build refuses fp8 there)")
    seed: int = 0

    @field_validator("exclude_modules")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.strip() or p.strip() in ("*", "*.*"):
                raise ValueError(f"exclude pattern '{p}' would exclude every module; use format or enabled: false instead")
        return v


def check(cfg) -> list[tuple[str, str]]:
    sec: Config = cfg.quantize
    problems = []
    if not sec.enabled:
        return problems
    td = cfg.train_draft
    if sec.draft == "fp8" and not td.enabled:
        problems.append(("quantize.draft", "is fp8 but train_draft is disabled: there is no draft to quantize"))
    algo = td.algorithm.kind
    if sec.draft == "fp8" and not td.algorithm.traits.fp8_draft:
        problems.append(("quantize.draft", f"fp8 is implemented for EAGLE-3 drafts only; train_draft.algorithm is '{algo}' "
                                           "(use draft: none, NVIDIA's documented FP8 target + BF16 draft)"))
    if len(set(sec.fallback_formats)) != len(sec.fallback_formats) or sec.format in sec.fallback_formats:
        problems.append(("quantize.fallback_formats", f"lists a recipe twice (format {sec.format!r}, fallbacks "
                                                      f"{sec.fallback_formats}); each recipe is tried once"))
    return problems


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    import torch

    sec: Config = ctx.section
    torch.manual_seed(sec.seed)
    target_dir = target_artifact.model_dir(ctx.input("target").path)
    data = ctx.input("data").path
    tinfo = target_artifact.read_info(ctx.input("target").path)
    export_dtype = getattr(torch, tinfo.dtype)
    device = ctx.device.torch
    calib_dtype = getattr(torch, calib_dtype_name(device.type))   # the fingerprint holds it (`resolved`)
    calib, heldout = _read_calib_and_heldout(ctx, sec, data, device)

    t_all = time.monotonic()
    tried, shipped = _try_recipes(ctx, sec, target_dir, calib, heldout, device, calib_dtype, export_dtype)
    chosen = shipped or min(tried, key=lambda c: c["quality"]["ppl_increase"])
    out_target = _keep_chosen(ctx, chosen, tried)
    quality = _quality_doc(sec, chosen, tried, target_dir, device)
    _log_quality(ctx, chosen["recipe"], quality)

    # the draft
    draft_rel = "train_draft/draft"
    draft_metrics: dict = {}
    if sec.draft == "fp8":
        draft_metrics = quantize_eagle_draft(ctx, sec, target_dir, calib, heldout, device, calib_dtype)
        draft_rel = "quantize/draft_fp8"
        quality["draft"] = draft_metrics

    (ctx.out_dir / "quality.json").write_text(json.dumps(quality, indent=2))
    _write_quantize_json(ctx, sec, chosen, tried, out_target, draft_rel, n_calib=len(calib))
    metrics = _stage_metrics(sec, quality, chosen, tried, draft_rel, draft_metrics,
                             seconds=round(time.monotonic() - t_all, 2))
    if shipped is None:  # the measured numbers stay visible in status --json (failed_metrics) and the report
        msg = " | ".join(f"{c['recipe']}: " + "; ".join(c["gate_problems"]) for c in tried)
        raise StageError("quantize: FP8 quality gate failed for every recipe tried: " + msg,
                         metrics={**metrics, "max_ppl_increase": sec.max_ppl_increase,
                                  "min_top1_agreement": sec.min_top1_agreement, "gate_passed": False})
    return metrics


def _read_calib_and_heldout(ctx: StageContext, sec: Config, data: Path, device) -> tuple[list[dict], list[dict]]:
    """The calibration and held-out samples of the data artifact; StageError when there is nothing to measure on."""
    calib = read_samples(data, "calib", sec.calib_samples, sec.calib_seq_len)
    heldout = read_samples(data, "heldout", sec.eval_samples, None)
    if not heldout:
        raise StageError(f"quantize: {data / 'heldout.parquet'} has no samples; quality cannot be measured "
                         "(raise data.eval_fraction)")
    ctx.log.info("calibrating on %d samples (<= %d tokens each), measuring on %d held-out samples, device %s",
                 len(calib), sec.calib_seq_len, len(heldout), device)
    return calib, heldout


def _try_recipes(ctx: StageContext, sec: Config, target_dir: Path, calib, heldout, device, calib_dtype,
                 export_dtype) -> tuple[list[dict], dict | None]:
    """`format`, then each of `fallback_formats` while the gate is missed: (every candidate tried, the one that
    meets the gate or None)."""
    tried: list[dict] = []
    for recipe in [sec.format] + list(sec.fallback_formats):
        ctx.log.info("recipe %s (%s weights, %s activations, ModelOpt %s)", recipe, RECIPES[recipe]["weights"],
                     RECIPES[recipe]["activations"], RECIPES[recipe]["preset"])
        cand = _try_recipe(ctx, recipe, target_dir, calib, heldout, device, calib_dtype, export_dtype)
        tried.append(cand)
        if cand["gate_problems"]:
            ctx.log.warning("recipe %s misses the gate: %s", recipe, "; ".join(cand["gate_problems"]))
            continue
        return tried, cand
    return tried, None


def _keep_chosen(ctx: StageContext, chosen: dict, tried: list[dict]) -> Path:
    """Move the chosen candidate's checkpoint to `target_fp8/`, remove the others from scratch; its new path."""
    out_target = ctx.out_dir / "target_fp8"
    shutil.move(str(chosen["path"]), str(out_target))
    for c in tried:  # the candidates not shipped were written to scratch
        if c is not chosen:
            shutil.rmtree(c["path"], ignore_errors=True)
    return out_target


def _quality_doc(sec: Config, chosen: dict, tried: list[dict], target_dir: Path, device) -> dict:
    """quality.json (without the draft): the chosen candidate's measurement, what was measured, every recipe tried."""
    quality = dict(chosen["quality"])
    quality.update(target_dir=str(target_dir), checkpoint="target_fp8", format=chosen["recipe"],
                   quant_algo=RECIPES[chosen["recipe"]]["quant_algo"],
                   runtime="runtime.engine.fp8 (emulated E4M3 on " + device.type + ", TensorRT-LLM 1.2 semantics: fused-layer "
                   "scales, FP8 KV with unit scales)", kv_cache=sec.kv_cache, max_ppl_increase=sec.max_ppl_increase,
                   recipes=[_recipe_row(c) for c in tried])
    return quality


def _log_quality(ctx: StageContext, recipe: str, quality: dict) -> None:
    ctx.log.info("quality (%s): perplexity %.4f -> %.4f (%+.3f%%), top-1 agreement %.4f, mean KL %.3g nats; export vs "
                 "ModelOpt fake-quant: top-1 %.4f, KL %.3g (FP8 noise floor: top-1 %.4f, KL %.3g), layer-wise max "
                 "relative error %.2g", recipe, quality["ppl_bf16"], quality["ppl_fp8"],
                 100 * quality["ppl_increase"], quality["top1_agreement"], quality["mean_kl"],
                 quality["export_vs_fakequant_top1_agreement"], quality["export_vs_fakequant_kl"],
                 quality["noise_floor_top1_agreement"], quality["noise_floor_kl"],
                 quality["layerwise_max_rel_err"])


def _write_quantize_json(ctx: StageContext, sec: Config, chosen: dict, tried: list[dict], out_target: Path,
                         draft_rel: str, *, n_calib: int) -> None:
    from runtime.quant.checks import read_hf_quant_config
    from runtime.records import QuantizeInfo

    hq = read_hf_quant_config(out_target)
    info = QuantizeInfo(format=chosen["recipe"], quant_algo=hq.get("quant_algo"), kv_cache=sec.kv_cache,
                        target_rel="quantize/target_fp8", draft_rel=draft_rel,
                        draft_format=sec.draft if sec.draft == "fp8" else "bf16", exclude_modules=hq.get("exclude_modules"),
                        auto_excluded=chosen["auto_excluded"], recipes_tried=[c["recipe"] for c in tried],
                        calib_samples=n_calib, calib_seq_len=sec.calib_seq_len, checks=chosen["checks"])
    (ctx.out_dir / quantize_artifact.INFO).write_text(json.dumps(info.to_json(), indent=2))


def _stage_metrics(sec: Config, quality: dict, chosen: dict, tried: list[dict], draft_rel: str, draft_metrics: dict, *,
                   seconds: float) -> dict:
    """The stage's metrics: the quality figures, what shipped, and the draft's headline figures."""
    metrics = {k: quality[k] for k in ("ppl_bf16", "ppl_fp8", "ppl_fakequant", "ppl_increase", "top1_agreement", "mean_kl",
                                       "max_abs_logit_diff", "export_vs_fakequant_max_abs_logit_diff",
                                       "export_vs_fakequant_top1_agreement", "export_vs_fakequant_kl",
                                       "noise_floor_top1_agreement", "noise_floor_kl", "layerwise_max_rel_err",
                                       "eval_tokens")}
    metrics.update(format=chosen["recipe"], quant_algo=quality["quant_algo"], kv_cache=sec.kv_cache, draft=draft_rel,
                   quantize_seconds=seconds, checks_passed=len(chosen["checks"]),
                   recipes_tried=[c["recipe"] for c in tried], kept_bf16=chosen["auto_excluded"],
                   search_forwards=(chosen.get("search") or {}).get("forwards", 0))
    for k in ("draft_top1_bf16", "draft_top1_fp8", "draft_export_vs_fakequant_loss_diff"):
        if k in draft_metrics:
            metrics[k] = draft_metrics[k]
    return metrics


def _recipe_row(c: dict) -> dict:
    q = c["quality"]
    return {"format": c["recipe"], "quant_algo": RECIPES[c["recipe"]]["quant_algo"],
            "ppl_bf16": q["ppl_bf16"], "ppl_fp8": q["ppl_fp8"], "ppl_increase": q["ppl_increase"],
            "top1_agreement": q["top1_agreement"], "mean_kl": q["mean_kl"],
            "kept_bf16": c["auto_excluded"], "exclude_modules": c["exclude_modules"],
            "export_vs_fakequant_top1_agreement": q["export_vs_fakequant_top1_agreement"],
            "export_vs_fakequant_kl": q["export_vs_fakequant_kl"], "noise_floor_kl": q["noise_floor_kl"],
            "layerwise_max_rel_err": q["layerwise_max_rel_err"], "gate_passed": not c["gate_problems"],
            "gate_problems": c["gate_problems"], "search": c.get("search"), "seconds": c["seconds"]}


def _try_recipe(ctx: StageContext, recipe: str, target_dir: Path, calib, heldout, device, calib_dtype,
                export_dtype) -> dict:
    """Calibrate, align, (search), export into scratch, check and measure one recipe. Returns the candidate."""
    import torch

    from runtime.engine.fp8 import load_causal_lm
    from runtime.quant.checks import check_checkpoint, read_hf_quant_config
    from runtime.quant.exclusion import search_exclusions
    from runtime.quant.export import export_target
    from runtime.quant.quality import fake_quant_reference, measure_quality

    sec: Config = ctx.section
    run = QuantRun(device, calib_dtype, ctx.progress, ctx.log)
    t0 = time.monotonic()
    kv = sec.kv_cache
    with _stage_errors():
        fq_model = quantize_model(target_dir, calib, fmt=recipe, kv_cache=kv, exclude=sec.exclude_modules, run=run)
    align_with_deployment(fq_model, log=ctx.log)
    auto: list[str] = []
    search = None
    if sec.auto_exclude.enabled:
        with _stage_errors():  # the method and its cost: runtime.quant.exclusion
            search = search_exclusions(fq_model, target_dir, calib, recipe=recipe, kv_cache=kv,
                                       max_ppl_increase=sec.max_ppl_increase, opts=sec.auto_exclude, run=run)
        auto = search["kept_bf16"]
        disable_quantizers(fq_model, auto)
    with kv_unit_scales(fq_model), _stage_errors():  # the reference computes what TensorRT-LLM computes for the KV cache
        fq_ref = fake_quant_reference(fq_model, heldout, device=device, keep=sec.fidelity_samples)
    out = ctx.scratch_dir / f"target_{recipe}"
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    export_target(fq_model, out, target_dir, export_dtype)
    del fq_model   # its logits are kept (fq_ref); the reference and FP8 models below need the memory

    exclude = list(sec.exclude_modules) + auto
    checks = check_checkpoint(out, kv_cache=kv == "fp8", exclude=exclude, quant_algo=RECIPES[recipe]["quant_algo"])
    _raise_failed(checks, f"target_fp8 ({recipe})")
    ctx.log.info("target_fp8 (%s): all %d format checks passed", recipe, len(checks))

    ref = load_causal_lm(target_dir, device=device, compute_dtype=calib_dtype, spread=True)
    fp8 = load_causal_lm(out, device=device, compute_dtype=calib_dtype, spread=True)
    with _stage_errors():
        quality = measure_quality(ref, fp8, heldout, device=device, fake_quant=fq_ref, progress=ctx.progress)
    del ref, fp8
    torch.cuda.empty_cache() if device.type == "cuda" else None
    problems = quality_gate(quality, sec.max_ppl_increase, sec.min_top1_agreement)
    ctx.log.info("recipe %s: perplexity %.4f -> %.4f (%+.3f%%), top-1 %.4f, KL %.3g, BF16 layers %s", recipe,
                 quality["ppl_bf16"], quality["ppl_fp8"], 100 * quality["ppl_increase"], quality["top1_agreement"],
                 quality["mean_kl"], auto or "none")
    return {"recipe": recipe, "path": out, "quality": quality, "checks": checks, "auto_excluded": auto,
            "exclude_modules": read_hf_quant_config(out).get("exclude_modules"), "search": search, "gate_problems": problems,
            "seconds": round(time.monotonic() - t0, 1)}


@contextlib.contextmanager
def _stage_errors():
    """runtime.quant's failures as the stage's: a draft that cannot be rebuilt as StageError("quantize.draft: <message>"),
    any other `RuntimeFailure` (a target that cannot be placed, no calibration samples, no decoder-layer list) as
    StageError("quantize: <message>")."""
    from runtime.quant.eagle_draft import DraftRebuildError

    try:
        yield
    except DraftRebuildError as e:
        raise StageError(f"quantize.draft: {e}") from None
    except RuntimeFailure as e:
        raise StageError(f"quantize: {e}") from None


def _raise_failed(checks: list[dict], what: str) -> None:
    bad = [c for c in checks if not c["passed"]]
    if bad:
        raise StageError(f"quantize: {what} failed format checks: " + "; ".join(f"[{c['name']}] {c['message']}" for c in bad))


# ---------------------------------------------------------------------------------------------- data


def read_samples(data_art: Path, split: str, limit: int, max_len: int | None) -> list[dict]:
    """First `limit` rows of a data split (`pipeline.artifacts.data`) as {"input_ids", "loss_mask"} LongTensors."""
    import torch

    return [{"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}
            for ids, mask in data_artifact.read_rows(data_art, split, limit=limit, max_len=max_len)]


# ---------------------------------------------------------------------------------------------- gate, draft


def quality_gate(q: dict, max_ppl_increase: float, min_top1: float | None = None) -> list[str]:
    """Messages for every failed quality gate (empty when all pass)."""
    out = []
    if q["ppl_increase"] > max_ppl_increase:
        out.append(f"held-out perplexity {q['ppl_bf16']:.4f} (unquantized) -> {q['ppl_fp8']:.4f} (FP8) is "
                   f"+{100 * q['ppl_increase']:.3f}%, more than quantize.max_ppl_increase {100 * max_ppl_increase:.3f}% "
                   f"(top-1 agreement {q['top1_agreement']:.4f}, mean KL {q['mean_kl']:.4g}); keep sensitive layers in "
                   "BF16 (quantize.auto_exclude, quantize.exclude_modules), try another recipe "
                   "(quantize.fallback_formats), calibrate on more representative data, or raise the limit knowingly")
    if min_top1 is not None and q["top1_agreement"] < min_top1:
        out.append(f"next-token top-1 agreement {q['top1_agreement']:.4f} < quantize.min_top1_agreement {min_top1}")
    return out


def quantize_eagle_draft(ctx: StageContext, sec: Config, target_dir: Path, calib, heldout, device, dtype) -> dict:
    """Quantize train_draft's EAGLE-3 draft to FP8 into `draft_fp8/`, check its format, return its metrics."""
    from runtime.quant.checks import check_checkpoint
    from runtime.quant.eagle_draft import DraftRecipe, quantize_eagle_checkpoint

    draft_dir = ctx.input("train_draft").path / "draft"
    out = ctx.out_dir / "draft_fp8"
    with _stage_errors():
        res = quantize_eagle_checkpoint(
            target_dir, draft_dir, out, calib, heldout,
            recipe=DraftRecipe(sec.kv_cache, tuple(sec.exclude_modules), fc_fp8=sec.draft_fc == "fp8"),
            run=QuantRun(device, dtype, log=ctx.log))
    # quantize.exclude_modules name target modules; the draft is checked against its own exclude_modules
    _raise_failed(checks := check_checkpoint(out, kv_cache=sec.kv_cache == "fp8"), "draft_fp8")
    return {**res, "checks": checks}


def report(artifact) -> str:
    from pipeline.report import esc, figure, table

    q = artifact.read_json("quality.json")
    meta = quantize_artifact.read_info(artifact.path).raw
    pct = lambda v: "" if v is None else f"{100 * v:+.3f}%"  # noqa: E731
    rows = [["format (shipped)", f"{meta['format']} (quant_algo {meta.get('quant_algo')})"], ["KV cache", meta["kv_cache"]],
            ["draft deployed", meta["draft_dir"]],
            ["excluded (high precision)", ", ".join(meta.get("exclude_modules") or [])],
            ["kept in BF16 by auto_exclude", ", ".join(meta.get("auto_excluded") or []) or "none"],
            ["perplexity unquantized", q["ppl_bf16"]], ["perplexity FP8 (exported checkpoint)", q["ppl_fp8"]],
            ["perplexity increase", f"{100 * q['ppl_increase']:+.3f}% (limit {100 * q['max_ppl_increase']:.2f}%)"],
            ["next-token top-1 agreement", q["top1_agreement"]], ["mean KL (nats/token)", q["mean_kl"]],
            ["perplexity ModelOpt fake-quant (fidelity samples)", q.get("ppl_fakequant")],
            ["export vs ModelOpt fake-quant: top-1 / KL", f"{q.get('export_vs_fakequant_top1_agreement')} / "
                                                         f"{q.get('export_vs_fakequant_kl')}"],
            ["FP8 noise floor (self vs 1e-6 input perturbation): top-1 / KL",
             f"{q.get('noise_floor_top1_agreement')} / {q.get('noise_floor_kl')}"],
            ["layer-wise max relative error, export vs fake-quant (same inputs)", q.get("layerwise_max_rel_err")],
            ["held-out tokens", q["eval_tokens"]]]
    d = q.get("draft") or {}
    for k in ("draft_top1_bf16", "draft_top1_fp8", "draft_export_vs_fakequant_loss_diff"):
        if k in d:
            rows.append([k.replace("_", " "), d[k]])
    html = table(rows, ["", ""])
    rec = q.get("recipes") or []
    if rec:
        html += "<p>Recipes tried, in order (the first meeting the gate ships):</p>" + table(
            [[r["format"], r["ppl_fp8"], pct(r["ppl_increase"]), r["top1_agreement"], r["mean_kl"],
              ", ".join(r.get("kept_bf16") or []) or "none",
              f"{r['export_vs_fakequant_top1_agreement']} / {r['export_vs_fakequant_kl']}",
              (r.get("search") or {}).get("forwards", ""), "pass" if r["gate_passed"] else "fail"] for r in rec],
            ["recipe", "ppl FP8", "ppl increase", "top-1", "mean KL", "kept in BF16", "export vs fake-quant top-1 / KL",
             "search forwards", "gate"])
    rows_html = "".join(
        f"<tr><td>{esc(c['name'])}</td><td class='{'pass' if c['passed'] else 'fail'}'>{'pass' if c['passed'] else 'fail'}"
        f"</td><td>{esc(c['message'])}</td></tr>" for c in meta.get("checks", []))
    html += f"<table><tr><th>format check (target_fp8)</th><th></th><th></th></tr>{rows_html}</table>"
    ps = q.get("per_sample_ppl") or []
    if ps:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(4.5, 4))
        xs, ys = [p[0] for p in ps], [p[1] for p in ps]
        ax.scatter(xs, ys, s=10)
        lo, hi = min(xs + ys), max(xs + ys)
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8)
        ax.set_xscale("log"), ax.set_yscale("log")
        ax.set_xlabel("per-sample perplexity, unquantized"), ax.set_ylabel("FP8 (exported)")
        ax.set_title("held-out samples")
        html += figure(fig)
    return html
