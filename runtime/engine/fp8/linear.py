"""The FP8 arithmetic TensorRT-LLM's GEMMs compute: E4M3 quantize-dequantize with a static scale (activations, KV
cache), dynamic per-token activation scales, weight quantization and dequantization (per tensor or per output
channel), `FP8Linear`, and the re-quantization of fused q/k/v and gate/up members onto one scale
(`trtllm_fuse_scales`)."""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                      # largest finite float8_e4m3fn value
# TensorRT-LLM's smallest per-token activation scale (cpp/tensorrt_llm/common/cudaFp8Utils.cu,
# dynamicQuantizeMatrixPerToken: min_scaling_factor = 1 / (FP8_E4M3_MAX * 512))
FP8_MIN_TOKEN_SCALE = 1.0 / (FP8_MAX * 512.0)

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))   # TensorRT-LLM's fused Llama GEMMs


def qdq_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize through float8_e4m3fn with a static per-tensor scale, in float32, as TensorRT-LLM's
    static quantization kernel computes it (cudaFp8Utils.cu `scaleMatrix<PER_TENSOR>`: the input is multiplied by
    `1 / scale`, then converted with saturation): x * (1/scale) -> clamp +-448 -> round to E4M3 -> * scale.
    Returns x's dtype. Used for static activations and for the FP8 KV cache."""
    s = scale.to(device=x.device, dtype=torch.float32)
    q = (x.float() * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * s).to(x.dtype)


def qdq_e4m3_fast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`qdq_e4m3` (x * (1 / scale) -> clamp +-448 -> E4M3 -> float32 * scale, TensorRT-LLM's static quantization) in
    fewer ops, for float32 x and a float32 scale already on x's device (anything else goes through `qdq_e4m3`); the
    same arithmetic, bit for bit (tests/unit/runtime/engine/test_runtime_speed.py). The runtime's fused layers and FP8 KV
    caches use it."""
    if x.dtype != torch.float32 or scale.dtype != torch.float32 or scale.device != x.device:
        return qdq_e4m3(x, scale)
    return (x * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float().mul_(scale)


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


def trtllm_fuse_scales(linears: Mapping[str, FP8Linear], dtype: torch.dtype = torch.bfloat16) -> list[list[str]]:
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
            for m, own in zip(mods, scales, strict=True):
                w = m.weight.to(dtype) * own            # bf16 * 0-dim float32 -> bf16, as on the GPU
                m.set_weight((w / s).to(FP8_DTYPE), s.clone())
            changed.append([f"{parent}.{g}" if parent else g for g in group])
    return changed
