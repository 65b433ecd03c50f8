"""EAGLE-3 (`LlamaForCausalLMEagle3`): the exported draft as a module (`Eagle3Draft.step` runs the decoder over
new positions with a KV cache) and the checks of its export, in order: eagle_config, tensor names, the fc and
first-layer shapes, the draft vocabulary and its d2t map, the pairing with the target."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from runtime.engine.drafts.blocks import DraftPlan, decoder_layer, draft_plan, make_linear, make_norm, set_attention_shape
from runtime.engine.drafts.format import DraftFormatError, TargetShape, strip_scales
from runtime.engine.layers import KVCache, RopeTable, attention, causal_mask, rope_module

log = logging.getLogger("specpipe.runtime")


class Eagle3Draft(nn.Module):
    """The exported EAGLE-3 draft. `step()` runs the decoder over new positions with a KV cache."""

    algorithm = "eagle3"
    kv_fp8_scale: float | None = None   # FP8 KV cache with this scale (`load_draft(kv_cache="fp8")`), else BF16

    def __init__(self, cfg: dict, sd: dict, compute_dtype: torch.dtype, first_layer_norm: str):
        super().__init__()
        self.cfg = cfg
        ec = cfg["eagle_config"]
        set_attention_shape(self, cfg)
        self.aux_layer_ids = sorted(int(i) for i in ec["eagle_aux_hidden_state_layer_ids"])
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
        self.norm = make_norm(sd, "norm", eps, compute_dtype) if ec.get("use_last_layernorm", True) else None
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
    keys = strip_scales(sd.keys())
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
