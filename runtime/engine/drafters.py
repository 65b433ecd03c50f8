"""The drafter side of speculative decoding: what the engine asks of a drafter (`Drafter`: observe the target's
hidden states of the kept positions, propose k tokens) and the two drafters of exported drafts, EAGLE-3 chain
drafting (`Eagle3Drafter`: one draft pass over the newly verified positions, then k-1 single-token passes, the
chain positions rolled back after verification) and DFlash block drafting (`DFlashDrafter`: one pass over the
block [x, mask, ..., mask]). The draft models themselves are `runtime.engine.drafts`'."""
from __future__ import annotations

import abc

import torch

from runtime.algorithms import dflash
from runtime.engine.layers import positions_for
from runtime.engine.sampling import pick
from runtime.engine.target import TargetRunner


class Drafter(abc.ABC):
    """What the engine asks of a drafter. `observe` receives, for the positions the target just kept, their
    captured hidden states and the token that follows each one (now known); `propose` returns k draft tokens
    (target ids) and, for sampling, their distributions q over the target vocabulary."""

    capture_layers: list[int] = []
    max_draft_len: int | None = None
    # Attributes holding per-row state (a KVCache or a list with one entry per row), in batch order. A drafter
    # that declares them can take new rows into a running batch (`DecodeBatch.add`); None: it cannot.
    row_state: tuple[str, ...] | None = None
    # After `propose`: the real draft length per row when it varies ([B]; the rest of the block is padding that
    # is never accepted, see runtime.engine.ngram_drafter), None when every row drafts k.
    draft_lens = None

    def reset(self, batch: int, capacity: int) -> None: ...
    def begin(self, prompts: list[list[int]]) -> None:
        """The new rows' prompts, after `reset` (a drafter that reads token ids needs the first one)."""
    def select_rows(self, idx: torch.Tensor) -> None: ...
    def observe(self, hidden, next_tokens: torch.Tensor, counts: torch.Tensor) -> None: ...
    @abc.abstractmethod
    def propose(self, last: torch.Tensor, k: int, temperature: float, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row (target ids) and, when sampling, their distributions over the target vocab."""


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
            tok_d, q = pick(logits, temperature, gen)
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
        self.max_draft_len = dflash.max_draft_len(draft.block_size)
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
        return pick(logits, temperature, gen)


def make_drafter(draft, target: TargetRunner) -> Drafter:
    return DFlashDrafter(draft, target) if draft.traits.drafts_block else Eagle3Drafter(draft, target)

