"""EAGLE-3 (`LlamaForCausalLMEagle3`): the exported draft as a module (`Eagle3Draft.step` runs the decoder over
new positions with a KV cache) and the checks of its export, in order: eagle_config, tensor names, the fc and
first-layer shapes, the draft vocabulary and its d2t map, the pairing with the target: runtime/algorithms/eagle3.py's
`check_export`."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from runtime.algorithms import eagle3
from runtime.algorithms.export import TargetShape, raise_first, read_export
from runtime.engine.drafts.blocks import DraftPlan, decoder_layer, draft_plan, make_linear, make_norm, set_attention_shape
from runtime.engine.drafts.format import DraftFormatError
from runtime.engine.layers import KVCache, RopeTable, attention, causal_mask, rope_module

log = logging.getLogger("specpipe.runtime")


class Eagle3Draft(nn.Module):
    """The exported EAGLE-3 draft. `step()` runs the decoder over new positions with a KV cache."""

    algorithm = eagle3.EAGLE3.name
    traits = eagle3.EAGLE3                # the Algorithm (runtime/algorithms/base.py)
    kv_fp8_scale: float | None = None   # FP8 KV cache with this scale (`load_draft(kv_cache="fp8")`), else BF16

    def __init__(self, cfg: dict, sd: dict, compute_dtype: torch.dtype, first_layer_norm: str):
        super().__init__()
        self.cfg = cfg
        spec = eagle3.EAGLE3.parse(cfg)       # the frozen Eagle3Config of the export
        set_attention_shape(self, cfg)
        self.aux_layer_ids = list(spec.capture_layers)
        self.capture_layers = self.aux_layer_ids          # the target layers it reads, whatever the algorithm
        self.vocab_size = cfg["vocab_size"]
        self.draft_vocab_size = cfg["draft_vocab_size"]
        self.first_layer_norm = first_layer_norm
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.fc = make_linear(sd, "fc", compute_dtype)
        self.layers = nn.ModuleList()
        for i in range(self.num_layers):
            layer = decoder_layer(sd, f"layers.{i}", eps, compute_dtype)
            if i == 0:
                layer.hidden_norm = make_norm(sd, f"layers.{i}.hidden_norm", eps, compute_dtype)
            self.layers.append(layer)
        self.norm = make_norm(sd, "norm", eps, compute_dtype) if spec.use_last_layernorm else None
        self.lm_head = make_linear(sd, "lm_head", compute_dtype)
        d2t = sd.get("d2t")
        self.register_buffer("d2t", d2t.long() if d2t is not None else None)
        self.rotary = rope_module(cfg, "llama")
        self.rope = RopeTable(self.rotary)

    def new_cache(self, batch: int, capacity: int, device) -> KVCache:
        dt = self.layers[0].input_layernorm.weight.dtype
        return KVCache(self.num_layers, batch, self.n_kv, self.head_dim, capacity, dt, device, self.kv_fp8_scale)

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

    def plan(self, compute: str = "fp32") -> DraftPlan:
        """The fused weights for `compute` (`fp32` | `bf16`), built on first use and kept (see `TargetRunner`)."""
        return draft_plan(self, compute)

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


def check_eagle3(cfg: dict, sd: dict, path: Path, target: TargetShape | None, strict: bool) -> dict:
    """The export checked by `runtime.algorithms.eagle3.check_export` (and its pairing with `target`); raises
    DraftFormatError at the first problem. As TensorRT-LLM does (`_ensure_draft_vocab_size`), a config.json without
    `draft_vocab_size` is read as the full vocabulary (a warning); not `strict`, a missing d2t is only a warning
    (draft ids are then used as target ids, what TensorRT-LLM would do). Returns `cfg`."""
    if cfg.get("draft_vocab_size") is None and cfg.get("vocab_size") is not None:
        log.warning("%s: config.json has no draft_vocab_size; assuming the full vocabulary %d (as TensorRT-LLM does)",
                    path, cfg["vocab_size"])
        cfg["draft_vocab_size"] = cfg["vocab_size"]
    probs = eagle3.check_export(read_export(sd, cfg, str(path)), target=target)
    if not strict:
        for p in [p for p in probs if p.check == "d2t" and p.code == "missing"]:
            log.warning("%s (strict=False: draft ids used as target ids)", p.message)
            probs.remove(p)
    raise_first(probs, DraftFormatError)
    return cfg
