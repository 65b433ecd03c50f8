"""Named format checks of an exported ModelOpt FP8 unified checkpoint (target or draft), as TensorRT-LLM loads it.

`check_checkpoint` runs them all and returns one {"name", "passed", "message"} per check; it never raises on a
bad checkpoint (the caller decides what a failed check means)."""
from __future__ import annotations

import json
from pathlib import Path

from runtime.quant import hf_quant_config
from runtime.quant.modules import fused_groups, matches


def read_hf_quant_config(path: Path) -> dict:
    """The `quantization` section of `path/hf_quant_config.json` ({} when the file is missing)."""
    return hf_quant_config.read(path) or {}


def check_checkpoint(path: Path, *, kv_cache: bool, exclude: list[str] = (), quant_algo: str = "FP8") -> list[dict]:
    """Named format checks of a ModelOpt FP8 unified checkpoint (target or draft), as TensorRT-LLM loads it.

    `quant_algo`: the recipe's: "FP8" wants per FP8 linear a float32 scalar weight_scale and input_scale
    (TensorRT-LLM FP8QDQLinearMethod); "FP8_PER_CHANNEL_PER_TOKEN" wants a float32 weight_scale with one entry per
    output channel ([out] as ModelOpt writes it, or [out, 1]) and no static input_scale (FP8RowwiseLinearMethod
    quantizes activations per token at run time).
    Returns [{"name", "passed", "message"}] for: hf_quant_config, config_agrees, fp8_linears_have_scales,
    quantized_coverage, excluded_high_precision, fused_groups_consistent, kv_scales, finite_scales. Never raises
    on a bad checkpoint."""
    from runtime.engine.fp8 import FP8_DTYPE, read_safetensors

    path = Path(path)
    want = str(quant_algo).upper()
    first, q = _check_hf_quant_config(path, want)
    res = [first, _check_config_agrees(path, q)]
    try:
        sd = read_safetensors(path)
    except FileNotFoundError as e:
        return res + [_result("fp8_linears_have_scales", False, str(e))]
    fp8_mods = sorted(k[:-7] for k, v in sd.items() if k.endswith(".weight") and v.dtype == FP8_DTYPE)
    listed = list(q.get("exclude_modules") or [])
    linears = sorted(k[:-7] for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2 and "embed" not in k)
    return res + [
        _check_fp8_scales(sd, fp8_mods, per_channel=want == "FP8_PER_CHANNEL_PER_TOKEN"),
        _check_coverage(sd, listed + list(exclude)),
        _check_excluded(fp8_mods, linears, listed, exclude),
        _check_fused_groups(fp8_mods, linears),
        _check_kv_scales(sd, q, kv_cache),
        _check_finite_scales(sd),
    ]


def _result(name: str, ok, msg_bad: str, msg_ok: str = "") -> dict:
    return {"name": name, "passed": bool(ok), "message": msg_ok if ok else msg_bad}


def _check_hf_quant_config(path: Path, want: str) -> tuple[dict, dict]:
    """hf_quant_config: the file exists, parses and names the recipe's quant_algo. Returns (result, its contents)."""
    hq_file = path / "hf_quant_config.json"
    if not hq_file.exists():
        return _result("hf_quant_config", False,
                       f"{hq_file} is missing: TensorRT-LLM 1.2 would load the model unquantized"), {}
    q = {}
    try:
        q = read_hf_quant_config(path)
        ok = str(q.get("quant_algo")).upper() == want
        return _result("hf_quant_config", ok, f"quant_algo is {q.get('quant_algo')!r}, expected {want!r}",
                       f"quant_algo {want}"), q
    except (json.JSONDecodeError, AttributeError) as e:
        return _result("hf_quant_config", False, f"{hq_file} is not valid JSON ({e})"), q


def _check_config_agrees(path: Path, q: dict) -> dict:
    """config_agrees: config.json's quantization_config says what hf_quant_config.json says."""
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict):
        return _result("config_agrees", False, "config.json has no quantization_config")
    if isinstance(qc.get("quantization"), dict):  # export_speculative_decoding embeds the hf_quant_config form
        qc = qc["quantization"]
    problems = []
    if str(qc.get("quant_algo")).upper() != str(q.get("quant_algo")).upper():
        problems.append(f"quant_algo {qc.get('quant_algo')!r} vs hf_quant_config {q.get('quant_algo')!r}")
    kv_cfg = "FP8" if isinstance(qc.get("kv_cache_scheme"),
                                 dict) or str(qc.get("kv_cache_quant_algo")).upper() == "FP8" else None
    if kv_cfg != (q.get("kv_cache_quant_algo") or None):
        problems.append(f"KV cache {kv_cfg} vs hf_quant_config {q.get('kv_cache_quant_algo')}")
    ign = qc.get("ignore", qc.get("exclude_modules"))
    if ign is not None and sorted(ign) != sorted(q.get("exclude_modules") or []):
        problems.append(f"ignore {ign} vs exclude_modules {q.get('exclude_modules')}")
    return _result("config_agrees", not problems, "config.json quantization_config disagrees with hf_quant_config.json: "
                   + "; ".join(problems), "config.json and hf_quant_config.json agree")


def _check_fp8_scales(sd: dict, fp8_mods: list[str], *, per_channel: bool) -> dict:
    """fp8_linears_have_scales: every FP8 weight has the recipe's float32 weight_scale (and input_scale or none)."""
    import torch

    missing = []
    for m in fp8_mods:
        out_features = sd[f"{m}.weight"].shape[0]
        ws, xs = sd.get(f"{m}.weight_scale"), sd.get(f"{m}.input_scale")
        if ws is None:
            missing.append(f"{m}.weight_scale")
        elif ws.dtype != torch.float32 or (tuple(ws.shape) not in ((out_features,), (out_features, 1)) if per_channel
                                           else ws.numel() != 1):
            missing.append(f"{m}.weight_scale ({ws.dtype}, shape {tuple(ws.shape)}; expected float32 "
                           + (f"[{out_features}] (per output channel)" if per_channel else "scalar") + ")")
        if per_channel:
            if xs is not None and (xs.dtype != torch.float32 or xs.numel() != 1):
                missing.append(f"{m}.input_scale ({xs.dtype}, shape {tuple(xs.shape)}; per-token recipes need none)")
        elif xs is None:
            missing.append(f"{m}.input_scale")
        elif xs.dtype != torch.float32 or xs.numel() != 1:
            missing.append(f"{m}.input_scale ({xs.dtype}, shape {tuple(xs.shape)}; expected a float32 scalar)")
    what = ("float32 per-channel weight_scale, activations per token" if per_channel
            else "float32 weight_scale and input_scale")
    return _result("fp8_linears_have_scales", fp8_mods and not missing,
                   "no FP8 weights at all" if not fp8_mods else f"{len(missing)} scale(s) missing or malformed: {missing[:6]}",
                   f"{len(fp8_mods)} FP8 linears, each with {what}")


def _check_coverage(sd: dict, excl: list[str]) -> dict:
    """quantized_coverage: every linear weight left in high precision is excluded (listed or requested)."""
    from runtime.engine.fp8 import FP8_DTYPE

    hp = sorted(k[:-7] for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2 and v.dtype != FP8_DTYPE)
    not_quant = [m for m in hp if not matches(m, excl) and "embed" not in m]
    return _result("quantized_coverage", not not_quant, f"linear weights left in high precision but not listed in "
                   f"exclude_modules: {not_quant[:6]} (TensorRT-LLM would read them as FP8)",
                   "every non-excluded linear is FP8")


def _check_excluded(fp8_mods: list[str], linears: list[str], listed: list[str], exclude) -> dict:
    """excluded_high_precision: listed modules are not FP8, and every requested pattern names high-precision
    linears that exclude_modules covers."""
    wrong = [m for m in fp8_mods if matches(m, listed)]
    problems = [f"excluded modules stored as FP8: {wrong[:6]}"] if wrong else []
    for p in exclude:  # every module a requested pattern names must be high precision and covered by the list
        hit = [m for m in linears if matches(m, [p])]
        if not hit:
            problems.append(f"requested exclusion '{p}' matches no linear module")
        elif [m for m in hit if m in fp8_mods]:
            problems.append(f"'{p}' was excluded but {[m for m in hit if m in fp8_mods][:4]} are FP8")
        elif [m for m in hit if not matches(m, listed)]:
            problems.append(f"'{p}' modules {[m for m in hit if not matches(m, listed)][:4]} are missing from exclude_modules")
    return _result("excluded_high_precision", not problems, "; ".join(problems),
                   "excluded modules are high precision and listed")


def _check_fused_groups(fp8_mods: list[str], linears: list[str]) -> dict:
    """fused_groups_consistent: TensorRT-LLM runs q/k/v and gate/up of a block as one GEMM with one quantization
    method: all FP8 or none."""
    fp8_set = set(fp8_mods)
    split = [g for g in fused_groups(linears) if 0 < sum(m in fp8_set for m in g) < len(g)]
    return _result("fused_groups_consistent", not split, f"fused groups with FP8 and high-precision members "
                   f"(TensorRT-LLM runs each as one GEMM, so exclude all or none of them): {split[:4]}",
                   "q/k/v and gate/up groups are uniform")


def _check_kv_scales(sd: dict, q: dict, kv_cache: bool) -> dict:
    """kv_scales: with FP8 KV, every attention module has k_scale and v_scale; without, none has."""
    k_scales = {k[: -len(".k_proj.k_scale")] for k in sd if k.endswith("k_proj.k_scale")}
    v_scales = {k[: -len(".v_proj.v_scale")] for k in sd if k.endswith("v_proj.v_scale")}
    attns = {k[: -len(".k_proj.weight")] for k in sd if k.endswith("k_proj.weight")}
    if kv_cache:
        bad = sorted((attns - k_scales) | (attns - v_scales))
        algo = q.get("kv_cache_quant_algo")
        return _result("kv_scales", not bad and str(algo).upper() == "FP8",
                       f"FP8 KV cache asked for but kv_cache_quant_algo={algo!r}, attention modules without "
                       f"k_scale/v_scale: {bad[:6]}", f"{len(k_scales)} attention modules with k_scale and v_scale")
    return _result("kv_scales", not k_scales and not v_scales and not q.get("kv_cache_quant_algo"),
                   "KV cache quantization not asked for but the checkpoint has KV scales or kv_cache_quant_algo",
                   "no FP8 KV (as asked)")


def _check_finite_scales(sd: dict) -> dict:
    """finite_scales: every scale tensor is finite and positive."""
    import torch

    bad_scales = [k for k, v in sd.items() if k.rsplit(".", 1)[-1] in ("weight_scale", "input_scale", "k_scale", "v_scale")
                  and not (torch.isfinite(v.float()).all() and (v.float() > 0).all())]
    return _result("finite_scales", not bad_scales, f"non-finite or non-positive scales: {bad_scales[:6]}",
                   "all scales finite and > 0")
