"""The parts both exported draft formats are built from: linears (dense, or FP8 through `runtime.engine.fp8`) and
RMSNorms read from the exported tensors, the Llama-style decoder layer, the attention shape from config.json, and
the `DraftPlan` (a draft's weights fused for one compute mode, built once and kept on the module)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runtime.engine.drafts.format import DraftFormatError
from runtime.engine.fused import FusedLayer, Gemm, LogitsHead, Norm
from runtime.engine.layers import GatedMLP, RMSNorm


def make_linear(sd: dict, prefix: str, compute_dtype: torch.dtype) -> nn.Module:
    """A Linear from `prefix.weight` (+ bias). FP8 weights (ModelOpt: float8_e4m3fn + weight_scale/input_scale)
    go through the shared FP8 code in `runtime.engine.fp8`."""
    w = sd[f"{prefix}.weight"]
    b = sd.get(f"{prefix}.bias")
    if w.dtype == torch.float8_e4m3fn:
        from runtime.engine.fp8 import FP8Linear

        if f"{prefix}.weight_scale" not in sd:
            raise DraftFormatError(f"{prefix}.weight is float8 but {prefix}.weight_scale is missing")
        # use_scaled_mm: the real FP8 GEMM when the input is on CUDA, exact emulation otherwise
        return FP8Linear(w, sd[f"{prefix}.weight_scale"], sd.get(f"{prefix}.input_scale"), b,
                         compute_dtype=compute_dtype, use_scaled_mm=True)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w.to(compute_dtype))
        if b is not None:
            lin.bias.copy_(b.to(compute_dtype))
    return lin.to(compute_dtype)


def make_norm(sd: dict, name: str, eps: float, dtype) -> RMSNorm:
    w = sd[f"{name}.weight"]
    n = RMSNorm(w.shape[0], eps)
    with torch.no_grad():
        n.weight.copy_(w.to(dtype))
    return n.to(dtype)


def decoder_layer(sd: dict, p: str, eps: float, compute_dtype: torch.dtype) -> nn.Module:
    """One Llama-style draft decoder layer read from `sd` under prefix `p`: the two RMSNorms, q/k/v/o
    projections and the gated MLP; each draft adds its own extras (EAGLE-3's hidden_norm, DFlash's q/k norms)."""
    layer = nn.Module()
    layer.input_layernorm = make_norm(sd, f"{p}.input_layernorm", eps, compute_dtype)
    layer.post_attention_layernorm = make_norm(sd, f"{p}.post_attention_layernorm", eps, compute_dtype)
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(layer, n, make_linear(sd, f"{p}.self_attn.{n}", compute_dtype))
    layer.mlp = GatedMLP({n: make_linear(sd, f"{p}.mlp.{n}", compute_dtype) for n in ("gate_proj", "up_proj", "down_proj")})
    return layer


def set_attention_shape(m: nn.Module, cfg: dict) -> None:
    """Decoder shape fields both exported draft formats share (config.json keys as ModelOpt writes them)."""
    m.hidden_size = cfg["hidden_size"]
    m.num_layers = cfg["num_hidden_layers"]
    m.n_heads = cfg["num_attention_heads"]
    m.n_kv = cfg["num_key_value_heads"]
    m.head_dim = cfg.get("head_dim") or m.hidden_size // m.n_heads
    m.scale = m.head_dim ** -0.5


@dataclass
class DraftPlan:
    """A draft's weights as the runtime runs them in one compute mode: fused layers, fc, norms, lm_head."""

    compute: str
    fc: Gemm
    layers: list[FusedLayer]
    norm: Norm | None
    hidden_norm: Norm | None
    head: LogitsHead | None


def draft_plan(draft: nn.Module, compute: str) -> DraftPlan:
    dev = draft.fc.weight.device
    plans = draft.__dict__.setdefault("_specpipe_plans", {})
    key = (compute, str(dev))
    if key not in plans:
        eagle = not draft.traits.drafts_block   # EAGLE-3: chain drafting; DFlash: context K/V from target features
        layers = [FusedLayer(layer, layer, compute, dev, n_heads=draft.n_heads, n_kv=draft.n_kv,
                             head_dim=draft.head_dim, context_kv=not eagle) for layer in draft.layers]
        hn = draft.layers[0].hidden_norm if eagle else draft.hidden_norm
        plans[key] = DraftPlan(compute, Gemm([draft.fc], compute, dev), layers,
                               Norm(draft.norm) if draft.norm is not None else None, Norm(hn),
                               LogitsHead(draft.lm_head, compute, dev) if eagle else None)
    return plans[key]
