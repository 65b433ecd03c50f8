"""Stage `tune`: draft length and batch limits from the GPU's arithmetic intensity and the measured acceptance.

Verification runs the target on B x (1+k) rows. Below the GPU's ridge point (peak FLOP/s / HBM bytes/s) the
extra rows are nearly free; past it every rejected draft token costs compute, so the best k falls as the batch
grows and speculation stops paying at high batch. This stage prices one step of the target and the draft with
the roofline cost model (`runtime.cost.costmodel`) for the deployment GPU (`hardware.gpu`, or a measured
`hardware.profile`), combines it with the per-position acceptance that `validate` measured on the FP8 pair,
and picks k for every batch size. The draft length the deployment runs is then fitted to what the targeted
TensorRT-LLM version does in the deployment's mode (`build.trtllm_version`, `build.eagle3_mode`; runtime/trtllm/compat.py):
1.2 one-model applies one draft length at every batch size, 1.2 two-model a per-batch schedule that may switch
speculation off, 1.3 one-engine a per-batch schedule that must never reach 0 (TensorRT-LLM PR #16888). From that:
`max_batch_size`, `max_num_tokens` and CUDA-graph batch sizes. Because the decision depends on the build section,
`build` is in USES: changing the version or the mode re-tunes.

Artifact: `tuning.json` (the draft-length schedule as one `DraftSchedule`, limits, and the predicted table).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.artifacts import quantize as quantize_artifact
from pipeline.artifacts import target as target_artifact
from pipeline.artifacts import train_draft as train_draft_artifact
from pipeline.artifacts import tune as tune_artifact
from pipeline.artifacts import validate as validate_artifact
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict
from runtime.errors import RuntimeFailure
from runtime.records_deploy import TuningInfo

NAME = "tune"
CONSUMES: tuple[str, ...] = ("target", "train_draft", "quantize", "validate")
USES = ("hardware", "build")   # build.trtllm_version / eagle3_mode decide which schedules the deployment runs
VERSION = "2"
PACKAGES: tuple[str, ...] = ()

class Efficiency(Strict):
    """Fractions of the datasheet a real kernel reaches (ignored with `hardware.profile`, which is measured).
    Defaults from anchors.md: an H200 GEMM reaches ~790 of 989 BF16 TFLOP/s, a device copy ~4.3 of 4.8 TB/s."""

    compute: float = Field(0.8, gt=0, le=1)
    memory: float = Field(0.85, gt=0, le=1)
    op_overhead_us: float = Field(2.0, ge=0, description="fixed cost per kernel (CUDA graphs: a few us)")


class Config(StageSection):
    trtllm_version: str | None = Field(None, description="TensorRT-LLM version to tune for when build is disabled; "
                                       "with build enabled it must equal build.trtllm_version (default: build's)")
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256],
                                   description="batch sizes of the predicted table and the plot")
    context_length: int = Field(2048, ge=1, description="typical KV length during decode (prompt + output so far)")
    max_draft_len: int | None = Field(None, ge=1, description="cap on k; default: the length validate measured")
    domain_weights: dict[str, float] | None = Field(None, description="traffic share per eval domain; default equal")
    min_speedup: float = Field(1.0, gt=0, description="speculation off where the predicted speedup is below this")
    tie_tolerance: float = Field(0.01, ge=0, lt=0.5, description="prefer a shorter k within this fraction of the best")
    max_batch_size: int | None = Field(None, ge=1, description="default: the largest batch size, capped by KV memory")
    min_num_tokens: int = Field(8192, ge=1, description="max_num_tokens never below this (chunked-prefill budget)")
    kv_cache_memory_fraction: float = Field(0.9, gt=0, le=1, description="share of memory left after weights for KV")
    efficiency: Efficiency = Field(default_factory=Efficiency)
    sa_enhancer: Literal["auto", "always", "never"] = Field("auto", description=(
        "TensorRT-LLM's suffix-automaton enhancer (sa_config) on the trained draft: auto = at the best threshold "
        "validate.hybrid measured, where it pays on the traffic mix and the version has it; always = wherever the "
        "version has it; never (runtime/cost/hybrid.py)"))

    @field_validator("trtllm_version", mode="before")
    @classmethod
    def _version(cls, v):
        from runtime.trtllm import compat

        if v is None:
            return v
        v = str(v).strip()
        compat.release(v)   # ValueError naming the supported lines
        return v

    @field_validator("batch_sizes")
    @classmethod
    def _batches(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("give at least one batch size")
        if any(b < 1 for b in v):
            raise ValueError(f"batch sizes must be >= 1, found {v}")
        if v != sorted(set(v)):
            raise ValueError(f"batch sizes must be strictly increasing, found {v}")
        return v

    @field_validator("domain_weights")
    @classmethod
    def _weights(cls, v):
        if v is None:
            return v
        if any(w < 0 for w in v.values()):
            raise ValueError("domain weights must be >= 0")
        if not v or sum(v.values()) <= 0:
            raise ValueError("at least one domain needs a positive weight")
        return v

    @model_validator(mode="after")
    def _batch_cap(self):
        if self.max_batch_size is not None and self.max_batch_size < self.batch_sizes[0]:
            raise ValueError(f"max_batch_size {self.max_batch_size} is below the smallest batch size {self.batch_sizes[0]}")
        return self


def target_version(cfg) -> str:
    """The TensorRT-LLM version the schedule is tuned for: the one build deploys (`build.trtllm_version`, which always
    has a value: default `compat.DEFAULT_TRTLLM_VERSION`); tune's own (`tune.trtllm_version`) only when build is
    disabled. A version that cannot serve the draft is a config error (build.check, check: DFlash needs 1.3)."""
    from runtime.trtllm import compat

    b = cfg.build
    return compat.normalize_version((b.trtllm_version if b.enabled else None) or cfg.tune.trtllm_version
                                    or b.trtllm_version)


def eagle3_one_model(cfg) -> bool:
    """Whether the deployment runs EAGLE-3 as one model (build.eagle3_mode; the default)."""
    return cfg.build.eagle3_mode != "two_model"


def check(cfg) -> list[tuple[str, str]]:
    """Cross-section checks: the profile file, FP8 on the GPU, a version that can serve the draft."""
    from pipeline.hardware import GPUS
    from runtime.trtllm import compat

    out: list[tuple[str, str]] = []
    prof = cfg.hardware.profile
    if prof is not None:
        p = Path(prof)
        if not p.is_file():
            out.append(("hardware.profile", f"{p}: no such file; write one with `specpipe profile CONFIG`"))
        else:
            from runtime.cost.profile import check_profile

            try:
                doc = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError) as e:
                doc = None
                out.append(("hardware.profile", f"{p}: not readable JSON ({e})"))
            if doc is not None:
                out += [("hardware.profile", f"{p}: {msg}") for msg in check_profile(doc)]
    fmt = str(cfg.quantize.format or "")
    gpu = GPUS[cfg.hardware.gpu]
    if "fp8" in fmt.lower() and not gpu.has_fp8 and prof is None:
        out.append(("hardware.gpu", f"{gpu.name} has no FP8 tensor cores, but quantize.format is {fmt}; TensorRT-LLM "
                                    "FP8 needs Ada, Hopper or Blackwell (l40s, h100_*, h200*, b200)"))
    algo = cfg.train_draft.algorithm.kind
    if cfg.tune.trtllm_version and \
            (p := compat.algorithm_problem(cfg.tune.trtllm_version, algo)) is not None:
        out.append(("tune.trtllm_version", p))
    if cfg.tune.sa_enhancer == "always":
        from runtime.trtllm import sa_enhancer

        if (p := sa_enhancer.problem(target_version(cfg), algo)) is not None:
            out.append(("tune.sa_enhancer", f"always: {p}; or set tune.sa_enhancer: auto or never"))
    b = cfg.build
    if cfg.tune.trtllm_version and b.enabled and b.trtllm_version \
            and compat.normalize_version(cfg.tune.trtllm_version) != compat.normalize_version(b.trtllm_version):
        out.append(("tune.trtllm_version", f"{cfg.tune.trtllm_version} differs from build.trtllm_version "
                                           f"{b.trtllm_version}: the schedule is tuned for the version build deploys "
                                           "(which schedules it runs differs by version); remove tune.trtllm_version"))
    return out


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    from runtime.cost import draft_length as dl
    from runtime.trtllm import compat

    sec: Config = ctx.section
    target = target_artifact.read_info(ctx.input("target").path)
    draft_art = ctx.input("train_draft")
    draft = train_draft_artifact.read_info(draft_art.path)
    version = target_version(ctx.config)
    rel = compat.release(version)
    quant = quantize_artifact.read_info(ctx.input("quantize").path)
    acc = validate_artifact.read_acceptance(ctx.input("validate").path)

    if (p := compat.algorithm_problem(version, draft.algorithm)) is not None:
        raise StageError(p)
    draft_cfg = train_draft_artifact.read_draft_config(draft_art.path)
    dep, hw_doc, curves, weights, K = _price(ctx, target, draft, draft_cfg.raw, quant, acc)
    max_batch, capacity = _batch_limit(ctx, dep)
    kw = dict(min_speedup=sec.min_speedup, tie_tolerance=sec.tie_tolerance)
    table = _predicted_table(ctx, dep, curves, weights, K, max_batch, kw)

    mode = rel.mode(draft.algorithm, eagle3_one_model(ctx.config))
    schedule, policy = dl.choose_schedule(dep, curves, weights, max_batch, K, dl.TrtllmMode(rel, mode), sec.batch_sizes, kw)
    ctx.log.info("TensorRT-LLM %s, %s: %s", version, mode.replace("_", "-"), policy["note"])
    _mark_deployed(ctx, table, schedule, policy)
    kmax, num_tokens, graphs = _limits(ctx, schedule, max_batch, policy)

    info = TuningInfo(
        deployment={"trtllm_version": version, "mode": mode, "algorithm": draft.algorithm, **policy},
        draft_schedule=schedule, max_batch_size=max_batch, speculation=kmax > 0, max_draft_len=kmax,
        max_num_tokens=num_tokens, cuda_graph_batch_sizes=graphs, context_length=sec.context_length,
        kv_capacity_sequences=capacity, hardware=hw_doc, **_models_and_acceptance(dep, curves, weights, K, acc),
        predicted=table, prediction_check=_prediction_check(ctx, table),
        sa_enhancer=_sa_enhancer(ctx, dep, acc, (curves, weights, K), version, draft.algorithm, kw))
    (ctx.out_dir / tune_artifact.INFO).write_text(json.dumps(info.to_json(), indent=2))
    b1 = table[0]
    return {
        "speculation": kmax > 0, "max_draft_len": kmax, "draft_schedule": schedule.describe(max_batch),
        "schedule_policy": policy["name"], "max_batch_size": max_batch, "max_num_tokens": num_tokens,
        "trtllm_version": version, "mode": mode, "gpu": hw_doc["gpu"], "ridge_rows": round(hw_doc["ridge_rows"], 1),
        f"predicted_speedup_batch{b1['batch']}": round(b1["speedup"], 3),
        "predicted_speedup": {str(r["batch"]): round(r["speedup"], 3) for r in table},
        "sa_enhancer": {k: info.sa_enhancer.get(k) for k in ("deploy", "threshold", "pays", "why")},
    }


def _sa_enhancer(ctx: StageContext, dep, acc, mix: tuple, version: str, algorithm: str, kw: dict) -> dict:
    """Whether build writes sa_config and at which threshold (runtime/cost/hybrid.py), logged."""
    from runtime.cost import hybrid
    from runtime.trtllm import sa_enhancer

    out = hybrid.choose(dep, acc, mix, ctx.section.batch_sizes, kw,
                        {"want": ctx.section.sa_enhancer, "problem": sa_enhancer.problem(version, algorithm),
                         "vllm_alternative": sa_enhancer.vllm_alternative(mix[2])})
    ctx.log.info("suffix-automaton enhancer: %s (%s)", "deployed" if out["deploy"] else "not deployed", out["why"])
    return out


def _price(ctx: StageContext, target, draft, draft_cfg, quant, acc):
    """The cost model's deployment on `hardware` (target, draft and their precisions) and the acceptance curves it
    weighs, logged: (deployment, hardware document, curves per domain, domain weights, K)."""
    from pipeline.hardware import GPUS
    from runtime.cost import tuning

    sec: Config = ctx.section
    hw = ctx.config.hardware
    dep, hw_doc = _priced(tuning.deployment, target, draft, draft_cfg, quant,
                          hardware=tuning.Hardware(hw.gpu, GPUS[hw.gpu], hw.profile, hw.tensor_parallel_size),
                          context_length=sec.context_length, efficiency=sec.efficiency, log=ctx.log)
    curves, weights, K = _priced(tuning.acceptance_curves, acc, draft, domain_weights=sec.domain_weights,
                                 max_draft_len=sec.max_draft_len, log=ctx.log)
    ctx.log.info("cost model: %s, TP %d, context %d; target %s weights / %s KV, draft %s; ridge %.0f rows",
                 hw_doc["machine"], dep.tp, dep.context, dep.target_prec.gemm_dtype, tuning.kv_name(dep.target_prec),
                 dep.draft_prec.gemm_dtype, dep.machine.ridge_rows(dep.target_prec))
    ctx.log.info("acceptance (FP8 pair) per domain, positions 1..%d: %s; traffic weights %s", K,
                 {d: [round(a, 3) for a in c[:K]] for d, c in curves.items()}, weights)
    return dep, hw_doc, curves, weights, K


def _batch_limit(ctx: StageContext, dep) -> tuple[int, int | None]:
    """max_batch_size (the configured or largest batch size, capped by KV memory) and the KV capacity, logged."""
    from runtime.cost import tuning

    sec: Config = ctx.section
    max_batch, capacity = _priced(tuning.batch_limit, dep, want=sec.max_batch_size or sec.batch_sizes[-1],
                                  context_length=sec.context_length, kv_cache_memory_fraction=sec.kv_cache_memory_fraction)
    ctx.log.info("max_batch_size %d (KV memory holds %s sequences of %d tokens)", max_batch,
                 capacity if capacity is not None else "any number of", sec.context_length)
    return max_batch, capacity


def _predicted_table(ctx: StageContext, dep, curves, weights, K: int, max_batch: int, kw: dict) -> list[dict]:
    """The best k and its predicted speedup at every table batch size, logged row by row."""
    from runtime.cost import draft_length as dl
    from runtime.cost import tuning

    table = [tuning.table_row(dep, dl.choose_k(dep, curves, weights, b, K, **kw), curves, weights, max_batch)
             for b in ctx.section.batch_sizes]
    for r in table:
        ctx.log.info("batch %4d: k=%d, predicted speedup %.2fx (k=0..%d: %s), B(1+k)/ridge %.2f%s", r["batch"], r["k"],
                     r["speedup"], K, " ".join(f"{s:.2f}" for s in r["speedups_by_k"]), r["rows_over_ridge"],
                     "" if r["within_max_batch_size"] else " [above max_batch_size]")
    return table


def _mark_deployed(ctx: StageContext, table: list[dict], schedule, policy: dict) -> None:
    """What the deployment runs at each table batch size (deployed_draft_len, deployed_speedup); says where that overrules
    the table."""
    for r in table:
        r["deployed_draft_len"] = schedule.k_at(r["batch"]) if r["within_max_batch_size"] else None
        r["deployed_speedup"] = r["speedups_by_k"][r["deployed_draft_len"]] if r["deployed_draft_len"] is not None else None
        if r["deployed_draft_len"] is not None and r["deployed_draft_len"] != r["k"]:
            ctx.log.info("batch %d: k=%d deployed as %d (%s)", r["batch"], r["k"], r["deployed_draft_len"], policy["name"])


def _limits(ctx: StageContext, schedule, max_batch: int, policy: dict) -> tuple[int, int, list[int]]:
    """The longest deployed draft length, max_num_tokens and the CUDA-graph batch sizes of the schedule, logged
    (with a warning when speculation never pays)."""
    from runtime.cost import tuning

    runs = schedule.bounded(max_batch)
    points = [hi for _, hi, _ in runs] + [lo for lo, _, _ in runs]
    graphs = tuning.cuda_graph_batch_sizes(max_batch, points)
    kmax = schedule.max_draft_len(max_batch)
    num_tokens = tuning.max_num_tokens(max_batch, kmax, ctx.section.min_num_tokens)
    for lo, hi, k in runs:
        ctx.log.info("batch %d-%d: draft length %d%s", lo, hi, k, " (speculation off)" if k == 0 else "")
    if kmax == 0:
        ctx.log.warning("speculation never pays on this hardware with this acceptance (%s): build deploys the "
                        "target without a draft", policy["note"])
    return kmax, num_tokens, graphs


def _prediction_check(ctx: StageContext, table: list[dict]) -> dict:
    """How far this model was from published GPU runs (runtime.cost.engine_fit.error_band), logged with the batch-1
    prediction it qualifies."""
    from runtime.cost import engine_fit

    band = engine_fit.error_band()
    b1 = table[0]
    ctx.log.info("predicted speedup %.2fx at batch %d; against %d published GPU runs the model priced this way "
                 "over-predicted speedup by %.0f %% on average (worst %.0f %%; the one TensorRT-LLM run %+.0f %%): %s",
                 b1["speedup"], b1["batch"], band["runs_held_out"], band["speedup_mean_abs_error"] * 100,
                 band["speedup_max_abs_error"] * 100, band["trtllm_speedup_error"] * 100, band["record"])
    return band


def _models_and_acceptance(dep, curves, weights, K: int, acc) -> dict:
    """tuning.json's `models` (shapes and precisions the cost model priced) and `acceptance` (the curves it used)."""
    from runtime.cost import tuning

    return {
        "models": {"target": tuning.shape_summary(dep.target), "draft": tuning.shape_summary(dep.draft),
                   "algorithm": dep.algorithm, "target_precision": vars(dep.target_prec),
                   "draft_precision": vars(dep.draft_prec)},
        "acceptance": {"per_position": {d: c[:K] for d, c in curves.items()}, "weights": weights, "draft_len": K,
                       "measured_draft_len": acc.measured_draft_len},
    }


def _priced(fn, *args, **kw):
    """runtime.cost's failures (RuntimeFailure: an artifact fact or a setting tune cannot price) as the stage's
    StageError, with the same message."""
    try:
        return fn(*args, **kw)
    except RuntimeFailure as e:
        raise StageError(str(e)) from None


# ---------------------------------------------------------------------------------------------- report


def report(artifact) -> str:
    import matplotlib.pyplot as plt

    from pipeline.report import esc, figure, table

    t = tune_artifact.read_tuning(artifact.path).raw
    rows = t["predicted"]
    K = t["acceptance"]["draft_len"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    xs = [r["batch"] for r in rows]
    for k in range(1, K + 1):
        ax.plot(xs, [r["speedups_by_k"][k] for r in rows], marker=".", lw=1.2, label=f"k={k}")
    ax.plot(xs, [r["speedup"] for r in rows], color="black", lw=2.5, alpha=0.35, label="chosen")
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    if t["max_batch_size"] < xs[-1]:
        ax.axvline(t["max_batch_size"], color="red", ls=":", lw=1.2, label=f"max_batch_size {t['max_batch_size']}")
    ridge = t["hardware"]["ridge_rows"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("predicted speedup over no speculation")
    ax.set_title(f"{t['hardware']['gpu_name']} TP{t['hardware']['tensor_parallel_size']}, context "
                 f"{t['context_length']}, ridge ~{ridge:.0f} rows")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    html = [figure(fig)]
    from runtime.algorithms.schedule import DraftSchedule
    from runtime.trtllm import compat, draft_schedule

    d = t["deployment"]
    sched = DraftSchedule.from_json(t["draft_schedule"])
    rel = compat.release(d["trtllm_version"])
    try:
        settings = draft_schedule.encode(sched, rel, d["mode"], t["max_batch_size"]) if t["speculation"] else {}
    except draft_schedule.UnsupportedSchedule as e:
        settings = {"not expressible": str(e)}
    html.append(table([
        ["TensorRT-LLM", f"{d['trtllm_version']}, {d['mode'].replace('_', '-')} (per-batch draft length "
                         f"{'applied' if d['per_batch_draft_len'] else 'not applied: one k at every batch size'})"],
        ["speculation", "on" if t["speculation"] else "off (never predicted to pay)"],
        ["draft length by batch", sched.describe(t["max_batch_size"])],
        ["why", d["note"]],
        ["speculative_config (as build writes it)", json.dumps(settings)],
        ["max_batch_size", f"{t['max_batch_size']} (KV holds {t['kv_capacity_sequences']} sequences)"],
        ["max_num_tokens", t["max_num_tokens"]],
        ["cuda_graph batch_sizes", t["cuda_graph_batch_sizes"]],
        ["hardware", t["hardware"]["machine"]],
        *_check_row(t.get("prediction_check")),
    ], ["", ""]))
    doms = sorted(rows[0]["domain_speedups"])
    html.append(table([[r["batch"], r["k"], round(r["speedup"], 3), *[round(r["domain_speedups"][d], 3) for d in doms],
                        round(r["tokens_per_step"], 2), round(r["target_step_ms"], 3), round(r["spec_step_ms"], 3),
                        round(r["tokens_per_s"], 1), round(r["rows_over_ridge"], 2)] for r in rows],
                      ["batch", "k", "speedup (mix)", *[f"speedup {esc(d)}" for d in doms], "tokens/step",
                       "target step ms", "spec step ms", "tokens/s", "B(1+k)/ridge"]))
    return "\n".join(html)


def _check_row(band: dict | None) -> list[list]:
    if not band:
        return []
    return [["error band of these predictions",
             f"on {band['runs_held_out']} published GPU runs held out of the fit the model as priced here was off in speedup "
             f"by {band['speedup_mean_abs_error'] * 100:.0f} % on average, worst {band['speedup_max_abs_error'] * 100:.0f} % "
             f"(TensorRT-LLM: one run, {band['trtllm_speedup_error'] * 100:+.0f} %); plain tokens/s by "
             f"{band['plain_tokens_per_s_mean_abs_error'] * 100:.0f} % "
             f"(worst {band['plain_tokens_per_s_max_abs_error'] * 100:.0f} %): {band['record']}"]]
