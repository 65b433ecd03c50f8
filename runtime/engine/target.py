"""The target side of speculative decoding: loading a deployed target checkpoint (BF16 or ModelOpt FP8) and
running it with a KV cache of per-row lengths (`TargetRunner`), on weights fused once per model and compute
mode (`TargetPlan`). Verification of k+1 tokens is one `forward`; rollback of rejected positions is committing
only the kept ones (`commit`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.algorithms.export import TargetShape
from runtime.engine.compute import resolve_compute
from runtime.engine.fp8.linear import qdq_e4m3_fast
from runtime.engine.fused import FusedLayer, LogitsHead, Norm
from runtime.engine.layers import KVCache, RopeTable, attention, causal_mask, positions_for


def load_target(path: str | Path, *, device="cpu", compute_dtype=torch.float32):
    """The one place the runtime loads a target checkpoint: BF16 or ModelOpt FP8 through `runtime.engine.fp8`."""
    from runtime.engine.fp8 import load_causal_lm

    return load_causal_lm(path, device=device, compute_dtype=compute_dtype)


def target_shape(model) -> TargetShape:
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return TargetShape(hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_layers=c.num_hidden_layers)


class TargetRunner:
    """Runs a Hugging Face Llama-family causal LM with a KV cache of per-row lengths, returning logits and the
    outputs of chosen layers. The layers' weights are prepared once (`TargetPlan`): q/k/v and gate/up as one GEMM
    each, norms and RoPE with fewer ops, the lm_head only where logits are asked for; FP8Linear layers and FP8 KV
    scales from `runtime.engine.fp8` compute as there.

    `compute` (`runtime.engine.compute.resolve_compute`): `fp32` (default) is the exact mode, the arithmetic of the loaded
    modules, which validate's exact check and every stage use; `bf16` runs the GEMMs on bf16 weights (half the
    bytes streamed per token, native bf16 GEMMs where the CPU has them), the rest in float32; `auto` picks `bf16`
    on a CPU with native bf16 GEMMs. docs/benchmarks.md has what each costs and how far apart their outputs are."""

    def __init__(self, model, capture_layers: list[int] | tuple[int, ...] = (), *, compute: str = "fp32"):
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.rotary = RopeTable(inner.rotary_emb)
        c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.n_kv = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.vocab_size = c.vocab_size
        self.capture_layers = list(capture_layers)
        self.param_dtype = self.embed.weight.dtype if self.embed.weight.is_floating_point() else torch.float32
        self.device = self.embed.weight.device
        self.compute = resolve_compute(compute, self.device)
        self.plan = target_plan(model, self.compute)
        self.act_dtype = self.param_dtype if self.compute == "fp32" else torch.float32
        self.cache: KVCache | None = None
        self._qdq = qdq_e4m3_fast       # FP8 KV: runtime.engine.fp8.qdq_e4m3's arithmetic in fewer ops
        # the FP8 KV scales of each layer as float32 scalars on the device (None: not an FP8 KV cache)
        self._kv_scales = [tuple(None if s is None else s.detach().float().reshape(()).to(self.device)
                                 for s in (getattr(layer.self_attn, "fp8_k_scale", None),
                                           getattr(layer.self_attn, "fp8_v_scale", None)))
                           for layer in self.layers]

    @property
    def head(self):
        """The lm_head as this runner computes it: hidden [.., H] (after the final norm) -> float32 logits."""
        return self.plan.head

    def reset(self, batch: int, capacity: int) -> None:
        self.cache = KVCache(len(self.layers), batch, self.n_kv, self.head_dim, capacity, self.act_dtype, self.device)

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths

    def select_rows(self, idx: torch.Tensor) -> None:
        self.cache.select_rows(idx)

    def forward(self, tokens: torch.Tensor, logits_at: torch.Tensor | None = None):
        """tokens [B, T] at positions lengths[b] + j. Returns (logits [B, T, V] or [B, V] at `logits_at`,
        captured hidden [B, T, n*H] or None). Does not move the cache lengths (see `commit`)."""
        cache = self.cache
        B, T = tokens.shape
        pos, uniform = positions_for(cache.lengths, T, cache.capacity)
        kv_len = int(pos.max()) + 1
        h = self.embed(tokens).to(self.act_dtype)
        cos, sin = self.rotary.signed(h, pos)
        mask = causal_mask(pos, kv_len)
        captured = {}
        for i, L in enumerate(self.plan.layers):
            a = self.layers[i].self_attn
            q, k, v = L.qkv_heads(L.ln1(h), cos, sin)
            ks, vs = self._kv_scales[i]
            if ks is not None:       # FP8 KV cache: keys after RoPE and values pass through E4M3
                k = self._qdq(k, ks)
            if vs is not None:
                v = self._qdq(v.float(), vs)
            cache.write(i, k, v, pos, uniform)
            o = attention(q, cache.k[i].narrow(2, 0, kv_len), cache.v[i].narrow(2, 0, kv_len), mask, a.scaling)
            h = L.finish(h, o)
            if i in self.capture_layers:
                captured[i] = h
        hid = torch.cat([captured[i] for i in self.capture_layers], dim=-1) if self.capture_layers else None
        if logits_at is not None:
            h = h[torch.arange(B, device=h.device), logits_at]
        return self.plan.head(self.plan.norm(h)), hid

    def commit(self, n: torch.Tensor) -> None:
        self.cache.lengths = self.cache.lengths + n


@dataclass
class TargetPlan:
    """A target's weights as `TargetRunner.forward` runs them in one compute mode (see `target_plan`)."""

    compute: str
    device: torch.device
    layers: list[FusedLayer]
    norm: Norm
    head: LogitsHead


def target_plan(model, compute: str) -> TargetPlan:
    """The fused weights of `model` for `compute` (`fp32` | `bf16`), built once per model, mode and device and
    kept on the model (`_specpipe_plans`), so every runner of one model shares them (the fp32 plan holds a
    transposed copy of the projection weights, the bf16 plan a bf16 copy in oneDNN's layout)."""
    dev = model.model.embed_tokens.weight.device
    plans = model.__dict__.setdefault("_specpipe_plans", {})
    key = (compute, str(dev))
    if key not in plans:
        c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        layers = [FusedLayer(layer, layer.self_attn, compute, dev, n_heads=c.num_attention_heads,
                             n_kv=c.num_key_value_heads, head_dim=hd) for layer in model.model.layers]
        plans[key] = TargetPlan(compute, dev, layers, Norm(model.model.norm), LogitsHead(model.lm_head, compute, dev))
    return plans[key]

