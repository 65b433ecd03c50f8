"""Execute ModelOpt FP8 checkpoints without an FP8 GPU: the project's one way to run deployed FP8 artifacts.

A ModelOpt *unified* Hugging Face checkpoint (what `export_hf_checkpoint` and `export_speculative_decoding`
write for `quant_algo: FP8`) stores, for every quantized linear `<p>`:

    <p>.weight        float8_e4m3fn [out, in]
    <p>.weight_scale  float32 scalar          real weight = fp8 weight * weight_scale
    <p>.input_scale   float32 scalar          static per-tensor activation scale (calibrated amax / 448)

and, with FP8 KV cache, `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` (per-tensor scales of the keys
after RoPE and of the values). Everything else (embeddings, lm_head, norms, excluded modules) stays in high
precision. transformers cannot run such a checkpoint (it skips the unknown `modelopt` quantization and runs
raw FP8 bit patterns as if they were real weights), so this module does it:

- `FP8Linear` reproduces the arithmetic of TensorRT-LLM's FP8 GEMM: the activation is quantized to E4M3 with
  its static `input_scale` (x / scale -> clamp +-448 -> round to float8_e4m3fn), multiplied with the FP8 weight
  and rescaled by `input_scale * weight_scale`. On CPU this is emulated exactly (dequantize both operands and
  use a float32 matmul; only the accumulation order differs from the GPU). On CUDA, `use_scaled_mm=True`
  runs the real `torch._scaled_mm` FP8 GEMM.
- FP8 KV scales are applied to keys (after RoPE) and values inside attention, where ModelOpt calibrated them
  and where TensorRT-LLM writes its FP8 KV cache.
- `load_causal_lm` loads either a plain (BF16/FP16/FP32) checkpoint or an FP8 one behind one call.
- `swap_fp8_linears` / `load_fp8_state_dict` / `fp8_linears_from_safetensors` / `load_state_dict_dequantized`
  do the same for any module tree (the EAGLE-3 draft `LlamaForCausalLMEagle3`, which transformers has no
  class for), keyed by the checkpoint's tensor names.

Only per-tensor FP8 (the ModelOpt `FP8_DEFAULT_CFG` format) is supported; other `quant_algo`s raise.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from runtime.placement import place

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                      # largest finite float8_e4m3fn value
SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "output_scale")
KV_ATTN_IMPL = "specpipe_fp8_kv"     # the attention function registered below


# ----------------------------------------------------------------------------------------- checkpoint metadata


def read_quant_config(path: str | Path) -> dict | None:
    """The `quantization` block of a checkpoint's `hf_quant_config.json` (what TensorRT-LLM reads), or None.

    Falls back to `config.json["quantization_config"]` (ModelOpt writes both; the flat `quant_method: modelopt`
    form carries the same `quant_algo` / `kv_cache_scheme`) so a checkpoint missing the file is still recognised
    here; `stages.quantize` checks separately that the file exists, since TensorRT-LLM 1.2 needs it.
    """
    path = Path(path)
    f = path / "hf_quant_config.json"
    if f.exists():
        doc = json.loads(f.read_text())
        return doc.get("quantization", doc)
    cfg_file = path / "config.json"
    if cfg_file.exists():
        qc = json.loads(cfg_file.read_text()).get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
            kv = qc.get("kv_cache_scheme")
            return {"quant_algo": qc.get("quant_algo"), "exclude_modules": qc.get("ignore", []),
                    "kv_cache_quant_algo": "FP8" if isinstance(kv, dict) and kv.get("type") == "float" else None}
    return None


def is_fp8_checkpoint(path: str | Path) -> bool:
    """True when `path` is a ModelOpt FP8 checkpoint: `hf_quant_config.json` with `quant_algo: FP8`."""
    f = Path(path) / "hf_quant_config.json"
    if not f.exists():
        return False
    doc = json.loads(f.read_text())
    return str(doc.get("quantization", doc).get("quant_algo") or "").upper() == "FP8"


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (every `*.safetensors` shard) or of one safetensors file."""
    from safetensors.torch import load_file

    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


# ----------------------------------------------------------------------------------------- FP8 arithmetic


def qdq_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize through float8_e4m3fn with a static per-tensor scale, in float32:
    x / scale -> clamp to +-448 -> round to E4M3 -> back to float32 * scale. Returns x's dtype."""
    s = scale.to(device=x.device, dtype=torch.float32)
    q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * s).to(x.dtype)


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """float8 weight * its scale (scalar, or per output channel with shape [out] / [out, 1])."""
    s = weight_scale.float()
    if s.ndim == 1 and s.numel() == weight.shape[0] and s.numel() > 1:
        s = s[:, None]
    return (weight.float() * s).to(dtype)


class FP8Linear(nn.Module):
    """A linear layer holding an FP8 E4M3 weight with static per-tensor scales, computing like the GPU kernel.

    forward(x) = (qdq(x, input_scale) @ (weight_fp8 * weight_scale)^T) + bias, in `compute_dtype`.
    Without `input_scale` (weight-only FP8) the activation is not quantized.
    With `use_scaled_mm` on a CUDA device (FP8 tensor cores, sm_89+), it calls `torch._scaled_mm` on the real
    FP8 operands instead of emulating; shapes not divisible by 16 fall back to emulation.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, *, compute_dtype: torch.dtype = torch.float32,
                 use_scaled_mm: bool = False):
        super().__init__()
        if weight.dtype != FP8_DTYPE:
            raise TypeError(f"FP8Linear needs a {FP8_DTYPE} weight, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype
        self.use_scaled_mm = use_scaled_mm
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.detach().float().reshape(weight_scale.shape))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.detach().float())
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))
        self._w_cache: torch.Tensor | None = None   # dequantized weight, built on first emulated forward

    def dequantized_weight(self) -> torch.Tensor:
        if self._w_cache is None or self._w_cache.device != self.weight.device:
            self._w_cache = dequantize_weight(self.weight, self.weight_scale, self.compute_dtype)
        return self._w_cache

    def _apply(self, fn, recurse=True):  # .to()/.cuda() invalidate the cache
        self._w_cache = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        if self.use_scaled_mm and x.is_cuda and self._scaled_mm_ok(x):
            return self._forward_scaled_mm(x)
        if self.input_scale is not None:
            x = qdq_e4m3(x, self.input_scale)
        return F.linear(x, self.dequantized_weight(), self.bias)

    def _scaled_mm_ok(self, x: torch.Tensor) -> bool:
        return (self.input_scale is not None and self.weight_scale.numel() == 1
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        s_in = self.input_scale.reshape(()).float()
        xq = (x2.float() / s_in).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        pad = (-x2.shape[0]) % 16                      # _scaled_mm wants M % 16 == 0 on some versions
        if pad:
            xq = torch.cat([xq, xq.new_zeros(pad, self.in_features)])
        out_dtype = self.compute_dtype if self.compute_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        # weight is [out, in] row-major, so weight.t() is the column-major [in, out] operand _scaled_mm wants
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=s_in, scale_b=self.weight_scale.reshape(()).float(),
                             bias=None if self.bias is None else self.bias.to(out_dtype), out_dtype=out_dtype)
        if pad:
            y = y[: x2.shape[0]]
        return y.to(self.compute_dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"static_input_scale={self.input_scale is not None}, compute_dtype={self.compute_dtype}")


# ----------------------------------------------------------------------------------------- state dicts


def fp8_linear_prefixes(state_dict: Mapping[str, torch.Tensor]) -> list[str]:
    """Module names (`model.layers.0.mlp.up_proj`) whose `.weight` is float8 in this state dict."""
    return sorted(k[: -len(".weight")] for k, v in state_dict.items() if k.endswith(".weight") and v.dtype == FP8_DTYPE)


def fp8_linears_from_state_dict(state_dict: Mapping[str, torch.Tensor], *, compute_dtype=torch.float32,
                                use_scaled_mm: bool = False) -> dict[str, FP8Linear]:
    """{module name: FP8Linear} for every FP8 weight in the state dict (with its scales and optional bias)."""
    out: dict[str, FP8Linear] = {}
    for p in fp8_linear_prefixes(state_dict):
        if f"{p}.weight_scale" not in state_dict:
            raise KeyError(f"{p}.weight is float8 but {p}.weight_scale is missing: cannot dequantize")
        out[p] = FP8Linear(state_dict[f"{p}.weight"], state_dict[f"{p}.weight_scale"],
                           state_dict.get(f"{p}.input_scale"), state_dict.get(f"{p}.bias"),
                           compute_dtype=compute_dtype, use_scaled_mm=use_scaled_mm)
    return out


def fp8_linears_from_safetensors(path: str | Path, **kw) -> dict[str, FP8Linear]:
    """`fp8_linears_from_state_dict` of a checkpoint directory or safetensors file."""
    return fp8_linears_from_state_dict(read_safetensors(path), **kw)


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
                     compute_dtype=torch.float32, use_scaled_mm: bool = False) -> list[str]:
    """Replace each `nn.Linear` of `module` whose checkpoint weight (`prefix + name + ".weight"`) is FP8 by an
    `FP8Linear` built from the checkpoint. Returns the replaced module names. Raises when the checkpoint has
    an FP8 weight for a module that is not an `nn.Linear` (or not there): a silent mismatch would run garbage."""
    linears = fp8_linears_from_state_dict(state_dict, compute_dtype=compute_dtype, use_scaled_mm=use_scaled_mm)
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
                        compute_dtype=torch.float32, use_scaled_mm: bool = False, strict: bool = True,
                        ignore_missing: Iterable[str] = ()) -> dict:
    """Load a (possibly FP8) checkpoint into any module tree: FP8 linears are swapped for `FP8Linear`, every
    other tensor is loaded (cast to `compute_dtype` when floating). KV scales are attached to the attention
    modules (see `attach_kv_scales`). Returns {"fp8_linears", "missing", "unexpected", "kv_scales"}; with
    `strict`, missing or unexpected tensors raise (names in `ignore_missing` excepted)."""
    sd = read_safetensors(path_or_sd) if isinstance(path_or_sd, (str, Path)) else dict(path_or_sd)
    if prefix:
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    swapped = swap_fp8_linears(module, sd, compute_dtype=compute_dtype, use_scaled_mm=use_scaled_mm)
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
    kv = attach_kv_scales(module, sd)
    if strict and (missing or unexpected):
        raise KeyError(f"checkpoint does not match the module: missing {missing[:8]}, unexpected {unexpected[:8]}")
    return {"fp8_linears": swapped, "missing": missing, "unexpected": unexpected, "kv_scales": kv}


# ----------------------------------------------------------------------------------------- FP8 KV cache


def attach_kv_scales(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Give every attention module whose checkpoint has `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` the
    buffers `fp8_k_scale` / `fp8_v_scale`, used by the `specpipe_fp8_kv` attention function. Returns how many."""
    n = 0
    names = dict(module.named_modules())
    for k, v in state_dict.items():
        for proj, leaf, attr in (("k_proj", "k_scale", "fp8_k_scale"), ("v_proj", "v_scale", "fp8_v_scale")):
            if k.endswith(f".{proj}.{leaf}") or k == f"{proj}.{leaf}":
                attn_name = k[: -len(f"{proj}.{leaf}")].rstrip(".")
                attn = names.get(attn_name)
                if attn is None:
                    raise KeyError(f"checkpoint has {k} but the module has no attention module '{attn_name}'")
                attn.register_buffer(attr, v.detach().float().reshape(()))
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


# ----------------------------------------------------------------------------------------- whole models


def load_causal_lm(path: str | Path, *, device: str | torch.device = "cpu", compute_dtype: torch.dtype = torch.float32,
                   use_scaled_mm: bool | None = None, apply_kv_scales: bool = True, trust_remote_code: bool = False,
                   spread: bool = False):
    """Load a causal LM checkpoint for inference, whether plain (BF16/FP16/FP32) or ModelOpt FP8 unified.
    `spread`: on CUDA, a model larger than one GPU goes over all of them (`runtime.placement`; only for callers
    that run the model through its own forward, whose hooks move activations between GPUs).

    FP8 checkpoints: every FP8 linear becomes an `FP8Linear` (weights dequantized with `weight_scale`,
    activations through E4M3 with `input_scale`), high-precision tensors are loaded as they are, and KV scales
    (when present and `apply_kv_scales`) quantize keys/values in attention. `use_scaled_mm` (default: on for
    CUDA) uses the real FP8 GEMM. Returns the model in eval mode; `model.fp8_info` says what was applied.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    path = Path(path)
    device = torch.device(device)
    if not is_fp8_checkpoint(path):
        qc = read_quant_config(path)
        if qc and qc.get("quant_algo"):
            raise ValueError(f"{path}: quant_algo {qc.get('quant_algo')} is not supported (only FP8); "
                             "or hf_quant_config.json is missing next to a quantized config.json")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype, trust_remote_code=trust_remote_code)
        model.fp8_info = {"fp8": False}
        return (place(model, device) if spread else model.to(device)).eval()

    qc = read_quant_config(path) or {}
    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if hasattr(cfg, "quantization_config"):  # transformers would otherwise try (and fail) to apply it
        del cfg.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=compute_dtype, trust_remote_code=trust_remote_code)
    sd = read_safetensors(path)
    if not apply_kv_scales:
        sd = {k: v for k, v in sd.items() if not k.endswith((".k_scale", ".v_scale"))}
    if use_scaled_mm is None:
        use_scaled_mm = device.type == "cuda"
    tied = ["lm_head.weight"] if getattr(cfg.get_text_config(), "tie_word_embeddings", False) else []
    info = load_fp8_state_dict(model, sd, compute_dtype=compute_dtype, use_scaled_mm=use_scaled_mm,
                               ignore_missing=tied)
    if tied:
        model.tie_weights()
    if info["kv_scales"]:
        enable_fp8_kv(model)
    model.fp8_info = {"fp8": True, "quant_algo": qc.get("quant_algo"), "kv_cache_quant_algo": qc.get("kv_cache_quant_algo"),
                      "fp8_linears": len(info["fp8_linears"]), "kv_scales": info["kv_scales"],
                      "use_scaled_mm": bool(use_scaled_mm)}
    log.info("loaded FP8 checkpoint %s: %d FP8 linears, %d layers with FP8 KV scales", path,
             len(info["fp8_linears"]), info["kv_scales"])
    return (place(model, device) if spread else model.to(device)).eval()
