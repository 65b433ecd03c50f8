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
the unknown `modelopt` quantization and runs raw FP8 bit patterns as if they were real weights), so this package
does, reproducing TensorRT-LLM's arithmetic (sources named where each rule is implemented):

- `FP8Linear`: weight = fp8 code * weight_scale (per tensor or per output channel). Activations:
  static per-tensor `x * (1 / input_scale)` -> saturate to +-448 -> E4M3 (TensorRT-LLM's
  `static_quantize_e4m3_per_tensor` multiplies by the reciprocal), or dynamic per token
  `s = max(amax(row) / 448, 1 / (448 * 512))`, `x / s` -> E4M3 (`quantize_e4m3_activation`), or none
  (weight-only). The product is computed in float32 from the dequantized operands (only the accumulation order
  differs from the GPU); on CUDA `use_scaled_mm=True` (`FP8LinearMode`) runs the real `torch._scaled_mm` FP8 GEMM.
- Fused layers: TensorRT-LLM fuses q/k/v and gate/up into one GEMM; for per-tensor FP8 it re-quantizes the
  members onto the largest weight scale when it loads them (`FP8QDQLinearMethod.load_weights_fused_qkv_linear`).
  `load_causal_lm` does the same (`FP8Reading.trtllm_fused_scales`, on), so a checkpoint whose members carry different
  scales runs as it will on the GPU (`runtime.quant.ptq` aligns the scales before export, which makes this a no-op).
- FP8 KV cache: keys (after RoPE) and values pass through E4M3 inside attention. TensorRT-LLM 1.2's PyTorch
  attention backend quantizes them with a unit scale whatever the checkpoint's `k_scale`/`v_scale` say
  (`FP8Reading(kv_scales="unit")`, the default); `kv_scales="checkpoint"` applies the calibrated scales instead (what
  ModelOpt's fake-quant model computes).
- `load_causal_lm` loads either a plain (BF16/FP16/FP32) checkpoint or an FP8 one behind one call; tied
  input/output embeddings (`tie_word_embeddings`) share one tensor, as in the deployment.
- `swap_fp8_linears` / `load_fp8_state_dict` / `load_state_dict_dequantized`
  do the same for any module tree (the EAGLE-3 draft `LlamaForCausalLMEagle3`, which transformers has no
  class for), keyed by the checkpoint's tensor names.

Other `quant_algo`s raise.

Modules: `checkpoint` (recognising an FP8 checkpoint: hf_quant_config.json, its recipe, the safetensors),
`linear` (the arithmetic: E4M3 quantize-dequantize, per-token scales, weight (de)quantization, `FP8Linear`,
TensorRT-LLM's fused-layer scales), `kv_cache` (FP8 KV: scales on the attention modules and the attention
function that applies them), `loading` (state dicts into any module tree, whole causal LMs).
"""
from runtime.engine.fp8.checkpoint import (
    QUANT_ALGOS,
    SCALE_SUFFIXES,
    is_fp8_checkpoint,
    quant_algo,
    read_quant_config,
    read_safetensors,
)
from runtime.engine.fp8.kv_cache import KV_ATTN_IMPL, KV_SCALE_MODES, attach_kv_scales, enable_fp8_kv
from runtime.engine.fp8.linear import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_MIN_TOKEN_SCALE,
    FUSED_GROUPS,
    FP8Linear,
    dequantize_weight,
    qdq_e4m3,
    qdq_per_token,
    quantize_per_token,
    quantize_weight,
    trtllm_fuse_scales,
)
from runtime.engine.fp8.loading import (
    FP8LinearMode,
    FP8Reading,
    fp8_linear_prefixes,
    fp8_linears_from_state_dict,
    load_causal_lm,
    load_fp8_state_dict,
    load_state_dict_dequantized,
    swap_fp8_linears,
)

__all__ = ["FP8_DTYPE", "FP8_MAX", "FP8_MIN_TOKEN_SCALE", "FUSED_GROUPS", "KV_ATTN_IMPL", "KV_SCALE_MODES", "QUANT_ALGOS",
           "SCALE_SUFFIXES", "FP8Linear", "FP8LinearMode", "FP8Reading",
           "attach_kv_scales", "dequantize_weight", "enable_fp8_kv", "fp8_linear_prefixes",
           "fp8_linears_from_state_dict", "is_fp8_checkpoint", "load_causal_lm", "load_fp8_state_dict",
           "load_state_dict_dequantized", "qdq_e4m3", "qdq_per_token", "quant_algo", "quantize_per_token",
           "quantize_weight", "read_quant_config", "read_safetensors", "swap_fp8_linears", "trtllm_fuse_scales"]
