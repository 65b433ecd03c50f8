"""Speculative decoding of deployed artifacts: a target checkpoint (BF16 or ModelOpt FP8) with an exported draft.

One engine runs every mode through the same code: plain autoregressive decoding (no drafter), EAGLE-3 chain
drafting and DFlash block drafting, for a batch of B requests of different lengths.

Each step for every live request (target has processed n tokens; x is the next token, not yet processed):
  1. the drafter proposes k tokens d1..dk (EAGLE-3: one draft pass over the newly verified positions, then
     k-1 single-token passes; DFlash: one pass over the block [x, mask, ..., mask]);
  2. the target verifies [x, d1..dk] in ONE forward (positions n..n+k) with its KV cache;
  3. acceptance: greedy (d_j accepted while it equals the target's argmax) or the standard rejection-sampling
     rule (accept d_j with probability min(1, p(d_j)/q(d_j)); on the first rejection sample from
     norm(max(0, p - q)); if all k are accepted, sample a bonus token from p), so the output distribution is
     exactly the target's;
  4. rollback: the target keeps n + a + 1 cache positions (x and the a accepted tokens), the rest are
     overwritten later; the drafter receives the target hidden states of the kept positions.

Statistics follow TensorRT-LLM's definitions (reference trtllm-triton.md §4): acceptance length AL = mean over
steps of (1 + accepted), draft acceptance rate = accepted / drafted, totals, per-position conditional
acceptance (P(position j accepted | positions < j accepted)), and draft vs target time per step.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from runtime.engine.compute import resolve_compute
from runtime.engine.drafts import TargetShape, load_draft
from runtime.engine.fused import FusedLayer, LogitsHead, Norm, qdq_e4m3_fast
from runtime.engine.layers import KVCache, RopeTable, attention, causal_mask, positions_for
from runtime.trtllm.draft_schedule import dflash_max_draft_len

# ---------------------------------------------------------------------------------------------- target


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


# ---------------------------------------------------------------------------------------------- drafters


class Drafter(abc.ABC):
    """What the engine asks of a drafter. `observe` receives, for the positions the target just kept, their
    captured hidden states and the token that follows each one (now known); `propose` returns k draft tokens
    (target ids) and, for sampling, their distributions q over the target vocabulary."""

    capture_layers: list[int] = []
    max_draft_len: int | None = None
    # Attributes holding per-row state (a KVCache or a list with one entry per row), in batch order. A drafter
    # that declares them can take new rows into a running batch (`DecodeBatch.add`); None: it cannot.
    row_state: tuple[str, ...] | None = None

    def reset(self, batch: int, capacity: int) -> None: ...
    def select_rows(self, idx: torch.Tensor) -> None: ...
    def observe(self, hidden, next_tokens: torch.Tensor, counts: torch.Tensor) -> None: ...
    @abc.abstractmethod
    def propose(self, last: torch.Tensor, k: int, temperature: float, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row (target ids) and, when sampling, their distributions over the target vocab."""


def _probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T), restricted to the smallest set of tokens whose mass reaches top_p (nucleus), renormalized."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    sp, si = p.sort(-1, descending=True)
    drop = (sp.cumsum(-1) - sp) >= top_p           # mass before this token already reaches top_p
    sp = sp.masked_fill(drop, 0.0)
    p = torch.zeros_like(p).scatter(-1, si, sp)
    return p / p.sum(-1, keepdim=True)


def _pick(logits: torch.Tensor, temperature: float, gen, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy argmax, or a sample from softmax(logits / T) (nucleus-filtered by top_p) with its distribution."""
    if temperature <= 0:
        return logits.argmax(-1), None
    p = _probs(logits, temperature, top_p)
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).reshape(p.shape[:-1]), p


class Eagle3Drafter(Drafter):
    """EAGLE-3 chain drafting with a draft KV cache. The draft entry at position i pairs fc(aux hidden of
    target position i) with the embedding of token i+1 (ModelOpt's shifted `eagle_ids`); chain steps feed
    back the draft's own pre-norm hidden. Chain positions are rolled back once the target has verified."""

    def __init__(self, draft, target: TargetRunner):
        self.draft = draft
        self.embed = target.embed
        self.vocab_size = target.vocab_size
        self.compute = target.compute
        self.capture_layers = list(draft.aux_layer_ids)
        self.max_draft_len = None
        self.row_state = ("cache", "pending_h", "pending_t")
        self.trace: list | None = None     # set to [] to record draft logits (tests compare them with ModelOpt)

    def reset(self, batch, capacity):
        self.cache = self.draft.new_cache(batch, capacity, self.embed.weight.device)
        self.pending_h: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.pending_t: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def select_rows(self, idx):
        self.cache.select_rows(idx)
        self.pending_h = [self.pending_h[i] for i in idx.tolist()]
        self.pending_t = [self.pending_t[i] for i in idx.tolist()]

    def observe(self, hidden, next_tokens, counts):
        for b, c in enumerate(counts.tolist()):
            self.pending_h[b].append(hidden[b, :c])
            self.pending_t[b].append(next_tokens[b, :c])

    def propose(self, last, k, temperature, gen):
        d = self.draft
        B = len(self.pending_h)
        hs = [torch.cat(x) for x in self.pending_h]
        ts = [torch.cat(x) for x in self.pending_t]
        counts = torch.tensor([len(t) for t in ts], device=last.device)
        T = int(counts.max())
        aux = hs[0].new_zeros(B, T, hs[0].shape[-1])
        nxt = torch.zeros(B, T, dtype=torch.long, device=last.device)
        for b in range(B):
            aux[b, :counts[b]] = hs[b]
            nxt[b, :counts[b]] = ts[b]
        self.pending_h = [[] for _ in range(B)]
        self.pending_t = [[] for _ in range(B)]
        cache = self.cache
        pos, uniform = positions_for(cache.lengths, T, cache.capacity)
        logits, pre = d.step(d.plan(self.compute).fc(aux), self.embed(nxt).to(aux.dtype), cache, pos, uniform,
                             self.compute)
        if self.trace is not None:
            self.trace.append(logits[torch.arange(B), counts - 1])
        rows = torch.arange(B, device=last.device)
        logits, pre = logits[rows, counts - 1], pre[rows, counts - 1]
        cache.lengths = cache.lengths + counts          # verified positions stay
        base = cache.lengths.clone()
        tokens, qs = [], []
        for j in range(k):
            tok_d, q = _pick(logits, temperature, gen)
            tok = d.to_target_ids(tok_d)
            tokens.append(tok)
            if q is not None:
                qs.append(self._to_target_vocab(q))
            if j == k - 1:
                break
            pos = (base + j)[:, None]
            logits, pre = d.step(pre[:, None], self.embed(tok[:, None]).to(pre.dtype), cache, pos,
                                 int(base[0]) + j if bool((base == base[0]).all()) else None, self.compute)
            logits, pre = logits[:, 0], pre[:, 0]
            if self.trace is not None:
                self.trace.append(logits)
        cache.lengths = base                            # roll back the chain positions
        return torch.stack(tokens, 1), (torch.stack(qs, 1) if qs else None)

    def _to_target_vocab(self, q):
        if q.shape[-1] == self.vocab_size and self.draft.d2t is None:
            return q
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        ids = self.draft.to_target_ids(torch.arange(q.shape[-1], device=q.device))
        out[..., ids] = q
        return out


class DFlashDrafter(Drafter):
    """DFlash block drafting: the context K/V (projected target hidden states) is cached per draft layer and
    grows with every verified position; each step drafts block_size-1 tokens in one pass."""

    def __init__(self, draft, target: TargetRunner):
        self.draft = draft
        self.embed = target.embed
        self.lm_head = target.head          # the target's lm_head as the runner computes it (float32 logits)
        self.compute = target.compute
        self.capture_layers = list(draft.target_layer_ids)
        self.max_draft_len = dflash_max_draft_len(draft.block_size)
        self.row_state = ("cache",)

    def reset(self, batch, capacity):
        self.cache = self.draft.new_cache(batch, capacity, self.embed.weight.device)

    def select_rows(self, idx):
        self.cache.select_rows(idx)

    def observe(self, hidden, next_tokens, counts):
        cache = self.cache
        pos, uniform = positions_for(cache.lengths, hidden.shape[1], cache.capacity)
        self.draft.add_context(hidden, cache, pos, uniform, self.compute)
        cache.lengths = cache.lengths + counts

    def propose(self, last, k, temperature, gen):
        d = self.draft
        if k > self.max_draft_len:
            raise ValueError(f"DFlash drafts at most block_size-1 = {self.max_draft_len} tokens, asked for {k}")
        B = last.shape[0]
        block = torch.full((B, d.block_size), d.mask_token_id, dtype=torch.long, device=last.device)
        block[:, 0] = last
        h = d.block(self.embed(block).to(d.norm.weight.dtype), self.cache, self.compute)
        logits = self.lm_head(h[:, 1:1 + k]).float()
        return _pick(logits, temperature, gen)


def make_drafter(draft, target: TargetRunner) -> Drafter:
    return Eagle3Drafter(draft, target) if draft.algorithm == "eagle3" else DFlashDrafter(draft, target)


# ---------------------------------------------------------------------------------------------- statistics


@dataclass
class RequestStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_length(self) -> float:
        return (self.steps + self.accepted) / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "total_draft_tokens": self.drafted, "total_accepted_draft_tokens": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 6), "acceptance_length": round(self.acceptance_length, 6)}


@dataclass
class RunStats:
    draft_len: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)      # steps in which position j was drafted with j-1 accepted
    hits: list[int] = field(default_factory=list)         # ... and position j was accepted too
    output_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    other_s: float = 0.0
    wall_s: float = 0.0
    rows_per_step: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.draft_len
        self.hits = self.hits or [0] * self.draft_len

    @property
    def acceptance_length(self) -> float:
        return (self.steps + self.accepted) / self.steps if self.steps else 1.0

    @property
    def per_position(self) -> list[float | None]:
        return [h / r if r else None for h, r in zip(self.hits, self.reached)]

    def merge(self, o: "RunStats") -> "RunStats":
        out = RunStats(max(self.draft_len, o.draft_len))
        pad = lambda xs: xs + [0] * (out.draft_len - len(xs))  # noqa: E731
        for f in ("steps", "drafted", "accepted", "output_tokens", "prefill_s", "draft_s", "target_s", "other_s", "wall_s"):
            setattr(out, f, getattr(self, f) + getattr(o, f))
        out.reached = [a + b for a, b in zip(pad(self.reached), pad(o.reached))]
        out.hits = [a + b for a, b in zip(pad(self.hits), pad(o.hits))]
        out.rows_per_step = self.rows_per_step + o.rows_per_step
        return out

    def as_dict(self) -> dict:
        gen_s = self.draft_s + self.target_s + self.other_s
        return {
            "draft_len": self.draft_len, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_length": round(self.acceptance_length, 6),
            "draft_acceptance_rate": round(self.accepted / self.drafted, 6) if self.drafted else None,
            "per_position": [None if p is None else round(p, 6) for p in self.per_position],
            "output_tokens": self.output_tokens,
            "draft_ms_per_step": round(1000 * self.draft_s / self.steps, 4) if self.steps else None,
            "target_ms_per_step": round(1000 * self.target_s / self.steps, 4) if self.steps else None,
            "overhead_ms_per_step": round(1000 * self.other_s / self.steps, 4) if self.steps else None,
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(gen_s, 4), "wall_s": round(self.wall_s, 4),
            "decode_tokens_per_s": round(self.output_tokens / gen_s, 3) if gen_s else None,
        }


@dataclass
class Generation:
    tokens: list[list[int]]                 # generated ids per request (prompt excluded), cut at eos/max
    requests: list[RequestStats]
    stats: RunStats


@dataclass
class VerifyStep:
    """One target forward that decided tokens, as `generate(on_verify=...)` reports it. Row r of every tensor
    belongs to request `requests[r]`. The prefill is reported as a step with `tokens` = the padded prompts,
    `logits` [B, 1, V] at each prompt's last position, `accepted` 0 and `next_tokens` the first new tokens."""

    requests: list[int]              # request index of each row
    tokens: torch.Tensor             # [B, k+1] the verified tokens [x, d1..dk] (prefill: the prompts)
    logits: torch.Tensor             # [B, k+1, V] the target's logits at those positions
    lengths_before: torch.Tensor     # [B] cache length of each row when this forward ran (prefill: prompt lengths)
    accepted: torch.Tensor           # [B] draft tokens accepted
    next_tokens: torch.Tensor        # [B] the token emitted after the accepted ones (bonus / correction)


def _eos_set(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset((eos,))
    return frozenset(int(e) for e in eos)


# ---------------------------------------------------------------------------------------------- engine


class SpeculativeEngine:
    """`generate(prompts, ...)`: speculative decoding when a drafter is given and draft_len > 0, plain
    autoregressive decoding otherwise (same target code path, one token per step). `batch(...)` gives the
    step-wise core that `generate` loops over, for callers that add and remove requests while others decode
    (continuous batching in `runtime.serving.batching`)."""

    def __init__(self, target_model, draft=None, *, drafter: Drafter | None = None, compute: str = "fp32"):
        """`compute`: `fp32` (the exact mode, default) | `bf16` | `auto`, for the target and the draft alike (see
        `TargetRunner`)."""
        if drafter is None and draft is not None:
            self.target = TargetRunner(target_model, draft.aux_layer_ids if draft.algorithm == "eagle3"
                                       else draft.target_layer_ids, compute=compute)
            self.drafter = make_drafter(draft, self.target)
        else:
            self.drafter = drafter
            self.target = TargetRunner(target_model, drafter.capture_layers if drafter else (), compute=compute)
        self.compute = self.target.compute

    def batch(self, *, draft_len: int = 0, temperature: float = 0.0, seed: int = 0, speculative: bool = True,
              top_p: float = 1.0, on_tokens: Callable[[int, list[int]], None] | None = None,
              on_verify: Callable[["VerifyStep"], None] | None = None) -> "DecodeBatch":
        """A running batch on this engine's target and drafter (one at a time: it owns their caches)."""
        return DecodeBatch(self, draft_len=draft_len, temperature=temperature, seed=seed, speculative=speculative,
                           top_p=top_p, on_tokens=on_tokens, on_verify=on_verify)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, draft_len: int = 0, temperature: float = 0.0,
                 eos_token_id: int | Iterable[int] | None = None, seed: int = 0, speculative: bool = True,
                 top_p: float = 1.0, on_tokens: Callable[[int, list[int]], None] | None = None,
                 on_verify: Callable[["VerifyStep"], None] | None = None) -> Generation:
        """`eos_token_id`: one id or several (an instruct model's end-of-turn and its eos); a request stops after
        the first of them. `top_p` < 1 restricts sampling (temperature > 0) to the nucleus; the acceptance rule
        then targets that distribution. `on_tokens(request index, tokens)` is called each time tokens are
        appended to a request's output (after prefill and after every verification step): per-step streaming.
        `on_verify(VerifyStep)` sees every verification forward (the prefill's first token included) with what
        the engine decided from it: the hook a checker of the acceptance rule needs."""
        t_start = time.perf_counter()
        b = self.batch(draft_len=draft_len, temperature=temperature, seed=seed, speculative=speculative, top_p=top_p,
                       on_tokens=on_tokens, on_verify=on_verify)
        keys = b.add(prompts, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        while b.live:
            b.step()
        reqs = [b.finished.pop(k) for k in keys]
        b.stats.output_tokens = sum(len(r.tokens) for r in reqs)
        b.stats.wall_s = time.perf_counter() - t_start
        return Generation([r.tokens for r in reqs], [r.stats for r in reqs], b.stats)

    @staticmethod
    def _accept(logits, d, q, temperature, gen, top_p: float = 1.0):
        """logits [B, k+1, V]. Returns (accepted count [B], next token [B])."""
        B, T, V = logits.shape
        rows = torch.arange(B, device=logits.device)
        if temperature <= 0:
            tgt = logits.argmax(-1)
            if d is None:
                return torch.zeros(B, dtype=torch.long, device=logits.device), tgt[:, 0]
            acc = torch.cumprod((d == tgt[:, :-1]).long(), 1).sum(1)
            return acc, tgt[rows, acc]
        p = _probs(logits, temperature, top_p)
        if d is None:
            return torch.zeros(B, dtype=torch.long, device=logits.device), torch.multinomial(p[:, 0], 1, generator=gen)[:, 0]
        k = d.shape[1]
        pd = p[:, :k].gather(-1, d[..., None])[..., 0]
        qd = q.gather(-1, d[..., None])[..., 0]
        u = torch.rand(B, k, generator=gen, device=logits.device)
        ok = u * qd < pd                                # u < min(1, p/q) without dividing by q
        acc = torch.cumprod(ok.long(), 1).sum(1)
        # where rejected at position a: residual norm(max(0, p_a - q_a)); all accepted: p_k
        q_full = torch.cat((q, q.new_zeros(B, 1, V)), 1)
        resid = (p - q_full).clamp_min(0)
        resid_a = resid[rows, acc]
        mass = resid_a.sum(-1, keepdim=True)
        dist = torch.where(mass > 0, resid_a / mass.clamp_min(1e-30), p[rows, acc])
        return acc, torch.multinomial(dist, 1, generator=gen)[:, 0]


@dataclass
class BatchRequest:
    """One request of a `DecodeBatch`: its generated tokens so far and its statistics."""

    key: int
    max_new_tokens: int
    eos: frozenset[int]
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finish: str | None = None          # "stop" (an eos id) | "length" | "cancelled" once it left the batch


class DecodeBatch:
    """The step-wise core of `SpeculativeEngine`: a batch of live requests that requests join and leave between
    steps. `add(prompts)` prefills the new prompts (one target forward over them) and appends their rows to
    the running batch, so they take part in the next `step()`; `step()` drafts for every live row and verifies
    all of them in ONE target forward; a row leaves the batch when it reaches an eos id or its token budget,
    or when `cancel(key)` removes it. Rows have their own lengths (the KV caches hold per-row lengths).

    One temperature / top_p / random generator per batch (rows share the generator, so a sampled request's
    draws depend on what else is in the batch; greedy rows do not). Statistics accumulate in `stats` as in
    `generate`; finished requests wait in `finished` (key -> BatchRequest) until the caller pops them."""

    def __init__(self, engine: SpeculativeEngine, *, draft_len: int, temperature: float, seed: int, speculative: bool,
                 top_p: float, on_tokens=None, on_verify=None):
        self.engine = engine
        self.drafter = engine.drafter if (speculative and draft_len > 0) else None
        self.k = draft_len if self.drafter is not None else 0
        d = self.drafter
        if d is not None and d.max_draft_len is not None and self.k > d.max_draft_len:
            raise ValueError(f"draft_len {self.k} exceeds what the drafter can propose ({d.max_draft_len})")
        self.temperature, self.top_p = temperature, top_p
        self.on_tokens, self.on_verify = on_tokens, on_verify
        self.device = engine.target.device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)  # on the device: multinomial needs it there
        self.stats = RunStats(self.k)
        self.rows: list[BatchRequest] = []       # live requests, in batch-row order
        self.x: torch.Tensor | None = None       # [B] the next token of each row (decided, not yet processed)
        self.finished: dict[int, BatchRequest] = {}
        self._next_key = 0
        self._parked = None

    @property
    def live(self) -> int:
        return len(self.rows)

    def keys(self) -> list[int]:
        return [r.key for r in self.rows]

    # -- joining
    @torch.no_grad()
    def add(self, prompts: list[list[int]], *, max_new_tokens: int | list[int],
            eos_token_id: int | Iterable[int] | None = None, keys: list[int] | None = None) -> list[int]:
        """Prefill `prompts` and append them to the batch; returns their keys (`keys` if given, else the next
        integers). `max_new_tokens`: one budget for all or one per prompt. Their first token (from the prefill)
        is emitted here."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if not prompts:
            return []
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != len(prompts) or min(budgets) < 0:
            raise ValueError(f"max_new_tokens must be >= 0 for each prompt, got {max_new_tokens}")
        if keys is None:
            keys = list(range(self._next_key, self._next_key + len(prompts)))
        taken = set(self.keys()) | set(self.finished)
        if len(keys) != len(prompts) or len(set(keys)) != len(keys) or taken & set(keys):
            raise ValueError(f"keys must be unique and new, one per prompt, got {keys}")
        self._next_key = max(self._next_key, max(keys) + 1)
        eos = _eos_set(eos_token_id)
        self._enter()
        tgt, drafter = self.engine.target, self.drafter
        joining = bool(self.rows)
        if joining and drafter is not None and drafter.row_state is None:
            raise ValueError(f"{type(drafter).__name__} declares no row_state: it cannot take rows into a running batch")
        t0 = time.perf_counter()
        B = len(prompts)
        cap = max(len(p) + n for p, n in zip(prompts, budgets)) + self.k + 2
        T = max(len(p) for p in prompts)
        if joining:                                         # set the running batch's state aside
            saved = self._state()
        try:
            x, toks, logits, lens = self._prefill(prompts, cap)
        except BaseException:
            if joining:                                     # the running rows carry on untouched
                self._restore(saved)
            raise
        if joining:                                         # running rows first, then the new ones
            tgt.cache = _cat_caches(saved[0], tgt.cache)
            # A drafter's next pass may cover every row's pending positions padded to the longest (EAGLE-3: the new
            # rows' whole prompt), written from each row's own length: the running rows need that much room.
            room = int(saved[0].lengths.max()) + T + self.k + 2
            for a, old in saved[1].items():
                new = getattr(drafter, a)
                setattr(drafter, a, _cat_caches(old, new, room) if isinstance(old, KVCache) else list(old) + list(new))
            self.x = torch.cat((self.x, x))
        else:
            self.x = x
        new_rows = [BatchRequest(key, n, eos, len(p)) for key, p, n in zip(keys, prompts, budgets)]
        self.rows += new_rows
        self.stats.prefill_s += time.perf_counter() - t0
        if self.on_verify is not None:
            self.on_verify(VerifyStep([r.key for r in new_rows], toks, logits[:, None], lens, torch.zeros_like(lens), x))
        first = len(self.rows) - B
        done = [False] * first + self._append(new_rows, [[t] for t in x.tolist()])
        self._compact(done)
        return [r.key for r in new_rows]

    def _prefill(self, prompts: list[list[int]], cap: int):
        """The target processes every prompt token (fresh caches for these rows); its last logits give the
        first new token, and the drafter observes the prompt."""
        tgt, drafter, dev = self.engine.target, self.drafter, self.device
        B = len(prompts)
        tgt.reset(B, cap)
        if drafter is not None:
            drafter.reset(B, cap)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        T = int(lens.max())
        toks = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            toks[b, :len(p)] = torch.tensor(p, device=dev)
        logits, hid = tgt.forward(toks, logits_at=lens - 1)
        tgt.commit(lens)
        x, _ = _pick(logits, self.temperature, self.gen, self.top_p)
        if drafter is not None:
            nxt = torch.cat((toks[:, 1:], toks.new_zeros(B, 1)), 1)
            nxt[torch.arange(B, device=dev), lens - 1] = x
            drafter.observe(hid, nxt, lens)
        return x, toks, logits, lens

    # -- one step of every live row
    @torch.no_grad()
    def step(self) -> list[int]:
        """Draft for every live row, verify all of them in one target forward, accept, roll back, emit.
        Returns the keys of the requests that finished in this step (now in `finished`)."""
        if not self.rows:
            return []
        self._enter()
        tgt, drafter, dev, k, stats = self.engine.target, self.drafter, self.device, self.k, self.stats
        n_live = len(self.rows)
        x = self.x
        t0 = time.perf_counter()
        if drafter is not None:
            d, q = drafter.propose(x, k, self.temperature, self.gen)
            verify = torch.cat((x[:, None], d), 1)
        else:
            d, q = None, None
            verify = x[:, None]
        t1 = time.perf_counter()
        before = tgt.lengths.clone()
        logits, hid = tgt.forward(verify)
        t2 = time.perf_counter()
        acc, bonus = self.engine._accept(
            logits, d, q, self.temperature, self.gen, self.top_p
        )  # the engine's rule (a subclass may replace it)
        tgt.commit(acc + 1)
        if self.on_verify is not None:
            self.on_verify(VerifyStep(self.keys(), verify, logits, before, acc, bonus))
        t3 = time.perf_counter()
        if drafter is not None:       # draft-side work: counted as draft time
            nxt = torch.cat((d, d.new_zeros(n_live, 1)), 1)
            nxt[torch.arange(n_live, device=dev), acc] = bonus
            drafter.observe(hid, nxt, acc + 1)
        t4 = time.perf_counter()
        new = []
        acc_l, bonus_l = acc.tolist(), bonus.tolist()
        d_l = d.tolist() if d is not None else None
        for r, req in enumerate(self.rows):
            a = acc_l[r]
            new.append((d_l[r][:a] if d_l else []) + [bonus_l[r]])
            if k:
                rs = req.stats
                rs.steps += 1
                rs.drafted += k
                rs.accepted += a
                for j in range(min(a + 1, k)):
                    stats.reached[j] += 1
                for j in range(a):
                    stats.hits[j] += 1
        stats.steps += n_live if k else 0
        stats.drafted += k * n_live
        stats.accepted += int(acc.sum()) if k else 0
        stats.rows_per_step.append(n_live)
        self.x = bonus
        done = self._append(self.rows, new)
        finished = self._compact(done)
        t5 = time.perf_counter()
        stats.draft_s += (t1 - t0) + (t4 - t3)
        stats.target_s += t2 - t1
        stats.other_s += (t3 - t2) + (t5 - t4)
        return finished

    # -- leaving
    def cancel(self, keys: Iterable[int]) -> list[int]:
        """Remove live requests (a cancelled or disconnected client): their rows are freed before the next step.
        Returns the keys that were live; each is in `finished` with finish 'cancelled'."""
        ks = set(keys)
        done = [r.key in ks for r in self.rows]
        if any(done):
            self._enter()
        for r, dn in zip(self.rows, done):
            if dn:
                r.finish = "cancelled"
        return self._compact(done)

    def _enter(self) -> None:
        """Several batches may share one engine (one per sampling rule): the target's cache and the drafter's
        per-row state belong to whichever batch runs; the others' are parked until they run again."""
        eng = self.engine
        cur = getattr(eng, "_active_batch", None)
        if cur is self:
            return
        if cur is not None and cur.rows:
            cur._parked = cur._state()
        if self.rows:
            self._restore(self._parked)
            self._parked = None
        eng._active_batch = self

    def _state(self):
        d = self.drafter
        if d is not None and d.row_state is None:
            raise ValueError(f"{type(d).__name__} declares no row_state: two batches cannot share its engine")
        return self.engine.target.cache, ({a: getattr(d, a) for a in d.row_state} if d is not None else {})

    def _restore(self, state) -> None:
        self.engine.target.cache = state[0]
        for a, v in state[1].items():
            setattr(self.drafter, a, v)

    def _append(self, rows: list[BatchRequest], new: list[list[int]]) -> list[bool]:
        done = []
        for req, toks in zip(rows, new):
            stop = next((i for i, t in enumerate(toks) if t in req.eos), None)
            if stop is not None:
                toks = toks[: stop + 1]
            room = req.max_new_tokens - len(req.tokens)
            req.tokens.extend(toks[:room])
            if self.on_tokens is not None and toks[:room]:
                self.on_tokens(req.key, toks[:room])
            if stop is not None and stop < room:
                req.finish = "stop"
            elif len(req.tokens) >= req.max_new_tokens:
                req.finish = "length"
            done.append(req.finish is not None)
        return done

    def _compact(self, done: list[bool]) -> list[int]:
        if not any(done):
            return []
        gone = [r for r, dn in zip(self.rows, done) if dn]
        keep = [i for i, dn in enumerate(done) if not dn]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if keep:
            self.engine.target.select_rows(idx)
            if self.drafter is not None:
                self.drafter.select_rows(idx)
        self.x = self.x.index_select(0, idx)
        self.rows = [self.rows[i] for i in keep]
        for r in gone:
            self.finished[r.key] = r
        return [r.key for r in gone]


def _cat_caches(a: KVCache, b: KVCache, min_capacity: int = 0) -> KVCache:
    """The rows of `a` followed by the rows of `b` in one cache (capacities padded to the largest)."""
    cap = max(a.capacity, b.capacity, min_capacity)

    def grow(t: torch.Tensor, c: int) -> torch.Tensor:
        return t if c == cap else torch.cat((t, t.new_zeros(*t.shape[:2], cap - c, t.shape[3])), 2)

    out = object.__new__(KVCache)
    out.k = [torch.cat((grow(x, a.capacity), grow(y, b.capacity))) for x, y in zip(a.k, b.k)]
    out.v = [torch.cat((grow(x, a.capacity), grow(y, b.capacity))) for x, y in zip(a.v, b.v)]
    out.lengths = torch.cat((a.lengths, b.lengths))
    out.capacity = cap
    return out




# ---------------------------------------------------------------------------------------------- helpers


def load_pair(target_dir, draft_dir, *, device="cpu", compute_dtype=torch.float32, **draft_kw):
    """Target + draft from their deployed directories, with the pairing checks; returns (model, draft).
    `draft_kw`: strict, first_layer_norm, expected_capture_layers (see `runtime.engine.drafts.load_draft`)."""
    model = load_target(target_dir, device=device, compute_dtype=compute_dtype)
    draft = load_draft(draft_dir, target_shape(model), compute_dtype=compute_dtype, device=device, **draft_kw)
    return model, draft


def predicted_speedup(al: float, k: int, t_target_1: float, t_draft: float, t_target_verify: float,
                      parallel_draft: bool = False) -> float:
    """anchors.md: S ~= AL * T_target(B) / (k T_draft + T_target(B (k+1))); a parallel drafter (DFlash) pays
    one draft pass instead of k."""
    draft_cost = t_draft if parallel_draft else k * t_draft
    return al * t_target_1 / (draft_cost + t_target_verify)


def lossless_diff(spec: list[list[int]], ref: list[list[int]]) -> list[dict]:
    """Requests whose greedy speculative output differs from target-only output, with the first divergence."""
    bad = []
    for i, (a, b) in enumerate(zip(spec, ref)):
        if a != b:
            j = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            bad.append({"request": i, "position": j, "speculative": a[j:j + 4], "target": b[j:j + 4]})
    return bad


@torch.no_grad()
def tie_margins(model, prompts: list[list[int]], ref: list[list[int]], bad: list[dict]) -> list[dict]:
    """For each divergence, the target's top-2 logit margin at that position, from one fresh forward over
    prompt + the target-only output before it. Verifying k+1 tokens at once and decoding one at a time do the
    same math in a different order; float rounding (amplified by FP8's E4M3 activation rounding) can flip an
    argmax only where the two best logits are within that noise, so a tiny margin marks a numerical tie,
    a large one a real bug. `gap`: the reference token's logit minus the other output's token's logit there
    (None when one output ended at the divergence)."""
    out = []
    for b in bad:
        seq = prompts[b["request"]] + ref[b["request"]][: b["position"]]
        r = TargetRunner(model)
        r.reset(1, len(seq) + 1)
        logits, _ = r.forward(torch.tensor([seq], device=r.device), logits_at=torch.tensor([len(seq) - 1], device=r.device))
        top = logits[0].topk(2)
        gap = (float(logits[0, b["target"][0]] - logits[0, b["speculative"][0]])
               if b["target"] and b["speculative"] else None)
        out.append({**b, "margin": float(top.values[0] - top.values[1]), "top2": top.indices.tolist(), "gap": gap})
    return out

