"""Execute ModelOpt FP8 checkpoints without an FP8 GPU: the project's one way to run deployed FP8 artifacts.

Two recipes (`hf_quant_config.json` `quantization.quant_algo`), as ModelOpt 0.47's `export_hf_checkpoint` writes
them and TensorRT-LLM 1.2's PyTorch backend executes them:

    quant_algo FP8 (ModelOpt FP8_DEFAULT_CFG)             quant_algo FP8_PER_CHANNEL_PER_TOKEN (FP8_PER_CHANNEL_PER_TOKEN_CFG)
    <p>.weight        float8_e4m3fn [out, in]             <p>.weight        float8_e4m3fn [out, in]
    <p>.weight_scale  float32 scalar (amax / 448)         <p>.weight_scale  float32 [out]  (per output channel amax / 448)
    <p>.input_scale   float32 scalar (static activations) (no input_scale: activations are quantized per token at run time)

and, with FP8 KV cache (`kv_cache_quant_algo: FP8`), scalar `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale`
(ModelOpt's calibrated amax / 448 of the keys after RoPE and of the values). Everything else (embeddings,
lm_head, norms, excluded modules) stays in high precision. transformers cannot run such a checkpoint (it skips
the unknown `modelopt` quantization and runs raw FP8 bit patterns as if they were real weights), so this module
does, reproducing TensorRT-LLM's arithmetic (sources named where each rule is implemented):

- `FP8Linear`: weight = fp8 code * weight_scale (per tensor or per output channel). Activations:
  static per-tensor `x * (1 / input_scale)` -> saturate to +-448 -> E4M3 (TensorRT-LLM's
  `static_quantize_e4m3_per_tensor` multiplies by the reciprocal), or dynamic per token
  `s = max(amax(row) / 448, 1 / (448 * 512))`, `x / s` -> E4M3 (`quantize_e4m3_activation`), or none
  (weight-only). The product is computed in float32 from the dequantized operands (only the accumulation order
  differs from the GPU); on CUDA `use_scaled_mm=True` runs the real `torch._scaled_mm` FP8 GEMM.
- Fused layers: TensorRT-LLM fuses q/k/v and gate/up into one GEMM; for per-tensor FP8 it re-quantizes the
  members onto the largest weight scale when it loads them (`FP8QDQLinearMethod.load_weights_fused_qkv_linear`).
  `load_causal_lm` does the same (`trtllm_fused_scales=True`), so a checkpoint whose members carry different
  scales runs as it will on the GPU (`stages.quantize` exports shared scales, which makes this a no-op).
- FP8 KV cache: keys (after RoPE) and values pass through E4M3 inside attention. TensorRT-LLM 1.2's PyTorch
  attention backend quantizes them with a unit scale whatever the checkpoint's `k_scale`/`v_scale` say
  (`kv_scales="unit"`, the default); `kv_scales="checkpoint"` applies the calibrated scales instead (what
  ModelOpt's fake-quant model computes).
- `load_causal_lm` loads either a plain (BF16/FP16/FP32) checkpoint or an FP8 one behind one call; tied
  input/output embeddings (`tie_word_embeddings`) share one tensor, as in the deployment.
- `swap_fp8_linears` / `load_fp8_state_dict` / `load_state_dict_dequantized`
  do the same for any module tree (the EAGLE-3 draft `LlamaForCausalLMEagle3`, which transformers has no
  class for), keyed by the checkpoint's tensor names.

Other `quant_algo`s raise.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.placement import place

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                      # largest finite float8_e4m3fn value
# TensorRT-LLM's smallest per-token activation scale (cpp/tensorrt_llm/common/cudaFp8Utils.cu,
# dynamicQuantizeMatrixPerToken: min_scaling_factor = 1 / (FP8_E4M3_MAX * 512))
FP8_MIN_TOKEN_SCALE = 1.0 / (FP8_MAX * 512.0)
SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "output_scale")
KV_ATTN_IMPL = "specpipe_fp8_kv"     # the attention function registered below
# hf_quant_config.json quant_algo -> how activations are quantized (ModelOpt 0.47 export names; TensorRT-LLM 1.2
# QuantAlgo.FP8 = FP8QDQLinearMethod, QuantAlgo.FP8_PER_CHANNEL_PER_TOKEN = FP8RowwiseLinearMethod)
QUANT_ALGOS = {"FP8": "static", "FP8_PER_CHANNEL_PER_TOKEN": "dynamic_per_token"}
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))   # TensorRT-LLM's fused Llama GEMMs


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


def quant_algo(path: str | Path) -> str | None:
    """`quant_algo` of the checkpoint's `hf_quant_config.json` (upper case), or None when the file is absent."""
    f = Path(path) / "hf_quant_config.json"
    if not f.exists():
        return None
    doc = json.loads(f.read_text())
    algo = doc.get("quantization", doc).get("quant_algo")
    return str(algo).upper() if algo else None


def is_fp8_checkpoint(path: str | Path) -> bool:
    """True when `path` is a ModelOpt FP8 checkpoint: `hf_quant_config.json` with a `quant_algo` of
    `QUANT_ALGOS` (FP8 per-tensor, or FP8_PER_CHANNEL_PER_TOKEN)."""
    return quant_algo(path) in QUANT_ALGOS


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
    """Quantize-dequantize through float8_e4m3fn with a static per-tensor scale, in float32, as TensorRT-LLM's
    static quantization kernel computes it (cudaFp8Utils.cu `scaleMatrix<PER_TENSOR>`: the input is multiplied by
    `1 / scale`, then converted with saturation): x * (1/scale) -> clamp +-448 -> round to E4M3 -> * scale.
    Returns x's dtype. Used for static activations and for the FP8 KV cache."""
    s = scale.to(device=x.device, dtype=torch.float32)
    q = (x.float() * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * s).to(x.dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token E4M3 quantization, as TensorRT-LLM's `quantize_e4m3_activation` computes it
    (cudaFp8Utils.cu `dynamicQuantizeMatrixPerToken`): for every row (token) of the last dimension,
    s = max(amax(|row|) / 448, 1 / (448 * 512)) and q = E4M3(x / s) (saturating). Returns (q float8 [..., n],
    s float32 [..., 1]); q * s is the dequantized activation."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    s = torch.clamp(amax / FP8_MAX, min=FP8_MIN_TOKEN_SCALE)
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


def qdq_per_token(x: torch.Tensor) -> torch.Tensor:
    """`quantize_per_token` then back to x's dtype (q * s in float32)."""
    q, s = quantize_per_token(x)
    return (q.float() * s).to(x.dtype)


def _channel_scale(weight_scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """A weight scale as float32 scalar (per tensor) or [out, 1] (per output channel; ModelOpt writes [out],
    TensorRT-LLM also accepts [out, 1])."""
    s = weight_scale.detach().float()
    if s.numel() == 1:
        return s.reshape(())
    if s.numel() != out_features:
        raise ValueError(f"weight_scale has {s.numel()} elements; expected 1 (per tensor) or {out_features} "
                         "(per output channel)")
    return s.reshape(out_features, 1)


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """float8 weight * its scale (scalar, or per output channel with shape [out] / [out, 1])."""
    return (weight.float() * _channel_scale(weight_scale, weight.shape[0])).to(dtype)


def quantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """float8 codes of a high-precision weight for a given scale, as ModelOpt 0.47 exports them
    (`modelopt/torch/export/quant_utils.py` `to_quantized_weight`: weight / scale (per channel: scale[:, None]),
    cast to float8_e4m3fn, in float32)."""
    return (weight.float() / _channel_scale(weight_scale, weight.shape[0])).to(FP8_DTYPE)


class FP8Linear(nn.Module):
    """A linear layer holding an FP8 E4M3 weight, computing like TensorRT-LLM's FP8 GEMMs.

    weight_scale: scalar (per tensor) or [out] (per output channel). Activations: `input_scale` given -> static
    per-tensor (`qdq_e4m3`); `dynamic_per_token=True` -> per-token scales computed from each row at run time
    (`quantize_per_token`; an `input_scale` is then ignored, as TensorRT-LLM's FP8RowwiseLinearMethod does for
    the GEMM); neither -> weight-only (the activation is not quantized).
    forward(x) = (qdq(x) @ (weight_fp8 * weight_scale)^T) + bias, in `compute_dtype`.
    With `use_scaled_mm` on a CUDA device (FP8 tensor cores, sm_89+), it calls `torch._scaled_mm` on the real
    FP8 operands instead of emulating (per-tensor: scalar scales; per-token/per-channel: row/column scales,
    bfloat16 output); shapes not divisible by 16 fall back to emulation.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, *, dynamic_per_token: bool = False,
                 compute_dtype: torch.dtype = torch.float32, use_scaled_mm: bool = False):
        super().__init__()
        if weight.dtype != FP8_DTYPE:
            raise TypeError(f"FP8Linear needs a {FP8_DTYPE} weight, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype
        self.use_scaled_mm = use_scaled_mm
        self.dynamic_per_token = bool(dynamic_per_token)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", _channel_scale(weight_scale, self.out_features))
        self.register_buffer("input_scale", None if input_scale is None or self.dynamic_per_token
                             else input_scale.detach().float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype))
        self._w_cache: torch.Tensor | None = None   # dequantized weight, built on first emulated forward

    @property
    def activation(self) -> str:
        """'static' (per-tensor input_scale), 'dynamic_per_token' or 'none' (weight-only)."""
        return "dynamic_per_token" if self.dynamic_per_token else ("static" if self.input_scale is not None else "none")

    @property
    def per_channel(self) -> bool:
        return self.weight_scale.numel() > 1

    def set_weight(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        """Replace the FP8 weight and its scale (e.g. TensorRT-LLM's fused-layer requantization)."""
        self.weight = weight.to(self.weight.device)
        self.weight_scale = _channel_scale(weight_scale, self.out_features).to(self.weight.device)
        self._w_cache = None

    def dequantized_weight(self) -> torch.Tensor:
        if self._w_cache is None or self._w_cache.device != self.weight.device:
            self._w_cache = dequantize_weight(self.weight, self.weight_scale, self.compute_dtype)
        return self._w_cache

    def _apply(self, fn, recurse=True):  # .to()/.cuda() invalidate the cache
        self._w_cache = None
        return super()._apply(fn, recurse)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The activation as the FP8 GEMM sees it (dequantized), in `compute_dtype`."""
        x = x.to(self.compute_dtype)
        if self.dynamic_per_token:
            return qdq_per_token(x)
        if self.input_scale is not None:
            return qdq_e4m3(x, self.input_scale)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype)
        if self.use_scaled_mm and x.is_cuda and self._scaled_mm_ok(x):
            return self._forward_scaled_mm(x)
        return F.linear(self.quantize_input(x), self.dequantized_weight(), self.bias)

    def _scaled_mm_ok(self, x: torch.Tensor) -> bool:
        if self.in_features % 16 or self.out_features % 16:
            return False
        if self.dynamic_per_token:
            return True
        return self.input_scale is not None and not self.per_channel

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.dynamic_per_token:
            xq, s_a = quantize_per_token(x2)                    # [M, K] fp8, [M, 1] float32
            s_b = self.weight_scale.reshape(1, -1).float() if self.per_channel else \
                self.weight_scale.reshape(1, 1).expand(1, self.out_features).float().contiguous()
        else:
            s_a = self.input_scale.reshape(()).float()
            xq = (x2.float() * (1.0 / s_a)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            s_b = self.weight_scale.reshape(()).float()
        pad = (-x2.shape[0]) % 16                      # _scaled_mm wants M % 16 == 0 on some versions
        if pad:
            xq = torch.cat([xq, xq.new_zeros(pad, self.in_features)])
            if s_a.ndim:
                s_a = torch.cat([s_a, s_a.new_ones(pad, 1)])
        # row-wise scaling needs a bfloat16 output; per-tensor keeps the compute dtype when it is 16-bit
        out_dtype = self.compute_dtype if self.compute_dtype in (torch.bfloat16, torch.float16) and \
            not self.dynamic_per_token else torch.bfloat16
        # weight is [out, in] row-major, so weight.t() is the column-major [in, out] operand _scaled_mm wants
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=s_a, scale_b=s_b,
                             bias=None if self.bias is None else self.bias.to(out_dtype), out_dtype=out_dtype)
        if pad:
            y = y[: x2.shape[0]]
        return y.to(self.compute_dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight_scale={'per_channel' if self.per_channel else 'per_tensor'}, activation={self.activation}, "
                f"compute_dtype={self.compute_dtype}")


def trtllm_fuse_scales(linears: Mapping[str, "FP8Linear"], dtype: torch.dtype = torch.bfloat16) -> list[list[str]]:
    """Re-quantize per-tensor FP8 members of TensorRT-LLM's fused GEMMs (q/k/v, gate/up of one block) onto one
    weight scale, the way TensorRT-LLM 1.2 loads them (tensorrt_llm/_torch/modules/linear.py @ ed53795b,
    FP8QDQLinearMethod.load_weights_fused_qkv_linear / _gate_up_linear): scale = max(member scales);
    w = fp8.to(model dtype) * own scale (in `dtype`), then (w / scale).to(float8); the static input scale becomes
    the max of the members' too. Per-channel weights are concatenated unchanged there (FP8RowwiseLinearMethod),
    so they are left alone. Returns the groups whose scales were unified (empty when they already were)."""
    changed = []
    by_parent: dict[str, dict[str, FP8Linear]] = {}
    for name, lin in linears.items():
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = lin
    for parent, kids in by_parent.items():
        for group in FUSED_GROUPS:
            mods = [kids.get(g) for g in group]
            if any(m is None for m in mods) or any(m.per_channel for m in mods):
                continue
            scales = [m.weight_scale.reshape(()) for m in mods]
            s = torch.stack(scales).max()
            if any(m.input_scale is not None for m in mods) and all(m.input_scale is not None for m in mods):
                s_in = torch.stack([m.input_scale.reshape(()) for m in mods]).max()
                for m in mods:
                    m.input_scale = s_in.clone()
            if all(torch.equal(x, s) for x in scales):
                continue
            for m, own in zip(mods, scales):
                w = m.weight.to(dtype) * own            # bf16 * 0-dim float32 -> bf16, as on the GPU
                m.set_weight((w / s).to(FP8_DTYPE), s.clone())
            changed.append([f"{parent}.{g}" if parent else g for g in group])
    return changed


# ----------------------------------------------------------------------------------------- state dicts


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
                     compute_dtype=torch.float32, use_scaled_mm: bool = False, dynamic_per_token: bool = False,
                     trtllm_fused_scales: bool = False, fuse_dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Replace each `nn.Linear` of `module` whose checkpoint weight (`prefix + name + ".weight"`) is FP8 by an
    `FP8Linear` built from the checkpoint. Returns the replaced module names. Raises when the checkpoint has
    an FP8 weight for a module that is not an `nn.Linear` (or not there): a silent mismatch would run garbage.
    `trtllm_fused_scales`: re-quantize fused groups onto one scale as TensorRT-LLM loads them
    (`trtllm_fuse_scales`, intermediate dtype `fuse_dtype`)."""
    linears = fp8_linears_from_state_dict(state_dict, compute_dtype=compute_dtype, use_scaled_mm=use_scaled_mm,
                                          dynamic_per_token=dynamic_per_token)
    if trtllm_fused_scales:
        trtllm_fuse_scales(linears, fuse_dtype)
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
                        ignore_missing: Iterable[str] = (), dynamic_per_token: bool = False,
                        trtllm_fused_scales: bool = False, fuse_dtype: torch.dtype = torch.bfloat16,
                        kv_scales: str = "checkpoint") -> dict:
    """Load a (possibly FP8) checkpoint into any module tree: FP8 linears are swapped for `FP8Linear`, every
    other tensor is loaded (cast to `compute_dtype` when floating). KV scales are attached to the attention
    modules (see `attach_kv_scales`; `kv_scales` "checkpoint" or "unit"). Returns {"fp8_linears", "missing",
    "unexpected", "kv_scales"}; with `strict`, missing or unexpected tensors raise (names in `ignore_missing`
    excepted)."""
    sd = read_safetensors(path_or_sd) if isinstance(path_or_sd, (str, Path)) else dict(path_or_sd)
    if prefix:
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    swapped = swap_fp8_linears(module, sd, compute_dtype=compute_dtype, use_scaled_mm=use_scaled_mm,
                               dynamic_per_token=dynamic_per_token, trtllm_fused_scales=trtllm_fused_scales,
                               fuse_dtype=fuse_dtype)
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


# ----------------------------------------------------------------------------------------- FP8 KV cache


KV_SCALE_MODES = ("unit", "checkpoint")


def attach_kv_scales(module: nn.Module, state_dict: Mapping[str, torch.Tensor], mode: str = "checkpoint") -> int:
    """Give every attention module whose checkpoint has `<attn>.k_proj.k_scale` / `<attn>.v_proj.v_scale` the
    buffers `fp8_k_scale` / `fp8_v_scale`, used by the `specpipe_fp8_kv` attention function (and by
    `runtime.engine.speculative.TargetRunner`). mode "checkpoint": the calibrated scales (ModelOpt's fake-quant model);
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


# ----------------------------------------------------------------------------------------- whole models


def load_causal_lm(path: str | Path, *, device: str | torch.device = "cpu", compute_dtype: torch.dtype = torch.float32,
                   use_scaled_mm: bool | None = None, apply_kv_scales: bool = True, trust_remote_code: bool = False,
                   spread: bool = False, kv_scales: str = "unit", trtllm_fused_scales: bool = True):
    """Load a causal LM checkpoint for inference, whether plain (BF16/FP16/FP32) or ModelOpt FP8 unified
    (quant_algo FP8 or FP8_PER_CHANNEL_PER_TOKEN). `spread`: on CUDA, a model larger than one GPU goes over all
    of them (`runtime.engine.placement`; only for callers that run the model through its own forward, whose hooks move
    activations between GPUs).

    FP8 checkpoints: every FP8 linear becomes an `FP8Linear` (weights dequantized with `weight_scale`, per tensor
    or per channel; activations through E4M3 with the static `input_scale` or with per-token scales),
    high-precision tensors are loaded as they are, and with FP8 KV (when present and `apply_kv_scales`) keys and
    values pass through E4M3 in attention, with unit scales (`kv_scales="unit"`, TensorRT-LLM 1.2) or the
    checkpoint's (`"checkpoint"`). `trtllm_fused_scales`: per-tensor q/k/v and gate/up run on one shared weight
    scale, as TensorRT-LLM loads fused layers (`trtllm_fuse_scales`). `use_scaled_mm` (default: on for CUDA)
    uses the real FP8 GEMM. Tied input/output embeddings share one tensor (a checkpoint that says
    `tie_word_embeddings` but stores a different `lm_head.weight` is refused). Returns the model in eval mode;
    `model.fp8_info` says what was applied.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    path = Path(path)
    device = torch.device(device)
    if not is_fp8_checkpoint(path):
        qc = read_quant_config(path)
        if qc and qc.get("quant_algo"):
            raise ValueError(f"{path}: quant_algo {qc.get('quant_algo')} is not supported (only "
                             f"{', '.join(QUANT_ALGOS)}); or hf_quant_config.json is missing next to a quantized "
                             "config.json")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype, trust_remote_code=trust_remote_code)
        model.fp8_info = {"fp8": False}
        return (place(model, device) if spread else model.to(device)).eval()

    qc = read_quant_config(path) or {}
    algo = quant_algo(path)
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
    text_cfg = cfg.get_text_config()
    tied = bool(getattr(text_cfg, "tie_word_embeddings", False))
    if tied:
        emb_key = next((k for k in sd if k.endswith("embed_tokens.weight")), None)
        head = sd.get("lm_head.weight")
        if head is not None and emb_key is not None and not torch.equal(head, sd[emb_key]):
            raise ValueError(f"{path}: config.json ties the input and output embeddings but lm_head.weight differs "
                             f"from {emb_key}; the deployment would use {emb_key} for both")
        sd.pop("lm_head.weight", None)
    # the dtype TensorRT-LLM runs the model in: its fused-layer requantization computes in it
    fuse_dtype = getattr(torch, str(getattr(text_cfg, "dtype", None) or getattr(text_cfg, "torch_dtype", None)
                                    or "bfloat16").replace("torch.", ""), torch.bfloat16)
    if fuse_dtype not in (torch.bfloat16, torch.float16):
        fuse_dtype = torch.bfloat16
    info = load_fp8_state_dict(model, sd, compute_dtype=compute_dtype, use_scaled_mm=use_scaled_mm,
                               ignore_missing=["lm_head.weight"] if tied else [],
                               dynamic_per_token=QUANT_ALGOS[algo] == "dynamic_per_token",
                               trtllm_fused_scales=trtllm_fused_scales, fuse_dtype=fuse_dtype, kv_scales=kv_scales)
    if tied:
        model.tie_weights()
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError(f"{path}: tie_word_embeddings is set but lm_head and embed_tokens are not tied")
    if info["kv_scales"]:
        enable_fp8_kv(model)
    model.fp8_info = {"fp8": True, "quant_algo": qc.get("quant_algo"), "kv_cache_quant_algo": qc.get("kv_cache_quant_algo"),
                      "fp8_linears": len(info["fp8_linears"]), "kv_scales": info["kv_scales"],
                      "kv_scale_mode": kv_scales if info["kv_scales"] else None,
                      "activation": QUANT_ALGOS[algo], "trtllm_fused_scales": bool(trtllm_fused_scales),
                      "tied_embeddings": tied, "use_scaled_mm": bool(use_scaled_mm)}
    log.info("loaded FP8 checkpoint %s (%s): %d FP8 linears, %d layers with FP8 KV (%s scales)", path, algo,
             len(info["fp8_linears"]), info["kv_scales"], kv_scales)
    return (place(model, device) if spread else model.to(device)).eval()
