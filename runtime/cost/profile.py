"""`specpipe profile`: measure the step time of a model's layer shapes on this machine and fit the cost model.

The measurement is runtime.cost.measure's chained forward of the model's shapes; the machine's achieved rates
come from runtime.cost.calibrate's microbenchmarks, which are not the step being predicted. This module runs
both in rounds (`profile`), predicts every measured point with the calibrated cost model, and owns the profile
file: its format, its check (`check_profile`, used by tune's config check) and the shapes and device it is for.
The profile file holds the achieved rates (`machine`), which `tune` uses instead of the datasheet when
`hardware.profile` points at it, and every measured point with the model's prediction.
"""
from __future__ import annotations

import platform
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from runtime.cost.calibrate import BenchSizes, best_calibration, calibrate, machine_from_calibration
from runtime.cost.costmodel import Machine, ModelShape, Precision, forward_ops, step_time
from runtime.cost.measure import DEFAULT_ROWS, measure, precision_for

if TYPE_CHECKING:
    from runtime.records import DraftInfo, TargetInfo

FORMAT = "specpipe.hardware-profile/1"


def predict(points: list[dict], shape: ModelShape, machine: Machine, prec: Precision) -> list[dict]:
    for p in points:
        ops = forward_ops(shape, batch=p["batch"], q_len=p["q_len"], context=p["context"], prec=prec)
        p["predicted_ms"] = step_time(ops, machine) * 1e3
        p["error"] = p["predicted_ms"] / p["measured_ms"] - 1
    return points


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()}"


def profile(shapes: dict[str, ModelShape], *, device, gemm_dtype: str, rows=DEFAULT_ROWS, context: int = 512,
            q_lens=(1, 4), rounds: int = 3, progress=None) -> dict:
    """Calibrate on the first shape (the target), measure every shape, predict every point, summarise.

    The whole measurement is repeated `rounds` times and each quantity keeps its best round (highest rate,
    lowest time): on a shared machine a burst of other work can last longer than one point's repetitions."""
    import torch

    first = next(iter(shapes.values()))
    cal: dict = {}
    measured: dict[str, list[dict]] = {}
    for r in range(rounds):
        c = calibrate(first, gemm_dtype, device, BenchSizes(context=context, curve_rows=rows))
        cal = c if not cal else best_calibration(cal, c, gemm_dtype)
        for key, shape in shapes.items():
            pts: list[dict] = []
            for q in q_lens:
                pts += measure(shape, gemm_dtype, device, rows=rows, q_len=q, context=context,
                               progress=(lambda m, t, key=key, q=q, r=r: progress(r, key, q, m, t)) if progress else None)
            if key not in measured:
                measured[key] = pts
            else:
                for old, new in zip(measured[key], pts, strict=True):
                    old["measured_ms"] = min(old["measured_ms"], new["measured_ms"])
    name = device_name(device)
    machine = machine_from_calibration(cal, gemm_dtype, name)
    prec = precision_for(gemm_dtype)
    models = {}
    for key, shape in shapes.items():
        pts = predict(measured[key], shape, machine, prec)
        models[key] = {"shape": _shape_doc(shape), "points": pts,
                       "max_abs_error": max(abs(p["error"]) for p in pts),
                       "mean_abs_error": sum(abs(p["error"]) for p in pts) / len(pts)}
    ridge = machine.peak(gemm_dtype) / machine.bandwidth * prec.weight_bytes / 2
    return {
        "format": FORMAT,
        "device": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "gemm_dtype": gemm_dtype,
        "context": context,
        "machine": {"peak_tflops": {gemm_dtype: cal["peak_tflops"]}, "bandwidth_tb_s": cal["bandwidth_tb_s"],
                    "attn_bandwidth_tb_s": cal["attn_bandwidth_tb_s"], "attn_tflops": cal["attn_tflops"],
                    "elem_bandwidth_tb_s": cal["elem_bandwidth_tb_s"], "overlap": cal["overlap"], "attn_overlap": 1.0,
                    "cache_bytes": cal["cache_bytes"], "cache_bandwidth_tb_s": cal["cache_bandwidth_tb_s"],
                    "op_overhead_us": cal["op_overhead_us"], "gemm_row_factors": cal["gemm_row_factors"],
                    "footprint_bandwidth_tb_s": cal["footprint_bandwidth_tb_s"],
                    "link_gb_s": None},
        "ridge_rows": ridge,
        "calibration": cal,
        "models": models,
        "max_abs_error": max(m["max_abs_error"] for m in models.values()),
        "mean_abs_error": sum(m["mean_abs_error"] for m in models.values()) / len(models),
    }

# ------------------------------------------------------------------------------------------ the profile file


def _shape_doc(s: ModelShape) -> dict:
    return {"num_layers": s.num_layers, "hidden": s.hidden, "heads": s.heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "gemms": [[g.name, g.k, g.n] for g in (*s.layer_gemms, *s.input_gemms, *s.head_gemms)],
            "weight_params": s.weight_params()}


def check_profile(doc: dict) -> list[str]:
    """Problems that make a profile file unusable (empty when fine)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return [f"not a specpipe hardware profile (expected format '{FORMAT}'); write one with `specpipe profile CONFIG`"]
    m = doc.get("machine") or {}
    probs = []
    if not isinstance(m.get("peak_tflops"), dict) or not m["peak_tflops"] or any(
            not isinstance(v, (int, float)) or v <= 0 for v in m["peak_tflops"].values()):
        probs.append("machine.peak_tflops must map a GEMM dtype to a positive TFLOP/s")
    for k in ("bandwidth_tb_s", "op_overhead_us"):
        if not isinstance(m.get(k), (int, float)) or m[k] < 0 or (k == "bandwidth_tb_s" and m[k] == 0):
            probs.append(f"machine.{k} must be a positive number")
    for k, what in (("gemm_row_factors", "[rows, factor]"), ("footprint_bandwidth_tb_s", "[bytes, TB/s]")):
        curve = m.get(k)
        if curve is None:
            continue
        ok = isinstance(curve, list) and all(
            isinstance(pt, list) and len(pt) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in pt) for pt in curve)
        if not ok or [pt[0] for pt in curve] != sorted({pt[0] for pt in curve}):
            probs.append(f"machine.{k} must be a list of {what} pairs of positive numbers, strictly increasing in the first")
    return probs

# ------------------------------------------------------------------------------------------ `specpipe profile`


def shapes_from_artifacts(target: TargetInfo, draft: DraftInfo | None = None,
                          draft_config: dict | None = None) -> dict[str, ModelShape]:
    """The target's (and, once trained, the draft's) shapes from `target.json` and `draft.json` + the draft's
    `config.json` (the caller reads them: `pipeline.artifacts`)."""
    from runtime.cost.costmodel import draft_shape, target_shape

    shapes = {"target": target_shape(target)}
    if draft is not None and draft_config is not None:
        shapes["draft"] = draft_shape(draft, draft_config, target.hidden_size)
    return shapes


def resolve_gemm_dtype(dev, dtype_opt: str) -> str:
    """The GEMM dtype on `dev` (a torch.device, `run.device` as the caller resolved it): `auto` -> FP8 on GPUs with
    FP8 tensor cores (sm89+), BF16 on other GPUs, float32 on a CPU (its float32 GEMMs are the fast, well-defined
    path)."""
    import torch

    from runtime.errors import RuntimeUsageError

    if dtype_opt == "auto":
        if dev.type == "cuda":
            dtype_opt = "fp8" if torch.cuda.get_device_capability(dev) >= (8, 9) else "bfloat16"
        else:
            dtype_opt = "float32"
    if dtype_opt == "fp8" and dev.type != "cuda":
        raise RuntimeUsageError("--dtype fp8 needs a CUDA GPU with FP8 tensor cores (torch._scaled_mm)")
    return dtype_opt
