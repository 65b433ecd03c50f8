"""Draft models read exactly as ModelOpt 0.47 exports them, plus the cached-attention primitives they share
with the target runner in `runtime.speculative`.

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
            self.k[layer][:, :, uniform:uniform + t] = k
            self.v[layer][:, :, uniform:uniform + t] = v
        else:
            b = torch.arange(k.shape[0], device=k.device)[:, None]
            self.k[layer][b, :, pos] = k.transpose(1, 2)
            self.v[layer][b, :, pos] = v.transpose(1, 2)

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

    def __call__(self, x: torch.Tensor, pos: torch.Tensor):
        need = int(pos.max()) + 1
        if self.cos is None or self.cos.shape[0] < need or self.cos.device != x.device or self.cos.dtype != x.dtype:
            n = max(need, 256 if self.cos is None else 2 * self.cos.shape[0])
            c, s = self.rotary(x[:1, :1], torch.arange(n, device=x.device)[None])
            self.cos, self.sin = c[0], s[0]
        return self.cos[pos], self.sin[pos]


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


# ---------------------------------------------------------------------------------------------- linear layers


def make_linear(sd: dict, prefix: str, compute_dtype: torch.dtype) -> nn.Module:
    """A Linear from `prefix.weight` (+ bias). FP8 weights (ModelOpt: float8_e4m3fn + weight_scale/input_scale)
    go through the shared FP8 code in `runtime.fp8`."""
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


def _read_dir(path: Path) -> tuple[dict, dict]:
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

    def step(self, hidden: torch.Tensor, embeds: torch.Tensor, cache: KVCache, pos: torch.Tensor,
             uniform: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, T, H]: fc(aux) for target-verified positions or the draft's own pre-norm output;
        embeds [B, T, H]: target embeddings of the *next* token at each position. Returns (logits over the
        draft vocabulary, pre-norm hidden) for every position. Writes K/V at `pos`; does not move lengths."""
        kv_len = int(pos.max()) + 1
        cos, sin = self.rope(hidden, pos)
        mask = causal_mask(pos, kv_len)
        h = hidden
        B, T, _ = h.shape
        for i, layer in enumerate(self.layers):
            residual = h
            if i == 0:
                hn = layer.input_layernorm(h) if self.first_layer_norm == "modelopt" else h
                x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hn)), dim=-1)
            else:
                x = layer.input_layernorm(h)
            q = layer.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            k = layer.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            v = layer.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(i, k, v, pos, uniform)
            o = attention(q, cache.k[i][:, :, :kv_len], cache.v[i][:, :, :kv_len], mask, self.scale)
            h = residual + layer.o_proj(o.transpose(1, 2).reshape(B, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        post = self.norm(h) if self.norm is not None else h
        return self.lm_head(post), h


def _check_eagle3(cfg: dict, sd: dict, path: Path, target: TargetShape | None, strict: bool) -> dict:
    ec = cfg.get("eagle_config")
    if not isinstance(ec, dict):
        raise DraftFormatError(f"{path}/config.json: no eagle_config; not an EAGLE-3 export")
    if not ec.get("use_aux_hidden_state", False):
        raise DraftFormatError(f"{path}: eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 draft, which "
                               "TensorRT-LLM's Eagle3 path cannot run")
    ids = ec.get("eagle_aux_hidden_state_layer_ids") or []
    if not ids:
        raise DraftFormatError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids is empty")
    H = cfg["hidden_size"]
    L = cfg["num_hidden_layers"]
    required = {"fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight"}
    for i in range(L):
        required |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    if not ec.get("use_last_layernorm", True):
        required.discard("norm.weight")
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
    fc_in = sd["fc.weight"].shape[1]
    if fc_in != len(ids) * H:
        raise DraftFormatError(f"{path}: fc.weight takes {fc_in} inputs = {fc_in / H:g} x hidden {H}, but "
                               f"eagle_aux_hidden_state_layer_ids lists {len(ids)} layers {ids}")
    if sd["layers.0.self_attn.q_proj.weight"].shape[1] != 2 * H:
        raise DraftFormatError(f"{path}: layers.0.self_attn.q_proj takes "
                               f"{sd['layers.0.self_attn.q_proj.weight'].shape[1]} inputs, expected 2 x hidden = {2 * H}")
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
        if "d2t" not in sd:
            msg = (f"{path}: draft_vocab_size {dv} < vocab_size {vocab} but there is no d2t tensor: draft token ids "
                   "cannot be mapped to target ids (TensorRT-LLM would use them as target ids and acceptance "
                   "collapses); export with the draft vocabulary cache loaded")
            if strict:
                raise DraftFormatError(msg)
            log.warning("%s (strict=False: draft ids used as target ids)", msg)
        else:
            d2t = sd["d2t"]
            if tuple(d2t.shape) != (dv,):
                raise DraftFormatError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({dv},) = draft_vocab_size")
            mapped = torch.arange(dv) + d2t.long()
            if int(mapped.min()) < 0 or int(mapped.max()) >= vocab:
                raise DraftFormatError(f"{path}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
    elif "d2t" in sd and bool((sd["d2t"] != 0).any()):
        raise DraftFormatError(f"{path}: d2t is non-zero although draft_vocab_size == vocab_size")
    if target is not None:
        if H != target.hidden_size:
            raise DraftFormatError(f"{path}: draft hidden_size {H} != target hidden_size {target.hidden_size}")
        if vocab != target.vocab_size:
            raise DraftFormatError(f"{path}: draft vocab_size {vocab} != target vocab_size {target.vocab_size}: "
                                   "the draft must share the target's tokenizer")
        bad = [i for i in ids if not 0 <= int(i) < target.num_layers]
        if bad:
            raise DraftFormatError(f"{path}: aux layer ids {bad} are outside the target's {target.num_layers} layers")
    return cfg


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

    def add_context(self, target_hidden: torch.Tensor, cache: KVCache, pos: torch.Tensor, uniform: int | None) -> None:
        """Project target hidden states [B, T, n*H] of newly verified positions into every layer's context K/V."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        B, T, _ = ctx.shape
        cos, sin = self.rope(ctx, pos)
        for i, layer in enumerate(self.layers):
            k = layer.k_norm(layer.k_proj(ctx).view(B, T, -1, self.head_dim)).transpose(1, 2)
            v = layer.v_proj(ctx).view(B, T, -1, self.head_dim).transpose(1, 2)
            cache.write(i, apply_rope(k, cos, sin), v, pos, uniform)

    def block(self, block_embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """block_embeds [B, S, H] of [anchor, mask, ...] at positions lengths[b] + j; returns the normed draft
        hidden [B, S, H]. Attends to the valid context of each row and to the whole block (bidirectional, or
        causal inside the block when the export says `causal: true`)."""
        B, S, _ = block_embeds.shape
        lengths = cache.lengths
        ctx_len = int(lengths.max())
        pos = lengths[:, None] + torch.arange(S, device=lengths.device)[None, :]
        cos, sin = self.rope(block_embeds, pos)
        ctx_ok = torch.arange(ctx_len, device=lengths.device)[None, :] < lengths[:, None]        # [B, Lc]
        blk_ok = (torch.tril(torch.ones(S, S, dtype=torch.bool, device=lengths.device)) if self.causal
                  else torch.ones(S, S, dtype=torch.bool, device=lengths.device))
        mask = torch.cat((ctx_ok[:, None, :].expand(B, S, ctx_len), blk_ok[None].expand(B, S, S)), dim=-1)[:, None]
        h = block_embeds
        for i, layer in enumerate(self.layers):
            residual = h
            x = layer.input_layernorm(h)
            q = layer.q_norm(layer.q_proj(x).view(B, S, -1, self.head_dim)).transpose(1, 2)
            k = layer.k_norm(layer.k_proj(x).view(B, S, -1, self.head_dim)).transpose(1, 2)
            v = layer.v_proj(x).view(B, S, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            K = torch.cat((cache.k[i][:, :, :ctx_len], k), dim=2)
            V = torch.cat((cache.v[i][:, :, :ctx_len], v), dim=2)
            o = attention(q, K, V, mask, self.scale)
            h = residual + layer.o_proj(o.transpose(1, 2).reshape(B, S, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


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
    cfg, sd = _read_dir(path)
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

