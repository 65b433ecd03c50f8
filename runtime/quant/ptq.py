"""ModelOpt post-training quantization of a Hugging Face causal LM to FP8: the recipes (which ModelOpt preset,
which `quant_algo` it exports, which TensorRT-LLM linear method executes it), the ModelOpt quant config of a recipe,
calibration (`mtq.quantize` with max calibration), aligning the calibrated fake-quant model with what the deployment
computes, disabling quantizers of excluded modules, and the FP8 KV cache with TensorRT-LLM's unit scales.
Failures are `runtime.errors.RuntimeFailure`."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import RuntimeFailure
from runtime.quant.modules import fused_groups, matches, quantized_linears

# recipe -> (ModelOpt 0.47 preset in modelopt.torch.quantization, hf_quant_config.json quant_algo it exports,
# TensorRT-LLM 1.2 linear method that executes it)
RECIPES: dict[str, dict] = {
    "fp8": {"preset": "FP8_DEFAULT_CFG", "quant_algo": "FP8", "trtllm": "FP8QDQLinearMethod",
            "weights": "per-tensor", "activations": "static per-tensor (calibrated input_scale)"},
    "fp8_per_channel_per_token": {"preset": "FP8_PER_CHANNEL_PER_TOKEN_CFG", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                  "trtllm": "FP8RowwiseLinearMethod", "weights": "per-channel",
                                  "activations": "dynamic per-token (computed at run time)"},
}


@dataclass(frozen=True)
class QuantRun:
    """Where a quantization runs: the device (None: the CPU), the calibration dtype (None: float32), the progress-bar
    factory (`progress(iterable, total=, desc=)`, none when None) and the log (None: silent)."""

    device: object = None
    dtype: object = None
    progress: object = None
    log: object = None


CPU_RUN = QuantRun()     # the default: on the CPU, float32, no progress bars, silent


def calib_dtype(device_type: str) -> str:
    """The dtype the target is calibrated and compared in: bfloat16 on CUDA; float32 on a CPU, whatever its bf16
    (the quality figures' exact reference; calibration is a small part of the stage, not worth bf16's rounding)."""
    return "bfloat16" if device_type == "cuda" else "float32"


def calibration_resolved(section, device_type) -> dict:
    """The quantize stage's `resolved` hook: the calibration dtype changes the committed FP8 scales (a GPU's bf16
    calibration and a CPU's float32 one are different artifacts), so it enters the fingerprint. It depends on the
    device only, never on the CPU's bf16."""
    return {"calib_dtype": calib_dtype(device_type())}


def place_model(model, device):
    """On `device`, or spread over all visible GPUs when it does not fit one (a 70B target); RuntimeFailure when
    it fits none."""
    from runtime.engine.placement import PlacementError, place

    try:
        return place(model, device)
    except PlacementError as e:
        raise RuntimeFailure(str(e)) from None


def quant_config(fmt: str, kv_cache: str, exclude: list[str], *, only_under: str | None = None,
                 other_top_modules: list[str] = ()) -> dict:
    """The ModelOpt quant config: the recipe's preset (`RECIPES`), + FP8 KV, + disabled quantizers for excluded
    modules. `only_under`/`other_top_modules`: quantize only that submodule (used for the draft)."""
    import copy

    import modelopt.torch.quantization as mtq

    if fmt not in RECIPES:  # the Literal already guarantees this; a new recipe adds its preset to RECIPES
        raise ValueError(f"unknown format {fmt}")
    cfg = copy.deepcopy(getattr(mtq, RECIPES[fmt]["preset"]))
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


def quantize_model(model_dir: Path, calib: list[dict], *, fmt="fp8", kv_cache="fp8", exclude=(),
                   run: QuantRun = CPU_RUN):
    """Load a HF causal LM and return it quantized and calibrated by ModelOpt (fake-quant, ready to export)."""
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM

    device, dtype, progress, log = run.device, run.dtype, run.progress, run.log

    device = device or torch.device("cpu")
    model = place_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32), device).eval()
    if not calib:
        raise RuntimeFailure("no calibration samples (data's calib.parquet is empty)")

    def forward_loop(m):
        with torch.no_grad():
            it = progress(calib, total=len(calib), desc="calibrate") if progress else contextlib.nullcontext()
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


def align_with_deployment(model, log=None) -> dict:
    """Make ModelOpt's calibrated fake-quant model compute what the exported checkpoint computes on TensorRT-LLM.

    1. Per-tensor q/k/v and gate/up get one shared weight (and input) amax, with ModelOpt's own
       `preprocess_linear_fusion`. TensorRT-LLM runs each group as one GEMM with one weight scale: given separate
       scales it re-quantizes the members onto the largest at load time (runtime.engine.fp8.trtllm_fuse_scales), a second
       rounding the calibrated model never saw. ModelOpt 0.47's export skips this fusion for FP8
       (unified_export_hf.py `_fuse_shared_input_modules` excludes QUANTIZATION_FP8), so the stage does it.
       Per-channel scales are concatenated by TensorRT-LLM unchanged: nothing to do there.
    2. Every quantized weight is replaced by its exact E4M3 dequantization as the export computes it
       (`weight / (amax / 448)` rounded to nearest even, runtime.engine.fp8.quantize_weight), so the fake-quant model
       holds the checkpoint's codes: its own `weight * (448 / amax)` breaks exact rounding ties the other way
       (about 1% of SmolLM2's weights, which sit on a 4-bit grid, lie exactly on a tie).
    Returns {"fused_groups": n, "snapped_weights": n}."""
    import torch
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    from runtime.engine.fp8 import FP8_MAX, dequantize_weight, quantize_weight

    lin = quantized_linears(model)
    fused = 0
    for group in fused_groups(lin):
        mods = [lin[n] for n in group]
        if all(m.weight_quantizer.amax is not None and m.weight_quantizer.amax.numel() == 1 for m in mods):
            with torch.no_grad():
                preprocess_linear_fusion(mods)
            fused += 1
    snapped = 0
    with torch.no_grad():
        for m in lin.values():
            amax = m.weight_quantizer.amax
            if amax is None:
                continue
            scale = (amax.float() / FP8_MAX).reshape(-1)
            w = m.weight
            m.weight.copy_(dequantize_weight(quantize_weight(w, scale), scale, w.dtype))
            snapped += 1
    if log:
        log.info("aligned with the deployment: %d fused groups share one scale, %d weights snapped to the export's "
                 "E4M3 codes", fused, snapped)
    return {"fused_groups": fused, "snapped_weights": snapped}


def disable_quantizers(model, patterns: list[str]) -> list[str]:
    """Disable the weight and input quantizers of every quantized linear matching `patterns` (fnmatch, as in
    `exclude_modules`): those modules are exported in high precision. Calibration is unaffected (ModelOpt
    calibrates on unquantized activations). Returns the module names."""
    names = [n for n in quantized_linears(model) if matches(n, patterns)]
    mods = dict(model.named_modules())
    for n in names:
        mods[n].weight_quantizer.disable()
        iq = getattr(mods[n], "input_quantizer", None)
        if iq is not None and iq.is_enabled:
            iq.disable()
    return names


@contextlib.contextmanager
def kv_unit_scales(model):
    """Within the block, ModelOpt's KV quantizers use scale 1 (amax 448): TensorRT-LLM 1.2's PyTorch backend
    quantizes the FP8 KV cache with unit scales whatever k_scale/v_scale say (see runtime.engine.fp8.attach_kv_scales).
    The calibrated amax is restored afterwards, so the export still writes the calibrated k_scale/v_scale."""
    import torch

    saved = []
    for n, q in model.named_modules():
        if n.endswith(("k_bmm_quantizer", "v_bmm_quantizer")) and getattr(q, "is_enabled", False) and q.amax is not None:
            saved.append((q, q.amax.detach().clone()))
            q.amax = torch.full_like(q.amax, 448.0)
    try:
        yield len(saved)
    finally:
        for q, a in saved:
            q.amax = a
