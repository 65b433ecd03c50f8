"""FP8 KV cache: the calibrated (or unit) k/v scales attached to a model's attention modules, and the transformers
attention function that passes keys (after RoPE) and values through E4M3 with them."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from runtime.engine.fp8.linear import qdq_e4m3

KV_ATTN_IMPL = "specpipe_fp8_kv"     # the attention function registered below

KV_SCALE_MODES = ("unit", "checkpoint")


def attach_kv_scales(module: nn.Module, state_dict: Mapping[str, torch.Tensor], mode: str = "checkpoint") -> int:
    """Give every attention module whose checkpoint has `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` the
    buffers `fp8_k_scale` / `fp8_v_scale`, used by the `specpipe_fp8_kv` attention function (and by
    `runtime.engine.target.TargetRunner`). mode "checkpoint": the calibrated scales (ModelOpt's fake-quant model);
    "unit": 1.0, what TensorRT-LLM 1.2's PyTorch attention backend applies to an FP8 KV cache whatever the
    checkpoint holds (tensorrt_llm/_torch/attention_backend/trtllm.py @ 9144c0e6: `kv_cache_scaling_factor`
    is ones and is passed unchanged as kv_scale_orig_quant/kv_scale_quant_orig; only NVFP4 KV overrides it).
    Returns how many attention modules got scales."""
    if mode not in KV_SCALE_MODES:
        raise ValueError(f"kv_scales must be one of {KV_SCALE_MODES}, got {mode!r}")
    n = 0
    names = dict(module.named_modules())
    for k, v in state_dict.items():
        for proj, leaf, attr in (("k_proj", "k_scale", "fp8_k_scale"), ("v_proj", "v_scale", "fp8_v_scale")):
            if k.endswith(f".{proj}.{leaf}") or k == f"{proj}.{leaf}":
                attn_name = k[: -len(f"{proj}.{leaf}")].rstrip(".")
                attn = names.get(attn_name)
                if attn is None:
                    raise KeyError(f"checkpoint has {k} but the module has no attention module '{attn_name}'")
                val = v.detach().float().reshape(())
                attn.register_buffer(attr, torch.ones_like(val) if mode == "unit" else val)
                n += attr == "fp8_k_scale"
    return n


def _register_kv_attention(base_impl: str) -> str:
    """Register (once per base implementation) an attention function that passes keys and values through E4M3
    with the module's `fp8_k_scale` / `fp8_v_scale` before the base implementation (sdpa or eager). Keys arrive
    after RoPE, the same point where ModelOpt calibrates k_bmm_quantizer and TensorRT-LLM writes its KV cache."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    name = f"{KV_ATTN_IMPL}_{base_impl}"
    if name in AttentionInterface._global_mapping:
        return name
    base = eager_attention_forward if base_impl == "eager" else AttentionInterface._global_mapping[base_impl]

    def fp8_kv_attention(module, query, key, value, *args, **kwargs):
        ks = getattr(module, "fp8_k_scale", None)
        vs = getattr(module, "fp8_v_scale", None)
        if ks is not None:
            key = qdq_e4m3(key, ks)
        if vs is not None:
            value = qdq_e4m3(value, vs)
        return base(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, fp8_kv_attention)
    return name


def enable_fp8_kv(model) -> str:
    """Switch a transformers model to the FP8-KV attention function (keeping its current sdpa/eager kernel)."""
    base = model.config._attn_implementation or "sdpa"
    if base.startswith(KV_ATTN_IMPL):
        return base
    name = _register_kv_attention(base if base in ("sdpa", "eager") else "sdpa")
    model.config._attn_implementation = name
    for sub in model.modules():  # sub-configs (text/vision) carry their own copy
        c = getattr(sub, "config", None)
        if c is not None and c is not model.config and getattr(c, "_attn_implementation", None) == base:
            c._attn_implementation = name
    return name
