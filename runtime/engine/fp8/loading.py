"""Loading FP8 checkpoints: state dicts into any module tree (FP8 weights become `FP8Linear`s, the rest loads as
it is, KV scales attach to the attention modules), and whole causal LMs behind one call (`load_causal_lm`, plain
or FP8, tied embeddings kept tied)."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runtime.engine.fp8.checkpoint import (
    QUANT_ALGOS,
    SCALE_SUFFIXES,
    is_fp8_checkpoint,
    quant_algo,
    read_quant_config,
    read_safetensors,
)
from runtime.engine.fp8.kv_cache import attach_kv_scales, enable_fp8_kv
from runtime.engine.fp8.linear import FP8_DTYPE, FP8Linear, dequantize_weight, trtllm_fuse_scales
from runtime.engine.placement import place

log = logging.getLogger("runtime.engine.fp8")     # the logger's name before the module became a package


@dataclass(frozen=True)
class FP8LinearMode:
    """How the FP8 linears of a checkpoint run: through the real FP8 GEMM (`use_scaled_mm`), with activations
    quantized per token (`dynamic_per_token`: the FP8_PER_CHANNEL_PER_TOKEN recipe), and fused groups re-quantized
    onto one scale as TensorRT-LLM loads them (`trtllm_fused_scales`, `trtllm_fuse_scales`, intermediate dtype
    `fuse_dtype`)."""

    use_scaled_mm: bool = False
    dynamic_per_token: bool = False
    trtllm_fused_scales: bool = False
    fuse_dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class FP8Reading:
    """Which serving engine's reading of an FP8 checkpoint `load_causal_lm` reproduces: FP8 KV applied at all
    (`apply_kv_scales`), with unit scales ("unit", TensorRT-LLM 1.2) or the checkpoint's ("checkpoint"), and per-tensor
    q/k/v and gate/up on one shared weight scale, as TensorRT-LLM loads fused layers (`trtllm_fused_scales`)."""

    apply_kv_scales: bool = True
    kv_scales: str = "unit"
    trtllm_fused_scales: bool = True


def fp8_linear_prefixes(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Module names (`model.layers.0.mlp.up_proj`) whose `.weight` is float8 in this state dict."""
    return sorted(k[: -len(".weight")] for k, v in state_dict.items() if k.endswith(".weight") and v.dtype == FP8_DTYPE)


def fp8_linears_from_state_dict(state_dict: Mapping[str, torch.Tensor], *, compute_dtype=torch.float32,
                                use_scaled_mm: bool = False, dynamic_per_token: bool = False) -> dict[str, FP8Linear]:
    """{module name: FP8Linear} for every FP8 weight in the state dict (with its scales and optional bias).
    `dynamic_per_token`: the checkpoint's recipe quantizes activations per token (FP8_PER_CHANNEL_PER_TOKEN)."""
    out: dict[str, FP8Linear] = {}
    for p in fp8_linear_prefixes(state_dict):
        if f"{p}.weight_scale" not in state_dict:
            raise KeyError(f"{p}.weight is float8 but {p}.weight_scale is missing: cannot dequantize")
        out[p] = FP8Linear(state_dict[f"{p}.weight"], state_dict[f"{p}.weight_scale"],
                           state_dict.get(f"{p}.input_scale"), state_dict.get(f"{p}.bias"),
                           dynamic_per_token=dynamic_per_token, compute_dtype=compute_dtype,
                           use_scaled_mm=use_scaled_mm)
    return out


def load_state_dict_dequantized(path_or_sd: str | Path | Mapping[str, torch.Tensor],
                                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A plain state dict: FP8 weights multiplied by their `weight_scale`, scale tensors dropped, other floating
    tensors cast to `dtype`, integer tensors (e.g. EAGLE-3 `d2t`) unchanged. Weight-only emulation: activation
    and KV quantization are NOT applied (use `swap_fp8_linears` for that)."""
    sd = read_safetensors(path_or_sd) if isinstance(path_or_sd, (str, Path)) else dict(path_or_sd)
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.rsplit(".", 1)[-1] in SCALE_SUFFIXES:
            continue
        if v.dtype == FP8_DTYPE:
            p = k[: -len(".weight")]
            out[k] = dequantize_weight(v, sd[f"{p}.weight_scale"], dtype)
        elif v.is_floating_point():
            out[k] = v.to(dtype)
        else:
            out[k] = v
    return out


def swap_fp8_linears(module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, prefix: str = "",
                     compute_dtype=torch.float32, mode: FP8LinearMode = FP8LinearMode()) -> list[str]:
    """Replace each `nn.Linear` of `module` whose checkpoint weight (`prefix + name + ".weight"`) is FP8 by an
    `FP8Linear` built from the checkpoint. Returns the replaced module names. Raises when the checkpoint has
    an FP8 weight for a module that is not an `nn.Linear` (or not there): a silent mismatch would run garbage.
    `mode`: how the FP8 linears run (FP8LinearMode)."""
    linears = fp8_linears_from_state_dict(state_dict, compute_dtype=compute_dtype, use_scaled_mm=mode.use_scaled_mm,
                                          dynamic_per_token=mode.dynamic_per_token)
    if mode.trtllm_fused_scales:
        trtllm_fuse_scales(linears, mode.fuse_dtype)
    names = dict(module.named_modules())
    done = []
    for ckpt_name, new in linears.items():
        if prefix and not ckpt_name.startswith(prefix):
            continue
        name = ckpt_name[len(prefix):]
        old = names.get(name)
        if not isinstance(old, (nn.Linear, FP8Linear)):
            raise KeyError(f"checkpoint has FP8 weight {ckpt_name}.weight but the module has "
                           f"{type(old).__name__ if old is not None else 'nothing'} at '{name}'")
        if isinstance(old, nn.Linear) and (old.in_features, old.out_features) != (new.in_features, new.out_features):
            raise ValueError(f"{ckpt_name}: checkpoint shape {new.out_features}x{new.in_features} != module "
                             f"{old.out_features}x{old.in_features}")
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, new.to(next((t.device for t in old.parameters()), torch.device("cpu"))))
        done.append(name)
    return done


def load_fp8_state_dict(module: nn.Module, path_or_sd: str | Path | Mapping[str, torch.Tensor], *, prefix: str = "",
                        compute_dtype=torch.float32, mode: FP8LinearMode = FP8LinearMode(), strict: bool = True,
                        ignore_missing: Iterable[str] = (), kv_scales: str = "checkpoint") -> dict:
    """Load a (possibly FP8) checkpoint into any module tree: FP8 linears are swapped for `FP8Linear`, every
    other tensor is loaded (cast to `compute_dtype` when floating). KV scales are attached to the attention
    modules (see `attach_kv_scales`; `kv_scales` "checkpoint" or "unit"). Returns {"fp8_linears", "missing",
    "unexpected", "kv_scales"}; with `strict`, missing or unexpected tensors raise (names in `ignore_missing`
    excepted)."""
    sd = read_safetensors(path_or_sd) if isinstance(path_or_sd, (str, Path)) else dict(path_or_sd)
    if prefix:
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    swapped = swap_fp8_linears(module, sd, compute_dtype=compute_dtype, mode=mode)
    swapped_set = set(swapped)
    rest = {}
    for k, v in sd.items():
        mod, _, leaf = k.rpartition(".")
        if mod in swapped_set or leaf in ("k_scale", "v_scale"):
            continue
        rest[k] = v.to(compute_dtype) if v.is_floating_point() and v.dtype != FP8_DTYPE else v
    res = module.load_state_dict(rest, strict=False)
    missing = [k for k in res.missing_keys if k.rpartition(".")[0] not in swapped_set and k not in set(ignore_missing)]
    unexpected = list(res.unexpected_keys)
    kv = attach_kv_scales(module, sd, mode=kv_scales)
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint does not match the module: missing {missing[:8]}, unexpected {unexpected[:8]}")
    return {"fp8_linears": swapped, "missing": missing, "unexpected": unexpected, "kv_scales": kv}


def load_causal_lm(path: str | Path, *, device: str | torch.device = "cpu", compute_dtype: torch.dtype = torch.float32,
                   use_scaled_mm: bool | None = None, trust_remote_code: bool = False, spread: bool = False,
                   reading: FP8Reading = FP8Reading()):
    """Load a causal LM checkpoint for inference, whether plain (BF16/FP16/FP32) or ModelOpt FP8 unified
    (quant_algo FP8 or FP8_PER_CHANNEL_PER_TOKEN). `spread`: on CUDA, a model larger than one GPU goes over all
    of them (`runtime.engine.placement`; only for callers that run the model through its own forward, whose hooks move
    activations between GPUs).

    FP8 checkpoints: every FP8 linear becomes an `FP8Linear` (weights dequantized with `weight_scale`, per tensor
    or per channel; activations through E4M3 with the static `input_scale` or with per-token scales),
    high-precision tensors are loaded as they are, and with FP8 KV (when present and `reading.apply_kv_scales`) keys
    and values pass through E4M3 in attention, with unit scales (`reading.kv_scales="unit"`, TensorRT-LLM 1.2) or the
    checkpoint's (`"checkpoint"`). `reading.trtllm_fused_scales`: per-tensor q/k/v and gate/up run on one shared
    weight scale, as TensorRT-LLM loads fused layers (`trtllm_fuse_scales`). `use_scaled_mm` (default: on for CUDA)
    uses the real FP8 GEMM. Tied input/output embeddings share one tensor (a checkpoint that says
    `tie_word_embeddings` but stores a different `lm_head.weight` is refused). Returns the model in eval mode;
    `model.fp8_info` says what was applied.
    """
    path = Path(path)
    device = torch.device(device)
    kv_scales, trtllm_fused_scales = reading.kv_scales, reading.trtllm_fused_scales
    if not is_fp8_checkpoint(path):
        return _load_plain(path, device, compute_dtype, trust_remote_code, spread)

    qc = read_quant_config(path) or {}
    algo = quant_algo(path)
    cfg, model = _empty_model(path, compute_dtype, trust_remote_code)
    sd = read_safetensors(path)
    if not reading.apply_kv_scales:
        sd = {k: v for k, v in sd.items() if not k.endswith((".k_scale", ".v_scale"))}
    if use_scaled_mm is None:
        use_scaled_mm = device.type == "cuda"
    text_cfg = cfg.get_text_config()
    tied = bool(getattr(text_cfg, "tie_word_embeddings", False))
    if tied:
        _drop_tied_head(path, sd)
    mode = FP8LinearMode(use_scaled_mm=use_scaled_mm, dynamic_per_token=QUANT_ALGOS[algo] == "dynamic_per_token",
                         trtllm_fused_scales=trtllm_fused_scales, fuse_dtype=_fuse_dtype(text_cfg))
    info = load_fp8_state_dict(model, sd, compute_dtype=compute_dtype, mode=mode,
                               ignore_missing=["lm_head.weight"] if tied else [], kv_scales=kv_scales)
    if tied:
        _tie_embeddings(model, path)
    if info["kv_scales"]:
        enable_fp8_kv(model)
    model.fp8_info = {"fp8": True, "quant_algo": qc.get("quant_algo"), "kv_cache_quant_algo": qc.get("kv_cache_quant_algo"),
                      "fp8_linears": len(info["fp8_linears"]), "kv_scales": info["kv_scales"],
                      "kv_scale_mode": kv_scales if info["kv_scales"] else None,
                      "activation": QUANT_ALGOS[algo], "trtllm_fused_scales": bool(trtllm_fused_scales),
                      "tied_embeddings": tied, "use_scaled_mm": bool(use_scaled_mm)}
    log.info("loaded FP8 checkpoint %s (%s): %d FP8 linears, %d layers with FP8 KV (%s scales)", path, algo,
             len(info["fp8_linears"]), info["kv_scales"], kv_scales)
    return _placed(model, device, spread)


def _placed(model, device: torch.device, spread: bool):
    """The model on `device` (with `spread`, over all GPUs: `runtime.engine.placement`), in eval mode."""
    return (place(model, device) if spread else model.to(device)).eval()


def _load_plain(path: Path, device: torch.device, compute_dtype: torch.dtype, trust_remote_code: bool, spread: bool):
    """A plain (unquantized) checkpoint through transformers; a quant_algo specpipe cannot run is refused."""
    from transformers import AutoModelForCausalLM

    qc = read_quant_config(path)
    if qc and qc.get("quant_algo"):
        raise ValueError(f"{path}: quant_algo {qc.get('quant_algo')} is not supported (only "
                         f"{', '.join(QUANT_ALGOS)}); or hf_quant_config.json is missing next to a quantized "
                         "config.json")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype, trust_remote_code=trust_remote_code)
    model.fp8_info = {"fp8": False}
    return _placed(model, device, spread)


def _empty_model(path: Path, compute_dtype: torch.dtype, trust_remote_code: bool):
    """(config, model) of config.json's architecture with uninitialized weights, for an FP8 state dict to fill."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(cfg, "quantization_config"):  # transformers would otherwise try (and fail) to apply it
        del cfg.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=compute_dtype, trust_remote_code=trust_remote_code)
    return cfg, model


def _drop_tied_head(path: Path, sd: dict[str, torch.Tensor]) -> None:
    """Tied embeddings: remove `lm_head.weight` from `sd` (the head is the input embedding), refusing a checkpoint
    whose stored head differs from its embedding."""
    emb_key = next((k for k in sd if k.endswith("embed_tokens.weight")), None)
    head = sd.get("lm_head.weight")
    if head is not None and emb_key is not None and not torch.equal(head, sd[emb_key]):
        raise ValueError(f"{path}: config.json ties the input and output embeddings but lm_head.weight differs "
                         f"from {emb_key}; the deployment would use {emb_key} for both")
    sd.pop("lm_head.weight", None)


def _fuse_dtype(text_cfg) -> torch.dtype:
    """The dtype TensorRT-LLM runs the model in: its fused-layer requantization computes in it."""
    fuse_dtype = getattr(torch, str(getattr(text_cfg, "dtype", None) or getattr(text_cfg, "torch_dtype", None)
                                    or "bfloat16").replace("torch.", ""), torch.bfloat16)
    if fuse_dtype not in (torch.bfloat16, torch.float16):
        fuse_dtype = torch.bfloat16
    return fuse_dtype


def _tie_embeddings(model, path: Path) -> None:
    model.tie_weights()
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"{path}: tie_word_embeddings is set but lm_head and embed_tokens are not tied")
