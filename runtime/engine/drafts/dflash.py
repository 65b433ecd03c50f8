"""DFlash (`DFlashDraftModel`, Qwen3-style): the exported draft as a module (the target's hidden states projected
into every layer's context K/V; a block [anchor, mask, ...] drafted in one pass) and the checks of its export."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runtime.algorithms import dflash
from runtime.algorithms.export import TargetShape, raise_first, read_export
from runtime.engine.drafts.blocks import DraftPlan, decoder_layer, draft_plan, make_linear, make_norm, set_attention_shape
from runtime.engine.drafts.format import DraftFormatError
from runtime.engine.layers import KVCache, RopeTable, attention, rope_heads, rope_module


class DFlashDraft(nn.Module):
    """The exported DFlash draft (no embeddings or lm_head: the target's are passed in)."""

    algorithm = dflash.DFLASH.name
    traits = dflash.DFLASH                # the Algorithm (runtime/algorithms/base.py)
    kv_fp8_scale: float | None = None   # FP8 KV cache with this scale (`load_draft(kv_cache="fp8")`), else BF16

    def __init__(self, cfg: dict, sd: dict, compute_dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        spec = dflash.DFLASH.parse(cfg)       # the frozen DFlashConfig of the export
        self.block_size = spec.block_size
        self.mask_token_id = spec.mask_token_id
        self.target_layer_ids = list(spec.capture_layers)
        self.capture_layers = self.target_layer_ids       # the target layers it reads, whatever the algorithm
        self.causal = spec.causal
        set_attention_shape(self, cfg)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.fc = make_linear(sd, "fc", compute_dtype)
        self.hidden_norm = make_norm(sd, "hidden_norm", eps, compute_dtype)
        self.norm = make_norm(sd, "norm", eps, compute_dtype)
        self.layers = nn.ModuleList()
        for i in range(self.num_layers):
            p = f"layers.{i}"
            layer = decoder_layer(sd, p, eps, compute_dtype)
            layer.q_norm = make_norm(sd, f"{p}.self_attn.q_norm", eps, compute_dtype)
            layer.k_norm = make_norm(sd, f"{p}.self_attn.k_norm", eps, compute_dtype)
            self.layers.append(layer)
        self.rotary = rope_module(cfg, "qwen3")
        self.rope = RopeTable(self.rotary)

    def new_cache(self, batch: int, capacity: int, device) -> KVCache:
        dt = self.norm.weight.dtype
        return KVCache(self.num_layers, batch, self.n_kv, self.head_dim, capacity, dt, device, self.kv_fp8_scale)

    def plan(self, compute: str = "fp32") -> DraftPlan:
        """The fused weights for `compute` (`fp32` | `bf16`), built on first use and kept."""
        return draft_plan(self, compute)

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
            k, v = cache.quantized(k, v)        # the block's own K/V meet the context's in the (FP8) cache's precision
            K = torch.cat((cache.k[i][:, :, :ctx_len], k), dim=2)
            V = torch.cat((cache.v[i][:, :, :ctx_len], v), dim=2)
            o = attention(q, K, V, mask, self.scale)
            h = L.finish(h, o)
        return P.norm(h)


_UNSUPPORTED_DFLASH = ("attention_sink_bias", "use_swa", "projector_type")


def check_dflash(cfg: dict, sd: dict, path: Path, target: TargetShape | None) -> dict:
    """The export checked by `runtime.algorithms.dflash.check_export` (and its pairing with `target`), then what this
    runtime does not implement; raises DraftFormatError at the first problem. Returns `cfg`."""
    raise_first(dflash.check_export(read_export(sd, cfg, str(path)), target=target), DraftFormatError)
    if bad := [k for k in _UNSUPPORTED_DFLASH if cfg["dflash_config"].get(k)]:
        raise DraftFormatError(f"{path}: dflash_config uses {bad}, which this runtime does not implement")
    return cfg
