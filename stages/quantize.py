"""Stage `quantize`: FP8 post-training quantization of the target (and optionally the draft) with ModelOpt.

What it does, in order:
1. Loads the target in float32 (bfloat16 on CUDA), inserts ModelOpt quantizers (`mtq.quantize`, FP8 E4M3
   per-tensor weights and static activations, optionally FP8 KV) and calibrates them (max calibration) on the
   `data` stage's `calib.parquet`.
2. Exports a ModelOpt unified Hugging Face checkpoint (`export_hf_checkpoint`) to `target_fp8/`, with
   `hf_quant_config.json` (TensorRT-LLM 1.2 ignores the FP8 scales without it) and the target's tokenizer.
3. Runs named format checks on what was written (`check_checkpoint`) before anything is committed.
4. Measures quality by running the exported checkpoint itself through `runtime.fp8` (FP8 weights and E4M3
   activations with the exported scales, as the GPU kernels compute) against the unquantized target on
   `heldout.parquet`: perplexity before/after, next-token top-1 agreement, mean KL. The exported model's
   logits are also compared with ModelOpt's own fake-quant model (a check of the export).
   `max_ppl_increase` (relative) fails the stage, naming the numbers.
5. With `draft: fp8`, rebuilds ModelOpt's EAGLE-3 model around the target from the exported draft
   (`train_draft/draft`, verified by re-exporting it bit-exactly), quantizes only the draft part, calibrates
   it with the training-time forward (all TTT steps, so later draft steps are covered) and exports it with
   `export_speculative_decoding` to `draft_fp8/`.

Artifact (see docs/architecture.md): `target_fp8/`, `draft_fp8/` (only with `draft: fp8`), `quantize.json`,
`quality.json`.
"""
from __future__ import annotations

import fnmatch
import json
import math
import shutil
import time
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from pipeline.errors import StageError
from pipeline.stage import StageContext, StageSection

NAME = "quantize"
CONSUMES: tuple[str, ...] = ("target", "data", "train_draft")
VERSION = "1"
PACKAGES = ("torch", "transformers", "nvidia-modelopt", "safetensors")

WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "hf_quant_config.json")


class Config(StageSection):
    """FP8 post-training quantization. Defaults follow ModelOpt's hf_ptq example (FP8 weights+activations, FP8 KV)."""

    format: Literal["fp8"] = Field("fp8", description="quantization format; FP8 E4M3 per-tensor (ModelOpt FP8_DEFAULT_CFG)")
    kv_cache: Literal["fp8", "none"] = Field("fp8", description="fp8: calibrate and export FP8 KV-cache scales")
    exclude_modules: list[str] = Field(default_factory=list, description=(
        "module name patterns (fnmatch, e.g. 'model.layers.0.*' or '*down_proj') kept in high precision, "
        "in addition to ModelOpt's defaults (lm_head, embeddings, routers)"))
    calib_samples: int = Field(64, ge=1, description="calibration samples taken from data's calib.parquet")
    calib_seq_len: int = Field(256, ge=8, description="calibration samples are truncated to this many tokens")
    eval_samples: int = Field(64, ge=1, description="held-out samples for the quality measurement")
    max_ppl_increase: float = Field(0.02, ge=0, description="fail when ppl_fp8 / ppl_bf16 - 1 exceeds this")
    min_top1_agreement: float | None = Field(None, ge=0, le=1, description="optional gate on next-token top-1 agreement")
    draft: Literal["none", "fp8"] = Field("none", description=(
        "none: deploy train_draft's BF16 draft (NVIDIA's documented combination: FP8 target + BF16 draft); "
        "fp8: quantize the draft too"))
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
    td = getattr(cfg, "train_draft", None)
    if sec.draft == "fp8" and td is not None and not getattr(td, "enabled", True):
        problems.append(("quantize.draft", "is fp8 but train_draft is disabled: there is no draft to quantize"))
    algo = getattr(getattr(td, "algorithm", None), "kind", None) if td is not None else None
    if sec.draft == "fp8" and algo not in (None, "eagle3"):
        problems.append(("quantize.draft", f"fp8 is implemented for EAGLE-3 drafts only; train_draft.algorithm is '{algo}' "
                                           "(use draft: none, NVIDIA's documented FP8 target + BF16 draft)"))
    return problems


# ---------------------------------------------------------------------------------------------- run


def run(ctx: StageContext) -> dict:
    import torch

    sec: Config = ctx.section
    torch.manual_seed(sec.seed)
    target_dir = ctx.input("target").path / "model"
    data = ctx.input("data").path
    tinfo = ctx.input("target").read_json("target.json")
    export_dtype = getattr(torch, tinfo.get("dtype") or "bfloat16")
    device = _device(ctx)
    calib_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    calib = read_samples(data / "calib.parquet", sec.calib_samples, sec.calib_seq_len)
    heldout = read_samples(data / "heldout.parquet", sec.eval_samples, None)
    if not heldout:
        raise StageError(f"quantize: {data / 'heldout.parquet'} has no samples; quality cannot be measured "
                         "(raise data.eval_fraction)")
    ctx.log.info("calibrating on %d samples (<= %d tokens each), measuring on %d held-out samples, device %s",
                 len(calib), sec.calib_seq_len, len(heldout), device)

    # 1-2. quantize + export the target
    t0 = time.monotonic()
    fq_model = quantize_model(target_dir, calib, fmt=sec.format, kv_cache=sec.kv_cache, exclude=sec.exclude_modules,
                              device=device, dtype=calib_dtype, progress=ctx.progress, log=ctx.log)
    fq_ref = fake_quant_reference(fq_model, heldout, device=device)
    out_target = ctx.out_dir / "target_fp8"
    export_target(fq_model, out_target, target_dir, export_dtype)
    del fq_model   # its logits are kept (fq_ref); the reference and FP8 models below need the memory
    quant_s = time.monotonic() - t0

    # 3. format checks
    checks = check_checkpoint(out_target, kv_cache=sec.kv_cache == "fp8", exclude=sec.exclude_modules)
    _raise_failed(checks, "target_fp8")
    ctx.log.info("target_fp8: all %d format checks passed", len(checks))

    # 4. quality, running the exported files
    from runtime.fp8 import load_causal_lm

    ref = load_causal_lm(target_dir, device=device, compute_dtype=calib_dtype, spread=True)
    fp8 = load_causal_lm(out_target, device=device, compute_dtype=calib_dtype, spread=True)
    quality = measure_quality(ref, fp8, heldout, device=device, fake_quant=fq_ref, progress=ctx.progress)
    del ref, fp8
    quality.update(target_dir=str(target_dir), checkpoint="target_fp8", runtime="runtime.fp8 (emulated E4M3 on "
                   + device.type + ")", kv_cache=sec.kv_cache, max_ppl_increase=sec.max_ppl_increase)
    ctx.log.info("quality: perplexity %.4f -> %.4f (%+.3f%%), top-1 agreement %.4f, mean KL %.3g nats, "
                 "export vs ModelOpt fake-quant max |dlogit| %.3g", quality["ppl_bf16"], quality["ppl_fp8"],
                 100 * quality["ppl_increase"], quality["top1_agreement"], quality["mean_kl"],
                 quality["export_vs_fakequant_max_abs_logit_diff"])

    # 5. the draft
    draft_rel = "train_draft/draft"
    draft_metrics: dict = {}
    if sec.draft == "fp8":
        draft_metrics = quantize_eagle_draft(ctx, sec, target_dir, calib, heldout, device, calib_dtype, export_dtype)
        draft_rel = "quantize/draft_fp8"
        quality["draft"] = draft_metrics

    (ctx.out_dir / "quality.json").write_text(json.dumps(quality, indent=2))
    (ctx.out_dir / "quantize.json").write_text(json.dumps({
        "format": sec.format, "kv_cache": sec.kv_cache, "target_dir": "quantize/target_fp8", "draft_dir": draft_rel,
        "draft_format": sec.draft if sec.draft == "fp8" else "bf16", "exclude_modules": _hf_quant(out_target).get("exclude_modules"),
        "calib_samples": len(calib), "calib_seq_len": sec.calib_seq_len, "checks": checks,
    }, indent=2))

    metrics = {k: quality[k] for k in ("ppl_bf16", "ppl_fp8", "ppl_fakequant", "ppl_increase", "top1_agreement", "mean_kl",
                                       "max_abs_logit_diff", "export_vs_fakequant_max_abs_logit_diff",
                                       "export_vs_fakequant_top1_agreement", "eval_tokens")}
    metrics.update(format=sec.format, kv_cache=sec.kv_cache, draft=draft_rel, quantize_seconds=round(quant_s, 2),
                   checks_passed=len(checks))
    for k in ("draft_top1_bf16", "draft_top1_fp8", "draft_export_vs_fakequant_loss_diff"):
        if k in draft_metrics:
            metrics[k] = draft_metrics[k]
    gate_problems = quality_gate(quality, sec.max_ppl_increase, sec.min_top1_agreement)
    if gate_problems:  # the measured numbers stay visible in status --json (failed_metrics) and the report
        raise StageError("quantize: FP8 quality gate failed: " + "; ".join(gate_problems),
                         metrics={**metrics, "max_ppl_increase": sec.max_ppl_increase,
                                  "min_top1_agreement": sec.min_top1_agreement, "gate_passed": False})
    return metrics


def _place(model, device):
    """On `device`, or spread over all visible GPUs when it does not fit one (a 70B target)."""
    from runtime.placement import PlacementError, place

    try:
        return place(model, device)
    except PlacementError as e:
        raise StageError(f"quantize: {e}") from None


def _device(ctx: StageContext):
    import torch

    want = getattr(getattr(ctx.config, "run", None), "device", "auto")
    if want == "cuda" and not torch.cuda.is_available():
        raise StageError("run.device is cuda but torch sees no CUDA device")
    return torch.device("cuda" if want in ("auto", "cuda") and torch.cuda.is_available() else "cpu")


def _raise_failed(checks: list[dict], what: str) -> None:
    bad = [c for c in checks if not c["passed"]]
    if bad:
        raise StageError(f"quantize: {what} failed format checks: " + "; ".join(f"[{c['name']}] {c['message']}" for c in bad))


# ---------------------------------------------------------------------------------------------- data


def read_samples(path: Path, limit: int, max_len: int | None) -> list[dict]:
    """First `limit` rows of a data-stage parquet file as {"input_ids": LongTensor, "loss_mask": LongTensor}."""
    import pyarrow.parquet as pq
    import torch

    if not Path(path).exists():
        raise StageError(f"quantize: {path} is missing; the data stage's artifact contract promises it")
    rows = pq.read_table(str(path), columns=["input_ids", "loss_mask"]).slice(0, limit).to_pylist()
    out = []
    for r in rows:
        ids, mask = r["input_ids"][:max_len], r["loss_mask"][:max_len]
        if len(ids) >= 2:
            out.append({"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)})
    return out


# ---------------------------------------------------------------------------------------------- quantization


def quant_config(fmt: str, kv_cache: str, exclude: list[str], *, only_under: str | None = None,
                 other_top_modules: list[str] = ()) -> dict:
    """The ModelOpt quant config: the format's preset, + FP8 KV, + disabled quantizers for excluded modules.
    `only_under`/`other_top_modules`: quantize only that submodule (used for the draft)."""
    import copy

    import modelopt.torch.quantization as mtq

    if fmt != "fp8":  # the Literal already guarantees this; a new format adds its preset here
        raise ValueError(f"unknown format {fmt}")
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    entries = list(cfg["quant_cfg"])
    if kv_cache == "fp8":
        entries += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    for pat in exclude:
        # only the linear quantizers: an excluded attention block keeps its KV-cache scales (the KV cache dtype is
        # global in TensorRT-LLM; a layer without k_scale/v_scale would run FP8 KV with scale 1.0)
        base = pat if pat.endswith("*") else pat + "."
        entries += [{"quantizer_name": f"{base}{q}", "enable": False} for q in ("weight_quantizer", "input_quantizer")]
    if only_under:
        entries += [{"quantizer_name": f"{name}.*", "enable": False} for name in other_top_modules if name != only_under]
    cfg["quant_cfg"] = entries
    return cfg


def quantize_model(model_dir: Path, calib: list[dict], *, fmt="fp8", kv_cache="fp8", exclude=(), device=None,
                   dtype=None, progress=None, log=None):
    """Load a HF causal LM and return it quantized and calibrated by ModelOpt (fake-quant, ready to export)."""
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM

    device = device or torch.device("cpu")
    model = _place(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32), device).eval()
    if not calib:
        raise StageError("quantize: no calibration samples (data's calib.parquet is empty)")

    def forward_loop(m):
        with torch.no_grad():
            it = progress(calib, total=len(calib), desc="calibrate") if progress else _nullctx(calib)
            with it as bar:
                for s in calib:
                    m(input_ids=s["input_ids"][None].to(device))
                    if progress:
                        bar.update(1)

    model = mtq.quantize(model, quant_config(fmt, kv_cache, list(exclude)), forward_loop)
    if log:
        n = sum(1 for n_, mod in model.named_modules() if n_.endswith("weight_quantizer") and mod.is_enabled)
        log.info("ModelOpt inserted and calibrated %d weight quantizers (%s, kv_cache %s)", n, fmt, kv_cache)
    return model


class _nullctx:
    def __init__(self, x):
        self.x = x

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def export_target(model, out_dir: Path, source_dir: Path, dtype) -> None:
    """`export_hf_checkpoint` + the source model's tokenizer files (the deployment loads them from here)."""
    from modelopt.torch.export import export_hf_checkpoint

    import torch

    # FP8 weights are computed as weight.to(export dtype) / weight_scale: in bfloat16 that division rounds twice
    # (bf16, then E4M3) and ~2% of weights land one FP8 step away from what was calibrated. Export in float32
    # (exact division, the same E4M3 values as ModelOpt's fake-quant model), then store the rest in `dtype`.
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=out_dir)
    cast_high_precision(out_dir, lambda k, v: dtype)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["dtype"] = str(dtype).replace("torch.", "")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    from runtime.hf_config import normalize_file  # RoPE in the form TensorRT-LLM 1.2 and 1.3 read
    normalize_file(out_dir / "config.json")
    copy_tokenizer(source_dir, out_dir)


def cast_high_precision(out: Path, dtype_for) -> int:
    """ModelOpt's exporters store the tensors they do not quantize (embeddings, lm_head, norms, excluded
    modules) in the calibration dtype (float32 on CPU) whatever `dtype` says; store them as `dtype_for(name,
    tensor)` (the deployment dtype). FP8 weights and float32 scales are left alone. Returns how many changed."""
    from safetensors.torch import save_file

    from runtime.fp8 import FP8_DTYPE, SCALE_SUFFIXES, read_safetensors

    sd = read_safetensors(out)
    n = 0
    for k, v in sd.items():
        if v.dtype == FP8_DTYPE or not v.is_floating_point() or k.rsplit(".", 1)[-1] in SCALE_SUFFIXES:
            continue
        want = dtype_for(k, v)
        if v.dtype != want:
            sd[k] = v.to(want)
            n += 1
    if n:
        for f in out.glob("*.safetensors"):
            f.unlink()
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return n


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in WEIGHT_FILES and not (dst / p.name).exists():
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied


# ---------------------------------------------------------------------------------------------- format checks


def _hf_quant(path: Path) -> dict:
    f = Path(path) / "hf_quant_config.json"
    if not f.exists():
        return {}
    doc = json.loads(f.read_text())
    return doc.get("quantization", doc)


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") or name.startswith(p + ".")
               for p in patterns)


def check_checkpoint(path: Path, *, kv_cache: bool, exclude: list[str] = ()) -> list[dict]:
    """Named format checks of a ModelOpt FP8 unified checkpoint (target or draft), as TensorRT-LLM loads it.

    Returns [{"name", "passed", "message"}] for: hf_quant_config, config_agrees, fp8_linears_have_scales,
    quantized_coverage, excluded_high_precision, kv_scales, finite_scales. Never raises on a bad checkpoint."""
    import torch

    from runtime.fp8 import FP8_DTYPE, read_safetensors

    path = Path(path)
    res: list[dict] = []

    def add(name, ok, msg_bad, msg_ok=""):
        res.append({"name": name, "passed": bool(ok), "message": msg_ok if ok else msg_bad})

    hq_file = path / "hf_quant_config.json"
    q = {}
    if not hq_file.exists():
        add("hf_quant_config", False, f"{hq_file} is missing: TensorRT-LLM 1.2 would load the model unquantized")
    else:
        try:
            q = _hf_quant(path)
            ok = str(q.get("quant_algo")).upper() == "FP8"
            add("hf_quant_config", ok, f"quant_algo is {q.get('quant_algo')!r}, expected 'FP8'", "quant_algo FP8")
        except (json.JSONDecodeError, AttributeError) as e:
            add("hf_quant_config", False, f"{hq_file} is not valid JSON ({e})")
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        add("config_agrees", False, "config.json has no quantization_config")
    else:
        if isinstance(qc.get("quantization"), dict):  # export_speculative_decoding embeds the hf_quant_config form
            qc = qc["quantization"]
        problems = []
        if str(qc.get("quant_algo")).upper() != str(q.get("quant_algo")).upper():
            problems.append(f"quant_algo {qc.get('quant_algo')!r} vs hf_quant_config {q.get('quant_algo')!r}")
        kv_cfg = "FP8" if isinstance(qc.get("kv_cache_scheme"), dict) or str(qc.get("kv_cache_quant_algo")).upper() == "FP8" else None
        if kv_cfg != (q.get("kv_cache_quant_algo") or None):
            problems.append(f"KV cache {kv_cfg} vs hf_quant_config {q.get('kv_cache_quant_algo')}")
        ign = qc.get("ignore", qc.get("exclude_modules"))
        if ign is not None and sorted(ign) != sorted(q.get("exclude_modules") or []):
            problems.append(f"ignore {ign} vs exclude_modules {q.get('exclude_modules')}")
        add("config_agrees", not problems, "config.json quantization_config disagrees with hf_quant_config.json: "
            + "; ".join(problems), "config.json and hf_quant_config.json agree")

    try:
        sd = read_safetensors(path)
    except FileNotFoundError as e:
        add("fp8_linears_have_scales", False, str(e))
        return res
    fp8_mods = sorted(k[:-7] for k, v in sd.items() if k.endswith(".weight") and v.dtype == FP8_DTYPE)
    missing = []
    for m in fp8_mods:
        for s in ("weight_scale", "input_scale"):
            t = sd.get(f"{m}.{s}")
            if t is None:
                missing.append(f"{m}.{s}")
            elif t.dtype != torch.float32 or t.numel() != 1:
                missing.append(f"{m}.{s} ({t.dtype}, shape {tuple(t.shape)}; expected a float32 scalar)")
    add("fp8_linears_have_scales", fp8_mods and not missing,
        "no FP8 weights at all" if not fp8_mods else f"{len(missing)} scale(s) missing or malformed: {missing[:6]}",
        f"{len(fp8_mods)} FP8 linears, each with float32 weight_scale and input_scale")

    excl = list(q.get("exclude_modules") or []) + list(exclude)
    hp = sorted(k[:-7] for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2 and v.dtype != FP8_DTYPE)
    not_quant = [m for m in hp if not _matches(m, excl) and "embed" not in m]
    add("quantized_coverage", not not_quant, f"linear weights left in high precision but not listed in exclude_modules: "
        f"{not_quant[:6]} (TensorRT-LLM would read them as FP8)", "every non-excluded linear is FP8")
    listed = list(q.get("exclude_modules") or [])
    linears = sorted(k[:-7] for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2 and "embed" not in k)
    wrong = [m for m in fp8_mods if _matches(m, listed)]
    problems = [f"excluded modules stored as FP8: {wrong[:6]}"] if wrong else []
    for p in exclude:  # every module a requested pattern names must be high precision and covered by the list
        hit = [m for m in linears if _matches(m, [p])]
        if not hit:
            problems.append(f"requested exclusion '{p}' matches no linear module")
        elif [m for m in hit if m in fp8_mods]:
            problems.append(f"'{p}' was excluded but {[m for m in hit if m in fp8_mods][:4]} are FP8")
        elif [m for m in hit if not _matches(m, listed)]:
            problems.append(f"'{p}' modules {[m for m in hit if not _matches(m, listed)][:4]} are missing from exclude_modules")
    add("excluded_high_precision", not problems, "; ".join(problems), "excluded modules are high precision and listed")

    k_scales = {k[: -len(".k_proj.k_scale")] for k in sd if k.endswith("k_proj.k_scale")}
    v_scales = {k[: -len(".v_proj.v_scale")] for k in sd if k.endswith("v_proj.v_scale")}
    attns = {k[: -len(".k_proj.weight")] for k in sd if k.endswith("k_proj.weight")}
    if kv_cache:
        bad = sorted((attns - k_scales) | (attns - v_scales))
        algo = q.get("kv_cache_quant_algo")
        add("kv_scales", not bad and str(algo).upper() == "FP8",
            f"FP8 KV cache asked for but kv_cache_quant_algo={algo!r}, attention modules without k_scale/v_scale: {bad[:6]}",
            f"{len(k_scales)} attention modules with k_scale and v_scale")
    else:
        add("kv_scales", not k_scales and not v_scales and not q.get("kv_cache_quant_algo"),
            "KV cache quantization not asked for but the checkpoint has KV scales or kv_cache_quant_algo",
            "no FP8 KV (as asked)")

    bad_scales = [k for k, v in sd.items() if k.rsplit(".", 1)[-1] in ("weight_scale", "input_scale", "k_scale", "v_scale")
                  and not (torch.isfinite(v.float()).all() and (v.float() > 0).all())]
    add("finite_scales", not bad_scales, f"non-finite or non-positive scales: {bad_scales[:6]}", "all scales finite and > 0")
    return res


# ---------------------------------------------------------------------------------------------- quality


def _positions(s: dict, device):
    """Next-token targets and the mask of scored positions (loss_mask of the target token; all when none)."""
    import torch

    tgt = s["input_ids"][1:].to(device)
    mask = s["loss_mask"][1:].to(device).bool()
    return tgt, (mask if mask.any() else torch.ones_like(tgt, dtype=torch.bool))


def fake_quant_reference(model, samples: list[dict], *, device=None, keep: int = 8) -> dict:
    """Run ModelOpt's fake-quant model BEFORE export (export rewrites its weights to FP8 in place): its held-out
    perplexity and the logits of the first `keep` samples, to compare the exported checkpoint against."""
    import torch

    device = device or torch.device("cpu")
    nll, n, logits = 0.0, 0, []
    with torch.no_grad():
        for i, s in enumerate(samples):
            lf = model(input_ids=s["input_ids"][None].to(device)).logits[0, :-1].float()
            tgt, mask = _positions(s, device)
            nll -= lf.log_softmax(-1)[mask].gather(1, tgt[mask][:, None]).sum().item()
            n += int(mask.sum())
            if i < keep:
                logits.append(lf.cpu())
    return {"ppl": math.exp(nll / n), "logits": logits}


def measure_quality(ref, test, samples: list[dict], *, device=None, fake_quant: dict | None = None, progress=None) -> dict:
    """Quality of `test` (the FP8 model) against `ref` (unquantized) on held-out samples.

    Scored positions: those whose target token has loss_mask 1 (all positions when a sample has none).
    ppl = exp(mean next-token NLL); top-1 agreement = share of positions where both argmaxes agree;
    mean KL = mean over positions of KL(p_ref || p_test), nats; max_abs_logit_diff = the largest |logit change|
    FP8 causes. With `fake_quant` (`fake_quant_reference`): ModelOpt's fake-quant perplexity, the largest |logit
    difference| and the top-1 agreement between it and `test`. They are not exactly equal: ModelOpt's export
    computes weight / (amax/448) where fake-quant computes weight * (448/amax); with bfloat16-exact weights a few
    elements sit exactly on an E4M3 rounding tie and the two float32 results round to neighbouring FP8 values."""
    import torch

    device = device or torch.device("cpu")
    nll_r = nll_t = kl = agree = 0.0
    n = 0
    max_diff = max_effect = 0.0
    fq_agree = fq_n = 0
    per_sample = []
    fq_logits = (fake_quant or {}).get("logits", [])
    ctxm = progress(total=len(samples), desc="quality") if progress else _nullctx(None)
    with torch.no_grad(), ctxm as bar:
        for i, s in enumerate(samples):
            ids = s["input_ids"][None].to(device)
            lr = ref(input_ids=ids).logits[0, :-1].float().to(device)    # a model spread over GPUs may
            lt = test(input_ids=ids).logits[0, :-1].float().to(device)   # return them on its last one
            max_effect = max(max_effect, (lr - lt).abs().max().item())
            if i < len(fq_logits):
                lf = fq_logits[i].to(device)
                max_diff = max(max_diff, (lf - lt).abs().max().item())
                fq_agree += int((lf.argmax(-1) == lt.argmax(-1)).sum())
                fq_n += lt.shape[0]
            tgt, mask = _positions(s, device)
            lpr, lpt = lr.log_softmax(-1)[mask], lt.log_softmax(-1)[mask]
            t = tgt[mask]
            a = -lpr.gather(1, t[:, None]).sum().item()
            b = -lpt.gather(1, t[:, None]).sum().item()
            nll_r += a
            nll_t += b
            kl += (lpr.exp() * (lpr - lpt)).sum().item()
            agree += (lpr.argmax(-1) == lpt.argmax(-1)).sum().item()
            k = int(mask.sum())
            n += k
            per_sample.append([round(math.exp(a / k), 4), round(math.exp(b / k), 4)])
            if progress:
                bar.update(1)
    ppl_r, ppl_t = math.exp(nll_r / n), math.exp(nll_t / n)
    out = {"ppl_bf16": round(ppl_r, 4), "ppl_fp8": round(ppl_t, 4), "ppl_increase": round(ppl_t / ppl_r - 1, 6),
           "top1_agreement": round(agree / n, 6), "mean_kl": round(kl / n, 8), "eval_tokens": n,
           "eval_samples": len(samples), "max_abs_logit_diff": round(max_effect, 6), "per_sample_ppl": per_sample}
    if fake_quant is not None:
        out["ppl_fakequant"] = round(fake_quant["ppl"], 4)
        out["export_vs_fakequant_max_abs_logit_diff"] = round(max_diff, 6)
        out["export_vs_fakequant_top1_agreement"] = round(fq_agree / max(1, fq_n), 6)
        out["export_vs_fakequant_samples"] = len(fq_logits)
    return out


def quality_gate(q: dict, max_ppl_increase: float, min_top1: float | None = None) -> list[str]:
    """Messages for every failed quality gate (empty when all pass)."""
    out = []
    if q["ppl_increase"] > max_ppl_increase:
        out.append(f"held-out perplexity {q['ppl_bf16']:.4f} (unquantized) -> {q['ppl_fp8']:.4f} (FP8) is "
                   f"+{100 * q['ppl_increase']:.3f}%, more than quantize.max_ppl_increase {100 * max_ppl_increase:.3f}% "
                   f"(top-1 agreement {q['top1_agreement']:.4f}, mean KL {q['mean_kl']:.4g}); exclude sensitive modules "
                   "(quantize.exclude_modules), calibrate on more representative data, or raise the limit knowingly")
    if min_top1 is not None and q["top1_agreement"] < min_top1:
        out.append(f"next-token top-1 agreement {q['top1_agreement']:.4f} < quantize.min_top1_agreement {min_top1}")
    return out


# ---------------------------------------------------------------------------------------------- draft


def quantize_eagle_draft(ctx: StageContext, sec: Config, target_dir: Path, calib, heldout, device, dtype, export_dtype) -> dict:
    """Quantize train_draft's EAGLE-3 draft to FP8 into `draft_fp8/`, check its format, return its metrics."""
    draft_dir = ctx.input("train_draft").path / "draft"
    out = ctx.out_dir / "draft_fp8"
    res = quantize_eagle_checkpoint(target_dir, draft_dir, out, calib, heldout, kv_cache=sec.kv_cache,
                                    exclude=sec.exclude_modules, device=device, dtype=dtype, export_dtype=export_dtype,
                                    log=ctx.log)
    # quantize.exclude_modules name target modules; the draft is checked against its own exclude_modules
    checks = check_checkpoint(out, kv_cache=sec.kv_cache == "fp8")
    _raise_failed(checks, "draft_fp8")
    res["checks"] = checks
    return res


def _eagle_cfg_from_export(dcfg: dict, has_lm_head: bool) -> dict:
    """The ModelOpt EAGLE-3 convert config that produced an exported draft config.json."""
    import copy

    import modelopt.torch.speculative as mtsp

    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    arch = cfg["eagle_architecture_config"]
    for k in ("num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "mlp_bias", "attention_bias", "initializer_range", "draft_vocab_size"):
        if dcfg.get(k) is not None:
            arch[k] = dcfg[k]
    for k, v in (dcfg.get("eagle_config") or {}).items():
        if k in arch and v is not None:
            arch[k] = v
    theta = dcfg.get("rope_theta") or (dcfg.get("rope_scaling") or {}).get("rope_theta") or arch["rope_theta"]
    # the exported rope_scaling is ModelOpt's export-time override (YaRN); training used the default rope
    arch["rope_scaling"] = {"rope_type": "default", "rope_theta": theta}
    arch["rope_theta"] = theta
    arch["has_lm_head"] = has_lm_head
    cfg["eagle_use_torch_compile"] = False
    return cfg


def _eagle_model(target_dir: Path, draft_dir: Path, device, dtype):
    """Target + ModelOpt EAGLE-3 module rebuilt from an exported draft, weights loaded and verified: re-exporting
    the rebuilt module must give back the draft's tensors bit for bit."""
    import modelopt.torch.speculative as mtsp
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.fp8 import FP8_DTYPE, read_safetensors

    dcfg = json.loads((draft_dir / "config.json").read_text())
    if "LlamaForCausalLMEagle3" not in (dcfg.get("architectures") or []):
        raise StageError(f"quantize.draft: fp8 supports EAGLE-3 drafts (LlamaForCausalLMEagle3); {draft_dir} is "
                         f"{dcfg.get('architectures')}. Use quantize.draft: none")
    dsd = read_safetensors(draft_dir)
    if any(v.dtype == FP8_DTYPE for v in dsd.values()):
        raise StageError(f"quantize.draft: {draft_dir} is already FP8")
    base = _place(AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype), device)
    base_head = base.get_output_embeddings().weight
    lm = dsd.get("lm_head.weight")
    has_lm_head = lm is not None and (lm.shape != base_head.shape or not torch.equal(lm.to(base_head.dtype).cpu(), base_head.detach().cpu()))
    mtsp.convert(base, [("eagle", _eagle_cfg_from_export(dcfg, has_lm_head))])
    esd = {f"eagle_module.{k}": v for k, v in dsd.items() if k != "lm_head.weight" or has_lm_head}
    res = base.load_state_dict(esd, strict=False)
    missing = [k for k in res.missing_keys if k.startswith("eagle_module.")]
    if missing or res.unexpected_keys:
        raise StageError(f"quantize.draft: could not rebuild the EAGLE-3 module from {draft_dir}: missing {missing[:5]}, "
                         f"unexpected {res.unexpected_keys[:5]}")
    again = base.get_exporter()._extract_state_dict(base.state_dict())
    diff = sorted(set(again) ^ set(dsd)) + [k for k in dsd if k in again and not torch.equal(again[k].to(dsd[k].dtype).cpu(), dsd[k])]
    if diff:
        raise StageError(f"quantize.draft: the rebuilt EAGLE-3 module does not reproduce {draft_dir} (differs at {diff[:5]}); "
                         "the draft was exported with options this stage does not know")
    return base.eval(), dcfg, has_lm_head


def _draft_eval(model, samples, device) -> tuple[float, float]:
    """(top-1 accuracy of the draft's first step vs the target's next-token argmax, mean EAGLE loss), eval forward."""
    import torch

    acc = loss = 0.0
    with torch.no_grad():
        for s in samples:
            out = model(input_ids=s["input_ids"][None].to(device), loss_mask=s["loss_mask"][None].to(device))
            acc += out.train_acc[0][0]
            loss += float(out.eagle_loss)
    return acc / len(samples), loss / len(samples)


def quantize_eagle_checkpoint(target_dir: Path, draft_dir: Path, out: Path, calib, heldout, *, kv_cache="fp8",
                              exclude=(), device=None, dtype=None, export_dtype=None, log=None) -> dict:
    """FP8-quantize an exported EAGLE-3 draft: rebuild ModelOpt's EAGLE model around the target, quantize only the
    draft (`eagle_module`), calibrate with the training-time forward (every TTT step runs the draft on its own
    outputs, as speculative decoding does), export with `export_speculative_decoding`, keep the original draft
    config (plus `quantization_config`) and tokenizer. Then load the written draft back through `runtime.fp8`
    and compare its EAGLE loss with the fake-quant model's: the export's consistency check."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_speculative_decoding

    from runtime.fp8 import enable_fp8_kv, load_fp8_state_dict, read_safetensors

    device = device or torch.device("cpu")
    dtype = dtype or torch.float32
    model, dcfg, has_lm_head = _eagle_model(target_dir, draft_dir, device, dtype)
    acc_bf16, loss_bf16 = _draft_eval(model, heldout, device)
    others = [n for n, _ in model.named_children() if n != "eagle_module"]
    qcfg = quant_config("fp8", kv_cache, list(exclude), only_under="eagle_module", other_top_modules=others)

    def forward_loop(m):
        m.train()  # training forward: all TTT steps; no gradients, no parameter updates
        with torch.no_grad():
            for s in calib:
                # ModelOpt caches the training-time-test masks per step for one sequence length (training pads
                # to a fixed length); calibration samples vary in length, so drop the cache each time
                if isinstance(getattr(m, "_cached_attn_blk_masks", None), dict):
                    m._cached_attn_blk_masks = {}
                m(input_ids=s["input_ids"][None].to(device), loss_mask=s["loss_mask"][None].to(device))
        m.eval()

    model = mtq.quantize(model, qcfg, forward_loop)
    model.eval()
    acc_fp8, loss_fp8 = _draft_eval(model, heldout, device)
    export_speculative_decoding(model, dtype=torch.float32, export_dir=out)  # exact FP8 weights; see export_target
    exported = json.loads((out / "config.json").read_text())
    dcfg = dict(dcfg, quantization_config=exported.get("quantization_config"))
    (out / "config.json").write_text(json.dumps(dcfg, indent=4))   # RoPE as train_draft normalized it
    orig = read_safetensors(draft_dir)
    cast_high_precision(out, lambda k, v: orig[k].dtype if k in orig else v.dtype)
    copy_tokenizer(draft_dir, out)

    # consistency: the written FP8 draft, run through runtime.fp8, against ModelOpt's fake-quant draft
    check_model, _, _ = _eagle_model(target_dir, draft_dir, device, dtype)
    sd = read_safetensors(out)
    if not has_lm_head:
        sd.pop("lm_head.weight", None)
    info = load_fp8_state_dict(check_model.eagle_module, sd, compute_dtype=dtype)
    if info["kv_scales"]:
        enable_fp8_kv(check_model.eagle_module)
    _, loss_export = _draft_eval(check_model, heldout, device)
    m = {"draft_top1_bf16": round(acc_bf16, 6), "draft_top1_fp8": round(acc_fp8, 6),
         "draft_loss_bf16": round(loss_bf16, 6), "draft_loss_fp8": round(loss_fp8, 6),
         "draft_loss_fp8_exported": round(loss_export, 6),
         "draft_export_vs_fakequant_loss_diff": round(abs(loss_export - loss_fp8), 8),
         "draft_fp8_linears": len(info["fp8_linears"]), "draft_kv_scales": info["kv_scales"],
         "calibration_forward": "training-mode (all TTT steps)"}
    if log:
        log.info("draft FP8: first-step top-1 vs target %.4f -> %.4f, EAGLE loss %.4f -> %.4f (exported %.4f)",
                 acc_bf16, acc_fp8, loss_bf16, loss_fp8, loss_export)
    return m


def report(artifact) -> str:
    from pipeline.report import esc, figure, table

    q = artifact.read_json("quality.json")
    meta = artifact.read_json("quantize.json")
    rows = [["format", meta["format"]], ["KV cache", meta["kv_cache"]], ["draft deployed", meta["draft_dir"]],
            ["excluded (high precision)", ", ".join(meta.get("exclude_modules") or [])],
            ["perplexity unquantized", q["ppl_bf16"]], ["perplexity FP8 (exported checkpoint)", q["ppl_fp8"]],
            ["perplexity increase", f"{100 * q['ppl_increase']:+.3f}% (limit {100 * q['max_ppl_increase']:.2f}%)"],
            ["next-token top-1 agreement", q["top1_agreement"]], ["mean KL (nats/token)", q["mean_kl"]],
            ["perplexity ModelOpt fake-quant (before export)", q.get("ppl_fakequant")],
            ["export vs ModelOpt fake-quant, max |Δlogit|", q.get("export_vs_fakequant_max_abs_logit_diff")],
            ["held-out tokens", q["eval_tokens"]]]
    d = q.get("draft") or {}
    for k in ("draft_top1_bf16", "draft_top1_fp8", "draft_export_vs_fakequant_loss_diff"):
        if k in d:
            rows.append([k.replace("_", " "), d[k]])
    html = table(rows, ["", ""])
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
