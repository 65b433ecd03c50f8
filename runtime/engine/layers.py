"""The cached-attention building blocks the target runner (`runtime.engine.speculative`) and the exported drafts
(`runtime.engine.drafts`) share: a preallocated KV cache written at explicit positions, causal masks, RoPE tables
and rotations (with the rotary module a serving engine builds from an exported config.json), SDPA attention with
grouped-query heads, RMSNorm and the gated MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.fp8.linear import qdq_e4m3_fast


class KVCache:
    """Preallocated K/V per layer for a batch of rows of different lengths.

    `lengths[b]` is the number of valid positions of row b. Writes go to explicit positions, so rolling back
    rejected draft tokens is just setting `lengths` (later writes overwrite the stale entries).

    `fp8_scale`: an FP8 (E4M3) KV cache with that per-tensor scale: every written K/V is quantized to
    float8_e4m3fn (x / scale, saturated at +-448) and held as its dequantized value (code x scale), which is
    what an attention kernel reading the FP8 cache computes with (`quantized` applies the same to K/V that
    attention uses without reading them back). The drafts use it with a unit scale (`runtime.engine.drafts`)."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device, fp8_scale: float | None = None):
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.capacity = capacity
        self.fp8_scale = None if fp8_scale is None else torch.tensor(float(fp8_scale), dtype=torch.float32,
                                                                      device=device)

    def quantized(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as the FP8 cache holds them (E4M3 at `fp8_scale`, dequantized); unchanged without FP8."""
        if self.fp8_scale is None:
            return k, v
        s = self.fp8_scale
        return qdq_e4m3_fast(k.float(), s).to(k.dtype), qdq_e4m3_fast(v.float(), s).to(v.dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, uniform: int | None) -> None:
        """k, v: [B, Hkv, T, D] at positions pos [B, T] (callers keep them < capacity, see `positions_for`);
        `uniform` = common start position if all rows agree (plain slicing, no scatter). Through E4M3 first
        when the cache is FP8."""
        k, v = self.quantized(k, v)
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


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, T, heads, D] with `RopeTable.signed` tables [B, T, 1, D]: x * cos + rotate_half(x) * sin,
    written as x * cos + roll(x, D/2) * sin_signed (the sign of rotate_half folded into the table), which is
    bit for bit `apply_rope` (a sign flip is exact) in four ops instead of six, for q and k in one go."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
