"""Draft models read exactly as ModelOpt 0.47 exports them, plus the cached-attention primitives they share
with the target runner in `runtime.engine.speculative`.

Two formats (see `export/plugins/hf_spec_export.py` in ModelOpt):

- EAGLE-3 (`architectures: ["LlamaForCausalLMEagle3"]`): `fc` over the concatenated outputs of the target
  layers `eagle_config.eagle_aux_hidden_state_layer_ids` (concatenated in ascending layer order: ModelOpt
  collects them with forward hooks, which fire in execution order), Llama decoder layers whose first layer
  takes `cat(input_layernorm(embed(token)), hidden_norm(...))` (width 2H) for q/k/v, a final `norm`, its own
  `lm_head` of `draft_vocab_size` rows and, when that is smaller than the target vocabulary, `d2t`
  (target_id = draft_id + d2t[draft_id]). Token embeddings are the target's.
- DFlash (`architectures: ["DFlashDraftModel"]`, Qwen3-style): `fc` + `hidden_norm` over the outputs of
  `dflash_config.target_layer_ids` (in listed order) give a context that every draft layer projects to K/V
  (with `k_norm`); a block `[anchor, mask, ..., mask]` embedded with the target's embeddings supplies Q and
  its own K/V; positions continue the context; logits come from the target's `lm_head` on the draft `norm`.

First-layer norm of EAGLE-3: ModelOpt's HF module computes `hidden_norm(input_layernorm(h))` for the hidden
half (the first decoder layer normalizes `h` before the attention pre-hook applies `hidden_norm`), while
TensorRT-LLM, vLLM and SGLang compute `hidden_norm(h)`. `first_layer_norm="modelopt"` (default) reproduces
the trained model exactly; `"serving"` reproduces the serving engines, so the difference can be measured.

Every format problem raises `DraftFormatError` with what was expected and what was found, unless the
loader is told to behave like TensorRT-LLM (`strict=False`): then a missing `d2t` maps draft ids as target
ids, as TensorRT-LLM does, and the acceptance collapse shows up in the measurement instead.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("specpipe.runtime")

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
DFLASH_ARCH = "DFlashDraftModel"
_SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "weight_scale_2", "pre_quant_scale")


class DraftFormatError(ValueError):
    """The draft directory does not match the exported format (or the target it is paired with)."""


# ---------------------------------------------------------------------------------------------- primitives


class KVCache:
    """Preallocated K/V per layer for a batch of rows of different lengths.

    `lengths[b]` is the number of valid positions of row b. Writes go to explicit positions, so rolling back
    rejected draft tokens is just setting `lengths` (later writes overwrite the stale entries)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device):
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.capacity = capacity

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, uniform: int | None) -> None:
        """k, v: [B, Hkv, T, D] at positions pos [B, T] (callers keep them < capacity, see `positions_for`);
        `uniform` = common start position if all rows agree (plain slicing, no scatter)."""
        if uniform is not None:
            t = k.shape[2]
            self.k[layer].narrow(2, uniform, t).copy_(k)
            self.v[layer].narrow(2, uniform, t).copy_(v)
        else:
            b = torch.arange(k.shape[0], device=k.device)[:, None]
            dt = self.k[layer].dtype
            self.k[layer][b, :, pos] = k.transpose(1, 2).to(dt)
            self.v[layer][b, :, pos] = v.transpose(1, 2).to(dt)

    def select_rows(self, idx: torch.Tensor) -> None:
        self.k = [t.index_select(0, idx) for t in self.k]
        self.v = [t.index_select(0, idx) for t in self.v]
        self.lengths = self.lengths.index_select(0, idx)


def positions_for(lengths: torch.Tensor, t: int, capacity: int | None = None) -> tuple[torch.Tensor, int | None]:
    """Positions [B, T] continuing each row, and the common start when every row has the same length."""
    pos = lengths[:, None] + torch.arange(t, device=lengths.device)[None, :]
    lo, hi = int(lengths.min()), int(lengths.max())
    if capacity is not None and hi + t > capacity:
        raise RuntimeError(f"KV cache capacity {capacity} exceeded (position {hi + t - 1})")
    return pos, (lo if lo == hi else None)


def causal_mask(pos: torch.Tensor, kv_len: int) -> torch.Tensor | None:
    """[B, 1, T, kv_len] boolean: query at position p sees keys at positions <= p. None when it would be all
    True (a single query at the end of every row), so SDPA takes its fast path."""
    if pos.shape[1] == 1 and bool((pos[:, 0] == kv_len - 1).all()):
        return None
    kv = torch.arange(kv_len, device=pos.device)
    return (kv[None, None, :] <= pos[:, :, None])[:, None]


class RopeTable:
    """cos/sin of a rotary module for positions 0..n-1, computed once and indexed per step (the per-position
    values are identical to calling the module on those positions; this only removes per-step overhead)."""

    def __init__(self, rotary):
        self.rotary = rotary
        self.cos = self.sin = None

    def _ensure(self, x: torch.Tensor, pos: torch.Tensor) -> None:
        need = int(pos.max()) + 1
        if self.cos is None or self.cos.shape[0] < need or self.cos.device != x.device or self.cos.dtype != x.dtype:
            n = max(need, 256 if self.cos is None else 2 * self.cos.shape[0])
            c, s = self.rotary(x[:1, :1], torch.arange(n, device=x.device)[None])
            self.cos, self.sin = c[0], s[0]
            half = self.sin.shape[-1] // 2
            self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), -1)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor):
        self._ensure(x, pos)
        return self.cos[pos], self.sin[pos]

    def signed(self, x: torch.Tensor, pos: torch.Tensor):
        """(cos, sin with rotate_half's sign folded in), each [B, T, 1, D], for `rope_heads` on [B, T, heads, D]."""
        self._ensure(x, pos)
        return self.cos[pos][:, :, None], self.sin_signed[pos][:, :, None]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D] (HF convention, attention scaling already folded in)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def attention(q, k, v, mask, scale: float):
    """q [B, H, T, D], k/v [B, Hkv, L, D] (grouped-query heads repeated inside SDPA)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class GatedMLP(nn.Module):
    def __init__(self, linears: dict):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linears["gate_proj"], linears["up_proj"], linears["down_proj"]

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_module(cfg_dict: dict, family: str = "llama"):
    """The rotary embedding the serving engine builds from the exported config.json (its rope_theta and any
    injected rope_scaling such as ModelOpt's default YaRN), via transformers so the formulas are the standard ones."""
    import transformers

    cfg_cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rope_theta", "rope_scaling")
    kw = {k: cfg_dict[k] for k in keys if cfg_dict.get(k) is not None}
    cfg = cfg_cls(**kw)
    rot_cls = (transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding if family == "qwen3"
               else transformers.models.llama.modeling_llama.LlamaRotaryEmbedding)
    return rot_cls(config=cfg)


# ---------------------------------------------------------------------------------------------- compute modes


COMPUTE_MODES = ("fp32", "bf16", "auto")


def native_bf16_gemm(device="cpu") -> bool:
    """Whether bf16 GEMMs run natively here (detected, not assumed): on CPU, oneDNN with AMX-BF16 or AVX512-BF16
    dot-product instructions (without them oneDNN emulates bf16 and fp32 is faster); on CUDA, bf16 support."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if dev.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    cpu = torch.cpu
    isa = (getattr(cpu, "_is_amx_tile_supported", lambda: False)()
           or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())
    return bool(isa and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_compute(compute: str, device="cpu") -> str:
    """`fp32` | `bf16` from a requested mode. `fp32`: the exact mode, every GEMM in the loaded parameters' dtype
    (float32 as the loaders give it). `bf16`: GEMMs take bf16 weights and bf16-rounded activations (float32
    accumulation), everything else (residual stream, norms, RoPE, attention, KV cache) stays float32. `auto`:
    `bf16` on a CPU with native bf16 GEMMs (`native_bf16_gemm`), `fp32` otherwise (and on CUDA, where the exact
    mode is what `validate` compares against)."""
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, not {compute!r}")
    if compute == "auto":
        dev = torch.device(device)
        return "bf16" if dev.type == "cpu" and native_bf16_gemm(dev) else "fp32"
    return compute


# ---------------------------------------------------------------------------------------------- fused GEMMs

_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
# What an FP8Linear (runtime.engine.fp8) holds when it computes qdq(x, input_scale) @ (weight * weight_scale)^T + bias;
# one with anything else (another recipe) runs through its own forward instead of a fused GEMM.
_FP8_BUFFERS = {"weight", "weight_scale", "input_scale", "bias"}
_FP8_ATTRS = {"out_features", "in_features", "compute_dtype", "use_scaled_mm", "dynamic_per_token", "_w_cache"}


def qdq_e4m3_fast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`runtime.engine.fp8.qdq_e4m3` (x * (1 / scale) -> clamp +-448 -> E4M3 -> float32 * scale, TensorRT-LLM's static
    quantization) in fewer ops, for float32 x and a float32 scale already on x's device; the same arithmetic, bit
    for bit (tests/test_runtime_speed.py)."""
    if x.dtype != torch.float32 or scale.dtype != torch.float32 or scale.device != x.device:
        from runtime.engine.fp8 import qdq_e4m3

        return qdq_e4m3(x, scale)
    return (x * (1.0 / scale)).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8).float().mul_(scale)


def _e4m3_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The E4M3 codes `qdq_e4m3` rounds x to (x * (1 / scale), saturated), as float8."""
    return (x.float() * (1.0 / scale)).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8)


def _onednn_bf16() -> bool:
    """oneDNN can run bf16 matmuls here (natively or emulated); without it the bf16 mode uses torch's own kernels."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _linear_kind(m: nn.Module) -> str | None:
    """'dense' (nn.Linear), 'fp8' (an FP8Linear with a static per-tensor input scale, or weight-only), 'fp8_tok'
    (an FP8Linear with dynamic per-token activations), or None (run the module itself)."""
    if type(m) is nn.Linear:
        return "dense"
    w = getattr(m, "weight", None)
    if type(m).__name__ == "FP8Linear" and isinstance(w, torch.Tensor) and w.dtype == _FP8:
        own = {k for k in vars(m) if not k.startswith("_") or k == "_w_cache"} - {"training"}
        if set(m._buffers) <= _FP8_BUFFERS and own <= _FP8_ATTRS and not m._modules:
            ws, si = m.weight_scale, m.input_scale
            if getattr(m, "use_scaled_mm", False) and w.is_cuda:
                return None                      # the real FP8 GEMM (torch._scaled_mm) runs in the module
            if ws.numel() in (1, w.shape[0]) and getattr(m, "dynamic_per_token", False):
                return "fp8_tok"
            if ws.numel() in (1, w.shape[0]) and (si is None or si.numel() == 1):
                return "fp8"
    return None


class Gemm:
    """y = x @ W^T (+ b) of one or several linears that read the same input (q/k/v, gate/up), as ONE GEMM over
    their weights concatenated along the output dimension at build time; returns the concatenated outputs in the
    activation dtype (float32, or the loaded parameters' dtype in the fp32 mode).

    fp32 mode: dense weights as loaded (on CPU stored transposed, [in, out], which MKL runs faster at 2-20 rows);
    FP8 linears as `runtime.engine.fp8.FP8Linear` emulates them: qdq(x) @ (weight * weight_scale)^T, qdq with the static
    input scale or per token (FP8_PER_CHANNEL_PER_TOKEN; one row's scale is shared by the fused members).
    bf16 mode, on CPU through oneDNN with the weights reordered once for its kernels: dense weights in bf16,
    activations rounded to bf16; FP8 linears multiply the E4M3 codes of the quantized activation and of the weight
    (both exact in bf16, their products exact in the float32 accumulator) and scale the result by
    input_scale (or the row's per-token scale) * weight_scale, i.e. FP8Linear's arithmetic with the output
    rounded to bf16, as an FP8 GEMM with
    a bf16 output does on a GPU. A group whose members differ (kind, input scale) is not fused: each member runs
    through its own module and the outputs are concatenated."""

    def __init__(self, mods: list[nn.Module], compute: str, device):
        self.splits = [int(m.out_features) for m in mods]
        self.in_features = int(mods[0].in_features)
        self.compute = compute
        self.device = torch.device(device)
        kinds = {_linear_kind(m) for m in mods}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind == "fp8":
            si = [m.input_scale for m in mods]
            if not (all(s is None for s in si) or (all(s is not None for s in si)
                                                   and all(torch.equal(s, si[0]) for s in si))):
                kind = None
        self.kind = kind
        self.mods = mods
        if kind is None:
            return
        bias = [m.bias for m in mods]
        self.bias = (torch.cat([b.detach().float() if b is not None else torch.zeros(n, device=self.device)
                                for b, n in zip(bias, self.splits)]) if any(b is not None for b in bias) else None)
        cpu = self.device.type == "cpu"
        if kind == "dense":
            w = torch.cat([m.weight.detach() for m in mods])
            self.act_dtype = w.dtype if w.is_floating_point() else torch.float32
            self.scale = self.in_scale = None
            if self.bias is not None:
                self.bias = self.bias.to(self.act_dtype)
            if compute == "bf16":
                self._w_exact = w            # for `LogitsHead` refinement (no copy: concatenation of one is a view)
                w = w.to(torch.bfloat16)
        else:
            from runtime.engine.fp8 import dequantize_weight

            self.act_dtype = mods[0].compute_dtype
            s_in = mods[0].input_scale if kind == "fp8" else None
            self.in_scale = None if s_in is None else s_in.detach().float().reshape(()).to(self.device)
            if compute == "bf16":
                w = torch.cat([m.weight for m in mods]).to(torch.bfloat16)            # E4M3 codes, exact in bf16
                ws = torch.cat([m.weight_scale.detach().float().reshape(-1).expand(n) for m, n in zip(mods, self.splits)])
                self.scale = ws * (self.in_scale if self.in_scale is not None else 1.0)
                self._w_exact = None
            else:
                w = torch.cat([dequantize_weight(m.weight, m.weight_scale, self.act_dtype) for m in mods])
                self.scale = None
            if self.bias is not None and compute != "bf16":
                self.bias = self.bias.to(self.act_dtype)
        if compute == "bf16" and cpu and _onednn_bf16():
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
            self._op = "onednn"
        elif cpu and compute != "bf16":
            self.w = w.t().contiguous()
            self._op = "mm"
        else:
            self.w = w.contiguous()
            self._op = "linear"

    @property
    def out_features(self) -> int:
        return sum(self.splits)

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the GEMM operand, a per-row scale or None). bf16 mode: the activation in bf16, or for an FP8 linear the
        E4M3 codes of the quantized activation in bf16 (per-token: with each row's scale, applied after the GEMM);
        fp32 mode: the activation as FP8Linear feeds its GEMM (through E4M3 with the input scale, or per-token
        quantize-dequantize)."""
        if self.compute == "bf16":
            if self.kind == "fp8_tok":
                from runtime.engine.fp8 import quantize_per_token

                q, s = quantize_per_token(x)
                return q.to(torch.bfloat16), s
            if self.kind == "fp8" and self.in_scale is not None:
                return _e4m3_codes(x, self.in_scale).to(torch.bfloat16), None
            return x.to(torch.bfloat16), None
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        if self.kind == "fp8_tok":
            from runtime.engine.fp8 import qdq_per_token

            return qdq_per_token(x), None
        if self.kind == "fp8" and self.in_scale is not None:
            x = qdq_e4m3_fast(x, self.in_scale)
        return x, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            outs = [m(x) for m in self.mods]
            return outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        return self._gemm(*self._quantize_input(x))

    def promoting(self, x: torch.Tensor) -> torch.Tensor:
        """As `__call__`, but in the bf16 mode the output may stay bf16 (no scale or bias to apply): for a caller
        whose next op takes it together with a float32 tensor (type promotion converts it exactly), saving a
        conversion op."""
        if self.kind is None or self.compute != "bf16" or self.scale is not None or self.bias is not None:
            return self(x)
        return self._gemm(*self._quantize_input(x), promote=False)

    def _gemm(self, xq: torch.Tensor, row_scale: torch.Tensor | None = None, promote: bool = True) -> torch.Tensor:
        if self._op == "mm":                              # fp32 on CPU: x @ W^T with W^T stored contiguous
            return torch.matmul(xq, self.w) if self.bias is None else torch.matmul(xq, self.w).add_(self.bias)
        if self._op == "linear":
            y = F.linear(xq, self.w, None if self.compute == "bf16" else self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(xq, self.w, None, "none", [], "")
        if self.compute != "bf16" or not promote:
            return y
        y = y.float() if self.scale is None else y * self.scale      # bf16 * float32 -> float32
        if row_scale is not None:
            y = y.mul_(row_scale)
        return y if self.bias is None else y.add_(self.bias)


class LogitsHead(Gemm):
    """The lm_head as a `Gemm`. In the bf16 mode the GEMM's bf16 output carries 8 significant bits (a logit near
    20 is rounded to a multiple of 0.125), so near-ties at the top would be decided by rounding: every logit
    within the rounding bound of a row's maximum is recomputed exactly (float64 dot product of the bf16-rounded
    input with the weight row, rounded to float32), so the argmax is the argmax of the exact logits of the bf16
    input, whatever the GEMM's accumulation order; logits further down keep the bf16 value (they cannot be the
    maximum; as probabilities they are within 2^-8 relative of exact)."""

    def __init__(self, mod: nn.Module, compute: str, device, refine: bool = True):
        super().__init__([mod], compute, device)
        self.refine = refine and compute == "bf16" and self.kind == "dense"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is None:
            return self.mods[0](x).float()
        xq, rs = self._quantize_input(x)
        y = self._gemm(xq, rs)
        if not self.refine:
            return y.float()
        y2 = y.view(-1, y.shape[-1])
        top = y2.max(-1, keepdim=True).values
        # |bf16(v) - v| <= 2^-8 |v|, and every v within 2^-4 |top| of top has |v| <= (1 + 2^-4) |top|: a logit that
        # is not a candidate cannot exceed the exact value of the row's bf16 maximum
        cand = (y2 >= top - top.abs() * 0.0625 - 1e-6).nonzero()
        r, c = cand[:, 0], cand[:, 1]
        xr = xq.reshape(-1, self.in_features)[r].double()
        exact = (xr * self._w_exact[c].to(torch.bfloat16).double()).sum(-1)
        if self.bias is not None:
            exact = exact + self.bias[c].double()
        y2[r, c] = exact.float()
        return y


class Norm:
    """An RMSNorm module computed by `torch.nn.functional.rms_norm` (fewer dispatched ops), used only where it
    gives the module's own output bit for bit (checked on a probe at build time); otherwise the module runs."""

    def __init__(self, mod: nn.Module):
        self.mod = mod
        w = getattr(mod, "weight", None)
        self.eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
        self.w = w.detach() if isinstance(w, torch.Tensor) else None
        self.fast = False
        if self.w is not None and self.w.ndim == 1 and self.w.dtype == torch.float32 and isinstance(self.eps, float):
            g = torch.Generator(device="cpu").manual_seed(0)
            probe = (torch.randn(3, self.w.shape[0], generator=g) * 3).to(self.w.device)
            with torch.no_grad():
                self.fast = bool(torch.equal(self._rms(probe), mod(probe)))

    def _rms(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.w, self.eps)

    def __call__(self, x):
        return self._rms(x) if self.fast and x.dtype == torch.float32 else self.mod(x)


_GATED_MLPS = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GatedMLP"}


def _is_silu(mlp: nn.Module) -> bool:
    act = getattr(mlp, "act_fn", None)
    if act is None:
        return type(mlp).__name__ == "GatedMLP"        # ours: F.silu
    probe = torch.linspace(-6, 6, 97)
    with torch.no_grad():
        return isinstance(act, nn.Module) and torch.equal(act(probe), F.silu(probe))


class FusedLayer:
    """A Llama-style decoder layer prepared for the runtime's forward: one GEMM for q/k/v, one for gate/up,
    norms with fewer ops. `proj` holds q/k/v/o_proj (a target layer's self_attn, or a draft layer itself).
    Parts the plan does not recognise run through their modules (a non-gated MLP, a norm that differs)."""

    def __init__(self, layer: nn.Module, proj: nn.Module, compute: str, device, *, n_heads: int, n_kv: int,
                 head_dim: int, context_kv: bool = False):
        self.nq, self.nkv, self.hd = n_heads, n_kv, head_dim
        self.ln1 = Norm(layer.input_layernorm)
        self.ln2 = Norm(layer.post_attention_layernorm)
        self.qkv = Gemm([proj.q_proj, proj.k_proj, proj.v_proj], compute, device)
        # DFlash projects the target's context through k/v alone: a second fused GEMM over those two
        self.kv = Gemm([proj.k_proj, proj.v_proj], compute, device) if context_kv else None
        self.o = Gemm([proj.o_proj], compute, device)
        self.q_norm, self.k_norm = getattr(proj, "q_norm", None), getattr(proj, "k_norm", None)
        mlp = layer.mlp
        self.mlp = mlp
        self.gate_up = self.down = None
        if type(mlp).__name__ in _GATED_MLPS and _is_silu(mlp):
            self.gate_up = Gemm([mlp.gate_proj, mlp.up_proj], compute, device)
            self.down = Gemm([mlp.down_proj], compute, device)
            self.inter = int(mlp.gate_proj.out_features)

    def qkv_heads(self, x: torch.Tensor, cos, sin):
        """x [B, T, in] (normed) -> q [B, nq, T, D], k, v [B, nkv, T, D] with RoPE applied to q and k (and the
        per-head q/k norms first where the layer has them)."""
        B, T = x.shape[:2]
        nq, nkv = self.nq, self.nkv
        # bf16 mode: q/k reach float32 in RoPE's products with the float32 tables, v in the cache write (or
        # FP8 KV's qdq, which takes it as float32); only the per-head norms need float32 inputs
        qkv = (self.qkv(x) if self.q_norm is not None else self.qkv.promoting(x)).view(B, T, nq + 2 * nkv, self.hd)
        qk, v = qkv.split((nq + nkv, nkv), 2)
        if self.q_norm is not None:
            q, k = qk.split((nq, nkv), 2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), 2)
        q, k = rope_heads(qk, cos, sin).split((nq, nkv), 2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual h [B, T, H] + o_proj(attention output o [B, nq, T, D]), then the MLP block."""
        B, T = h.shape[:2]
        h = h + self.o.promoting(o.transpose(1, 2).reshape(B, T, -1))
        x = self.ln2(h)
        if self.gate_up is None:
            return h + self.mlp(x)
        g, u = self.gate_up(x).split(self.inter, -1)
        return h + self.down.promoting(F.silu(g) * u)


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, T, heads, D] with `RopeTable.signed` tables [B, T, 1, D]: x * cos + rotate_half(x) * sin,
    written as x * cos + roll(x, D/2) * sin_signed (the sign of rotate_half folded into the table), which is
    bit for bit `apply_rope` (a sign flip is exact) in four ops instead of six, for q and k in one go."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


# ---------------------------------------------------------------------------------------------- linear layers


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


def _norm(sd: dict, name: str, eps: float, dtype) -> RMSNorm:
    w = sd[f"{name}.weight"]
    n = RMSNorm(w.shape[0], eps)
    with torch.no_grad():
        n.weight.copy_(w.to(dtype))
    return n.to(dtype)


def _decoder_layer(sd: dict, p: str, eps: float, compute_dtype: torch.dtype) -> nn.Module:
    """One Llama-style draft decoder layer read from `sd` under prefix `p`: the two RMSNorms, q/k/v/o
    projections and the gated MLP; each draft adds its own extras (EAGLE-3's hidden_norm, DFlash's q/k norms)."""
    layer = nn.Module()
    layer.input_layernorm = _norm(sd, f"{p}.input_layernorm", eps, compute_dtype)
    layer.post_attention_layernorm = _norm(sd, f"{p}.post_attention_layernorm", eps, compute_dtype)
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(layer, n, make_linear(sd, f"{p}.self_attn.{n}", compute_dtype))
    layer.mlp = GatedMLP({n: make_linear(sd, f"{p}.mlp.{n}", compute_dtype) for n in ("gate_proj", "up_proj", "down_proj")})
    return layer


def _strip_scales(keys) -> set[str]:
    return {k for k in keys if k.rsplit(".", 1)[-1] not in _SCALE_SUFFIXES}


def read_draft_dir(path: Path) -> tuple[dict, dict]:
    """(config.json, every weight) of a draft directory as ModelOpt's export_speculative_decoding writes it (an
    adapter_model.safetensors beside the weights is not read)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").exists():
        raise DraftFormatError(f"{path}: no config.json; expected a draft directory written by ModelOpt's "
                               "export_speculative_decoding")
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    files = [f for f in files if f.name != "adapter_model.safetensors"]
    if not files:
        raise DraftFormatError(f"{path}: no *.safetensors weights")
    sd: dict = {}
    for f in files:
        sd.update(load_file(str(f)))
    return cfg, sd


# ---------------------------------------------------------------------------------------------- EAGLE-3


@dataclass
class TargetShape:
    """What a draft must agree with: read from the target's config."""

    hidden_size: int
    vocab_size: int
    num_layers: int


def _set_attention_shape(m: nn.Module, cfg: dict) -> None:
    """Decoder shape fields both exported draft formats share (config.json keys as ModelOpt writes them)."""
    m.hidden_size = cfg["hidden_size"]
    m.num_layers = cfg["num_hidden_layers"]
    m.n_heads = cfg["num_attention_heads"]
    m.n_kv = cfg["num_key_value_heads"]
    m.head_dim = cfg.get("head_dim") or m.hidden_size // m.n_heads
    m.scale = m.head_dim ** -0.5


class Eagle3Draft(nn.Module):
    """The exported EAGLE-3 draft. `step()` runs the decoder over new positions with a KV cache."""

    algorithm = "eagle3"

    def __init__(self, cfg: dict, sd: dict, compute_dtype: torch.dtype, first_layer_norm: str):
        super().__init__()
        self.cfg = cfg
        ec = cfg["eagle_config"]
        _set_attention_shape(self, cfg)
        self.aux_layer_ids = sorted(int(i) for i in ec["eagle_aux_hidden_state_layer_ids"])
        self.vocab_size = cfg["vocab_size"]
        self.draft_vocab_size = cfg["draft_vocab_size"]
        self.first_layer_norm = first_layer_norm
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.fc = make_linear(sd, "fc", compute_dtype)
        self.layers = nn.ModuleList()
        for i in range(self.num_layers):
            layer = _decoder_layer(sd, f"layers.{i}", eps, compute_dtype)
            if i == 0:
                layer.hidden_norm = _norm(sd, f"layers.{i}.hidden_norm", eps, compute_dtype)
            self.layers.append(layer)
        self.norm = _norm(sd, "norm", eps, compute_dtype) if ec.get("use_last_layernorm", True) else None
        self.lm_head = make_linear(sd, "lm_head", compute_dtype)
        d2t = sd.get("d2t")
        self.register_buffer("d2t", d2t.long() if d2t is not None else None)
        self.rotary = rope_module(cfg, "llama")
        self.rope = RopeTable(self.rotary)

    def new_cache(self, batch: int, capacity: int, device) -> KVCache:
        dt = self.layers[0].input_layernorm.weight.dtype
        return KVCache(self.num_layers, batch, self.n_kv, self.head_dim, capacity, dt, device)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def logits_to_target_vocab(self, logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
        """Draft logits [.., Vd] -> [.., V] with -inf where the draft cannot propose (for sampling q)."""
        if self.d2t is None and logits.shape[-1] == target_vocab:
            return logits
        out = logits.new_full((*logits.shape[:-1], target_vocab), float("-inf"))
        ids = self.to_target_ids(torch.arange(logits.shape[-1], device=logits.device))
        out[..., ids] = logits
        return out

    def plan(self, compute: str = "fp32") -> "DraftPlan":
        """The fused weights for `compute` (`fp32` | `bf16`), built on first use and kept (see `TargetRunner`)."""
        return _draft_plan(self, compute)

    def step(self, hidden: torch.Tensor, embeds: torch.Tensor, cache: KVCache, pos: torch.Tensor,
             uniform: int | None, compute: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, H]: fc(aux) for target-verified positions or the draft's own pre-norm output;
        embeds [B, T, H]: target embeddings of the *next* token at each position. Returns (float32 logits over
        the draft vocabulary, pre-norm hidden) for every position. Writes K/V at `pos`; does not move lengths."""
        P = self.plan(compute)
        kv_len = int(pos.max()) + 1
        cos, sin = self.rope.signed(hidden, pos)
        mask = causal_mask(pos, kv_len)
        h = hidden
        for i, L in enumerate(P.layers):
            if i == 0:
                hn = L.ln1(h) if self.first_layer_norm == "modelopt" else h
                x = torch.cat((L.ln1(embeds), P.hidden_norm(hn)), dim=-1)
            else:
                x = L.ln1(h)
            q, k, v = L.qkv_heads(x, cos, sin)
            cache.write(i, k, v, pos, uniform)
            o = attention(q, cache.k[i].narrow(2, 0, kv_len), cache.v[i].narrow(2, 0, kv_len), mask, self.scale)
            h = L.finish(h, o)
        post = P.norm(h) if P.norm is not None else h
        return P.head(post), h


@dataclass
class DraftPlan:
    """A draft's weights as the runtime runs them in one compute mode: fused layers, fc, norms, lm_head."""

    compute: str
    fc: Gemm
    layers: list[FusedLayer]
    norm: Norm | None
    hidden_norm: Norm | None
    head: LogitsHead | None


def _draft_plan(draft: nn.Module, compute: str) -> DraftPlan:
    dev = draft.fc.weight.device
    plans = draft.__dict__.setdefault("_specpipe_plans", {})
    key = (compute, str(dev))
    if key not in plans:
        eagle = draft.algorithm == "eagle3"
        layers = [FusedLayer(layer, layer, compute, dev, n_heads=draft.n_heads, n_kv=draft.n_kv,
                             head_dim=draft.head_dim, context_kv=not eagle) for layer in draft.layers]
        hn = draft.layers[0].hidden_norm if eagle else draft.hidden_norm
        plans[key] = DraftPlan(compute, Gemm([draft.fc], compute, dev), layers,
                               Norm(draft.norm) if draft.norm is not None else None, Norm(hn),
                               LogitsHead(draft.lm_head, compute, dev) if eagle else None)
    return plans[key]


def _check_eagle3(cfg: dict, sd: dict, path: Path, target: TargetShape | None, strict: bool) -> dict:
    """An EAGLE-3 export's config and tensors checked in order: its eagle_config, the tensor names, the fc and
    first-layer shapes, the draft vocabulary (filling in a missing `draft_vocab_size`), then the pairing with
    `target`. Raises DraftFormatError at the first problem; returns `cfg`."""
    ec = _eagle3_config(cfg, path)
    ids = ec["eagle_aux_hidden_state_layer_ids"]
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    _check_eagle3_tensor_names(sd, path, L, ec.get("use_last_layernorm", True))
    _check_eagle3_input_shapes(sd, path, H, ids)
    _check_eagle3_vocab(cfg, sd, path, strict)
    if target is not None:
        _check_eagle3_pairing(cfg, ids, path, target)
    return cfg


def _eagle3_config(cfg: dict, path: Path) -> dict:
    """`eagle_config`, refused unless it describes an EAGLE-3 draft (aux hidden states from listed layers)."""
    ec = cfg.get("eagle_config")
    if not isinstance(ec, dict):
        raise DraftFormatError(f"{path}/config.json: no eagle_config; not an EAGLE-3 export")
    if not ec.get("use_aux_hidden_state", False):
        raise DraftFormatError(f"{path}: eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 draft, which "
                               "TensorRT-LLM's Eagle3 path cannot run")
    if not ec.get("eagle_aux_hidden_state_layer_ids"):
        raise DraftFormatError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids is empty")
    return ec


def _eagle3_required_tensors(num_layers: int, use_last_layernorm: bool) -> set[str]:
    required = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"}
    for i in range(num_layers):
        required |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    if not use_last_layernorm:
        required.discard("norm.weight")
    return required


def _check_eagle3_tensor_names(sd: dict, path: Path, num_layers: int, use_last_layernorm: bool) -> None:
    """Every tensor a serving engine loads is there, and nothing it would skip or reject."""
    required = _eagle3_required_tensors(num_layers, use_last_layernorm)
    keys = _strip_scales(sd.keys())
    missing = sorted(required - keys)
    allowed = required | {"d2t", "norm.weight"} | {k.replace(".weight", ".bias") for k in required}
    unexpected = sorted(keys - allowed)
    if missing:
        raise DraftFormatError(f"{path}: missing tensors {missing}; the EAGLE-3 export must have "
                               "fc, layers.*.{{input_layernorm,post_attention_layernorm,self_attn.*,mlp.*}}, "
                               "layers.0.hidden_norm, norm, lm_head")
    if unexpected:
        raise DraftFormatError(f"{path}: unexpected tensors {unexpected[:8]}: a serving engine would skip or "
                               "reject them; re-export with export_speculative_decoding")


def _check_eagle3_input_shapes(sd: dict, path: Path, H: int, ids: list) -> None:
    """fc reads one hidden state per aux layer; the first layer's attention reads [embedding, hidden]."""
    fc_in = sd["fc.weight"].shape[1]
    if fc_in != len(ids) * H:
        raise DraftFormatError(f"{path}: fc.weight takes {fc_in} inputs = {fc_in / H:g} x hidden {H}, but "
                               f"eagle_aux_hidden_state_layer_ids lists {len(ids)} layers {ids}")
    if sd["layers.0.self_attn.q_proj.weight"].shape[1] != 2 * H:
        raise DraftFormatError(f"{path}: layers.0.self_attn.q_proj takes "
                               f"{sd['layers.0.self_attn.q_proj.weight'].shape[1]} inputs, expected 2 x hidden = {2 * H}")


def _check_eagle3_vocab(cfg: dict, sd: dict, path: Path, strict: bool) -> None:
    """lm_head has `draft_vocab_size` rows (set to the full vocabulary when config.json lacks it); a reduced
    vocabulary has a d2t map into the target's (only a warning without one when not `strict`)."""
    vocab = cfg["vocab_size"]
    dv = cfg.get("draft_vocab_size")
    if dv is None:
        log.warning("%s: config.json has no draft_vocab_size; assuming the full vocabulary %d (as TensorRT-LLM does)",
                    path, vocab)
        dv = cfg["draft_vocab_size"] = vocab
    if sd["lm_head.weight"].shape[0] != dv:
        raise DraftFormatError(f"{path}: lm_head has {sd['lm_head.weight'].shape[0]} rows but draft_vocab_size is {dv}")
    if dv > vocab:
        raise DraftFormatError(f"{path}: draft_vocab_size {dv} > vocab_size {vocab}")
    if dv < vocab:
        _check_d2t(sd, path, dv, vocab, strict)
    elif "d2t" in sd and bool((sd["d2t"] != 0).any()):
        raise DraftFormatError(f"{path}: d2t is non-zero although draft_vocab_size == vocab_size")


def _check_d2t(sd: dict, path: Path, dv: int, vocab: int, strict: bool) -> None:
    """A reduced draft vocabulary's d2t: one offset per draft id, each mapping into [0, vocab)."""
    if "d2t" not in sd:
        msg = (f"{path}: draft_vocab_size {dv} < vocab_size {vocab} but there is no d2t tensor: draft token ids "
               "cannot be mapped to target ids (TensorRT-LLM would use them as target ids and acceptance "
               "collapses); export with the draft vocabulary cache loaded")
        if strict:
            raise DraftFormatError(msg)
        log.warning("%s (strict=False: draft ids used as target ids)", msg)
        return
    d2t = sd["d2t"]
    if tuple(d2t.shape) != (dv,):
        raise DraftFormatError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({dv},) = draft_vocab_size")
    mapped = torch.arange(dv) + d2t.long()
    if int(mapped.min()) < 0 or int(mapped.max()) >= vocab:
        raise DraftFormatError(f"{path}: d2t maps draft ids outside the target vocabulary [0, {vocab})")


def _check_eagle3_pairing(cfg: dict, ids: list, path: Path, target: TargetShape) -> None:
    """The draft fits `target`: same hidden size and vocabulary, aux layers inside its stack."""
    H, vocab = cfg["hidden_size"], cfg["vocab_size"]
    if H != target.hidden_size:
        raise DraftFormatError(f"{path}: draft hidden_size {H} != target hidden_size {target.hidden_size}")
    if vocab != target.vocab_size:
        raise DraftFormatError(f"{path}: draft vocab_size {vocab} != target vocab_size {target.vocab_size}: "
                               "the draft must share the target's tokenizer")
    bad = [i for i in ids if not 0 <= int(i) < target.num_layers]
    if bad:
        raise DraftFormatError(f"{path}: aux layer ids {bad} are outside the target's {target.num_layers} layers")


# ---------------------------------------------------------------------------------------------- DFlash


class DFlashDraft(nn.Module):
    """The exported DFlash draft (no embeddings or lm_head: the target's are passed in)."""

    algorithm = "dflash"

    def __init__(self, cfg: dict, sd: dict, compute_dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        dc = cfg["dflash_config"]
        self.block_size = int(cfg["block_size"])
        self.mask_token_id = int(dc["mask_token_id"])
        self.target_layer_ids = [int(i) for i in dc["target_layer_ids"]]
        self.causal = bool(dc.get("causal", False))
        _set_attention_shape(self, cfg)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.fc = make_linear(sd, "fc", compute_dtype)
        self.hidden_norm = _norm(sd, "hidden_norm", eps, compute_dtype)
        self.norm = _norm(sd, "norm", eps, compute_dtype)
        self.layers = nn.ModuleList()
        for i in range(self.num_layers):
            p = f"layers.{i}"
            layer = _decoder_layer(sd, p, eps, compute_dtype)
            layer.q_norm = _norm(sd, f"{p}.self_attn.q_norm", eps, compute_dtype)
            layer.k_norm = _norm(sd, f"{p}.self_attn.k_norm", eps, compute_dtype)
            self.layers.append(layer)
        self.rotary = rope_module(cfg, "qwen3")
        self.rope = RopeTable(self.rotary)

    def new_cache(self, batch: int, capacity: int, device) -> KVCache:
        dt = self.norm.weight.dtype
        return KVCache(self.num_layers, batch, self.n_kv, self.head_dim, capacity, dt, device)

    def plan(self, compute: str = "fp32") -> DraftPlan:
        """The fused weights for `compute` (`fp32` | `bf16`), built on first use and kept."""
        return _draft_plan(self, compute)

    def add_context(self, target_hidden: torch.Tensor, cache: KVCache, pos: torch.Tensor, uniform: int | None,
                    compute: str = "fp32") -> None:
        """Project target hidden states [B, T, n*H] of newly verified positions into every layer's context K/V."""
        P = self.plan(compute)
        ctx = P.hidden_norm(P.fc(target_hidden))
        B, T, _ = ctx.shape
        cos, sin = self.rope.signed(ctx, pos)
        for i, L in enumerate(P.layers):
            kv = L.kv(ctx).view(B, T, 2 * self.n_kv, self.head_dim)
            k = rope_heads(L.k_norm(kv[:, :, :self.n_kv]), cos, sin).transpose(1, 2)
            cache.write(i, k, kv[:, :, self.n_kv:].transpose(1, 2), pos, uniform)

    def block(self, block_embeds: torch.Tensor, cache: KVCache, compute: str = "fp32") -> torch.Tensor:
        """block_embeds [B, S, H] of [anchor, mask, ...] at positions lengths[b] + j; returns the normed draft
        hidden [B, S, H]. Attends to the valid context of each row and to the whole block (bidirectional, or
        causal inside the block when the export says `causal: true`)."""
        P = self.plan(compute)
        B, S, _ = block_embeds.shape
        lengths = cache.lengths
        ctx_len = int(lengths.max())
        pos = lengths[:, None] + torch.arange(S, device=lengths.device)[None, :]
        cos, sin = self.rope.signed(block_embeds, pos)
        ctx_ok = torch.arange(ctx_len, device=lengths.device)[None, :] < lengths[:, None]        # [B, Lc]
        blk_ok = (torch.tril(torch.ones(S, S, dtype=torch.bool, device=lengths.device)) if self.causal
                  else torch.ones(S, S, dtype=torch.bool, device=lengths.device))
        mask = torch.cat((ctx_ok[:, None, :].expand(B, S, ctx_len), blk_ok[None].expand(B, S, S)), dim=-1)[:, None]
        h = block_embeds
        for i, L in enumerate(P.layers):
            q, k, v = L.qkv_heads(L.ln1(h), cos, sin)
            K = torch.cat((cache.k[i][:, :, :ctx_len], k), dim=2)
            V = torch.cat((cache.v[i][:, :, :ctx_len], v), dim=2)
            o = attention(q, K, V, mask, self.scale)
            h = L.finish(h, o)
        return P.norm(h)


_UNSUPPORTED_DFLASH = ("attention_sink_bias", "use_swa", "projector_type")


def _check_dflash(cfg: dict, sd: dict, path: Path, target: TargetShape | None) -> dict:
    dc = cfg.get("dflash_config")
    if not isinstance(dc, dict):
        raise DraftFormatError(f"{path}/config.json: no dflash_config; not a DFlash export")
    for k in ("mask_token_id", "target_layer_ids"):
        if dc.get(k) is None:
            raise DraftFormatError(f"{path}: dflash_config.{k} is missing")
    if cfg.get("block_size") is None or int(cfg["block_size"]) < 2:
        raise DraftFormatError(f"{path}: block_size must be >= 2, found {cfg.get('block_size')}")
    if bad := [k for k in _UNSUPPORTED_DFLASH if dc.get(k)]:
        raise DraftFormatError(f"{path}: dflash_config uses {bad}, which this runtime does not implement")
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    ids = dc["target_layer_ids"]
    required = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(L):
        required |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    keys = _strip_scales(sd.keys())
    allowed = required | {k.replace(".weight", ".bias") for k in required}
    if missing := sorted(required - keys):
        raise DraftFormatError(f"{path}: missing tensors {missing[:8]} for a {L}-layer DFlash draft")
    if unexpected := sorted(keys - allowed):
        raise DraftFormatError(f"{path}: unexpected tensors {unexpected[:8]} (embeddings and lm_head come from the target)")
    if sd["fc.weight"].shape[1] != len(ids) * H:
        raise DraftFormatError(f"{path}: fc.weight takes {sd['fc.weight'].shape[1]} inputs but target_layer_ids "
                               f"{ids} x hidden {H} = {len(ids) * H}")
    if target is not None:
        if H != target.hidden_size:
            raise DraftFormatError(f"{path}: draft hidden_size {H} != target hidden_size {target.hidden_size}")
        if not 0 <= int(dc["mask_token_id"]) < target.vocab_size:
            raise DraftFormatError(f"{path}: mask_token_id {dc['mask_token_id']} is outside the target vocabulary")
        if bad := [i for i in ids if not 0 <= int(i) < target.num_layers]:
            raise DraftFormatError(f"{path}: target_layer_ids {bad} are outside the target's {target.num_layers} layers")
        n = cfg.get("num_target_layers")
        if n is not None and int(n) != target.num_layers:
            raise DraftFormatError(f"{path}: exported for a {n}-layer target, paired with a {target.num_layers}-layer one")
    return cfg


# ---------------------------------------------------------------------------------------------- entry point


def draft_algorithm(path: str | Path) -> str:
    cfg = json.loads((Path(path) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if EAGLE3_ARCH in archs:
        return "eagle3"
    if DFLASH_ARCH in archs:
        return "dflash"
    raise DraftFormatError(f"{path}: architectures {archs} is neither {EAGLE3_ARCH} nor {DFLASH_ARCH}")


def load_draft(path: str | Path, target: TargetShape | None = None, *, compute_dtype=torch.float32,
               device="cpu", strict: bool = True, first_layer_norm: str = "modelopt",
               expected_capture_layers: list[int] | None = None):
    """Load a draft directory exactly as exported. `target` enables the pairing checks;
    `expected_capture_layers` (the aux / target layer ids training used, e.g. from draft.json) must match the
    ids the export declares: an edited or stale config.json would otherwise feed the draft the wrong layers."""
    if first_layer_norm not in ("modelopt", "serving"):
        raise ValueError(f"first_layer_norm must be 'modelopt' or 'serving', not {first_layer_norm!r}")
    path = Path(path)
    cfg, sd = read_draft_dir(path)
    algo = draft_algorithm(path)
    if expected_capture_layers is not None:
        declared = ((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if algo == "eagle3"
                    else (cfg.get("dflash_config") or {}).get("target_layer_ids"))
        if declared is None or sorted(map(int, declared)) != sorted(map(int, expected_capture_layers)):
            raise DraftFormatError(f"{path}: config.json declares capture layers {declared}, but the draft was trained "
                                   f"on target layers {list(expected_capture_layers)}")
    if algo == "eagle3":
        cfg = _check_eagle3(cfg, sd, path, target, strict)
        m = Eagle3Draft(cfg, sd, compute_dtype, first_layer_norm)
    else:
        cfg = _check_dflash(cfg, sd, path, target)
        m = DFlashDraft(cfg, sd, compute_dtype)
    quant = (path / "hf_quant_config.json").exists()
    log.info("loaded %s draft %s (%d layers%s)", algo, path, m.num_layers, ", FP8" if quant else "")
    return m.to(device).eval()


def summarize(draft) -> dict:
    """The facts a report shows about a loaded draft."""
    if draft.algorithm == "eagle3":
        return {"algorithm": "eagle3", "num_layers": draft.num_layers, "aux_layer_ids": draft.aux_layer_ids,
                "draft_vocab_size": draft.draft_vocab_size, "has_d2t": draft.d2t is not None,
                "rope_scaling": draft.cfg.get("rope_scaling"), "first_layer_norm": draft.first_layer_norm}
    return {"algorithm": "dflash", "num_layers": draft.num_layers, "target_layer_ids": draft.target_layer_ids,
            "block_size": draft.block_size, "mask_token_id": draft.mask_token_id, "causal": draft.causal,
            "rope_scaling": draft.cfg.get("rope_scaling")}

