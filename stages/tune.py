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

from pydantic import Field, field_validator, model_validator

from pipeline.artifacts import quantize as quantize_artifact
from pipeline.artifacts import target as target_artifact
from pipeline.artifacts import train_draft as train_draft_artifact
from pipeline.artifacts import validate as validate_artifact
from pipeline.artifacts.quantize import QuantizeInfo
from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection, Strict

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


def target_version(cfg, algorithm: str | None = None) -> str:
    """The TensorRT-LLM version the schedule is tuned for: the one build deploys (tune's own only when build is
    disabled or absent), else the default version, or, when that cannot serve the draft (DFlash needs 1.3), the
    newest one that can."""
    from runtime.trtllm import compat

    b = getattr(cfg, "build", None)
    v = (getattr(b, "trtllm_version", None) if getattr(b, "enabled", True) else None) or cfg.tune.trtllm_version \
        or getattr(b, "trtllm_version", None)
    if v:
        return compat.normalize_version(v)
    if algorithm and compat.algorithm_problem(compat.DEFAULT_TRTLLM_VERSION, algorithm) is not None:
        able = compat.supported_versions_for(algorithm)
        if able:
            return able[-1]
    return compat.DEFAULT_TRTLLM_VERSION


def eagle3_one_model(cfg) -> bool:
    """Whether the deployment runs EAGLE-3 as one model (build.eagle3_mode; the default)."""
    return getattr(getattr(cfg, "build", None), "eagle3_mode", "one_model") != "two_model"


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
    quant = getattr(cfg, "quantize", None)
    fmt = str(getattr(quant, "format", "") or "")
    gpu = GPUS[cfg.hardware.gpu]
    if "fp8" in fmt.lower() and not gpu.has_fp8 and prof is None:
        out.append(("hardware.gpu", f"{gpu.name} has no FP8 tensor cores, but quantize.format is {fmt}; TensorRT-LLM "
                                    "FP8 needs Ada, Hopper or Blackwell (l40s, h100_*, h200*, b200)"))
    algo = getattr(getattr(cfg, "train_draft", None), "algorithm", None)
    algo = getattr(algo, "kind", algo)
    if cfg.tune.trtllm_version and isinstance(algo, str) and \
            (p := compat.algorithm_problem(cfg.tune.trtllm_version, algo)) is not None:
        out.append(("tune.trtllm_version", p))
    b = getattr(cfg, "build", None)
    if cfg.tune.trtllm_version and b is not None and getattr(b, "enabled", True) and getattr(b, "trtllm_version", None) \
            and compat.normalize_version(cfg.tune.trtllm_version) != compat.normalize_version(b.trtllm_version):
        out.append(("tune.trtllm_version", f"{cfg.tune.trtllm_version} differs from build.trtllm_version "
                                           f"{b.trtllm_version}: the schedule is tuned for the version build deploys "
                                           "(which schedules it runs differs by version); remove tune.trtllm_version"))
    return out


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    from runtime.cost import costmodel as cm
    from runtime.trtllm import compat

    sec: Config = ctx.section
    hw = ctx.config.hardware
    target = target_artifact.read_info(ctx.input("target").path)
    draft_art = ctx.input("train_draft")
    draft = train_draft_artifact.read_info(draft_art.path)
    version = target_version(ctx.config, draft.get("algorithm"))
    rel = compat.release(version)
    quant = quantize_artifact.read_info(ctx.input("quantize").path)
    acc = validate_artifact.read_acceptance(ctx.input("validate").path)

    if (p := compat.algorithm_problem(version, str(draft.get("algorithm")))) is not None:
        raise StageError(p)
    dep, hw_doc = deployment(ctx, sec, hw, target, draft, draft_art.path, quant)
    curves, weights, K = acceptance_curves(acc, sec, draft, ctx.log)
    ctx.log.info("cost model: %s, TP %d, context %d; target %s weights / %s KV, draft %s; ridge %.0f rows",
                 hw_doc["machine"], dep.tp, dep.context, dep.target_prec.gemm_dtype, _kv_name(dep.target_prec),
                 dep.draft_prec.gemm_dtype, dep.machine.ridge_rows(dep.target_prec))
    ctx.log.info("acceptance (FP8 pair) per domain, positions 1..%d: %s; traffic weights %s", K,
                 {d: [round(a, 3) for a in c[:K]] for d, c in curves.items()}, weights)

    max_batch, capacity = batch_limit(dep, sec, hw)
    ctx.log.info("max_batch_size %d (KV memory holds %s sequences of %d tokens)", max_batch,
                 capacity if capacity is not None else "any number of", sec.context_length)
    kw = dict(min_speedup=sec.min_speedup, tie_tolerance=sec.tie_tolerance)
    table = [_row(dep, cm.choose_k(dep, curves, weights, b, K, **kw), curves, weights, max_batch)
             for b in sec.batch_sizes]
    for r in table:
        ctx.log.info("batch %4d: k=%d, predicted speedup %.2fx (k=0..%d: %s), B(1+k)/ridge %.2f%s", r["batch"], r["k"],
                     r["speedup"], K, " ".join(f"{s:.2f}" for s in r["speedups_by_k"]), r["rows_over_ridge"],
                     "" if r["within_max_batch_size"] else " [above max_batch_size]")

    mode = rel.mode(str(draft.get("algorithm")), eagle3_one_model(ctx.config))
    schedule, policy = choose_schedule(dep, curves, weights, max_batch, K, rel, mode, sec, kw)
    ctx.log.info("TensorRT-LLM %s, %s: %s", version, mode.replace("_", "-"), policy["note"])
    for r in table:   # what the deployment runs at each table batch size; say where that overrules the table
        r["deployed_k"] = schedule.k_at(r["batch"]) if r["within_max_batch_size"] else None
        r["deployed_speedup"] = r["speedups_by_k"][r["deployed_k"]] if r["deployed_k"] is not None else None
        if r["deployed_k"] is not None and r["deployed_k"] != r["k"]:
            ctx.log.info("batch %d: k=%d deployed as %d (%s)", r["batch"], r["k"], r["deployed_k"], policy["name"])
    runs = schedule.bounded(max_batch)
    points = [hi for _, hi, _ in runs] + [lo for lo, _, _ in runs]
    graphs = cm.cuda_graph_batch_sizes(max_batch, points)
    kmax = schedule.max_draft_len(max_batch)
    num_tokens = cm.max_num_tokens(max_batch, kmax, sec.min_num_tokens)
    for lo, hi, k in runs:
        ctx.log.info("batch %d-%d: draft length %d%s", lo, hi, k, " (speculation off)" if k == 0 else "")
    if kmax == 0:
        ctx.log.warning("speculation never pays on this hardware with this acceptance (%s): build deploys the "
                        "target without a draft", policy["note"])

    doc = {
        "deployment": {"trtllm_version": version, "mode": mode, "algorithm": draft.get("algorithm"), **policy},
        "speculation": kmax > 0,
        "max_draft_len": kmax,
        "draft_schedule": schedule.to_json(max_batch),
        "max_batch_size": max_batch,
        "max_num_tokens": num_tokens,
        "cuda_graph_batch_sizes": graphs,
        "context_length": sec.context_length,
        "kv_capacity_sequences": capacity,
        "hardware": hw_doc,
        "models": {"target": _shape(dep.target), "draft": _shape(dep.draft), "algorithm": dep.algorithm,
                   "target_precision": vars(dep.target_prec), "draft_precision": vars(dep.draft_prec)},
        "acceptance": {"per_position": {d: c[:K] for d, c in curves.items()}, "weights": weights, "K": K,
                       "source_max_draft_len": acc.get("max_draft_len")},
        "predicted": table,
    }
    (ctx.out_dir / "tuning.json").write_text(json.dumps(doc, indent=2))
    b1 = table[0]
    return {
        "speculation": kmax > 0, "max_draft_len": kmax, "draft_schedule": schedule.describe(max_batch),
        "schedule_policy": policy["name"], "max_batch_size": max_batch, "max_num_tokens": num_tokens,
        "trtllm_version": version, "mode": mode, "gpu": hw_doc["gpu"], "ridge_rows": round(hw_doc["ridge_rows"], 1),
        f"predicted_speedup_batch{b1['batch']}": round(b1["speedup"], 3),
        "predicted_speedup": {str(r["batch"]): round(r["speedup"], 3) for r in table},
    }


def choose_schedule(dep, curves, weights, max_batch: int, K: int, rel, mode: str, sec: Config, kw: dict):
    """The draft length per batch size the deployment runs, fitted to what `rel` does in `mode`
    (runtime/trtllm/compat.py, SOURCES per_batch_draft_len_1_2 and zero_draft_len_one_engine), and a description."""
    from runtime.cost import costmodel as cm
    from runtime.trtllm.draft_schedule import DraftSchedule

    line = f"TensorRT-LLM {rel.line}"
    if mode not in rel.per_batch_draft_len:
        batches = [b for b in sec.batch_sizes if b <= max_batch] or [max_batch]
        k, gm = cm.best_constant_k(dep, curves, weights, batches, K, **kw)
        return DraftSchedule.constant(k), {
            "name": "constant", "per_batch_draft_len": False,
            "note": (f"{line} in {mode.replace('_', '-')} mode uses one draft length at every batch size (it applies "
                     "draft_len_schedule and max_concurrency only with a two-model drafter): "
                     + (f"k={k} at every batch size, the best geometric-mean predicted speedup ({gm:.3f}x) over batch "
                        f"sizes {batches}" if k else "no constant draft length pays on average: no speculation"))}
    ideal = cm.k_by_batch(dep, curves, weights, max_batch, K, **kw)
    if mode in rel.zero_draft_len_ok or not any(ideal):
        sched = DraftSchedule.from_ks(ideal)
        return sched, {"name": "per_batch", "per_batch_draft_len": True,
                       "note": f"{line} applies the draft length per batch size: {sched.describe(max_batch)}"}
    floored = cm.k_by_batch(dep, curves, weights, max_batch, K, **kw, min_k=1)
    sched = DraftSchedule.from_ks(floored)
    off = [b for b, k in enumerate(ideal, start=1) if k == 0]
    note = f"{line} applies the draft length per batch size: {sched.describe(max_batch)}"
    if off:
        note += (f"; batch sizes {off[0]}-{off[-1]} would do better without speculation, but a draft length of 0 in "
                 "one-engine mode corrupts the drafter's state and acceptance collapses once speculation resumes "
                 "(TensorRT-LLM PR #16888), and max_concurrency is translated into such a schedule: they keep the "
                 "best k >= 1 instead")
    return sched, {"name": "per_batch_min1", "per_batch_draft_len": True, "note": note}


def deployment(ctx, sec: Config, hw, target: dict, draft: dict, draft_art: Path, quant: QuantizeInfo):
    """Shapes, precisions and machine of the deployment, and a description of them for tuning.json."""
    from pipeline.hardware import GPUS
    from runtime.cost import costmodel as cm

    draft_cfg = train_draft_artifact.read_draft_config(draft_art)
    algo = draft.get("algorithm")
    if algo not in ("eagle3", "dflash"):
        raise StageError(f"draft.json algorithm is {algo!r}; tune prices eagle3 and dflash drafts")
    gpu = GPUS[hw.gpu]
    weight_fmt = _weight_format(quant.format)
    kv_bytes = 1.0 if quant.kv_cache_fp8 else 2.0
    draft_fp8 = quant.draft_is_fp8
    if hw.profile is not None:
        profile = json.loads(Path(hw.profile).read_text())
        machine = cm.machine_from_profile(profile, memory_gb=float(profile.get("memory_gb") or gpu.memory_gb))
        measured = set(profile["machine"]["peak_tflops"])
        if weight_fmt not in measured:
            ctx.log.warning("profile %s measured %s GEMMs, not %s: its rate stands in for %s GEMMs",
                            hw.profile, ", ".join(sorted(measured)), weight_fmt, weight_fmt)
        desc = f"profile {hw.profile} ({profile.get('device')})"
    else:
        if weight_fmt == "fp8" and not gpu.has_fp8:
            raise StageError(f"{gpu.name} has no FP8 tensor cores but the target is FP8 ({quant.format}); "
                             "choose an FP8-capable hardware.gpu or a BF16 quantize.format")
        e = sec.efficiency
        machine = cm.machine_from_gpu(gpu, compute_efficiency=e.compute, memory_efficiency=e.memory,
                                      op_overhead_us=e.op_overhead_us)
        desc = f"{gpu.name} datasheet x efficiency (compute {e.compute}, memory {e.memory})"
    tprec = cm.Precision(weight_fmt, 1.0 if weight_fmt == "fp8" else 2.0, kv_bytes)
    dprec = cm.Precision("fp8" if draft_fp8 and gpu.has_fp8 else "bf16", 1.0 if draft_fp8 else 2.0, kv_bytes)
    tshape = cm.target_shape(target)
    dshape = cm.draft_shape(draft, draft_cfg, target["hidden_size"])
    max_pos = target.get("max_position_embeddings")
    if max_pos and sec.context_length > max_pos:
        raise StageError(f"tune.context_length {sec.context_length} exceeds the target's max_position_embeddings "
                         f"{max_pos}; use the context the deployment will actually serve")
    dmax = draft.get("max_position_embeddings") or draft_cfg.get("max_position_embeddings")
    if dmax and sec.context_length > dmax:
        ctx.log.warning("tune.context_length %d is beyond the draft's max_position_embeddings %s: acceptance may "
                        "collapse past it in production", sec.context_length, dmax)
    tp = hw.tensor_parallel_size
    for name, shape in (("target", tshape), ("draft", dshape)):
        if shape.heads % tp or (shape.kv_heads % tp and tp % shape.kv_heads):
            raise StageError(f"hardware.tensor_parallel_size {tp} does not divide the {name}'s {shape.heads} "
                             f"attention heads / {shape.kv_heads} KV heads")
    dep = cm.Deployment(tshape, dshape, algo, tprec, dprec, machine, tp, sec.context_length)
    hw_doc = {"gpu": hw.gpu, "gpu_name": gpu.name, "datasheet_source": gpu.source, "tensor_parallel_size": tp,
              "profile": str(hw.profile) if hw.profile else None, "machine": desc,
              "peak_tflops": {k: v / 1e12 for k, v in machine.peak_flops.items()},
              "bandwidth_tb_s": machine.bandwidth / 1e12, "op_overhead_us": machine.op_overhead_s * 1e6,
              "ridge_rows": machine.ridge_rows(tprec)}
    return dep, hw_doc


def _weight_format(fmt) -> str:
    f = str(fmt or "bf16").lower()
    if "fp8" in f:
        return "fp8"
    if f in ("bf16", "bfloat16", "fp16", "float16", "none", "auto"):
        return "bf16"
    raise StageError(f"quantize.json format {fmt!r}: tune models FP8 and BF16 weights only")


def _kv_name(p) -> str:
    return "fp8" if p.kv_bytes == 1 else "bf16"


def acceptance_curves(acc: dict, sec: Config, draft: dict, log=None):
    """Per-domain conditional acceptance of the FP8 pair, the traffic weights, and the longest k to consider.

    A position no step reached (None) counts as 0: it adds nothing to the expected tokens either way. Where
    validate measured only acceptance lengths (its TensorRT-LLM runtime reports no per-position rates), the
    curve is the flat rate a with (1 - a^(K+1)) / (1 - a) = AL at the measured K."""
    from runtime.cost.costmodel import flat_acceptance

    domains = acc.get("domains") or {}
    curves: dict[str, list[float]] = {}
    for d, v in domains.items():
        fp8 = (v or {}).get("fp8") or {}
        pp = fp8.get("per_position")
        if not pp:
            al, K = fp8.get("acceptance_length"), acc.get("max_draft_len")
            if not isinstance(al, (int, float)) or not K:
                raise StageError(f"acceptance.json: domain '{d}' has neither fp8.per_position nor an acceptance_length "
                                 "with max_draft_len; rerun validate")
            a = flat_acceptance(float(al), int(K))
            pp = [a] * int(K)
            if log:
                log.info("domain %s: no per-position rates; flat acceptance %.3f from AL %.3f at k=%d", d, a, al, K)
        pp = [0.0 if a is None else a for a in pp]
        if any(not isinstance(a, (int, float)) or not 0 <= a <= 1 for a in pp):
            raise StageError(f"acceptance.json: domain '{d}' fp8.per_position must hold rates in [0, 1], found {pp}")
        curves[d] = [float(a) for a in pp]
    if not curves:
        raise StageError("acceptance.json has no domains; validate must measure at least one")
    if sec.domain_weights is None:
        weights = {d: 1.0 for d in curves}
    else:
        unknown = sorted(set(sec.domain_weights) - set(curves))
        if unknown:
            raise StageError(f"tune.domain_weights names {', '.join(unknown)}, which validate did not measure; "
                             f"measured domains: {', '.join(sorted(curves))}")
        weights = {d: float(w) for d, w in sec.domain_weights.items() if w > 0}
    K = min(len(c) for c in curves.values())
    if sec.max_draft_len:
        K = min(K, sec.max_draft_len)
    if draft.get("algorithm") == "dflash" and draft.get("block_size"):
        from runtime.trtllm.draft_schedule import dflash_max_draft_len

        K = min(K, dflash_max_draft_len(int(draft["block_size"])))
    return curves, weights, K


def batch_limit(dep, sec: Config, hw) -> tuple[int, int | None]:
    """max_batch_size: the configured (or largest table) batch, capped by how many sequences of
    `context_length` tokens the KV cache of all TP ranks holds next to the weights."""
    want = sec.max_batch_size or sec.batch_sizes[-1]
    mem = dep.machine.memory_bytes * dep.tp
    if not mem:
        return want, None
    weights = dep.target.weight_params() * dep.target_prec.weight_bytes
    if dep.draft is not None:
        weights += dep.draft.weight_params() * dep.draft_prec.weight_bytes
    per_seq = (dep.target.kv_bytes_per_token(dep.target_prec.kv_bytes)
               + (dep.draft.kv_bytes_per_token(dep.draft_prec.kv_bytes) if dep.draft else 0)) * sec.context_length
    free = (mem - weights) * sec.kv_cache_memory_fraction
    capacity = int(free // per_seq) if free > 0 else 0
    if capacity < 1:
        raise StageError(f"the weights ({weights / 1e9:.1f} GB) leave no room for one sequence's KV cache "
                         f"({per_seq / 1e9:.2f} GB at {sec.context_length} tokens) on {dep.tp} x {mem / dep.tp / 1e9:.0f} GB; "
                         "raise hardware.tensor_parallel_size or lower tune.context_length")
    return min(want, capacity), capacity


def _row(dep, choice, curves, weights, max_batch: int) -> dict:
    from runtime.cost import costmodel as cm

    b, k = choice.batch, choice.k
    t1 = dep.target_time(b, 1)
    ts = dep.spec_time(b, k)
    e = cm.mix_expected_tokens(curves, weights, k)
    return {"batch": b, "k": k, "speedup": choice.speedup, "speedups_by_k": choice.speedups,
            "domain_speedups": choice.domain_speedups, "tokens_per_step": e,
            "target_step_ms": t1 * 1e3, "spec_step_ms": ts * 1e3, "draft_ms": dep.draft_time(b, k) * 1e3,
            "tokens_per_s": b * e / ts, "rows_over_ridge": choice.rows_over_ridge,
            "within_max_batch_size": b <= max_batch}


def _shape(s) -> dict | None:
    if s is None:
        return None
    return {"num_layers": s.num_layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "weight_params": s.weight_params()}


# ---------------------------------------------------------------------------------------------- report


def report(artifact) -> str:
    import matplotlib.pyplot as plt

    from pipeline.report import esc, figure, table

    t = artifact.read_json("tuning.json")
    rows = t["predicted"]
    K = t["acceptance"]["K"]
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
    from runtime.trtllm import compat, draft_schedule

    d = t["deployment"]
    sched = draft_schedule.DraftSchedule.from_json(t["draft_schedule"])
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
    ], ["", ""]))
    doms = sorted(rows[0]["domain_speedups"])
    html.append(table([[r["batch"], r["k"], round(r["speedup"], 3), *[round(r["domain_speedups"][d], 3) for d in doms],
                        round(r["tokens_per_step"], 2), round(r["target_step_ms"], 3), round(r["spec_step_ms"], 3),
                        round(r["tokens_per_s"], 1), round(r["rows_over_ridge"], 2)] for r in rows],
                      ["batch", "k", "speedup (mix)", *[f"speedup {esc(d)}" for d in doms], "tokens/step",
                       "target step ms", "spec step ms", "tokens/s", "B(1+k)/ridge"]))
    return "\n".join(html)
